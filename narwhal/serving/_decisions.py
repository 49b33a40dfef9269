"""One request's global decisions, in the one place that may take them
(docs/architecture.md#workers).

Owns
  `Decisions`: what a request asks of state only one place may keep: the retained
  ceiling, the admission queue, predictive admission, placement, the decode engine's
  claim, the phase slots, the producer's held KV, the retry budget. This class takes
  them on its process's own `ServingContext`; a worker of the multi-process plane asks
  the decision core instead (`narwhal.plane`), which runs this same class on its own.

Invariants
  One object per request (it keeps the decode placement's claim until the decode slot
  takes it). Holds are async context managers: what they grant is given back on leaving
  them, however the request ends. The local form adds no schedule point to the
  request path: its calls are async only so that a remote form can be.

Errors
  `retained` raises `BeforeBody` (the refusal, and whether the connection is worth
  keeping); the others raise the refusals the single process raised from them.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Literal

import attrs
import trio

from .._codes import ErrorCode
from .._errors import EngineFailed, NarwhalError, Refused, Unavailable
from ..admission import PathQuote
from ..config import Config
from ..fleet import Claim, EngineState, EngineView, Generated
from ..placement import NoPlacement, Placement, Policy, choose
from ..prefix import PromptKey
from ..signals import DecodeGaps
from ._admit import (
    LocalPrices,
    admit_predictively,
    aggregate_only,
    has_aggregate,
    local_prefill_prices,
    offered,
    placement_for,
)
from ._context import RequestRecord, ServingContext
from ._leg_failures import LegPhase
from ._legs import book_prefill, phase_slot
from ._pairs import pair_protocol
from ._prefix import prefills_locally
from ._request import ClientRequest
from ._retry import GiveUp, Reason, Retry, Tried, next_attempt

# Retry-After of a refusal at saturation (the retained ceiling, a full or timed-out
# admission queue): slots free as requests finish, which no prediction here prices.
SATURATED_RETRY_AFTER_S = 1.0


class BeforeBody(Exception):
    """A request refused before its body is read: `error` answers it, and the client's
    connection is kept only when `keep_connection`."""

    def __init__(self, error: NarwhalError, keep_connection: bool) -> None:
        super().__init__(error, keep_connection)
        self.error = error
        self.keep_connection = keep_connection


@attrs.frozen
class Standing:
    """What of the fleet's state a parsed request is checked against before its prompt
    is counted."""

    degraded_reason: str | None
    has_aggregate: bool


@attrs.frozen
class Admitted:
    """A request admitted: the tokens of its prompt each engine holds, predictive
    admission's quotes (none when admission is not predictive), and the seconds it
    waited in the admission queue."""

    cached: dict[str, int]
    quotes: list[PathQuote]
    waited_s: float


@attrs.frozen
class Placed:
    """An attempt's placement; `local_prefill`: the decode engine computes the prompt
    itself (no prefill leg), at `local_prices`; `cached_tokens`: what the engine that
    computes the prompt holds of it."""

    placement: Placement | NoPlacement
    local_prefill: bool = False
    local_prices: LocalPrices | None = None
    cached_tokens: int = 0


class Decisions:
    """One request's global decisions on this process's `ctx`, with the request's
    configuration snapshot `config`."""

    __slots__ = ("_body", "_pending", "config", "ctx")

    def __init__(self, ctx: ServingContext, config: Config) -> None:
        self.ctx = ctx
        self.config = config
        self._body: Claim | None = None
        self._pending: Claim | None = None

    # ---------------------------------------------------------------- ingress

    @asynccontextmanager
    async def retained(self, address: str) -> AsyncIterator[None]:
        """Count the request among the retained ones, and among `address`'s bodies
        still arriving until `body_read`."""
        ctx = self.ctx
        refused = refusal_before_body(ctx, address)
        if refused is not None:
            raise BeforeBody(*refused)
        ctx.retained += 1
        body = ctx.pending_bodies.hold(address)
        self._body = Claim(body)
        try:
            yield
        finally:
            body()
            ctx.retained -= 1

    def body_read(self) -> None:
        """The request's body is read: its client may send another."""
        if self._body is not None:
            self._body.release()

    async def standing(self) -> Standing:
        return standing_of(self.ctx)

    async def cached(self, key: PromptKey | None) -> dict[str, int]:
        """The engines holding some of the prompt `key`, with how many leading tokens."""
        caches = self.ctx.prefix_caches
        if caches is None or key is None:
            return {}
        now = trio.current_time()
        found = {engine.id: caches.cached_tokens(engine.id, key, now) for engine in self.ctx.fleet}
        return {engine: tokens for engine, tokens in found.items() if tokens > 0}

    # ---------------------------------------------------------------- admission

    @asynccontextmanager
    async def admission(
        self, request: ClientRequest, tokens: int, prompt: PromptKey | None
    ) -> AsyncIterator[Admitted]:
        """Admit the request (predictive admission when configured, then a place in the
        admission queue) and hold its admission slot; raises the refusal. Every
        admission, and every refusal of the queue, is offered demand
        (predictive admission offers its own refusals)."""
        ctx, config = self.ctx, self.config
        cached = await self.cached(prompt)
        quotes: list[PathQuote] = []
        if config.serving.admission == "predictive":
            quotes = admit_predictively(ctx, request, tokens, config, cached)
        try:
            async with ctx.gate.admitted(
                queue_timeout_s=config.serving.queue_timeout_s,
                retry_after_s=SATURATED_RETRY_AFTER_S,
            ) as waited:
                offered(ctx, request, tokens, admitted=True, cached=cached)
                yield Admitted(cached, quotes, waited)
        except Refused as refusal:
            if refusal.code in (ErrorCode.QUEUE_FULL, ErrorCode.QUEUE_TIMEOUT):
                offered(ctx, request, tokens, admitted=False, reason=refusal.code, cached=cached)
            raise

    # ---------------------------------------------------------------- placement

    async def place(
        self,
        request: ClientRequest,
        tokens: int,
        cached: Mapping[str, int],
        tried: Tried,
        prompt: PromptKey | None,
    ) -> Placed:
        """Where attempt `tried` runs, and whether its decode engine computes the prompt
        itself."""
        ctx, config = self.ctx, self.config
        views = ctx.fleet.views(trio.current_time())
        if aggregate_only(ctx, request):
            views = tuple(view for view in views if view.role == "both")
        policy = placement_for(ctx, tokens, config, cached)
        placement = place(views, tried, policy)
        if isinstance(placement, NoPlacement):
            return Placed(placement)
        if placement.unserved:
            # docs/design.md#placement: every candidate misses its projected SLO; run
            # on the cheapest.
            ctx.unserved_placements += 1
            ctx.metrics.unserved_placements.inc()
        local_prices = None
        decode = ctx.fleet.get(placement.decode)
        assert decode is not None
        decode_alone = pair_protocol(decode.dialect).decode_alone(request)
        if placement.prefill is not None and not decode_alone:
            local_prices = self._local_prices(placement, decode, tokens, cached)
        local = placement.prefill is None or decode_alone or local_prices is not None
        computed = placement.decode if local else placement.prefill
        assert computed is not None
        cached_tokens = cached.get(computed, 0)
        if cached_tokens:
            ctx.metrics.cached_prompt_tokens.labels(computed).inc(cached_tokens)
        self._ran_on(prompt, {computed, placement.decode})
        return Placed(
            placement,
            local_prefill=placement.prefill is not None and local,
            local_prices=local_prices,
            cached_tokens=cached_tokens,
        )

    def _local_prices(
        self, placement: Placement, engine: EngineState, tokens: int, cached: Mapping[str, int]
    ) -> LocalPrices | None:
        """docs/design.md#prefix-caching: the prices on which a vLLM decode engine that
        holds most of the prompt computes the rest itself (no slower than the pair's
        path), or None."""
        ctx, decode = self.ctx, placement.decode
        prefill = placement.prefill
        assert prefill is not None
        if not pair_protocol(engine.dialect).prefills_locally:
            return None

        def price() -> LocalPrices:
            return local_prefill_prices(ctx, prefill, decode, tokens, cached)

        share = self.config.cache.local_prefill_share
        prices = prefills_locally(cached.get(decode, 0), tokens, share, price)
        if prices is not None:
            ctx.metrics.local_prefills.labels(decode).inc()
        return prices

    def _ran_on(self, prompt: PromptKey | None, engine_ids: set[str]) -> None:
        """The prompt's KV is on these engines now (the prefill's and, after a handoff,
        the decode engine's): the approximate index learns it."""
        caches = self.ctx.prefix_caches
        if caches is None or prompt is None:
            return
        now = trio.current_time()
        for engine_id in sorted(engine_ids):
            caches.routed(engine_id, prompt, now)

    # ---------------------------------------------------------------- engine holds

    @asynccontextmanager
    async def decode_placed(self, engine: EngineState, tokens: int) -> AsyncIterator[None]:
        """The decode engine is chosen a whole prefill before its leg starts: placement
        sees the request there from now on, until its decode slot takes it over."""
        with engine.load.decode_placed(tokens) as pending:
            self._pending = pending
            try:
                yield
            finally:
                self._pending = None

    def phase_slot(
        self,
        engine: EngineState,
        phase: Literal["prefill", "decode"],
        tokens: int,
        *,
        not_after: float = math.inf,
    ) -> AbstractAsyncContextManager[None]:
        """One of the engine's phase slots (`_legs.phase_slot`); a decode slot takes over
        the decode placement's claim."""
        pending = self._pending if phase == "decode" else None
        return phase_slot(self.ctx, engine, phase, tokens, not_after=not_after, pending=pending)

    def local_prefill(self, engine: EngineState, tokens: int, cached: int) -> Claim:
        """The prefill a decode engine makes of the prompt itself, booked on its backlog
        (`_legs.book_prefill`) until released at the first token."""
        return book_prefill(self.ctx, engine, tokens, cached)

    def handoff(self, engine: EngineState) -> Claim:
        """The producer's KV held for a decode leg not sent yet."""
        return engine.load.handoff()

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
        """Count `failure` of `failed` (the instance its leg ran on) and decide what follows
        it; a retry's credit is spent here."""
        ctx = self.ctx
        if failure.code == ErrorCode.KV_TRANSFER_FAILED and placement.prefill is not None:
            # Recovery tells which engine of the pair fails its transfers.
            failure.partner_id = (
                placement.decode if failure.engine_id == placement.prefill else placement.prefill
            )
        ctx.metrics.engine_failures.labels(failure.engine_id, failure.phase, failure.code).inc()
        ctx.engine_leg_failed(failure, failed)
        decision = next_attempt(
            failure,
            tried,
            prefill=placement.prefill,
            visible=visible,
            serving=self.config.serving,
            budget_credits=ctx.retry_budget.level,
            deadline=deadline,
            now=trio.current_time(),
            jitter=ctx.rng.random(),
        )
        if isinstance(decision, GiveUp):
            if decision.reason is Reason.BUDGET_EXHAUSTED:
                ctx.retry_budget.refused()
            return decision
        spent = ctx.retry_budget.try_spend()
        assert spent  # next_attempt saw the credit, and nothing ran since
        ctx.metrics.retries.labels(failure.code).inc()
        return decision

    def succeeded(self) -> None:
        """The request's attempt succeeded: the retry budget earns its share."""
        self.ctx.retry_budget.on_success()

    # ---------------------------------------------------------------- what legs report

    def alone(self, engine: EngineState) -> int | None:
        """Called inside a leg's phase slot: the engine's leg count if the leg is the
        only one on it now, else None. The leg was uncontended throughout when the count
        is unchanged at its end (`leg_ok`)."""
        load = engine.load
        # Another replica's legs on the engine are not in this ledger: with more than
        # one member no leg is known to be alone, and latency residuals come from decode
        # legs only (priced at the fleet's estimated load, `EngineState.load_scale`).
        if load.prefill_inflight + load.decode_active > 1 or engine.load_scale > 1:
            return None
        return load.legs_started

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
        """A leg succeeded; it was uncontended if the engine's leg count is still `alone`."""
        contended = alone is None or engine.load.legs_started != alone
        self.ctx.leg_observer.leg_ok(
            engine, phase, duration_s, prompt_tokens=prompt_tokens, contended=contended, gaps=gaps
        )

    def leg_failed(self, failure: EngineFailed, engine: EngineState) -> None:
        self.ctx.engine_leg_failed(failure, engine)

    def kv_freed(self, engine: EngineState, tokens: int) -> None:
        self.ctx.kv_freed(engine, tokens, trio.current_time())

    def first_token_lag(self, engine: EngineState, lag_s: float) -> None:
        self.ctx.first_token_lag(engine, lag_s, trio.current_time())

    def decode_gaps(self, engine: EngineState, summary: DecodeGaps) -> None:
        self.ctx.signals.decode_gaps(engine, summary)

    def first_token_timeout(self, engine: EngineState) -> None:
        self.ctx.signals.first_token_timeout(engine)

    def generated(self, engine: EngineState) -> Generated:
        """The KV a running streamed decode leg generates (`KvGrowth`)."""
        return engine.load.generated()

    def awaiting_first_token(self, engine: EngineState, since: float) -> Claim:
        return engine.load.awaiting_first_token(since)

    def unstreamed_decode(self, engine: EngineState, bound: int | None, since: float) -> Claim:
        return engine.load.unstreamed_decode(bound, since)

    def finished(self, outcome: str, record: RequestRecord | None = None) -> None:
        """The request ended with `outcome`: counted, and its projection compared with
        the TTFT it had."""
        ctx = self.ctx
        ctx.finished(outcome, record)
        if record is not None:
            ctx.projection_observed(record, trio.current_time())


