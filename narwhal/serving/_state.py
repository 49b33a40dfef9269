"""The /narwhal/state document and the live Prometheus gauges, both read from one place.

Owns
  The serving sections of the state document as frozen records (`StateDocument` and its
  parts), built from the serving context by `state`; `state_document`, the document as
  JSON (`narwhal._records.to_json`); `live_gauges`, read at each scrape of /metrics.

Invariants
  Reads only. Sections other subsystems add (`ServingContext.state_providers`: the
  controller, supervisor, recovery, monitor and profiles) follow the serving ones in the
  order they were added.

See
  docs/observability.md (every key), tests/docs/test_observability.py.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import trio

from .. import __version__
from .._records import SPLICED, JsonObject, to_json
from ..admission import ErrorStatistics, WindowStatistics, ttft_budget_s
from ..engines import PoolStatistics
from ..fleet import EngineState
from ._context import RequestRecord, ServingContext
from ._context_check import ContextRule, engine_rule
from ._descriptors import OpenFiles
from ._per_client import PerClientStatistics
from ._slo import SloResult, attainment

_LISTED_REQUESTS = 200


@attrs.frozen(kw_only=True)
class NarwhalSection:
    version: str
    uptime_s: float
    accepting: bool
    degraded: str | None


@attrs.frozen(kw_only=True)
class OverrunWindow:
    samples: int
    overrun_s: float


@attrs.frozen(kw_only=True)
class ProjectionErrorsSection:
    """What admission adds to a projection (the `quantile` of recent overruns): on a path
    with backlog, and on one without, by prompt size (tokens)."""

    quantile: float
    backlog: OverrunWindow
    idle_by_prompt_tokens: Mapping[str, OverrunWindow]


@attrs.frozen(kw_only=True)
class AdmissionSection:
    mode: str
    retained: int
    retained_ceiling: int
    ttft_budget_s: float
    admitted: int
    max_admitted: int
    queue_depth: int
    queue_capacity: int
    unsized_offers: int
    unserved_placements: int
    profiles_loaded: bool
    prefill_backlog_s: Mapping[str, float]
    decode_first_token_lag_s: Mapping[str, float]
    projection_errors: ProjectionErrorsSection
    decode_kv_release_tokens_per_s: Mapping[str, float]


@attrs.frozen(kw_only=True)
class ConnectionsSection:
    open: int
    idle: int
    limit: int
    configured_limit: int
    at_limit: bool
    limit_reached_total: int
    shed_total: int
    accept_failing: bool
    accept_failures_total: int
    protocol_errors: Mapping[str, int]  # by status
    open_files: OpenFiles | None


@attrs.frozen(kw_only=True)
class ClientsSection:
    connections: PerClientStatistics
    pending_bodies: PerClientStatistics


@attrs.frozen(kw_only=True)
class RetryBudgetSection:
    level: float
    maximum: float
    spent_total: int
    denied_total: int


@attrs.frozen(kw_only=True)
class SloSection:
    """SLO attainment over the last controller.reactive.window_s (`SloTally`)."""

    ttft_s: float
    tpot_s: float
    percentile: float
    window_s: float
    counts: Mapping[SloResult, int]
    attainment: float | None
    # The service meets its SLO when at least `percentile` of offered requests did.
    meets_percentile: bool | None


@attrs.frozen(kw_only=True)
class FallbackRatio:
    value: float
    source: str


@attrs.frozen(kw_only=True)
class InFlightRequest:
    id: str
    endpoint: str
    stream: bool
    stage: str
    age_s: float
    attempts: int
    prefill_engine: str | None
    decode_engine: str | None
    prompt_tokens: int | None
    token_count_method: str | None
    token_count_fallback: str | None
    token_count_local_miss: str | None
    context_unchecked: str | None
    cached_tokens: int


@attrs.frozen(kw_only=True)
class RequestsSection:
    outcomes: Mapping[str, int]
    token_counts: Mapping[str, int]
    token_count_fallbacks: Mapping[str, int]
    token_count_local_misses: Mapping[str, int]
    context_checks: Mapping[str, int]
    unstreamed_decode_legs: Mapping[str, int]
    fallback_chars_per_token: FallbackRatio
    # Engines whose /tokenize refused chat messages (an older SGLang build): their chat
    # requests are estimated; seconds since it was learnt.
    tokenize_chat_refused: Mapping[str, float]
    in_flight: tuple[InFlightRequest, ...]  # the oldest _LISTED_REQUESTS


@attrs.frozen(kw_only=True)
class PrefillSlots:
    inflight: int
    tokens_inflight: int
    queued: int
    queued_tokens: int
    limit: int | None
    slots_in_use: int


@attrs.frozen(kw_only=True)
class DecodeSlots:
    active: int
    tokens: int
    pending: int
    pending_tokens: int
    unstreamed_legs: int
    tokens_per_event: float
    limit: int | None
    slots_in_use: int


@attrs.frozen(kw_only=True)
class EngineContext:
    """What requests are checked against before any leg (`length` None: nothing; `note`
    why), and by which rule of the engine's build (`version`, from its /version)."""

    length: int | None
    note: str | None
    rule: ContextRule
    version: str | None


