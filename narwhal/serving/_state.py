"""The /narwhal/state document and the live Prometheus gauges, both read from one place."""

from __future__ import annotations

import math
from collections.abc import Iterator

import attrs
import trio

from .. import __version__
from ..admission import ErrorStatistics, WindowStatistics, ttft_budget_s
from ..engines import PoolStatistics
from ..fleet import EngineState
from ._context import ServingContext
from ._context_check import engine_rule
from ._per_client import PerClientStatistics
from ._slo import attainment

_LISTED_REQUESTS = 200


def _limit(value: float) -> int | None:
    return None if math.isinf(value) else int(value)


def _pool(stats: PoolStatistics) -> dict[str, int]:
    return attrs.asdict(stats)


def _window(stats: WindowStatistics) -> dict[str, object]:
    return {"samples": stats.samples, "overrun_s": round(stats.overrun_s, 6)}


def _projection_errors(stats: ErrorStatistics) -> dict[str, object]:
    """What admission adds to a projection (the `quantile` of recent overruns): on a path
    with backlog, and on one without, by prompt size (tokens)."""
    return {
        "quantile": round(stats.quantile, 6),
        "backlog": _window(stats.backlog),
        "idle_by_prompt_tokens": {band: _window(w) for band, w in stats.idle.items()},
    }


def engine_state(engine: EngineState, now: float) -> dict[str, object]:
    reason = engine.unavailable_reason(now)
    load = engine.load.statistics()
    return {
        "id": engine.id,
        "url": engine.spec.url,
        "dialect": engine.dialect.name,
        "model": engine.spec.model,
        "role": engine.role,
        "available": reason is None,
        "unavailable_reason": reason,
        "drained": engine.drained,
        "pinned": engine.pinned,
        "prefill": {
            "inflight": load.prefill_inflight,
            "tokens_inflight": load.prefill_tokens_inflight,
            "queued": load.prefill_queued,
            "queued_tokens": load.prefill_queued_tokens,
            "limit": _limit(engine.prefill_limiter.total_tokens),
            "slots_in_use": engine.prefill_limiter.borrowed_tokens,
        },
        "decode": {
            "active": load.decode_active,
            "tokens": load.decode_tokens,
            "pending": load.decode_pending,
            "pending_tokens": load.decode_pending_tokens,
            "unstreamed_legs": load.unstreamed_legs,
            "tokens_per_event": round(engine.tokens_per_event, 3),
            "limit": _limit(engine.decode_limiter.total_tokens),
            "slots_in_use": engine.decode_limiter.borrowed_tokens,
        },
        "handoffs_pending": load.handoffs_pending,
        # What requests are checked against before any leg (null: nothing; `note` why),
        # and by which rule of the engine's build (`version`, from its /version).
        "context": {
            "length": engine.context_length,
            "note": engine.context_note,
            "rule": engine_rule(engine),
            "version": engine.version,
        },
        "pools": {
            "serving": _pool(engine.serving_pool.statistics()),
            "control": _pool(engine.control_pool.statistics()),
        },
    }


def slo_state(ctx: ServingContext, now: float) -> dict[str, object]:
    """SLO attainment over the last controller.reactive.window_s (`SloTally`)."""
    slo = ctx.config.slo
    counts = ctx.slo.counts(now)
    share = attainment(counts)
    return {
        "ttft_s": slo.ttft_s,
        "tpot_s": slo.tpot_s,
        "percentile": slo.percentile,
        "window_s": ctx.slo.window_s,
        "counts": counts,
        "attainment": None if share is None else round(share, 4),
        # The service meets its SLO when at least `percentile` of offered requests did.
        "meets_percentile": None if share is None else share >= slo.percentile,
    }


def _per_client(stats: PerClientStatistics) -> dict[str, object]:
    return {
        "limit_per_client": stats.limit,
        "counted": stats.counted,
        "clients": stats.clients,
        "busiest": stats.busiest,
        "refused_total": stats.refused,
        "refusing": stats.refusing,
    }