def standing_of(ctx: ServingContext) -> Standing:
    return Standing(ctx.degraded_reason, has_aggregate(ctx))


def first_slot(placed: Placed) -> tuple[str, Literal["prefill", "decode"]] | None:
    """The engine and phase of the first phase slot an attempt placed so takes: every
    path takes its prefill slot first (`_pairs`), and a path without a prefill leg has
    only its decode slot. None: nothing was placed."""
    placement = placed.placement
    if isinstance(placement, NoPlacement):
        return None
    if placement.prefill is None or placed.local_prefill:
        return placement.decode, "decode"
    return placement.prefill, "prefill"


def refusal_before_body(ctx: ServingContext, address: str) -> tuple[NarwhalError, bool] | None:
    """Why a request from `address` is refused before its body is read, and whether its
    connection is worth keeping; None: it may be retained. Counts the refusal where the
    state document counts it."""
    if not ctx.accepting:
        # No connection to a daemon that is going away is worth keeping.
        return Unavailable("narwhal is shutting down", code=ErrorCode.SHUTTING_DOWN), False
    if ctx.retained >= ctx.retained_ceiling:
        # docs/design.md#retained-ceiling: past the ceiling, refuse before parsing the body.
        ctx.unsized_offers += 1
        ceiling = Refused(
            f"narwhal retains at most serving.max_connections + serving.queue_capacity"
            f" = {ctx.retained_ceiling} requests",
            code=ErrorCode.RETAINED_CEILING,
            retry_after_s=SATURATED_RETRY_AFTER_S,
        )
        return ceiling, True
    if ctx.pending_bodies.full(address):
        # Below the ceiling, so that one client's slow bodies cannot reach it. Its body
        # is not waited for: the client has enough of them arriving already.
        slow = ctx.pending_bodies.refusal(address)
        ctx.pending_bodies.refused(address)
        return slow, False
    return None


def place(views: tuple[EngineView, ...], tried: Tried, policy: Policy) -> Placement | NoPlacement:
    """Where an attempt goes: not to an engine `tried` leaves out while another can take it.
    When none can (the role's others are out), a retry goes back to the engine that
    failed, as any HTTP retry would: a transient failure is worth the attempt, and
    refusing the request as `no_engine_available` would blame a fleet that still has an
    engine. An engine taken out of placement meanwhile (unreachable, breaker, quarantine,
    ejection) is not placeable either way."""
    placement = choose(views, excluded=tried.excluded | tried.avoided, policy=policy)
    if isinstance(placement, NoPlacement) and tried.avoided:
        placement = choose(views, excluded=tried.excluded, policy=policy)
    if isinstance(placement, NoPlacement) and tried.excluded:
        placement = choose(views, excluded=frozenset(), policy=policy)
    return placement