@attrs.frozen(kw_only=True)
class EnginePools:
    serving: PoolStatistics
    control: PoolStatistics


@attrs.frozen(kw_only=True)
class OtherReplicasLegs:
    """The other replicas' legs on the engine (`SeenLoad`): as they published them
    ("replicas"), or as its last scrape showed them ("scrape")."""

    source: str
    prefill: int
    decode: int


@attrs.frozen(kw_only=True)
class EngineSection:
    id: str
    url: str
    dialect: str
    model: str
    role: str
    available: bool
    unavailable_reason: str | None
    drained: bool
    pinned: bool
    prefill: PrefillSlots
    decode: DecodeSlots
    handoffs_pending: int
    # None for one replica, or without a recent scrape (pricing then takes this
    # replica's ledger times the members).
    other_replicas: OtherReplicasLegs | None
    context: EngineContext
    pools: EnginePools


@attrs.frozen(kw_only=True)
class StateDocument:
    """/narwhal/state: the serving sections, then those of `ServingContext.state_providers`."""

    narwhal: NarwhalSection
    admission: AdmissionSection
    connections: ConnectionsSection
    clients: ClientsSection
    retry_budget: RetryBudgetSection
    slo: SloSection
    requests: RequestsSection
    engines: tuple[EngineSection, ...]
    provided: Mapping[str, attrs.AttrsInstance] = attrs.field(metadata=SPLICED)


def _limit(value: float) -> int | None:
    return None if math.isinf(value) else int(value)


def _window(stats: WindowStatistics) -> OverrunWindow:
    return OverrunWindow(samples=stats.samples, overrun_s=round(stats.overrun_s, 6))


def _projection_errors(stats: ErrorStatistics) -> ProjectionErrorsSection:
    return ProjectionErrorsSection(
        quantile=round(stats.quantile, 6),
        backlog=_window(stats.backlog),
        idle_by_prompt_tokens={band: _window(w) for band, w in stats.idle.items()},
    )


