"""The controller's `/narwhal/state` section and Prometheus families
(docs/design.md#advisory-rollout, #evidence-gate).

The section is a frozen record (`ControllerSection` and its parts), built by
`state_section` and shown by `narwhal._records.to_json`. Section and families read the
same inputs: the last evaluated decision (the one that states what the controller
proposes and what blocks it), the last pass (which may only have waited for the next
step), the snapshot it was made from (demand estimates), and the flip history.
Gauges use the `(name, help, labels, samples)` shape of `serving._state.live_gauges`, so
`Metrics.add_live_gauges` can register them; counters come from `counter_families`,
which a `prometheus_client` Collector yields at scrape time.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from typing import Literal

import attrs
from prometheus_client.core import CounterMetricFamily, Metric

from .._records import OPTIONAL, SPLICED, key
from ..config import Config
from ._apply import FlipHistory, FlipRecord
from ._decide import (
    CALLERS,
    GATES,
    REASONS,
    RESULTS,
    Caller,
    Decision,
    FloorReport,
    Gate,
    Pool,
    Reason,
    Result,
    Split,
)
from ._demand import DemandEstimate
from ._load import SplitLoad
from ._snapshot import FleetSnapshot
from ._state import Direction, Rule

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


@attrs.frozen(kw_only=True)
class LastPass:
    """The last monitor pass's call, which may only have waited for the next step."""

    time: float
    caller: Caller
    result: Result
    detail: str


@attrs.frozen(kw_only=True)
class SplitCounts:
    roles: Split  # engines by role, live or not
    current: Split  # live engines by role
    proposed: Split


@attrs.frozen(kw_only=True)
class RoleMove:
    engine: str
    from_role: Pool = attrs.field(metadata=key("from"))
    to_role: Pool = attrs.field(metadata=key("to"))


@attrs.frozen(kw_only=True)
class Candidate:
    direction: Direction
    split: Split
    demand_complete: bool
    rule: Rule


@attrs.frozen(kw_only=True)
class Confirmations:
    count: int
    required: int
    candidate: Candidate | None


@attrs.frozen(kw_only=True)
class SplitProjection:
    """Projected loads of one split (`SplitLoad`); None where not finite."""

    prefill: int
    decode: int
    prefill_load: float | None
    decode_load: float | None
    worst: float | None
    decode_batch: float | None
    decode_kv_tokens: float | None
    decode_interval_s: float | None
    decode_feasible: bool
    decode_in_domain: bool


@attrs.frozen(kw_only=True)
class MeasuredLoads:
    prefill: float | None
    decode: float | None


@attrs.frozen(kw_only=True)
class ProjectedLoads:
    current: SplitProjection | None
    to_prefill: SplitProjection | None
    to_decode: SplitProjection | None


@attrs.frozen(kw_only=True)
class PoolLoads:
    measured: MeasuredLoads
    projected: ProjectedLoads
    # serving.decode_concurrency as the projections bound each engine's batch by it
    # (None: no cap)
    decode_slots_per_engine: float | None


@attrs.frozen(kw_only=True)
class Evidence:
    state: Literal["open", "closed"]
    opened_at: float
    elapsed_s: float
    samples: int
    why: str


@attrs.frozen(kw_only=True)
class Cooldown:
    last_p2d_at: float | None
    remaining_s: float


@attrs.frozen(kw_only=True)
class Evaluation:
    """The last evaluated decision (`Exposure.decision`)."""

    time: float
    split: SplitCounts
    caller: Caller
    reason: Reason
    detail: str
    result: str | None  # after application: EXPOSED_RESULTS
    gate: Gate | None
    rule: Rule | None
    urgent: bool
    move: RoleMove | None
    confirmations: Confirmations
    loads: PoolLoads
    evidence: Evidence
    floors: FloorReport
    cooldown: Cooldown


@attrs.frozen(kw_only=True)
class DemandHorizon:
    horizon_s: float
    span_s: float | None
    arrivals: int
    refused: int
    requests_per_s: float | None
    floored_requests_per_s: float | None
    prompt_tokens_mean: float | None
    output_tokens_mean: float | None
    prefill_work: float | None
    decode_tokens_per_s: float | None
    priced: int


@attrs.frozen(kw_only=True)
class Demand:
    short: DemandHorizon
    long: DemandHorizon
    rising: bool
    arrivals_total: int


@attrs.frozen(kw_only=True)
class FlipEntry:
    """A `FlipRecord` as the state shows it (`flip_entry`)."""

    time: float
    engine: str
    from_role: str = attrs.field(metadata=key("from"))
    to_role: str = attrs.field(metadata=key("to"))
    caller: Caller
    reason: Reason
    detail: str
    before: Split
    after: Split
    resident_streams: int
    applied: bool


@attrs.frozen(kw_only=True)
class Flips:
    total: int
    retained: int
    limit: int  # controller.flip_history
    history: tuple[FlipEntry, ...]


