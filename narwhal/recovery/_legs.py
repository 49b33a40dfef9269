"""Leg accounting: what each engine leg's outcome does to that engine's verdicts.

Owns
  `LegAccounting`, recovery's side of `LegObserver`: a counted failure feeds the failing
  phase's breaker and starts recovery.failure_quarantine_s of quarantine (0 disables
  it); a leg that could not connect takes the engine out until a probe sent after it
  answers (`_unreachable`); an SGLang pair's failed transfer goes to
  `TransferAttribution`. Successes are kept, newest last and at most _PENDING_LEGS, as
  the latency observations of the monitor's residual stage (`residual_pass`), which
  owns the `predictor`.

Invariants
  Runs on the request path: never blocks. A failure counts against the engine only when
  `EngineFailed.counts_against_engine` says so and the router's own lag does not
  explain its deadline. A failure is charged to the phase of the leg that failed (both
  phases for an aggregate leg).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import trio

from .._codes import ErrorCode
from .._errors import EngineFailed
from ..fleet import EngineState
from ..signals import DecodeGaps
from ._breaker import BreakerEvent
from ._health import Verdict
from ._record import PHASES, EngineRecovery, LegObservation
from ._transfer import TransferAttribution
from ._verdicts import Verdicts

log = logging.getLogger("narwhal.recovery")

# (engine, phase, observation) -> the latency the engine's profile predicts for that
# leg's `observed_s`, or None when there is no prediction (no profile, outside the
# measured domain).
Predictor = Callable[[EngineState, str, LegObservation], float | None]


def _latest_predicted(
    predictor: Predictor, engine: EngineState, observations: list[LegObservation]
) -> tuple[LegObservation, float] | None:
    """The newest observation the profile predicts, with its prediction."""
    for observation in reversed(observations):
        predicted = predictor(engine, observation.phase, observation)
        if predicted is not None and math.isfinite(predicted) and predicted > 0:
            return observation, predicted
    return None


class LegAccounting:
    """Recovery's side of `LegObserver`, and the latency residuals it keeps."""

    def __init__(self, verdicts: Verdicts, predictor: Predictor | None) -> None:
        self.verdicts = verdicts
        self.ctx = verdicts.ctx
        self.metrics = verdicts.metrics
        self.predictor = predictor
        self.transfers = TransferAttribution(verdicts, self.count)

    def leg_ok(
        self,
        engine: EngineState,
        phase: str,
        duration_s: float,
        *,
        prompt_tokens: int = 0,
        contended: bool = False,
        gaps: DecodeGaps | None = None,
    ) -> None:
        record = self.verdicts.record_for(engine)
        if record is None:
            return
        now = trio.current_time()
        phases = PHASES if phase == "aggregate" else (phase,) if phase in PHASES else ()
        for name in phases:
            record.breakers[name].handle(BreakerEvent.SUCCESS, now)
        record.legs_seen += 1
        if self.predictor is None:
            return
        if self.ctx.loop_lag.excuse(duration_s, since=now - duration_s) is not None:
            # Its duration is partly the router's.
            self.metrics.excused.labels(engine.id, "residual").inc()
            return
        load = engine.load.statistics()
        record.pending.append(
            LegObservation(
                engine_id=engine.id,
                phase=phase,
                duration_s=duration_s,
                at=trio.current_time(),
                prompt_tokens=prompt_tokens,
                prefill_inflight=load.prefill_inflight,
                contended=contended,
                prefill_tokens_inflight=load.prefill_tokens_inflight,
                decode_active=load.decode_active,
                decode_tokens=load.decode_tokens,
                gaps=gaps,
            )
        )

    def leg_failed(self, engine: EngineState, phase: str, failure: EngineFailed) -> None:
        # failure.phase names the leg that failed; never the other engine of the pair.
        phase = failure.phase
        excuse = None
        if failure.counts_against_engine and failure.deadline_s is not None:
            excuse = self.ctx.loop_lag.excuse(failure.deadline_s)
        if not failure.counts_against_engine or excuse is not None:
            if excuse is not None:
                self.metrics.excused.labels(engine.id, "leg_failure").inc()
            log.log(
                logging.DEBUG if excuse is None else logging.INFO,
                "leg failure not counted against %s: %s%s",
                engine.id,
                failure.message,
                "" if excuse is None else f"; {excuse}",
                extra={
                    "event": "leg_failed",
                    "engine": engine.id,
                    "phase": phase,
                    "code": failure.code,
                    "counted": False,
                    "excuse": excuse,
                },
            )
            if failure.code == ErrorCode.KV_TRANSFER_FAILED and failure.partner_id is not None:
                self.transfers.failed(engine, failure, failure.partner_id)
            return
        record = self.verdicts.record_for(engine)
        if record is None:
            return
        self.count(record, phase, failure.message, failure.code)
        if failure.code == ErrorCode.ENGINE_UNREACHABLE:
            self._unreachable(record, phase, failure.message)

    def _unreachable(self, record: EngineRecovery, phase: str, message: str) -> None:
        """A leg could not connect to the engine: out of placement until a health probe
        sent after this answers, and that probe goes out at once.

        An engine that refuses connections fails every leg at once, so it looks idle and
        placement sends it most new requests; until its probes had failed
        recovery.health.failure_threshold times, each of those failed (a streamed one
        with its 200 sent, so not retried: docs/design.md#streaming-failures). Out at once, it costs
        its role one probe's round trip when the refusal was a blip, and its requests go to the
        role's other engines meanwhile."""
        engine = record.engine
        record.unreachable_at = trio.current_time()
        record.probe_now = True
        record.wake.set()
        if engine.unreachable is not None:
            return
        engine.recovery_unreachable(
            f"{phase} leg could not connect ({message}); until a probe answers"
        )
        self.verdicts.changed(engine.id, "reachability", None, "reachable", "unreachable", message)

    def count(self, record: EngineRecovery, phase: str, message: str, code: str) -> None:
        """A failure counted against the engine: its phase's breaker and quarantine."""
        engine = record.engine
        now = trio.current_time()
        self.metrics.counted.labels(engine.id, phase).inc()
        # An aggregate leg ran both phases on this engine; either may have failed.
        phases = PHASES if phase == "aggregate" else (phase,) if phase in PHASES else ()
        for name in phases:
            breaker = record.breakers[name]
            transition = breaker.handle(BreakerEvent.FAILURE, now, message)
            if transition is not None:
                self.verdicts.breaker_changed(transition)
        log.info(
            "%s leg on %s failed: %s",
            phase,
            engine.id,
            message,
            extra={
                "event": "leg_failed",
                "engine": engine.id,
                "phase": phase,
                "code": code,
                "counted": True,
                "failures_in_window": {
                    name: record.breakers[name].failures_in_window(now) for name in phases
                },
            },
        )
        quarantine_s = self.ctx.config.recovery.failure_quarantine_s
        if quarantine_s > 0:
            until = now + quarantine_s
            if until > engine.quarantined_until:
                if not record.quarantine_active:
                    self.verdicts.changed(
                        engine.id,
                        "quarantine",
                        None,
                        "released",
                        "quarantined",
                        f"counted {phase} failure ({code}); excluded from placement for "
                        f"recovery.failure_quarantine_s={quarantine_s}",
                    )
                record.quarantine_active = True
                engine.recovery_quarantine(until)
        record.wake.set()

    def residual_pass(self, now: float) -> dict[str, float]:
        """The monitor's residual stage: at most one residual per engine per pass.

        Each engine's latest successful leg since the previous pass that the profile
        predicts (an uncontended prefill leg in its domain, say, or a decode leg's median
        token interval at the engine's load) is compared with that prediction: the
        latest leg alone would on a busy engine most often be one it does
        not predict, and an engine slow enough to be busy would then go without the
        residuals that should eject it. Exceptions from the predictor propagate: they are
        a monitoring-stage failure.
        """
        residuals: dict[str, float] = {}
        predictor = self.predictor
        if predictor is None:
            return residuals
        health = self.ctx.config.recovery.health
        for record in list(self.verdicts.records.values()):
            observations = list(record.pending)
            record.pending.clear()
            if record.health.verdict is not Verdict.UP:
                continue
            found = _latest_predicted(predictor, record.engine, observations)
            if found is None:
                continue
            observation, predicted = found
            ratio = observation.observed_s / predicted
            record.residuals.add(now, ratio, health.window_s)
            residuals[record.engine.id] = ratio
            reason = record.residuals.verdict(now, health)
            if reason is not None:
                record.residuals.clear()
                if self.verdicts.last_of_role(record.engine, now):
                    # Slow is not down: without it, its role's work would stop altogether
                    # for at least window_s (readmission waits that long). Hard failures
                    # still take it out; its residuals start over.
                    log.warning(
                        "engine %s is slower than its profile (%s) but is the last "
                        "available %s engine: not ejected for latency",
                        record.engine.id,
                        reason,
                        record.engine.role,
                        extra={
                            "event": "latency_ejection_withheld",
                            "engine": record.engine.id,
                            "reason": reason,
                        },
                    )
                    continue
                record.latency_until = now + health.window_s
                reason += f"; readmission starts after recovery.health.window_s={health.window_s}"
                self.verdicts.health_changed(record, record.health.eject(reason))
        return residuals