def engine_section(engine: EngineState, now: float) -> EngineSection:
    reason = engine.unavailable_reason(now)
    load = engine.load.statistics()
    seen = engine.seen_load(now)
    return EngineSection(
        id=engine.id,
        url=engine.spec.url,
        dialect=engine.dialect.name,
        model=engine.spec.model,
        role=engine.role,
        available=reason is None,
        unavailable_reason=reason,
        drained=engine.drained,
        pinned=engine.pinned,
        prefill=PrefillSlots(
            inflight=load.prefill_inflight,
            tokens_inflight=load.prefill_tokens_inflight,
            queued=load.prefill_queued,
            queued_tokens=load.prefill_queued_tokens,
            limit=_limit(engine.prefill_limiter.total_tokens),
            slots_in_use=engine.prefill_limiter.borrowed_tokens,
        ),
        decode=DecodeSlots(
            active=load.decode_active,
            tokens=load.decode_tokens,
            pending=load.decode_pending,
            pending_tokens=load.decode_pending_tokens,
            unstreamed_legs=load.unstreamed_legs,
            tokens_per_event=round(engine.tokens_per_event, 3),
            limit=_limit(engine.decode_limiter.total_tokens),
            slots_in_use=engine.decode_limiter.borrowed_tokens,
        ),
        handoffs_pending=load.handoffs_pending,
        other_replicas=None
        if seen is None
        else OtherReplicasLegs(source=seen.source, prefill=seen.prefill, decode=seen.decode),
        context=EngineContext(
            length=engine.context_length,
            note=engine.context_note,
            rule=engine_rule(engine),
            version=engine.version,
        ),
        pools=EnginePools(
            serving=engine.serving_pool.statistics(),
            control=engine.control_pool.statistics(),
        ),
    )


def slo_section(ctx: ServingContext, now: float) -> SloSection:
    slo = ctx.config.slo
    counts = ctx.slo.counts(now)
    share = attainment(counts)
    return SloSection(
        ttft_s=slo.ttft_s,
        tpot_s=slo.tpot_s,
        percentile=slo.percentile,
        window_s=ctx.slo.window_s,
        counts=counts,
        attainment=None if share is None else round(share, 4),
        meets_percentile=None if share is None else share >= slo.percentile,
    )


def _in_flight(record: RequestRecord, now: float) -> InFlightRequest:
    return InFlightRequest(
        id=record.id,
        endpoint=record.endpoint,
        stream=record.stream,
        stage=record.stage,
        age_s=round(now - record.arrival, 3),
        attempts=record.attempts,
        prefill_engine=record.prefill_engine,
        decode_engine=record.decode_engine,
        prompt_tokens=record.prompt_tokens,
        token_count_method=record.token_count_method,
        token_count_fallback=record.token_count_fallback,
        token_count_local_miss=record.token_count_local_miss,
        context_unchecked=record.context_unchecked,
        cached_tokens=record.cached_tokens,
    )


def _listed_in_flight(ctx: ServingContext, now: float) -> tuple[InFlightRequest, ...]:
    """The oldest `_LISTED_REQUESTS` requests in flight, the oldest first."""
    records = sorted(ctx.records.values(), key=lambda r: r.arrival)
    return tuple(_in_flight(r, now) for r in records[:_LISTED_REQUESTS])


