"""The reactive role controller's decision core (docs/design.md#role-control): a pure function.

``decide(snapshot, state, now, config) -> Decision``. No trio, no I/O, no clock: the
same inputs give the same decision, so every rule has a deterministic unit test. The
caller (`Controller.on_pass`, the replay tool, the fluid scenario) applies the move the
decision names, if any, and keeps `decision.state` for the next pass.

One pass, in order
------------------
1. Evidence resets (docs/design.md#evidence-gate). First-token timeouts and prefill-to-decode
   recovery moves reported since the last pass reopen the consolidation evidence window now.
2. Floors (docs/design.md#role-floors). If live capacity of a phase is below its floor, the pass is
   a floor-recovery pass (caller ``floor-recovery``), run on every monitor pass whatever `step_s`
   says: one eligible engine moves per pass. Decode-floor recovery skips the cooldown but observes
   dwell; prefill-floor recovery ignores cooldown and dwell. Pins, availability, both floors and
   advisory mode still apply. When no engine can restore the floor the breach is reported and the
   split is kept: that is the safest reachable split. Ordinary decisions resume once no floor is
   breached: the first pass without a breach is a scheduled evaluation, whatever `step_s` says, so
   the state shows the split that capacity returned to, not the breach that ended.
3. Scheduling (docs/design.md#reactive-parameters, `step_s`). An adjacent-split evaluation of both
   directions runs when `step_s` has elapsed since the last one (caller ``scheduled``). Between
   scheduled passes, a projected prefill TTFT breach allows one guarded evaluation of the D-to-P
   direction only (caller ``breach-step``); the allowance renews at the next scheduled evaluation.
   Otherwise the pass only waits (caller ``none``).
4. Adjacent split (docs/design.md#adjacent-splits). The current live split (k, m) and the adjacent
   splits (k+1, m-1) and (k-1, m+1) are projected (`_load`). A proposal is an adjacent split whose
   worst projected SLO ratio is lower by at least the movement margin (strictly lower when the
   margin is 0); the best such split is proposed, else the split is held. The proposal then passes
   its eligibility checks, in this order, and the first that fails is the gate reported as blocking
   movement:
   * D-to-P: decode floor; source rule (projected decode at the target <= shrink:
     ordinary; else mixed-pressure when measured prefill pressure >= expand and every
     engine has a profile); closed evidence window; decode demand not rising; a movable
     decode engine; dwell; `flip_resident_guard`; the resident-work checks
     (docs/design.md#resident-work).
   * P-to-D: prefill floor; projected prefill at the target <= shrink; a movable
     prefill engine; dwell; cooldown (bypassed by panic).
   A failed check clears the candidate. A passing proposal is a confirmation; the move
   happens when the confirmations reach the required count.

Interpretations of the role-control rules (each has a test named after it)
-------------------------------------------------------------------------
* Live counts. An engine is live for a phase when its role covers the phase and that
  phase is not blocked (drained, removed, ejected, restart hold, quarantine, breaker).
  Floors count engines with role ``both`` for both phases, as the configuration rules
  do; the split the controller projects and moves counts only ``prefill`` and
  ``decode`` engines, and engines with role ``both`` (aggregate serving) are never moved.
* Movable: role prefill or decode, not pinned, no phase blocked, and a dialect that
  lets the role change. A breaker that blocks either phase makes the engine unmovable,
  like a drain. SGLang engines are never movable: an SGLang server's role is fixed by
  its launch flags and a disaggregated one refuses requests without a bootstrap room, so
  a flipped engine would only fail the legs sent to it. When every engine of the pool a
  move would take from is fixed, the gate is ``fixed_role`` (not ``no_movable_engine``):
  nothing but a relaunch and a config reload changes such a split. Floor recovery
  treats them the same way: it reports the breach with that gate and keeps the split.
* Movement margin: an absolute reduction of the worst projected SLO ratio (loads are
  already SLO-relative: 1.0 is the target), not a relative one.
* Urgent: the move expands a pool whose pressure, max(projected current load, measured
  load), is at or above `thresholds.expand`. Confirmations (max(reactive.confirmations,
  thresholds.sustained_intervals)) are required for nonurgent, incomplete-demand and
  mixed-pressure proposals; an urgent ordinary proposal with complete demand moves on
  its first passing evaluation. Demand is complete when the evidence window is closed.
* The confirmation key is (proposed split, demand completeness, eligibility rule);
  any change restarts the sequence at 1. A held pass (no adjacent split improves),
  and a pass without a decision (min_arrivals, no profile), also clear it: the
  proposals must be consecutive. A breach-step evaluation that finds no D-to-P proposal
  leaves the sequence alone; one that finds a proposal counts as a confirmation.
* Cooldown and dwell are eligibility checks too: while one blocks, the candidate is
  cleared, so confirmations accumulate only over passes on which the move was allowed.
* Evidence gating applies to every adjacent D-to-P proposal (ordinary, mixed-pressure
  and breach-step), never to moves toward decode, and not to prefill-floor recovery,
  whose list of constraints that still apply (docs/design.md#role-floors) does not
  include it.
* Evidence resets: first-token timeouts and P-to-D floor-recovery moves (the
  controller's own, and any reported in the snapshot). Ordinary P-to-D moves do not
  reset it; they are paced by the cooldown.
* Panic (`panic_ratio`, docs/design.md#reactive-parameters): when enabled and the decode pressure
  (as for urgency) is at least `panic_ratio` times the TPOT target (a load of `panic_ratio`), and
  the projected prefill load after the move is strictly below shrink, a P-to-D move ignores the
  cooldown. Nothing else is bypassed.
* Projected TTFT breach: signalled by admission (`FleetSnapshot.ttft_breach`) or the
  measured prefill pressure above 1.0 (the predicted work queued exceeds the target).
* Resident-work checks (docs/design.md#resident-work) run before every D-to-P move, floor recovery
  included, because they protect resident requests: (a) the projected decode operating point of the
  proposed split is inside the mean profile's decode domain; (b) every decode engine's resident
  batch, with the remaining engines' share of pending handoffs, is inside its profile's decode
  domain; (c) the remaining decode engines' free KV holds the pending handoffs and the candidate's
  free KV holds one mean prompt beside its resident streams. Prefill-floor recovery skips a check
  whose inputs do not exist (no profile, no priced demand) rather than leave the fleet with no
  prefill capacity.
* `flip_resident_guard` filters D-to-P candidates of adjacent decisions; floor
  recovery prefers the candidate with the fewest resident streams but is not blocked.
* Resident decode work of a D-to-P candidate (candidate order, `flip_resident_guard`,
  the candidate's own resident-work checks, the flip record) is its open streams plus the decode
  legs already placed on it that have not started: a role change moves neither
  (docs/design.md#placement), so the engine turned prefill still starts every placed leg.
* Candidate order: D-to-P takes the decode engine with the fewest resident streams,
  then the fewest resident KV tokens, then the lowest id; P-to-D the prefill engine with
  the least predicted prefill work, then fewest in flight, then the lowest id.
* Advisory mode: the decision is made exactly as it would be, reported with result
  ``advisory``; nothing records a dwell timestamp, the cooldown clock or an evidence
  reset, because no role changed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Literal, get_args

import attrs

from ..config import Config
from ._demand import EvidenceView, EvidenceWindow, demand_rising, evidence_view, pricing_demand
from ._load import (
    DecodeDemand,
    PrefillDemand,
    ResidentWork,
    SplitLoad,
    improves,
    project_decode,
    project_prefill,
)
from ._snapshot import EngineSnapshot, FleetSnapshot, measured_decode_load
from ._state import CandidateKey, ControllerState, Direction, Rule

Caller = Literal["scheduled", "breach-step", "floor-recovery", "none"]
Result = Literal["move", "advisory", "hold", "blocked", "confirming", "waiting", "breach"]
Gate = Literal[
    "floor",
    "no_movable_engine",
    "fixed_role",
    "dwell",
    "cooldown",
    "shrink",
    "evidence",
    "demand_rise",
    "resident_guard",
    "profile_domain",
    "resident_batches",
    "kv_capacity",
    "confirmations",
    "min_arrivals",
    "no_profile",
    "advisory",
]
Reason = Literal[
    "floor_recovery_decode",
    "floor_recovery_prefill",
    "floor_breach",
    "insufficient_arrivals",
    "no_profile",
    "between_steps",
    "balanced",
    "expand_prefill",
    "rebalance_to_prefill",
    "mixed_pressure",
    "expand_decode",
    "rebalance_to_decode",
]
GATES: tuple[Gate, ...] = get_args(Gate)
REASONS: tuple[Reason, ...] = get_args(Reason)
CALLERS: tuple[Caller, ...] = get_args(Caller)
RESULTS: tuple[Result, ...] = get_args(Result)
Pool = Literal["prefill", "decode"]


@attrs.frozen
class Split:
    prefill: int
    decode: int


@attrs.frozen
class Move:
    """One role change: which engine, which way."""

    engine: str
    direction: Direction

    @property
    def from_role(self) -> Pool:
        return "decode" if self.direction == "d2p" else "prefill"

    @property
    def to_role(self) -> Pool:
        return "prefill" if self.direction == "d2p" else "decode"


@attrs.frozen
class FloorBreach:
    pool: Pool
    floor: int
    live: int
    reachable: int  # live capacity after every move the floors and pins allow
    detail: str


@attrs.frozen
class FloorReport:
    min_prefill: int
    min_decode: int
    live_prefill: int
    live_decode: int
    breaches: tuple[FloorBreach, ...] = ()


@attrs.frozen
class Loads:
    """Projected loads of the current and adjacent splits, and the measured pressures."""

    current: SplitLoad | None
    to_prefill: SplitLoad | None  # one decode engine moved to prefill
    to_decode: SplitLoad | None  # one prefill engine moved to decode
    measured_prefill: float
    measured_decode: float
    decode_slots: float = math.inf  # the per-engine stream cap the projections used


@attrs.frozen(kw_only=True)
class Decision:
    now: float
    caller: Caller
    result: Result
    reason: Reason
    detail: str
    gate: Gate | None
    roles: Split  # engines by role, live or not
    current: Split  # live engines by role: the split the controller projects
    proposed: Split
    move: Move | None
    rule: Rule | None = None
    urgent: bool = False
    confirmations: int = 0
    required: int = 0
    loads: Loads
    floors: FloorReport
    evidence: EvidenceView
    demand_rising: bool = False
    state: ControllerState

    @property
    def evaluated(self) -> bool:
        return self.caller != "none"


class _Pass:
    """Everything one pass derives from its inputs, computed once."""

    def __init__(
        self, snap: FleetSnapshot, state: ControllerState, now: float, config: Config
    ) -> None:
        self.snap = snap
        self.now = now
        self.config = config
        ctl = config.controller
        self.ctl = ctl
        self.th = ctl.thresholds
        self.rx = ctl.reactive
        self.slo = config.slo
        engines = snap.engines
        self.roles = Split(
            sum(e.role == "prefill" for e in engines), sum(e.role == "decode" for e in engines)
        )
        self.split = Split(
            sum(e.role == "prefill" and e.live_for("prefill") for e in engines),
            sum(e.role == "decode" and e.live_for("decode") for e in engines),
        )
        self.live_prefill = sum(e.live_for("prefill") for e in engines)
        self.live_decode = sum(e.live_for("decode") for e in engines)
        self.state = self._reset_evidence(state)
        self.evidence = evidence_view(
            self.state.evidence,
            arrivals_total=snap.arrivals_total,
            short=snap.short,
            now=now,
            reactive=self.rx,
        )
        self.rising = demand_rising(snap.short, snap.long, self.rx)
        self.measured_prefill = snap.prefill_pressure
        self.measured_decode = measured_decode_load(engines, snap.mean_profile, self.slo.tpot_s)
        self.floors = self._floors()
        self.priceable = snap.mean_profile is not None and snap.long.priced
        self.enough_arrivals = snap.long.samples >= self.rx.min_arrivals
        self.prefill_demand: PrefillDemand | None = None
        self.decode_demand: DecodeDemand | None = None
        if self.priceable and snap.long.arrivals > 0:
            self.prefill_demand, self.decode_demand = pricing_demand(snap.short, snap.long, self.rx)
        live_decoders = [e for e in engines if e.role == "decode" and e.live_for("decode")]
        corrections = [e.decode_correction for e in live_decoders]
        self.correction = sum(corrections) / len(corrections) if corrections else 1.0
        # Per-engine decode slots, like the mean profile: the mean cap over the engines a
        # split counts; no bound when any of them is uncapped.
        slots = [e.decode_slots for e in engines if e.role in ("prefill", "decode")]
        self.decode_slots = sum(slots) / len(slots) if slots else math.inf
        pending = sum(e.handoffs_pending for e in engines)
        prompt_mean = self.decode_demand.prompt_tokens_mean if self.decode_demand else 0.0
        self.resident = ResidentWork(
            streams=sum(e.decode_active for e in live_decoders),
            kv_tokens=sum(e.decode_tokens for e in live_decoders),
            pending=pending,
            pending_kv_tokens=pending * prompt_mean,
        )

    # -- derived inputs ----------------------------------------------------------------

    # Projections are computed only by passes that evaluate: a pass waiting for the next
    # step needs none of them.
    @functools.cached_property
    def current(self) -> SplitLoad | None:
        return self.project(self.split.prefill, self.split.decode)

    @functools.cached_property
    def to_prefill(self) -> SplitLoad | None:
        k, m = self.split.prefill, self.split.decode
        return self.project(k + 1, m - 1) if m >= 1 else None

    @functools.cached_property
    def to_decode(self) -> SplitLoad | None:
        k, m = self.split.prefill, self.split.decode
        return self.project(k - 1, m + 1) if k >= 1 else None

    def _reset_evidence(self, state: ControllerState) -> ControllerState:
        if self.snap.first_token_timeouts or self.snap.p2d_recovery_moves:
            return attrs.evolve(state, evidence=EvidenceWindow(self.now, self.snap.arrivals_total))
        return state

    def _floors(self) -> FloorReport:
        min_p, min_d = self.ctl.min_prefill, self.ctl.min_decode
        breaches: list[FloorBreach] = []
        movable_p = sum(e.role == "prefill" and e.movable for e in self.snap.engines)
        movable_d = sum(e.role == "decode" and e.movable for e in self.snap.engines)
        if self.live_decode < min_d:
            spare = max(0, self.live_prefill - min_p)
            reachable = self.live_decode + min(movable_p, spare)
            breaches.append(
                FloorBreach(
                    "decode",
                    min_d,
                    self.live_decode,
                    reachable,
                    f"{self.live_decode} live decode engine(s), floor {min_d}; "
                    f"{min(movable_p, spare)} prefill engine(s) can move without breaching "
                    f"the prefill floor",
                )
            )
        if self.live_prefill < min_p:
            spare = max(0, self.live_decode - min_d)
            reachable = self.live_prefill + min(movable_d, spare)
            breaches.append(
                FloorBreach(
                    "prefill",
                    min_p,
                    self.live_prefill,
                    reachable,
                    f"{self.live_prefill} live prefill engine(s), floor {min_p}; "
                    f"{min(movable_d, spare)} decode engine(s) can move without breaching "
                    f"the decode floor",
                )
            )
        return FloorReport(min_p, min_d, self.live_prefill, self.live_decode, tuple(breaches))

    def project(self, prefill: int, decode: int) -> SplitLoad | None:
        profile = self.snap.mean_profile
        if profile is None or self.prefill_demand is None or self.decode_demand is None:
            return None
        rx = self.rx
        return SplitLoad(
            prefill,
            decode,
            project_prefill(
                self.prefill_demand, prefill, utilization=rx.utilization, ttft_s=self.slo.ttft_s
            ),
            project_decode(
                self.decode_demand,
                decode,
                self.resident,
                profile.decode,
                correction=self.correction,
                utilization=rx.utilization,
                tpot_s=self.slo.tpot_s,
                kv_capacity_tokens=profile.kv_capacity_tokens,
                slots=self.decode_slots,
            ),
        )

    @property
    def prefill_pressure(self) -> float:
        projected = self.current.prefill_load if self.current else 0.0
        return max(projected, self.measured_prefill)

    @property
    def decode_pressure(self) -> float:
        projected = self.current.decode_load if self.current else 0.0
        return max(projected, self.measured_decode)

    @property
    def ttft_breach(self) -> bool:
        return self.snap.ttft_breach or self.measured_prefill > 1.0

    @property
    def required_confirmations(self) -> int:
        return max(self.rx.confirmations, self.th.sustained_intervals)

    # -- decisions ---------------------------------------------------------------------

    def decision(
        self,
        *,
        caller: Caller,
        result: Result,
        reason: Reason,
        detail: str,
        gate: Gate | None = None,
        state: ControllerState,
        proposed: Split | None = None,
        move: Move | None = None,
        rule: Rule | None = None,
        urgent: bool = False,
        confirmations: int = 0,
        required: int = 0,
        projected: bool = True,
    ) -> Decision:
        loads = Loads(
            self.current if projected else None,
            self.to_prefill if projected else None,
            self.to_decode if projected else None,
            self.measured_prefill,
            self.measured_decode,
            self.decode_slots,
        )
        return Decision(
            now=self.now,
            caller=caller,
            result=result,
            reason=reason,
            detail=detail,
            gate=gate,
            roles=self.roles,
            current=self.split,
            proposed=proposed or self.split,
            move=move,
            rule=rule,
            urgent=urgent,
            confirmations=confirmations,
            required=required,
            loads=loads,
            floors=self.floors,
            evidence=self.evidence,
            demand_rising=self.rising,
            state=state,
        )

    def applied(self, state: ControllerState, move: Move, *, recovery: bool) -> ControllerState:
        """The state after `move` is applied (never called in advisory mode)."""
        state = state.cleared().with_role_change(move.engine, self.now)
        if move.direction == "p2d":
            state = attrs.evolve(state, last_p2d_at=self.now)
            if recovery:
                state = attrs.evolve(
                    state, evidence=EvidenceWindow(self.now, self.snap.arrivals_total)
                )
        return state


def _target(p: _Pass, direction: Direction) -> Split:
    k, m = p.split.prefill, p.split.decode
    return Split(k + 1, m - 1) if direction == "d2p" else Split(k - 1, m + 1)


def _movable(p: _Pass, role: Pool) -> list[EngineSnapshot]:
    return [e for e in p.snap.engines if e.role == role and e.movable]


def _none_movable(p: _Pass, role: Pool) -> _Blocked:
    """The gate when no engine of `role` may move. `fixed_role` when every one of them
    has a role its dialect fixes at launch: no pin, drain or wait would free one, and the
    operator has to relaunch an engine to change the split."""
    engines = [e for e in p.snap.engines if e.role == role]
    fixed = [e for e in engines if e.fixed_role is not None]
    if fixed and len(fixed) == len(engines):
        return _Blocked(
            "fixed_role",
            f"no {role} engine can change role ({', '.join(e.id for e in fixed)}): "
            f"{fixed[0].fixed_role}",
        )
    return _Blocked(
        "no_movable_engine",
        f"no {role} engine is movable (pinned, unavailable or with a fixed role)",
    )


def _d2p_order(e: EngineSnapshot) -> tuple[int, int, str]:
    return (e.decode_resident, e.decode_resident_tokens, e.id)


def _p2d_order(e: EngineSnapshot) -> tuple[float, int, str]:
    return (e.prefill_work_s, e.prefill_inflight, e.id)


@attrs.frozen
class _Eligible:
    rule: Rule
    engine: EngineSnapshot


@attrs.frozen
class _Blocked:
    gate: Gate
    detail: str


def _fmt(value: float) -> str:
    return f"{value:.3g}"


# --- resident work (docs/design.md#resident-work) ---------------------------------------


def resident_work_check(
    p: _Pass, candidate: EngineSnapshot, target: SplitLoad | None, *, strict: bool
) -> _Blocked | None:
    """docs/design.md#resident-work, before turning decode capacity into prefill capacity. Returns
    the failing check, or None. Non-strict (prefill-floor recovery) skips a check whose inputs do
    not exist instead of failing it."""
    mean = p.snap.mean_profile
    prompt_mean = p.decode_demand.prompt_tokens_mean if p.decode_demand else 0.0
    remaining = [
        e
        for e in p.snap.engines
        if e.role == "decode" and e.live_for("decode") and e.id != candidate.id
    ]
    pending = p.resident.pending
    # (a) the proposed split stays inside the measured profile domain
    if target is None:
        if strict:
            return _Blocked("profile_domain", "the proposed split cannot be priced (no profile)")
    elif not target.decode_projection.in_domain:
        dp = target.decode_projection
        return _Blocked(
            "profile_domain",
            f"projected decode point at {target.decode} engine(s) (batch {_fmt(dp.active)}, "
            f"KV {_fmt(dp.kv_tokens)}) is outside the measured profile domain",
        )
    # (b) resident decode batches stay inside the measured profile domain
    share = pending / len(remaining) if remaining else 0.0
    for e in [*remaining, candidate]:
        profile = e.profile or mean
        if profile is None:
            if strict:
                return _Blocked("resident_batches", f"engine {e.id!r} has no profile")
            continue
        if e is candidate:
            # Its placed decode legs start here after the move (docs/design.md#placement).
            active = float(e.decode_resident)
            kv = float(e.decode_resident_tokens)
        else:
            active = e.decode_active + share
            kv = e.decode_tokens + share * prompt_mean
        # An idle engine is the idle point, inside the domain: the least busy decode
        # engine, the usual candidate, must not block its own move.
        if not profile.decode.in_domain(math.ceil(active), math.ceil(kv)):
            return _Blocked(
                "resident_batches",
                f"engine {e.id!r} resident batch (batch {_fmt(active)}, KV {_fmt(kv)}) is "
                f"outside its measured profile domain",
            )
    # (c) available KV capacity holds the resident work
    need = pending * prompt_mean
    if remaining:
        free = 0.0
        for e in remaining:
            cap = e.kv_capacity(mean)
            if cap is None:
                if strict:
                    return _Blocked("kv_capacity", f"engine {e.id!r} has no KV capacity")
                continue
            free += max(0, cap - e.decode_tokens)
        if free < need:
            return _Blocked(
                "kv_capacity",
                f"remaining decode engines have {_fmt(free)} free KV tokens for "
                f"{_fmt(need)} pending handoff tokens",
            )
    cap = candidate.kv_capacity(mean)
    if cap is None:
        if strict:
            return _Blocked("kv_capacity", f"engine {candidate.id!r} has no KV capacity")
    elif cap - candidate.decode_resident_tokens < math.ceil(prompt_mean):
        return _Blocked(
            "kv_capacity",
            f"engine {candidate.id!r} holds {candidate.decode_resident_tokens} resident KV "
            f"tokens of {cap}; no room for a {_fmt(prompt_mean)}-token prompt",
        )
    return None


# --- floors (docs/design.md#role-floors) ----------------------------------------------


def _floor_recovery(p: _Pass) -> Decision:
    state = p.state
    dwell = p.th.dwell_s
    pools = {b.pool for b in p.floors.breaches}
    advisory = p.ctl.advisory

    def blocked(gate: Gate, detail: str) -> Decision:
        return p.decision(
            caller="floor-recovery",
            result="breach",
            reason="floor_breach",
            detail=detail,
            gate=gate,
            state=attrs.evolve(state.cleared(), floor_breached=True),
        )

    def moved(move: Move, reason: Reason, detail: str) -> Decision:
        after = state.cleared() if advisory else p.applied(state, move, recovery=True)
        return p.decision(
            caller="floor-recovery",
            result="advisory" if advisory else "move",
            reason=reason,
            detail=detail,
            gate="advisory" if advisory else None,
            state=attrs.evolve(after, floor_breached=True),
            proposed=_target(p, move.direction),
            move=move,
        )

    if pools == {"prefill", "decode"}:
        return blocked(
            "floor", "both floors are breached; no move restores one without deepening the other"
        )
    if "decode" in pools:
        if p.live_prefill - 1 < p.ctl.min_prefill:
            return blocked("floor", "moving a prefill engine would breach the prefill floor")
        movable = _movable(p, "prefill")
        if not movable:
            none = _none_movable(p, "prefill")
            return blocked(none.gate, none.detail)
        ready = [e for e in movable if e.since_role_change_s >= dwell]
        if not ready:
            return blocked("dwell", f"every movable prefill engine changed role within {dwell:g} s")
        engine = min(ready, key=_p2d_order)
        return moved(
            Move(engine.id, "p2d"),
            "floor_recovery_decode",
            f"live decode {p.live_decode} < floor {p.ctl.min_decode}: {engine.id} to decode "
            f"(cooldown skipped)",
        )
    if p.live_decode - 1 < p.ctl.min_decode:
        return blocked("floor", "moving a decode engine would breach the decode floor")
    movable = sorted(_movable(p, "decode"), key=_d2p_order)
    if not movable:
        none = _none_movable(p, "decode")
        return blocked(none.gate, none.detail)
    target = p.to_prefill if p.enough_arrivals else None
    failures: list[_Blocked] = []
    for engine in movable:
        failure = resident_work_check(p, engine, target, strict=False)
        if failure is None:
            return moved(
                Move(engine.id, "d2p"),
                "floor_recovery_prefill",
                f"live prefill {p.live_prefill} < floor {p.ctl.min_prefill}: {engine.id} to "
                f"prefill (cooldown and dwell ignored)",
            )
        failures.append(failure)
    return blocked(failures[0].gate, failures[0].detail)


# --- adjacent splits (docs/design.md#adjacent-splits) -------------------------------------


def _check_d2p(p: _Pass, target: SplitLoad) -> _Eligible | _Blocked:
    th = p.th
    if p.live_decode - 1 < p.ctl.min_decode:
        return _Blocked(
            "floor", f"moving a decode engine would breach the decode floor ({p.ctl.min_decode})"
        )
    rule: Rule
    if target.decode_load <= th.shrink:
        rule = "ordinary"
    elif p.measured_prefill >= th.expand and p.snap.all_profiled:
        rule = "mixed-pressure"
    else:
        why = (
            f"measured prefill pressure {_fmt(p.measured_prefill)} < expand {th.expand:g}"
            if p.measured_prefill < th.expand
            else "not every engine has a profile"
        )
        return _Blocked(
            "shrink",
            f"projected decode load {_fmt(target.decode_load)} at {target.decode} engine(s) is "
            f"above shrink {th.shrink:g} and the mixed-pressure rule does not apply ({why})",
        )
    if not p.evidence.closed:
        return _Blocked("evidence", f"evidence window open: {p.evidence.why}")
    if p.rising:
        return _Blocked(
            "demand_rise",
            f"short-horizon decode demand exceeds the long horizon by more than "
            f"{p.rx.demand_rise_tolerance:g}",
        )
    movable = _movable(p, "decode")
    if not movable:
        return _none_movable(p, "decode")
    ready = [e for e in movable if e.since_role_change_s >= th.dwell_s]
    if not ready:
        return _Blocked(
            "dwell", f"every movable decode engine changed role within {th.dwell_s:g} s"
        )
    guard = th.flip_resident_guard
    guarded = [e for e in ready if guard == 0 or e.decode_resident <= guard]
    if not guarded:
        return _Blocked(
            "resident_guard",
            f"every eligible decode engine holds more than {guard} resident streams",
        )
    failures: list[_Blocked] = []
    for engine in sorted(guarded, key=_d2p_order):
        failure = resident_work_check(p, engine, target, strict=True)
        if failure is None:
            return _Eligible(rule, engine)
        failures.append(failure)
    return failures[0]


def _check_p2d(p: _Pass, target: SplitLoad, state: ControllerState) -> _Eligible | _Blocked:
    th = p.th
    if p.live_prefill - 1 < p.ctl.min_prefill:
        return _Blocked(
            "floor",
            f"moving a prefill engine would breach the prefill floor ({p.ctl.min_prefill})",
        )
    if target.prefill_load > th.shrink:
        return _Blocked(
            "shrink",
            f"projected prefill load {_fmt(target.prefill_load)} at {target.prefill} engine(s) "
            f"is above shrink {th.shrink:g}",
        )
    movable = _movable(p, "prefill")
    if not movable:
        return _none_movable(p, "prefill")
    ready = [e for e in movable if e.since_role_change_s >= th.dwell_s]
    if not ready:
        return _Blocked(
            "dwell", f"every movable prefill engine changed role within {th.dwell_s:g} s"
        )
    panic = (
        th.panic_ratio > 0
        and p.decode_pressure >= th.panic_ratio
        and target.prefill_load < th.shrink
    )
    since = p.now - state.last_p2d_at
    if since < th.cooldown_s and not panic:
        return _Blocked(
            "cooldown",
            f"last prefill-to-decode move {_fmt(since)} s ago; cooldown {th.cooldown_s:g} s",
        )
    return _Eligible("ordinary", min(ready, key=_p2d_order))


def _adjacent(p: _Pass, caller: Caller, state: ControllerState) -> Decision:
    breach_step = caller == "breach-step"
    directions: tuple[Direction, ...] = ("d2p",) if breach_step else ("d2p", "p2d")
    # Without a D-to-P proposal, a breach-step evaluation leaves the sequence alone.
    no_proposal = state if breach_step else state.cleared()

    if not p.enough_arrivals:
        return p.decision(
            caller=caller,
            result="blocked",
            reason="insufficient_arrivals",
            detail=f"{p.snap.long.arrivals} arrivals in the demand window; "
            f"min_arrivals is {p.rx.min_arrivals}",
            gate="min_arrivals",
            state=no_proposal,
        )
    current = p.current
    if current is None:
        return p.decision(
            caller=caller,
            result="blocked",
            reason="no_profile",
            detail="demand cannot be priced: no mean profile",
            gate="no_profile",
            state=no_proposal,
        )
    options: list[tuple[Direction, SplitLoad]] = []
    if "d2p" in directions and p.to_prefill is not None:
        options.append(("d2p", p.to_prefill))
    if "p2d" in directions and p.to_decode is not None:
        options.append(("p2d", p.to_decode))
    margin = p.rx.movement_margin
    better = [(d, s) for d, s in options if improves(current.worst, s.worst, margin)]
    if not better:
        return p.decision(
            caller=caller,
            result="hold",
            reason="balanced",
            detail=f"no adjacent split lowers the worst projected SLO ratio "
            f"({_fmt(current.worst)}) by the movement margin {margin:g}",
            state=no_proposal,
        )
    direction, target = min(better, key=lambda o: (o[1].worst, o[0]))
    proposed = Split(target.prefill, target.decode)
    if direction == "d2p":
        urgent = p.prefill_pressure >= p.th.expand
        checked = _check_d2p(p, target)
    else:
        urgent = p.decode_pressure >= p.th.expand
        checked = _check_p2d(p, target, state)
    if isinstance(checked, _Blocked):
        return p.decision(
            caller=caller,
            result="blocked",
            reason=_proposal_reason(direction, urgent, None),
            detail=checked.detail,
            gate=checked.gate,
            state=state.cleared(),
            proposed=proposed,
            urgent=urgent,
        )
    rule, engine = checked.rule, checked.engine
    reason = _proposal_reason(direction, urgent, rule)
    complete = p.evidence.closed
    key = CandidateKey(direction, proposed.prefill, proposed.decode, complete, rule)
    count = state.confirmations + 1 if state.candidate == key else 1
    required = 1 if (urgent and complete and rule == "ordinary") else p.required_confirmations
    summary = (
        f"worst projected SLO ratio {_fmt(current.worst)} -> {_fmt(target.worst)} "
        f"(prefill {_fmt(target.prefill_load)}, decode {_fmt(target.decode_load)})"
    )
    if count < required:
        return p.decision(
            caller=caller,
            result="confirming",
            reason=reason,
            detail=f"{summary}; confirmation {count} of {required}",
            gate="confirmations",
            state=attrs.evolve(state, candidate=key, confirmations=count),
            proposed=proposed,
            rule=rule,
            urgent=urgent,
            confirmations=count,
            required=required,
        )
    move = Move(engine.id, direction)
    advisory = p.ctl.advisory
    return p.decision(
        caller=caller,
        result="advisory" if advisory else "move",
        reason=reason,
        detail=f"{summary}; {engine.id} to {move.to_role}",
        gate="advisory" if advisory else None,
        state=state.cleared() if advisory else p.applied(state, move, recovery=False),
        proposed=proposed,
        move=move,
        rule=rule,
        urgent=urgent,
        confirmations=count,
        required=required,
    )


def _proposal_reason(direction: Direction, urgent: bool, rule: Rule | None) -> Reason:
    if direction == "d2p":
        if rule == "mixed-pressure":
            return "mixed_pressure"
        return "expand_prefill" if urgent else "rebalance_to_prefill"
    return "expand_decode" if urgent else "rebalance_to_decode"


def decide(snapshot: FleetSnapshot, state: ControllerState, now: float, config: Config) -> Decision:
    """One monitor pass of the reactive controller (module docstring)."""
    p = _Pass(snapshot, state, now, config)
    if p.floors.breaches:
        return _floor_recovery(p)
    state = p.state
    if state.floor_breached or now - state.last_scheduled_at >= p.rx.step_s:
        state = attrs.evolve(
            state, last_scheduled_at=now, breach_step_used=False, floor_breached=False
        )
        return _adjacent(p, "scheduled", state)
    if p.ttft_breach and not state.breach_step_used:
        state = attrs.evolve(state, breach_step_used=True)
        return _adjacent(p, "breach-step", state)
    wait = state.last_scheduled_at + p.rx.step_s - now
    return p.decision(
        caller="none",
        result="waiting",
        reason="between_steps",
        detail=f"next scheduled evaluation in {_fmt(wait)} s",
        state=state,
        projected=False,
    )


def live_split(engines: Sequence[EngineSnapshot]) -> Split:
    """The live split of a fleet snapshot (prefill-role and decode-role engines only)."""
    return Split(
        sum(e.role == "prefill" and e.live_for("prefill") for e in engines),
        sum(e.role == "decode" and e.live_for("decode") for e in engines),
    )
