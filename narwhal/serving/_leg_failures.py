"""The words of an engine leg's failure (docs/design.md#retries).

Owns
  The constructors every leg failure goes through: `failed` (what Narwhal saw go
  wrong), `answered` (what the engine answered, in its words), `stream_error` (an error
  event in a 200 stream), `transfer_failed` (an SGLang bootstrap pair's KV transfer),
  `fault_failure` (a `StreamFault` of the meter).

Invariants
  Each makes the `EngineFailed` of its `FailureKind`'s row (`_failure.leg_failure`), so
  the status, code and retry rules come from the table alone. The message for the log
  names the engine; the client's (`public`) never names an engine or its address, but
  keeps what the engine said about the request the client sent.
"""

from __future__ import annotations

import json
from typing import Literal

from .._errors import EngineFailed
from .._values import json_int
from ..engines import SseEvent, SseKind, SseScanner
from ..engines._sse import SseOverflow
from ..fleet import EngineState
from ._failure import FailureKind, classify_event, leg_failure
from ._meter import StreamFault

LegPhase = Literal["prefill", "decode", "aggregate"]


def failed(
    engine: EngineState,
    phase: LegPhase,
    kind: FailureKind,
    detail: str,
    *,
    public: str | None = None,
    deadline_s: float | None = None,
) -> EngineFailed:
    """An engine leg's failure of `kind`, as FAILURE_POLICY has it. `public`: `detail` for
    a client, when `detail` names the engine or its address."""
    return leg_failure(
        kind,
        f"{phase} engine {engine.id}: {detail}",
        public=f"{phase} engine: {detail if public is None else public}",
        engine_id=engine.id,
        phase=phase,
        deadline_s=deadline_s,
    )


def answered(
    engine: EngineState,
    phase: LegPhase,
    kind: FailureKind,
    answer: str,
    public: str | None = None,
    *,
    status: int | None = None,
    param: str | None = None,
) -> EngineFailed:
    """A failure the engine answered with (`answer`: what it did, in its words, which go
    to the client too: they are about the request the client sent). `status`: the
    engine's, for the kinds that pass it on."""
    return leg_failure(
        kind,
        f"{phase} engine {engine.id} {answer}",
        public=f"{phase} engine {answer if public is None else public}",
        engine_id=engine.id,
        phase=phase,
        engine_status=status,
        param=param,
    )


def bootstrap_pair(engine: EngineState, phase: LegPhase) -> bool:
    """Whether the leg is one of an SGLang bootstrap pair's (`classify_answer`)."""
    return engine.dialect.concurrent_legs and phase != "aggregate"


def stream_error(engine: EngineState, phase: LegPhase, event: SseEvent) -> EngineFailed:
    """An error event inside a 200 stream (docs/design.md#streaming-failures: engines
    report late errors so); `classify_event` says what it is."""
    error = event.error or {}
    message = error.get("message", "engine error")
    status = json_int(error.get("code"))
    kind = classify_event(status, message, bootstrap_pair=bootstrap_pair(engine, phase))
    if kind is FailureKind.TRANSFER_FAILED:
        return transfer_failed(engine, phase, str(message))
    if status is None or kind is FailureKind.STREAM_ERROR:
        return failed(engine, phase, kind, f"engine reported an error mid-stream: {message}")
    param = error.get("param")
    answer = f"returned {status} in its stream: {message}"
    return answered(
        engine, phase, kind, answer, status=status, param=param if isinstance(param, str) else None
    )


def transfer_failed(engine: EngineState, phase: LegPhase, message: str) -> EngineFailed:
    """An SGLang bootstrap pair's KV transfer failed, as one of its servers reports it."""
    return failed(
        engine,
        phase,
        FailureKind.TRANSFER_FAILED,
        f"the bootstrap pair's KV transfer failed: {message}",
        # SGLang's words name the pair's transfer endpoints (host:port).
        public="the bootstrap pair's KV transfer failed",
    )


def fault_failure(engine: EngineState, phase: LegPhase, fault: StreamFault) -> EngineFailed:
    """The leg failure of a stream's `StreamFault`."""
    if fault.event is not None:
        return stream_error(engine, phase, fault.event)
    return failed(engine, phase, fault.kind, fault.detail)


def raise_stream_error(engine: EngineState, phase: LegPhase, raw: bytes) -> None:
    """Fail a leg whose whole event stream, read at once, holds an error event."""
    try:
        events = SseScanner().feed(raw)
    except SseOverflow as exc:
        raise failed(engine, phase, FailureKind.BAD_STREAM, str(exc)) from None
    for event in events:
        if event.kind is SseKind.ERROR:
            raise stream_error(engine, phase, event)


def loads(raw: bytes, engine: EngineState, phase: LegPhase) -> object:
    """An engine's JSON body, or the leg's `bad_response` failure."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise failed(
            engine, phase, FailureKind.BAD_RESPONSE, "returned a body that is not JSON"
        ) from None