def state(ctx: ServingContext) -> StateDocument:
    """The state document now, as records."""
    now = trio.current_time()
    gate = ctx.gate.statistics()
    budget = ctx.retry_budget
    connections = ctx.connections.statistics()
    ratio, ratio_source = ctx.chars_per_token(ctx.config)
    signals = ctx.load_signals(now)
    return StateDocument(
        narwhal=NarwhalSection(
            version=__version__,
            uptime_s=round(now - ctx.started_at, 3),
            accepting=ctx.accepting,
            degraded=ctx.degraded_reason,
        ),
        admission=AdmissionSection(
            mode=ctx.config.serving.admission,
            retained=ctx.retained,
            retained_ceiling=ctx.retained_ceiling,
            ttft_budget_s=ttft_budget_s(ctx.config.slo.ttft_s, ctx.config.serving.admission_margin),
            admitted=gate.admitted,
            max_admitted=gate.max_admitted,
            queue_depth=gate.waiting,
            queue_capacity=gate.queue_capacity,
            unsized_offers=ctx.unsized_offers,
            unserved_placements=ctx.unserved_placements,
            profiles_loaded=ctx.profiles is not None,
            prefill_backlog_s={
                engine_id: round(wait, 6) for engine_id, wait in sorted(signals.backlog_s.items())
            },
            decode_first_token_lag_s={
                engine_id: round(lag, 6)
                for engine_id, lag in sorted(signals.first_token_lag_s.items())
            },
            projection_errors=_projection_errors(ctx.projection_errors.statistics(now)),
            decode_kv_release_tokens_per_s={
                engine_id: round(rate, 1)
                for engine_id, rate in sorted(signals.kv_release_per_s.items())
            },
        ),
        connections=ConnectionsSection(
            open=connections.open,
            idle=connections.idle,
            limit=connections.limit,
            configured_limit=connections.configured_limit,
            at_limit=connections.at_limit,
            limit_reached_total=connections.limit_reached,
            shed_total=connections.shed,
            accept_failing=connections.accept_failing,
            accept_failures_total=connections.accept_failures,
            protocol_errors={
                str(status): count for status, count in sorted(ctx.protocol_errors.items())
            },
            open_files=None if ctx.descriptors is None else ctx.descriptors.open_files(),
        ),
        clients=ClientsSection(
            connections=connections.per_client,
            pending_bodies=ctx.pending_bodies.statistics(),
        ),
        retry_budget=RetryBudgetSection(
            level=round(budget.level, 3),
            maximum=budget.maximum,
            spent_total=budget.spent_total,
            denied_total=budget.denied_total,
        ),
        slo=slo_section(ctx, now),
        requests=RequestsSection(
            outcomes=dict(sorted(ctx.outcomes.items())),
            **_worker_counts(ctx),
            fallback_chars_per_token=FallbackRatio(value=round(ratio, 3), source=ratio_source),
            tokenize_chat_refused={
                engine.id: round(now - since, 3)
                for engine, since in ctx.chat_tokenize_refusals.learnt(ctx.config)
            },
            in_flight=_listed_in_flight(ctx, now),
        ),
        engines=tuple(engine_section(engine, now) for engine in ctx.fleet),
        provided={key: provider() for key, provider in ctx.state_providers},
    )


def state_document(ctx: ServingContext) -> JsonObject:
    """/narwhal/state as JSON (`state`), the process's own part."""
    return to_json(state(ctx))


async def full_state_document(ctx: ServingContext) -> JsonObject:
    """/narwhal/state as JSON, as the admin listener and narwhalctl show it: with the
    worker processes' parts when there are any (`with_workers`)."""
    document = state_document(ctx)
    if ctx.worker_states is not None:
        document = with_workers(document, await ctx.worker_states())
    return document


Gauge = tuple[str, str, list[str], list[tuple[list[str], float]]]


def live_gauges(ctx: ServingContext) -> Iterator[Gauge]:
    gate = ctx.gate.statistics()
    yield "narwhal_retained_requests", "Completion requests retained.", [], [([], ctx.retained)]
    yield (
        "narwhal_admitted_requests",
        "Requests holding an admission slot.",
        [],
        [([], gate.admitted)],
    )
    yield "narwhal_queue_depth", "Requests waiting for admission.", [], [([], gate.waiting)]
    connections = ctx.connections.statistics()
    yield (
        "narwhal_client_connections",
        "Client HTTP connections open (at most listen.max_open_connections), by whether "
        "a request is in flight (busy) or not (idle).",
        ["state"],
        [(["idle"], connections.idle), (["busy"], connections.open - connections.idle)],
    )
    yield (
        "narwhal_client_connection_limit",
        "Client connections allowed open: listen.max_open_connections, or fewer when the "
        "open-file limit (RLIMIT_NOFILE) has no room for that many.",
        [],
        [([], connections.limit)],
    )
    yield (
        "narwhal_client_connection_limit_configured",
        "listen.max_open_connections as configured.",
        [],
        [([], connections.configured_limit)],
    )
    yield (
        "narwhal_request_bodies_pending",
        "Completion requests whose bodies are still arriving (at most "
        "serving.max_pending_bodies_per_client from one client address).",
        [],
        [([], ctx.pending_bodies.statistics().counted)],
    )
    yield "narwhal_retry_budget", "Retry credits available.", [], [([], ctx.retry_budget.level)]
    share = ctx.slo.attainment(trio.current_time())
    yield (
        "narwhal_slo_attainment",
        "Share of offered requests served within both SLO targets over the last "
        "controller.reactive.window_s, refusals counted as misses (absent when none).",
        [],
        [] if share is None else [([], share)],
    )
    now = trio.current_time()
    engines = list(ctx.fleet)
    yield (
        "narwhal_engine_available",
        "1 when the engine can take new work.",
        ["engine"],
        [([e.id], float(e.unavailable_reason(now) is None)) for e in engines],
    )
    yield (
        "narwhal_engine_role",
        "1 for the engine's current role.",
        ["engine", "role"],
        [
            ([e.id, role], float(e.role == role))
            for e in engines
            for role in ("prefill", "decode", "both")
        ],
    )
    yield (
        "narwhal_engine_prefill_inflight",
        "Prefill legs in flight per engine.",
        ["engine"],
        [([e.id], e.load.prefill_inflight) for e in engines],
    )
    yield (
        "narwhal_engine_decode_active",
        "Decode streams active per engine.",
        ["engine"],
        [([e.id], e.load.decode_active) for e in engines],
    )
    yield (
        "narwhal_engine_handoffs_pending",
        "Prefilled requests whose KV still waits on the engine for its decode leg.",
        ["engine"],
        [([e.id], e.load.handoffs_pending) for e in engines],
    )
    yield (
        "narwhal_engine_connections",
        "Engine HTTP connections by pool and state.",
        ["engine", "pool", "state"],
        [
            ([e.id, name, state], float(getattr(pool.statistics(), state)))
            for e in engines
            for name, pool in (("serving", e.serving_pool), ("control", e.control_pool))
            for state in ("in_use", "idle", "waiting")
        ],
    )


