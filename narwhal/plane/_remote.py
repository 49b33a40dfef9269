"""A worker's request decisions, taken by the decision core (docs/architecture.md#workers).

Owns
  `RemoteDecisions`: the `Decisions` of one request on a worker, each sent to the core
  over the worker's channel, where a `Decisions` of the core's own runs it (`_core`):
  calls for answers, holds for what is granted until released, notes for what is only
  reported. `FirstAttempt`: what the core grants a request's first attempt with its
  admission (placement, decode claim, first phase slot), so that they cost one round
  trip. `RemoteGenerated`: a streamed leg's KV growth, reported as it grows.

Invariants
  The core's session of the request lives as long as its `retained` hold: everything the
  request still holds is released with it. Clock values never cross: each process has
  its own trio clock, so a deadline or a start time goes as the seconds left or gone.
  Engines go by id; the worker's own `EngineState` of that id serves the legs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Literal

import attrs
import trio

from .._errors import EngineFailed
from ..config import Config
from ..fleet import Claim, EngineState, Generated
from ..placement import Placement
from ..prefix import PromptKey
from ..serving._context import RequestRecord, ServingContext
from ..serving._decisions import Admitted, Decisions, Placed, Standing
from ..serving._leg_failures import LegPhase
from ..serving._request import ClientRequest
from ..serving._retry import GiveUp, Retry, Tried
from ..signals import DecodeGaps
from ._channel import Channel

_KEYS = itertools.count(1)
# A streamed leg's KV growth reaches the core's ledger in steps of this many tokens.
GROWTH_REPORT_TOKENS = 64


@attrs.frozen
class FirstAttempt:
    """What the core granted a request's first attempt with its admission, so that
    admission, placement and the first leg's slot cost one round trip: the placement,
    and whether the core holds the decode engine's claim and the first phase slot
    (`first_slot`) for it, with the slot's `alone` count."""

    placed: Placed
    slot: tuple[str, Literal["prefill", "decode"]] | None
    alone: int | None = None

    @property
    def decode(self) -> str | None:
        placement = self.placed.placement
        return placement.decode if isinstance(placement, Placement) else None


class RemoteGenerated(Generated):
    """A streamed decode leg's generated KV on the core's ledger, grown by notes: one
    each `GROWTH_REPORT_TOKENS` tokens, not one per chunk, and the rest before release."""

    __slots__ = ("_claim", "_decisions", "_unreported")

    def __init__(self, decisions: RemoteDecisions, claim: int) -> None:
        self._decisions = decisions
        self._claim = claim
        self._unreported = 0
        self.tokens = 0
        Claim.__init__(self, self._released)

    def add(self, tokens: int) -> None:
        if self.held:
            self.tokens += tokens
            self._unreported += tokens
            if self._unreported >= GROWTH_REPORT_TOKENS:
                self._report()

    def _report(self) -> None:
        if self._unreported:
            self._decisions.note("grow", self._claim, self._unreported)
            self._unreported = 0

    def _released(self) -> None:
        self._report()  # the ledger gives back what it was told of, all of it
        self._decisions.release_claim(self._claim)


