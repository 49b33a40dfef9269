"""Where a leg's stream goes: the client, or a collector that assembles it.

Owns
  `Sink`, what the relay writes to (`ClientChannel` is one), and `Collector`, the sink
  of a non-streaming request's stream: complete events, kept until [DONE] and
  assembled into the engine's non-streaming answer.

Invariants
  The collected answer is retained whole, as a non-streaming engine answer was, so it
  is bounded by serving.max_response_bytes (`too_large` past it). The relay hands over
  whole events only, and has failed the leg on an error event already.
"""

from __future__ import annotations

import json
from typing import Protocol

import trio

from ..engines import Json, SseKind, SseScanner
from ..engines._assemble import ResponseAssembler
from ..fleet import EngineState
from ._failure import FailureKind
from ._leg_failures import LegPhase, failed
from ._request import ClientRequest


class Sink(Protocol):
    async def send_chunk(self, data: bytes) -> None: ...
    async def end_stream(self) -> None: ...


class Collector:
    __slots__ = ("_assembler", "_engine", "_limit", "_phase", "_scanner", "_size")

    def __init__(
        self, engine: EngineState, phase: LegPhase, request: ClientRequest, limit: int
    ) -> None:
        self._engine = engine
        self._phase = phase
        self._limit = limit
        self._size = 0
        self._scanner = SseScanner()
        self._assembler = ResponseAssembler(request.kind, engine.dialect.name)

    async def send_chunk(self, data: bytes) -> None:
        self._size += len(data)
        if self._size > self._limit:
            raise failed(
                self._engine,
                self._phase,
                FailureKind.TOO_LARGE,
                f"response exceeds serving.max_response_bytes={self._limit}",
            )
        for event in self._scanner.feed(data):
            if event.kind is not SseKind.DATA:
                continue
            try:
                chunk = json.loads(event.payload)
            except (ValueError, RecursionError):
                chunk = None
            if not isinstance(chunk, dict):
                raise failed(
                    self._engine,
                    self._phase,
                    FailureKind.BAD_STREAM,
                    "sent an event that is not a JSON object",
                )
            self._assembler.add(chunk)

    async def end_stream(self) -> None:
        await trio.lowlevel.checkpoint()

    def result(self) -> Json:
        return self._assembler.result()