def _worker_counts(ctx: ServingContext) -> dict[str, dict[str, int]]:
    """The counts of /narwhal/state's `requests` that a worker process keeps for its own
    requests (`narwhal.plane`): the document adds every worker's to the core's."""
    return {
        "token_counts": dict(sorted(ctx.token_methods.items())),
        "token_count_fallbacks": dict(sorted(ctx.token_fallbacks.items())),
        "token_count_local_misses": dict(sorted(ctx.token_local_misses.items())),
        "context_checks": dict(sorted(ctx.context_checks.items())),
        "unstreamed_decode_legs": dict(sorted(ctx.unstreamed_legs.items())),
    }


def worker_section(ctx: ServingContext) -> JsonObject:
    """A worker process's part of /narwhal/state (`narwhal.plane`): what only it holds,
    its client connections and the requests it serves, and its counts of how their
    prompts were counted and checked. The rest of the document is its core's."""
    now = trio.current_time()
    connections = ctx.connections.statistics()
    return {
        "retained": ctx.retained,
        "connections": {"open": connections.open, "idle": connections.idle},
        **_worker_counts(ctx),
        "in_flight": [to_json(request) for request in _listed_in_flight(ctx, now)],
    }


def with_workers(document: JsonObject, workers: list[JsonObject]) -> JsonObject:
    """`document` (the core's) with its workers' sections under `workers`, and what they
    keep of its `requests` and `connections` added in: their counts summed, their
    requests in flight listed, the oldest first."""
    document["workers"] = workers
    requests: dict[str, Any] = document["requests"]  # type: ignore[assignment]
    connections: dict[str, int] = document["connections"]  # type: ignore[assignment]
    in_flight: list[dict[str, Any]] = list(requests["in_flight"])
    for worker in workers:
        for key, counts in worker.items():
            if isinstance(counts, dict) and key in requests:  # `_worker_counts`
                total = Counter(requests[key])
                total.update(counts)
                requests[key] = dict(sorted(total.items()))
        listed: Any = worker.get("in_flight", [])
        in_flight.extend(listed)
        opened: Any = worker.get("connections", {})
        for key in ("open", "idle"):
            connections[key] += opened.get(key, 0)
    in_flight.sort(key=lambda request: -request["age_s"])
    requests["in_flight"] = in_flight[:_LISTED_REQUESTS]
    return document