class RemoteDecisions(Decisions):
    """One request's decisions on worker `ctx`, taken by the core over `channel`."""

    __slots__ = (
        "_alone",
        "_channel",
        "_claims",
        "_first",
        "_grants",
        "_key",
        "_mirrored",
        "_unplaced",
        "endpoint",
    )

    def __init__(
        self,
        ctx: ServingContext,
        config: Config,
        channel: Channel,
        endpoint: str = "",
        *,
        mirrored: Callable[[], Standing | None] = lambda: None,
    ) -> None:
        super().__init__(ctx, config)
        self._channel = channel
        self.endpoint = endpoint  # counted under it if the worker dies with the request
        self._mirrored = mirrored
        self._key = str(next(_KEYS))
        self._claims = itertools.count(1)
        # Each engine's leg count as the core granted its phase slot (`alone`).
        self._alone: dict[str, int | None] = {}
        # The first attempt (`admission`): its placement until `place` reads it, and the
        # holds the core keeps for it ("decode_placed", "slot"), each with whether the
        # legs have taken it.
        self._first: FirstAttempt | None = None
        self._unplaced: Placed | None = None
        self._grants: dict[str, bool] = {}

    # ---------------------------------------------------------------- the wire

    async def _call(self, name: str, *args: object) -> object:
        return await self._channel.call(name, (self._key, args))

    def _hold(self, name: str, *args: object) -> AbstractAsyncContextManager[object]:
        return self._channel.hold(name, (self._key, args))

    def note(self, name: str, *args: object) -> None:
        """Report `name` to the core's session of this request (no answer)."""
        self._channel.note(name, (self._key, args))

    def _claim(self, kind: str, engine: EngineState, *args: object) -> int:
        claim = next(self._claims)
        self.note("claim", claim, kind, engine.id, *args)
        return claim

    def release_claim(self, claim: int) -> None:
        self.note("release", claim)

    # ---------------------------------------------------------------- ingress

    @asynccontextmanager
    async def retained(self, address: str) -> AsyncIterator[None]:
        async with self._hold("retained", address, self.endpoint):
            # The worker's own count too: its drain waits for its requests.
            self.ctx.retained += 1
            try:
                yield
            finally:
                self.ctx.retained -= 1

    def body_read(self) -> None:
        self.note("body_read")

    async def standing(self) -> Standing:
        # The core's mirror, at most MIRROR_INTERVAL_S old; asked until it comes.
        standing = self._mirrored()
        if standing is not None:
            return standing
        asked = await self._call("standing")
        assert isinstance(asked, Standing)
        return asked

    async def cached(self, key: PromptKey | None) -> dict[str, int]:
        if key is None or self.ctx.prefix_caches is None:
            return {}
        cached = await self._call("cached", key)
        assert isinstance(cached, dict)
        return cached

    # ---------------------------------------------------------------- admission

    @asynccontextmanager
    async def admission(
        self, request: ClientRequest, tokens: int, prompt: PromptKey | None
    ) -> AsyncIterator[Admitted]:
        async with self._hold("admission", _shape(request), tokens, prompt) as answer:
            assert isinstance(answer, tuple)
            admitted, first = answer
            assert isinstance(admitted, Admitted)
            assert isinstance(first, FirstAttempt)
            self._first, self._unplaced = first, first.placed
            self._grants = dict.fromkeys(("decode_placed", "slot"), False) if first.slot else {}
            try:
                yield admitted
            finally:
                self._unplaced = None
                self._grants.clear()

    def _untaken(self, grant: str) -> bool:
        """Whether the core holds the first attempt's `grant` and no leg has taken it."""
        return self._grants.get(grant) is False

    def _let_go(self, grant: str) -> None:
        """Give back the first attempt's `grant` the core holds, taken or not."""
        if self._grants.pop(grant, None) is not None:
            self.note("let_go", grant)

    async def place(
        self,
        request: ClientRequest,
        tokens: int,
        cached: Mapping[str, int],
        tried: Tried,
        prompt: PromptKey | None,
    ) -> Placed:
        if tried.attempts == 1 and self._unplaced is not None:
            first, self._unplaced = self._unplaced, None
            return first
        placed = await self._call("place", _shape(request), tokens, dict(cached), tried, prompt)
        assert isinstance(placed, Placed)
        return placed

    # ---------------------------------------------------------------- engine holds

    @asynccontextmanager
    async def decode_placed(self, engine: EngineState, tokens: int) -> AsyncIterator[None]:
        first = self._first
        if first is not None and self._untaken("decode_placed") and engine.id == first.decode:
            self._grants["decode_placed"] = True
            try:
                yield
            finally:
                self._let_go("slot")  # the attempt ended before its legs took it
                self._let_go("decode_placed")
        else:
            async with self._hold("decode_placed", engine.id, tokens):
                yield

    @asynccontextmanager
    async def phase_slot(
        self,
        engine: EngineState,
        phase: Literal["prefill", "decode"],
        tokens: int,
        *,
        not_after: float = math.inf,
    ) -> AsyncIterator[None]:
        first = self._first
        if first is not None and self._untaken("slot") and first.slot == (engine.id, phase):
            self._grants["slot"] = True
            self._alone[engine.id] = first.alone
            try:
                yield
            finally:
                self._let_go("slot")
        else:
            left = not_after - trio.current_time()
            async with self._hold("phase_slot", engine.id, phase, tokens, left) as alone:
                assert alone is None or isinstance(alone, int)
                self._alone[engine.id] = alone
                yield

    def handoff(self, engine: EngineState) -> Claim:
        claim = self._claim("handoff", engine)
        return Claim(lambda: self.release_claim(claim))

    def local_prefill(self, engine: EngineState, tokens: int, cached: int) -> Claim:
        claim = self._claim("local_prefill", engine, tokens, cached)
        return Claim(lambda: self.release_claim(claim))

    # ---------------------------------------------------------------- retries

    async def retry(
        self,
        failure: EngineFailed,
        failed: EngineState,
        tried: Tried,
        placement: Placement,
        *,
        visible: bool,
        deadline: float,
    ) -> Retry | GiveUp:
        left = deadline - trio.current_time()
        decision = await self._call("retry", failure, failed.id, tried, placement, visible, left)
        assert isinstance(decision, Retry | GiveUp)
        return decision

    def succeeded(self) -> None:
        self.note("succeeded")

    # ---------------------------------------------------------------- what legs report

    def alone(self, engine: EngineState) -> int | None:
        return self._alone.get(engine.id)

    def leg_ok(
        self,
        engine: EngineState,
        phase: LegPhase,
        duration_s: float,
        *,
        prompt_tokens: int,
        alone: int | None,
        gaps: DecodeGaps | None = None,
    ) -> None:
        self.note("leg_ok", engine.id, phase, duration_s, prompt_tokens, alone, gaps)

    def leg_failed(self, failure: EngineFailed, engine: EngineState) -> None:
        self.note("leg_failed", engine.id, failure)

    def kv_freed(self, engine: EngineState, tokens: int) -> None:
        self.note("kv_freed", engine.id, tokens)

    def first_token_lag(self, engine: EngineState, lag_s: float) -> None:
        self.note("first_token_lag", engine.id, lag_s)

    def decode_gaps(self, engine: EngineState, summary: DecodeGaps) -> None:
        self.note("decode_gaps", engine.id, summary)

    def first_token_timeout(self, engine: EngineState) -> None:
        self.note("first_token_timeout", engine.id)

    def generated(self, engine: EngineState) -> RemoteGenerated:
        return RemoteGenerated(self, self._claim("generated", engine))

    def awaiting_first_token(self, engine: EngineState, since: float) -> Claim:
        claim = self._claim("awaiting_first_token", engine, trio.current_time() - since)
        return Claim(lambda: self.release_claim(claim))

    def unstreamed_decode(self, engine: EngineState, bound: int | None, since: float) -> Claim:
        claim = self._claim("unstreamed_decode", engine, bound, trio.current_time() - since)
        return Claim(lambda: self.release_claim(claim))

    def finished(self, outcome: str, record: RequestRecord | None = None) -> None:
        self.note("finished", outcome, None if record is None else _outcome_of(record))


def _shape(request: ClientRequest) -> ClientRequest:
    """`request` as the core's decisions read it: its prompt left out (they price its
    tokens, counted already), but for the fields they look at."""
    body = request.body
    kept = {"prompt_logprobs": body["prompt_logprobs"]} if "prompt_logprobs" in body else {}
    return attrs.evolve(request, body=kept)


def _outcome_of(record: RequestRecord) -> RequestRecord:
    """What the core's tallies read of a finished request: its TTFT and TPOT, and the
    projection they are compared with (no clock values: arrival is 0)."""
    return RequestRecord(
        id=record.id,
        endpoint=record.endpoint,
        arrival=0.0,
        prompt_tokens=record.prompt_tokens,
        projected_ttft_s=record.projected_ttft_s,
        projected_wait_s=record.projected_wait_s,
        first_output_at=record.observed_ttft_s,
        observed_tpot_s=record.observed_tpot_s,
    )
