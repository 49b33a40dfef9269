"""The controller's `/narwhal/state` section and Prometheus families
(docs/design.md#advisory-rollout, #evidence-gate).

Both read the same inputs: the last evaluated decision (the one that states what the
controller proposes and what blocks it), the last pass (which may only have waited for
the next step), the snapshot it was made from (demand estimates), and the flip history.
Gauges use the `(name, help, labels, samples)` shape of `serving._state.live_gauges`, so
`Metrics.add_live_gauges` can register them; counters come from `counter_families`,
which a `prometheus_client` Collector yields at scrape time.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator

import attrs
from prometheus_client.core import CounterMetricFamily, Metric

from ..config import Config
from ._apply import FlipHistory
from ._decide import CALLERS, GATES, REASONS, RESULTS, Decision, Split
from ._demand import DemandEstimate
from ._load import SplitLoad
from ._snapshot import FleetSnapshot

Gauge = tuple[str, str, list[str], list[tuple[list[str], float]]]
# Results after application: "move" becomes "applied" (or "failed" if the live engine
# refused it, which only a bug can cause: the snapshot and the apply share one pass).
EXPOSED_RESULTS: tuple[str, ...] = (*(r for r in RESULTS if r != "move"), "applied", "failed")


@attrs.define
class ControllerCounters:
    flips: Counter[tuple[str, str]] = attrs.field(factory=Counter)  # (direction, caller)
    proposals: Counter[tuple[str, str]] = attrs.field(factory=Counter)  # advisory
    evaluations: Counter[tuple[str, str]] = attrs.field(factory=Counter)  # (caller, result)
    apply_failures: int = 0


@attrs.frozen(kw_only=True)
class Exposure:
    """Everything the state section and the metrics show."""

    config: Config
    now: float
    decision: Decision | None  # last evaluated decision
    result: str | None  # its result after application
    last_pass: Decision | None
    snapshot: FleetSnapshot | None  # the snapshot of the last pass
    history: FlipHistory
    counters: ControllerCounters


def _num(value: float, digits: int = 4) -> float | None:
    return round(value, digits) if math.isfinite(value) else None


def _split(split: Split) -> dict[str, int]:
    return {"prefill": split.prefill, "decode": split.decode}


def _load(load: SplitLoad | None) -> dict[str, object] | None:
    if load is None:
        return None
    dp = load.decode_projection
    return {
        "prefill": load.prefill,
        "decode": load.decode,
        "prefill_load": _num(load.prefill_load),
        "decode_load": _num(load.decode_load),
        "worst": _num(load.worst),
        "decode_batch": _num(dp.active, 2),
        "decode_kv_tokens": _num(dp.kv_tokens, 0),
        "decode_interval_s": _num(dp.interval_s, 6),
        "decode_feasible": dp.feasible,
        "decode_in_domain": dp.in_domain,
    }


def _demand(estimate: DemandEstimate, demand_floor: float) -> dict[str, object]:
    return {
        "horizon_s": estimate.horizon_s,
        "span_s": _num(estimate.span_s, 3),
        "arrivals": estimate.arrivals,
        "refused": estimate.refused,
        "requests_per_s": _num(estimate.rate),
        "floored_requests_per_s": _num(estimate.floored_rate(demand_floor)),
        "prompt_tokens_mean": _num(estimate.prompt_tokens_mean, 1),
        "output_tokens_mean": _num(estimate.output_tokens_mean, 1),
        "prefill_work": _num(estimate.prefill_work(demand_floor)),
        "decode_tokens_per_s": _num(estimate.decode_token_rate(demand_floor), 2),
        "priced": estimate.priced,
    }


def state_section(x: Exposure) -> dict[str, object]:
    """The `controller` section of `/narwhal/state`."""
    ctl = x.config.controller
    d = x.decision
    out: dict[str, object] = {"enabled": ctl.enabled, "advisory": ctl.advisory}
    if x.last_pass is not None:
        out["last_pass"] = {
            "time": round(x.last_pass.now, 3),
            "caller": x.last_pass.caller,
            "result": x.last_pass.result,
            "detail": x.last_pass.detail,
        }
    if d is None:
        out["flips"] = _flips(x)
        return out
    state = x.last_pass.state if x.last_pass is not None else d.state
    candidate = state.candidate
    out.update(
        {
            "time": round(d.now, 3),
            "split": {
                "roles": _split(d.roles),
                "current": _split(d.current),
                "proposed": _split(d.proposed),
            },
            "caller": d.caller,
            "reason": d.reason,
            "detail": d.detail,
            "result": x.result,
            "gate": d.gate,
            "rule": d.rule,
            "urgent": d.urgent,
            "move": None
            if d.move is None
            else {"engine": d.move.engine, "from": d.move.from_role, "to": d.move.to_role},
            "confirmations": {
                "count": state.confirmations,
                "required": d.required,
                "candidate": None
                if candidate is None
                else {
                    "direction": candidate.direction,
                    "split": {"prefill": candidate.prefill, "decode": candidate.decode},
                    "demand_complete": candidate.complete,
                    "rule": candidate.rule,
                },
            },
            "loads": {
                "measured": {
                    "prefill": _num(d.loads.measured_prefill),
                    "decode": _num(d.loads.measured_decode),
                },
                "projected": {
                    "current": _load(d.loads.current),
                    "to_prefill": _load(d.loads.to_prefill),
                    "to_decode": _load(d.loads.to_decode),
                },
                # serving.decode_concurrency as the projections bound each engine's
                # batch by it (null: no cap)
                "decode_slots_per_engine": _num(d.loads.decode_slots),
            },
            "evidence": {
                "state": "closed" if d.evidence.closed else "open",
                "opened_at": round(d.evidence.opened_at, 3),
                "elapsed_s": round(d.evidence.elapsed_s, 3),
                "samples": d.evidence.samples,
                "why": d.evidence.why,
            },
            "floors": {
                "min_prefill": d.floors.min_prefill,
                "min_decode": d.floors.min_decode,
                "live_prefill": d.floors.live_prefill,
                "live_decode": d.floors.live_decode,
                "breaches": [
                    {
                        "pool": b.pool,
                        "floor": b.floor,
                        "live": b.live,
                        "reachable": b.reachable,
                        "detail": b.detail,
                    }
                    for b in d.floors.breaches
                ],
            },
            "cooldown": {
                "last_p2d_at": _num(state.last_p2d_at, 3),
                "remaining_s": round(
                    max(0.0, state.last_p2d_at + ctl.thresholds.cooldown_s - x.now), 3
                ),
            },
        }
    )
    if x.snapshot is not None:
        floor = ctl.reactive.demand_floor
        out["demand"] = {
            "short": _demand(x.snapshot.short, floor),
            "long": _demand(x.snapshot.long, floor),
            "rising": d.demand_rising,
            "arrivals_total": x.snapshot.arrivals_total,
        }
    out["flips"] = _flips(x)
    return out


def _flips(x: Exposure) -> dict[str, object]:
    return {
        "total": x.history.total,
        "retained": len(x.history),
        "limit": x.history.limit,
        "history": [record.as_dict() for record in x.history],
    }


def _one_hot(values: tuple[str, ...], current: str | None) -> list[tuple[list[str], float]]:
    return [([v], float(v == current)) for v in values]


def controller_gauges(x: Exposure) -> Iterator[Gauge]:
    """Live gauge families, shaped for `Metrics.add_live_gauges`."""
    ctl = x.config.controller
    yield (
        "narwhal_controller_advisory",
        "1 when role control is advisory.",
        [],
        [([], float(ctl.advisory))],
    )
    d = x.decision
    yield (
        "narwhal_controller_flip_history",
        "Role-change records retained for /narwhal/state.",
        [],
        [([], float(len(x.history)))],
    )
    if d is None:
        return
    yield (
        "narwhal_controller_engines",
        "Engines by pool: by role, live, and in the proposed split.",
        ["pool", "kind"],
        [
            ([pool, kind], float(getattr(split, pool)))
            for kind, split in (
                ("roles", d.roles),
                ("current", d.current),
                ("proposed", d.proposed),
            )
            for pool in ("prefill", "decode")
        ],
    )
    yield (
        "narwhal_controller_caller",
        "1 for the caller of the last evaluation.",
        ["caller"],
        _one_hot(CALLERS, d.caller),
    )
    yield (
        "narwhal_controller_result",
        "1 for the result of the last evaluation.",
        ["result"],
        _one_hot(EXPOSED_RESULTS, x.result),
    )
    yield (
        "narwhal_controller_reason",
        "1 for the reason of the last evaluation.",
        ["reason"],
        _one_hot(REASONS, d.reason),
    )
    yield (
        "narwhal_controller_gate",
        "1 for the gate currently blocking movement (all 0 when none).",
        ["gate"],
        _one_hot(GATES, d.gate),
    )
    state = x.last_pass.state if x.last_pass is not None else d.state
    yield (
        "narwhal_controller_confirmations",
        "Matching confirmations so far and the count the proposal requires.",
        ["kind"],
        [(["count"], float(state.confirmations)), (["required"], float(d.required))],
    )
    loads: list[tuple[list[str], float]] = []
    for name, load in (
        ("current", d.loads.current),
        ("to_prefill", d.loads.to_prefill),
        ("to_decode", d.loads.to_decode),
    ):
        if load is not None:
            loads.append((["prefill", name], load.prefill_load))
            loads.append((["decode", name], load.decode_load))
    yield (
        "narwhal_controller_projected_load",
        "Projected SLO-relative pool load of the current and adjacent splits.",
        ["pool", "split"],
        loads,
    )
    yield (
        "narwhal_controller_measured_load",
        "Measured SLO-relative pool load (prefill pressure, decode token intervals).",
        ["pool"],
        [(["prefill"], d.loads.measured_prefill), (["decode"], d.loads.measured_decode)],
    )
    ev = d.evidence
    yield (
        "narwhal_controller_evidence_closed",
        "1 when the evidence window is closed.",
        [],
        [([], float(ev.closed))],
    )
    yield (
        "narwhal_controller_evidence_elapsed_seconds",
        "Time since the evidence window opened.",
        [],
        [([], ev.elapsed_s)],
    )
    yield (
        "narwhal_controller_evidence_samples",
        "Arrivals in the evidence span since the window opened.",
        [],
        [([], float(ev.samples))],
    )
    breached = {b.pool for b in d.floors.breaches}
    floors = d.floors
    yield (
        "narwhal_controller_floor",
        "Configured role floor.",
        ["pool"],
        [(["prefill"], float(floors.min_prefill)), (["decode"], float(floors.min_decode))],
    )
    yield (
        "narwhal_controller_live_engines",
        "Live engines serving each phase (role `both` counts for both).",
        ["pool"],
        [(["prefill"], float(floors.live_prefill)), (["decode"], float(floors.live_decode))],
    )
    yield (
        "narwhal_controller_floor_breached",
        "1 while live capacity of the pool is below its floor.",
        ["pool"],
        [([pool], float(pool in breached)) for pool in ("prefill", "decode")],
    )
    if x.snapshot is not None:
        floor = ctl.reactive.demand_floor
        horizons = (("short", x.snapshot.short), ("long", x.snapshot.long))
        yield (
            "narwhal_controller_demand_requests_per_second",
            "Offered requests per second (admitted and refused) by horizon.",
            ["horizon"],
            [([h], e.rate) for h, e in horizons],
        )
        yield (
            "narwhal_controller_demand_arrivals",
            "Offered requests in the horizon.",
            ["horizon"],
            [([h], float(e.arrivals)) for h, e in horizons],
        )
        yield (
            "narwhal_controller_demand_prefill_work",
            "Offered prefill work in engine-seconds per second (mean profile), by horizon.",
            ["horizon"],
            [([h], e.prefill_work(floor)) for h, e in horizons],
        )
        yield (
            "narwhal_controller_demand_decode_tokens_per_second",
            "Offered decode demand in output tokens per second, by horizon.",
            ["horizon"],
            [([h], e.decode_token_rate(floor)) for h, e in horizons],
        )
        yield (
            "narwhal_controller_demand_rising",
            "1 while short-horizon decode demand exceeds the rise tolerance.",
            [],
            [([], float(d.demand_rising))],
        )


def counter_families(x: Exposure) -> Iterator[Metric]:
    """Counter families (exposed with the `_total` suffix)."""
    flips = CounterMetricFamily(
        "narwhal_controller_flips",
        "Applied role changes by direction and caller.",
        labels=["direction", "caller"],
    )
    for (direction, caller), n in sorted(x.counters.flips.items()):
        flips.add_metric([direction, caller], n)
    yield flips
    proposals = CounterMetricFamily(
        "narwhal_controller_advisory_proposals",
        "Role changes proposed in advisory mode and not applied, by direction and caller.",
        labels=["direction", "caller"],
    )
    for (direction, caller), n in sorted(x.counters.proposals.items()):
        proposals.add_metric([direction, caller], n)
    yield proposals
    evaluations = CounterMetricFamily(
        "narwhal_controller_evaluations",
        "Controller evaluations by caller and result.",
        labels=["caller", "result"],
    )
    for (caller, result), n in sorted(x.counters.evaluations.items()):
        evaluations.add_metric([caller, result], n)
    yield evaluations
    failures = CounterMetricFamily(
        "narwhal_controller_apply_failures",
        "Moves the live engine refused at application.",
    )
    failures.add_metric([], x.counters.apply_failures)
    yield failures