def state_document(ctx: ServingContext) -> dict[str, object]:
    now = trio.current_time()
    gate = ctx.gate.statistics()
    budget = ctx.retry_budget
    connections = ctx.connections.statistics()
    records = sorted(ctx.records.values(), key=lambda r: r.arrival)
    ratio, ratio_source = ctx.chars_per_token(ctx.config)
    signals = ctx.load_signals(now)
    document: dict[str, object] = {
        "narwhal": {
            "version": __version__,
            "uptime_s": round(now - ctx.started_at, 3),
            "accepting": ctx.accepting,
            "degraded": ctx.degraded_reason,
        },
        "admission": {
            "mode": ctx.config.serving.admission,
            "retained": ctx.retained,
            "retained_ceiling": ctx.retained_ceiling,
            "ttft_budget_s": ttft_budget_s(
                ctx.config.slo.ttft_s, ctx.config.serving.admission_margin
            ),
            "admitted": gate.admitted,
            "max_admitted": gate.max_admitted,
            "queue_depth": gate.waiting,
            "queue_capacity": gate.queue_capacity,
            "unsized_offers": ctx.unsized_offers,
            "unserved_placements": ctx.unserved_placements,
            "profiles_loaded": ctx.profiles is not None,
            "prefill_backlog_s": {
                engine_id: round(wait, 6) for engine_id, wait in sorted(signals.backlog_s.items())
            },
            "decode_first_token_lag_s": {
                engine_id: round(lag, 6)
                for engine_id, lag in sorted(signals.first_token_lag_s.items())
            },
            "projection_errors": _projection_errors(ctx.projection_errors.statistics(now)),
            "decode_kv_release_tokens_per_s": {
                engine_id: round(rate, 1)
                for engine_id, rate in sorted(signals.kv_release_per_s.items())
            },
        },
        "connections": {
            "open": connections.open,
            "idle": connections.idle,
            "limit": connections.limit,
            "configured_limit": connections.configured_limit,
            "at_limit": connections.at_limit,
            "limit_reached_total": connections.limit_reached,
            "shed_total": connections.shed,
            "accept_failing": connections.accept_failing,
            "accept_failures_total": connections.accept_failures,
            "protocol_errors": {
                str(status): count for status, count in sorted(ctx.protocol_errors.items())
            },
            "open_files": None if ctx.descriptors is None else ctx.descriptors.to_json(),
        },
        "clients": {
            "connections": _per_client(connections.per_client),
            "pending_bodies": _per_client(ctx.pending_bodies.statistics()),
        },
        "retry_budget": {
            "level": round(budget.level, 3),
            "maximum": budget.maximum,
            "spent_total": budget.spent_total,
            "denied_total": budget.denied_total,
        },
        "slo": slo_state(ctx, now),
        "requests": {
            "outcomes": dict(sorted(ctx.outcomes.items())),
            "token_counts": dict(sorted(ctx.token_methods.items())),
            "token_count_fallbacks": dict(sorted(ctx.token_fallbacks.items())),
            "context_checks": dict(sorted(ctx.context_checks.items())),
            "unstreamed_decode_legs": dict(sorted(ctx.unstreamed_legs.items())),
            "fallback_chars_per_token": {"value": round(ratio, 3), "source": ratio_source},
            # Engines whose /tokenize refused chat messages (an older SGLang build): their
            # chat requests are estimated; seconds since it was learnt.
            "tokenize_chat_refused": {
                engine.id: round(now - since, 3)
                for engine, since in ctx.chat_tokenize_refusals.learnt(ctx.config)
            },
            "in_flight": [
                {
                    "id": r.id,
                    "endpoint": r.endpoint,
                    "stream": r.stream,
                    "stage": r.stage,
                    "age_s": round(now - r.arrival, 3),
                    "attempts": r.attempts,
                    "prefill_engine": r.prefill_engine,
                    "decode_engine": r.decode_engine,
                    "prompt_tokens": r.prompt_tokens,
                    "token_count_method": r.token_count_method,
                    "token_count_fallback": r.token_count_fallback,
                    "context_unchecked": r.context_unchecked,
                }
                for r in records[:_LISTED_REQUESTS]
            ],
        },
        "engines": [engine_state(engine, now) for engine in ctx.fleet],
    }
    for key, provider in ctx.state_providers:
        document[key] = provider()
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
