"""Verdict changes and what follows them: the log line, the metric, the wakes.

Owns
  `Verdicts`: the registry of engine records (`records`, and `replaced` while a reload
  swaps an instance), `recent_changes`, and the one path every verdict change takes
  (`changed`): one JSON log line (`"event": "verdict"` with engine, phase, kind, from,
  to, reason), one increment of narwhal_recovery_transitions_total, one entry in the
  bounded `recent_changes` of the state document. Also who is the last engine of its
  role (`last_of_role`, `alone`), which shortcuts that allows (`backoff_cut`), and when
  the router's own lag excuses evidence (`excused`).

Invariants
  A change that takes an engine out of placement wakes every waiting engine it may
  leave the last of its role (`left_placement`), so its readmission does not wait for
  its next probe interval. Recovery's own changes count only from in service, and never
  for the engine that changed (its own verdict or probe decides for itself).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import attrs
import trio

from ..fleet import EngineState, Phase
from ._breaker import BreakerState, Transition
from ._evidence import ProbeResult, VerifyResult
from ._expose import RecentChange, RecoveryMetrics
from ._health import Verdict, VerdictChange
from ._host import RecoveryHost
from ._record import EngineRecovery

log = logging.getLogger("narwhal.recovery")

_RECENT_CHANGES = 200

_R = TypeVar("_R", ProbeResult, VerifyResult)


def work(engine: EngineState) -> Phase:
    """The work of `engine`'s role, as placement names it."""
    return "aggregate" if engine.role == "both" else engine.role