@attrs.frozen(kw_only=True)
class ControllerSection:
    """The `controller` section of /narwhal/state: the last pass and evaluation (none
    before the first), the demand it saw (none before the first snapshot), the flips."""

    enabled: bool
    advisory: bool
    last_pass: LastPass | None = attrs.field(metadata=OPTIONAL)
    evaluation: Evaluation | None = attrs.field(metadata=SPLICED)
    demand: Demand | None = attrs.field(metadata=OPTIONAL)
    flips: Flips


def flip_entry(record: FlipRecord) -> FlipEntry:
    return FlipEntry(
        time=round(record.time, 3),
        engine=record.engine,
        from_role=record.from_role,
        to_role=record.to_role,
        caller=record.caller,
        reason=record.reason,
        detail=record.detail,
        before=record.before,
        after=record.after,
        resident_streams=record.resident_streams,
        applied=record.applied,
    )


def _projection(load: SplitLoad | None) -> SplitProjection | None:
    if load is None:
        return None
    dp = load.decode_projection
    return SplitProjection(
        prefill=load.prefill,
        decode=load.decode,
        prefill_load=_num(load.prefill_load),
        decode_load=_num(load.decode_load),
        worst=_num(load.worst),
        decode_batch=_num(dp.active, 2),
        decode_kv_tokens=_num(dp.kv_tokens, 0),
        decode_interval_s=_num(dp.interval_s, 6),
        decode_feasible=dp.feasible,
        decode_in_domain=dp.in_domain,
    )


def _horizon(estimate: DemandEstimate, demand_floor: float) -> DemandHorizon:
    return DemandHorizon(
        horizon_s=estimate.horizon_s,
        span_s=_num(estimate.span_s, 3),
        arrivals=estimate.arrivals,
        refused=estimate.refused,
        requests_per_s=_num(estimate.rate),
        floored_requests_per_s=_num(estimate.floored_rate(demand_floor)),
        prompt_tokens_mean=_num(estimate.prompt_tokens_mean, 1),
        output_tokens_mean=_num(estimate.output_tokens_mean, 1),
        prefill_work=_num(estimate.prefill_work(demand_floor)),
        decode_tokens_per_s=_num(estimate.decode_token_rate(demand_floor), 2),
        priced=estimate.priced,
    )


def _evaluation(x: Exposure, d: Decision) -> Evaluation:
    ctl = x.config.controller
    state = x.last_pass.state if x.last_pass is not None else d.state
    candidate = state.candidate
    return Evaluation(
        time=round(d.now, 3),
        split=SplitCounts(roles=d.roles, current=d.current, proposed=d.proposed),
        caller=d.caller,
        reason=d.reason,
        detail=d.detail,
        result=x.result,
        gate=d.gate,
        rule=d.rule,
        urgent=d.urgent,
        move=None
        if d.move is None
        else RoleMove(engine=d.move.engine, from_role=d.move.from_role, to_role=d.move.to_role),
        confirmations=Confirmations(
            count=state.confirmations,
            required=d.required,
            candidate=None
            if candidate is None
            else Candidate(
                direction=candidate.direction,
                split=Split(prefill=candidate.prefill, decode=candidate.decode),
                demand_complete=candidate.complete,
                rule=candidate.rule,
            ),
        ),
        loads=PoolLoads(
            measured=MeasuredLoads(
                prefill=_num(d.loads.measured_prefill), decode=_num(d.loads.measured_decode)
            ),
            projected=ProjectedLoads(
                current=_projection(d.loads.current),
                to_prefill=_projection(d.loads.to_prefill),
                to_decode=_projection(d.loads.to_decode),
            ),
            decode_slots_per_engine=_num(d.loads.decode_slots),
        ),
        evidence=Evidence(
            state="closed" if d.evidence.closed else "open",
            opened_at=round(d.evidence.opened_at, 3),
            elapsed_s=round(d.evidence.elapsed_s, 3),
            samples=d.evidence.samples,
            why=d.evidence.why,
        ),
        floors=d.floors,
        cooldown=Cooldown(
            last_p2d_at=_num(state.last_p2d_at, 3),
            remaining_s=round(max(0.0, state.last_p2d_at + ctl.thresholds.cooldown_s - x.now), 3),
        ),
    )


def state_section(x: Exposure) -> ControllerSection:
    """The `controller` section of `/narwhal/state`."""
    ctl = x.config.controller
    d = x.decision
    last = x.last_pass
    demand: Demand | None = None
    if d is not None and x.snapshot is not None:
        floor = ctl.reactive.demand_floor
        demand = Demand(
            short=_horizon(x.snapshot.short, floor),
            long=_horizon(x.snapshot.long, floor),
            rising=d.demand_rising,
            arrivals_total=x.snapshot.arrivals_total,
        )
    return ControllerSection(
        enabled=ctl.enabled,
        advisory=ctl.advisory,
        last_pass=None
        if last is None
        else LastPass(
            time=round(last.now, 3), caller=last.caller, result=last.result, detail=last.detail
        ),
        evaluation=None if d is None else _evaluation(x, d),
        demand=demand,
        flips=Flips(
            total=x.history.total,
            retained=len(x.history),
            limit=x.history.limit,
            history=tuple(flip_entry(record) for record in x.history),
        ),
    )


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