class Verdicts:
    """The fleet's recovery records and every change of their verdicts."""

    def __init__(self, ctx: RecoveryHost, metrics: RecoveryMetrics) -> None:
        self.ctx = ctx
        self.metrics = metrics
        self.records: dict[str, EngineRecovery] = {}
        # Records of engines a reload is replacing: the new instance is adopted (and
        # probed) while the old one is still in placement, until `Recovery.retire` ends it.
        self.replaced: list[EngineRecovery] = []
        self.recent_changes: deque[RecentChange] = deque(maxlen=_RECENT_CHANGES)
        # Told of every change, after it is recorded: (engine, kind, new, reason). The
        # cluster service shares ejections and quarantines with the other replicas.
        self.on_change: Callable[[EngineState, str, str, str], None] | None = None

    def record_for(self, engine: EngineState) -> EngineRecovery | None:
        record = self.records.get(engine.id)
        if record is not None and record.engine is engine:
            return record
        return next((r for r in self.replaced if r.engine is engine), None)

    def interval(self) -> float:
        return self.ctx.config.recovery.health.interval_s

    def changed(
        self, engine_id: str, kind: str, phase: str | None, old: str, new: str, reason: str
    ) -> None:
        self.metrics.transitions.labels(engine_id, kind, phase or "", old, new).inc()
        self.recent_changes.append(
            RecentChange(
                at=round(trio.current_time() - self.ctx.started_at, 6),
                engine=engine_id,
                kind=kind,
                phase=phase,
                old=old,
                new=new,
                reason=reason,
            )
        )
        worse = new in ("open", "ejected", "held", "quarantined", "unreachable")
        if worse and old in ("up", "closed", "released", "reachable"):
            self.left_placement(left=engine_id)
        where = f"{engine_id}/{phase}" if phase else engine_id
        log.log(
            logging.WARNING if worse else logging.INFO,
            "%s %s: %s -> %s: %s",
            kind,
            where,
            old,
            new,
            reason,
            extra={
                "event": "verdict",
                "engine": engine_id,
                "kind": kind,
                "phase": phase,
                "from": old,
                "to": new,
                "reason": reason,
            },
        )
        record = self.records.get(engine_id)
        if self.on_change is not None and record is not None:
            self.on_change(record.engine, kind, new, reason)

    def health_changed(self, record: EngineRecovery, change: VerdictChange | None) -> None:
        reason = record.health.ejected_reason
        if reason is None:
            record.engine.recovery_readmit()
        else:
            record.engine.recovery_eject(reason)
        if change is None:
            return
        if change.new is Verdict.EJECTED:
            record.next_verify_at = -math.inf
        self.changed(
            record.engine.id, "health", None, change.old.value, change.new.value, change.reason
        )
        record.wake.set()

    def breaker_changed(self, transition: Transition) -> None:
        self.changed(
            transition.engine,
            "breaker",
            transition.phase,
            transition.old.value,
            transition.new.value,
            transition.reason,
        )
        record = self.records.get(transition.engine)
        if record is not None:
            if transition.new is BreakerState.HALF_OPEN:
                record.next_verify_at = -math.inf
            record.wake.set()

    def left_placement(self, left: str | None = None) -> None:
        """An engine left placement (or one phase of it), or changed what it takes: if
        that leaves a waiting engine the last to take its role's work, it is probed at
        once, and its readmission goes ahead at that probe (`alone`), not at its next
        probe interval. Waiting: ejected, or held for recovery.restart_hold_s, with a
        good last probe; an engine verifying while a failed verification's backoff holds
        it back is woken for its verification (`backoff_cut`).

        Recovery's own changes (`changed`) count only from in service, and not for the
        engine that `left` (its own verdict, or its probe, decides for itself): one back
        to ejected after a failed verification takes nothing out of placement, and two
        waiting engines of one role must not wake each other's probes in turn. Every
        other change comes through `Recovery.placement_changed`."""
        now = trio.current_time()
        for record in self.records.values():
            if record.engine.id == left or record.probe_now:
                continue
            if record.readmission_wanted() and self.backoff_cut(record, now):
                record.wake.set()
                continue
            probe = record.last_probe
            if probe is None or probe.outcome != "ok":
                continue
            if record.waiting(now) and self.alone(record) is not None:
                record.probe_now = True
                record.wake.set()

    def alone(self, record: EngineRecovery) -> str | None:
        """Why this engine's readmission need not wait, or None: no other engine in
        placement takes its role's work (`last_of_role`), so every request needing that
        role is refused until it is back, and each probe interval it waits costs the
        whole service. Then one good probe starts its verification, not
        recovery.health.readmit_successes (`HealthTracker.probe_ok`); its good probes
        count within a latency ejection's recovery.health.window_s
        (`ProbeLoop._latency_cut`); and a restart hold's verification need not wait for
        recovery.restart_hold_s (`ProbeLoop._cut_hold`). The probe streak guards against
        an engine that answers /health while it flaps, the latency window against a slow
        one coming back at once, and the hold gives a restarted one time to warm up: each
        is worth less than serving the role at all. The verification pair that follows (a
        real prefill and decode) still has to pass, and a broken engine fails it and stays
        out. A drained or removed engine would stay out of placement anyway, so it gets no
        shortcut."""
        engine = record.engine
        if engine.drained or engine.removed:
            return None
        if not self.last_of_role(engine, trio.current_time()):
            return None
        return f"no other engine in placement takes {work(engine)} work"

    def last_of_role(self, engine: EngineState, now: float) -> bool:
        """No other engine in placement takes the work of `engine`'s role now, so without
        it every request that needs that role is refused (`no_engine_available`).

        What placement does with a role (docs/design.md#placement, `placement.choose`): a prefill or
        decode engine's work is that phase of a pair, and when no pair is available it
        goes to a `both` engine as aggregate work; a `both` engine's work goes to a pair
        when one is available, else to another `both` engine. A peer counts when it
        takes that work now: not removed, drained, auth-refused, ejected (or being
        verified), unreachable, held or quarantined, and its breaker of that phase not
        open; a pin fixes a role, not availability, so a pinned peer counts. Roles are
        read as they are now: a peer the controller just moved into the role counts, one
        it moved out does not (an SGLang server's role never moves)."""

        def taken(role: str, phase: Phase) -> bool:
            return any(
                other is not engine
                and other.role == role
                and other.unavailable_reason(now, phase) is None
                for other in self.ctx.fleet
            )

        if taken("both", "aggregate"):
            return False
        if engine.role == "both":
            return not (taken("prefill", "prefill") and taken("decode", "decode"))
        return not taken(engine.role, engine.role)

    def backoff_cut(self, record: EngineRecovery, now: float) -> bool:
        """Whether a readmission verification that the backoff of
        `Verification._verification_failed` holds back may run a probe interval after the
        last one instead: while no other engine in placement takes its role's work
        (`alone`), and only then.

        The backoff spares the logs, `recent_changes` and an in-service partner's leg
        the pairs of an engine that stays broken for hours. While its role is empty
        every request needing the role is refused, and an engine fixed without a restart
        (its KV path back, a wedged worker freed) would be refused as well for up to
        _VERIFY_BACKOFF_MAX probe intervals after it was fine: a verification is cheap
        next to that. There is no verification storm: `next_verify_at` still keeps one
        verification (its pair sent again once when it failed at once) per probe
        interval at most, the probe streak and a hold still gate it, and the backoff
        holds again as soon as another engine takes the role's work."""
        if now >= record.readmit_after:
            return False
        return self.alone(record) is not None

    def excused(self, engine: EngineState, evidence: str, started: float, result: _R) -> _R:
        """`result`, or inconclusive if it failed on a deadline the router's own event
        loop lag explains (`RouterLag.excuse`): probes timing out while a client flood
        starves the loop would otherwise eject healthy engines."""
        if result.outcome != "failed" or result.deadline_s is None:
            return result
        excuse = self.ctx.loop_lag.excuse(result.deadline_s, since=started)
        if excuse is None:
            return result
        self.metrics.excused.labels(engine.id, evidence).inc()
        return attrs.evolve(result, outcome="inconclusive", detail=f"{result.detail}; {excuse}")
