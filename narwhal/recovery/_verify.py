"""Verification: the leg pairs that readmit an engine or close its breaker.

Owns
  `Verification`: when a verification is due (`verify_due`), which engines run its pair
  (`_pair`), whose fault a failed pair is (`attribute`), and the backoff after
  readmission verifications that failed in a row (`_verification_failed`). It holds
  `before_release`, awaited before a restarted engine's hold is lifted.

Invariants
  Verifications run inside the engine's loop, one at a time per engine, so an engine is
  never verified twice concurrently. After one that did not pass, the next waits a probe
  interval (longer after readmission verifications that failed in a row, unless its role
  has no other engine: `Verdicts.backoff_cut`). An auth-refused engine is not verified;
  once its key check passes, at once.

Errors (as outcomes)
  A leg answered with 401/403 marks that engine auth-refused, as the request path would
  (`fleet.key_refused`); a 404 naming the model, model-refused (`fleet.model_refused`).
  Neither is a failed verification, nor a breaker's: the engine refuses the key or the
  model, not the work.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

import trio

from ..fleet import EngineState, Phase, key_refused, model_refused
from ._breaker import BreakerEvent, BreakerState
from ._evidence import ModelRefusal, Prober, VerifyOutcome, VerifyPair, VerifyResult
from ._expose import VerificationReport
from ._record import PHASES, EngineRecovery
from ._verdicts import Verdicts, work

log = logging.getLogger("narwhal.recovery")

# After consecutive failed readmission verifications the next waits twice as long as
# the one before, from one probe interval up to this many (`_verification_failed`),
# unless the engine's role has no other engine in placement (`Verdicts.backoff_cut`).
_VERIFY_BACKOFF_MAX = 8


# What a breaker's verification tells it: "refused" (a leg refused Narwhal's key or the
# model) says nothing of the engine's health, no more than "inconclusive" does.
BREAKER_EVENTS: Mapping[VerifyOutcome, BreakerEvent] = {
    "ok": BreakerEvent.VERIFY_OK,
    "failed": BreakerEvent.VERIFY_FAILED,
    "inconclusive": BreakerEvent.VERIFY_INCONCLUSIVE,
    "refused": BreakerEvent.VERIFY_INCONCLUSIVE,
}


def backoff_wait(failed: int, interval: float) -> float:
    """How long after the last readmission verification the next waits once `failed`
    (at least two) failed in a row: twice as long as the one before, from one probe
    `interval` up to _VERIFY_BACKOFF_MAX of them."""
    doubling: int = 2 ** (failed - 1)
    return interval * min(doubling, _VERIFY_BACKOFF_MAX)


def resent(result: VerifyResult) -> bool:
    """A verification pair that failed at once is sent again (`_verify`); one
    that ran out engine.first_token_timeout_s has waited its deadline already."""
    return result.outcome == "failed" and result.deadline_s is None


def attribute(pair: VerifyPair, result: VerifyResult) -> VerifyResult:
    """A failed pair with a standby partner is a failed verification of the subject only
    when the failure is certainly the subject's own (`VerifyResult.culprit`).

    The standby partner has not passed a verification itself, and in a bootstrap pair a
    fault of either engine can fail either leg. Blaming the subject for what may be its
    partner's fault would eject it again (or reopen its breaker) and restart its
    readmission streak, all logged and shown as its failure. Inconclusive instead keeps
    it out, as when there is no partner at all, and it is verified again a probe interval
    later. An available partner is in service, so presumed sound: with one, a failure
    counts against the subject unless it is certainly the partner's own (its connection
    refused, say), which the partner's serving traffic and breakers will judge."""
    partner = pair.partner
    if partner is None or result.outcome != "failed":
        return result
    subject = pair.subject.id
    if result.culprit == partner.id:
        why = f"the failure is {partner.id}'s own"
    elif pair.standby and result.culprit != subject:
        why = f"either engine may have caused it, and {partner.id} is unverified itself"
    else:
        return result
    return VerifyResult("inconclusive", f"{result.detail}; not counted against {subject}: {why}")


def _refusal(engine: EngineState) -> str | None:
    """Why `engine` would refuse a verification leg whatever its health: Narwhal's key
    (`fleet.key_refused`) or the model (`fleet.model_refused`)."""
    if engine.auth_refused is not None:
        return engine.auth_refused
    if engine.model_missing is not None:
        return f"does not serve the model ({engine.model_missing})"
    return None


class Verification:
    """Runs the verification an engine's loop finds due, and acts on its result."""

    def __init__(self, verdicts: Verdicts, prober: Prober) -> None:
        self.verdicts = verdicts
        self.ctx = verdicts.ctx
        self.metrics = verdicts.metrics
        self.prober = prober
        # Awaited when a restarted engine has passed its verification, before its hold is
        # lifted: a restart may be an upgrade, and the supervisor then compares the
        # engine's build with its profile's (a stale profile is dropped, not used).
        self.before_release: Callable[[EngineState], Awaitable[None]] | None = None
        self._verify_seq = 0

    async def verify_due(self, record: EngineRecovery) -> None:
        now = trio.current_time()
        if now < record.next_verify_at or record.engine.auth_refused is not None:
            return
        engine = record.engine
        backoff_over = now >= record.readmit_after or self.verdicts.backoff_cut(record, now)
        due = not record.hold.waiting(now) and backoff_over
        if record.readmission_wanted() and due:
            result = await self._verify(record, "readmission", work(engine))
            if result.outcome == "ok":
                record.failed_verifications = 0
                self.verdicts.health_changed(record, record.health.verify_ok(result.detail))
                if record.hold.active and self.before_release is not None:
                    await self.before_release(engine)
                cut = record.hold.cut_reason
                if record.hold.clear():
                    engine.recovery_release_hold()
                    released = "verification passed"
                    if cut is not None:
                        released += f"; the hold was {cut}"
                    self.verdicts.changed(engine.id, "hold", None, "held", "released", released)
            elif result.outcome == "failed":
                detail = self._verification_failed(record)
                change = record.health.verify_failed(result.detail + detail)
                self.verdicts.health_changed(record, change)
            # Neither "refused" nor "inconclusive" says anything of the engine's health.
            if result.outcome != "ok":
                record.next_verify_at = trio.current_time() + self.verdicts.interval()
            return
        if record.breaker_wanted():
            for breaker in record.breakers.values():
                if breaker.state is not BreakerState.HALF_OPEN:
                    continue
                result = await self._verify(record, "breaker", breaker.phase)
                event = BREAKER_EVENTS[result.outcome]
                transition = breaker.handle(event, trio.current_time(), result.detail)
                if transition is not None:
                    self.verdicts.breaker_changed(transition)
                if result.outcome != "ok":
                    record.next_verify_at = trio.current_time() + self.verdicts.interval()
                    return

    def _verification_failed(self, record: EngineRecovery) -> str:
        """Count a failed readmission verification; from the second in a row on, the
        next waits twice as long as the one before, from one probe interval up to
        _VERIFY_BACKOFF_MAX of them, and this says so for the ejection's reason.

        An engine that answers /health but fails its pair (a dead GPU behind a live HTTP
        server, a broken KV path) would otherwise be verified after every readmit_successes
        good probes for as long as it stays broken, for hours if nobody fixes it: each
        logged as warnings, each filling `recent_changes` with the same two transitions,
        one leg of each on an engine in service. Only the first failures of an instance
        come quickly: a passing pair or a restart (a new instance, which is how such an
        engine is usually fixed) starts the count over. While the engine is the last of
        its role (`Verdicts.alone`) the wait is one probe interval all the same
        (`Verdicts.backoff_cut`), and the ejection's reason says that too."""
        record.failed_verifications += 1
        failed = record.failed_verifications
        if failed < 2:
            return ""
        interval = self.verdicts.interval()
        wait = backoff_wait(failed, interval)
        record.readmit_after = trio.current_time() + wait
        record.readmit_wait_s = wait
        detail = (
            f"; {failed} failed in a row, so the next waits {wait:g} s (doubling from "
            f"recovery.health.interval_s={interval}, up to {_VERIFY_BACKOFF_MAX} of them)"
        )
        alone = self.verdicts.alone(record)
        if alone is not None:
            detail += f", or {interval:g} s while {alone}"
        return detail

    def backoff_note(self, record: EngineRecovery, alone: str | None) -> str:
        """The readmission backoff, for the reason of a change to verifying."""
        failed = f"{record.failed_verifications} verifications failed in a row"
        if alone is None:
            return f"{failed}, so it waits until {record.readmit_wait_s:g} s after the last"
        return (
            f"{failed}, so it would wait until {record.readmit_wait_s:g} s after the last, "
            f"but waits {self.verdicts.interval():g} s while its role has no other engine"
        )

    async def _verify(self, record: EngineRecovery, purpose: str, phase: str) -> VerifyResult:
        """One verification; a pair that failed at once is sent again, and only the second
        one's result counts.

        A verification is one pair of legs, and the verdict it decides (readmission, or a
        breaker's close) is re-tried only after readmit_successes more probes or a probe
        interval. A single transient fault on either leg (an engine's one 5xx, a dropped
        connection, an error event on the in-service partner's leg, which counts against
        the subject) would keep a sound engine out for another round, and when its role's
        other engines are out too, every request meanwhile is refused
        (`no_engine_available`). A broken engine fails the second pair as well, a moment
        later. A pair that ran out engine.first_token_timeout_s is not sent again: it has
        waited its deadline already, and a stalled engine would hold its loop twice as
        long."""
        result = await self._verify_once(record, purpose, phase, retry=True)
        if resent(result):
            result = await self._verify_once(record, purpose, phase, retry=False)
        return result

    async def _verify_once(
        self, record: EngineRecovery, purpose: str, phase: str, *, retry: bool
    ) -> VerifyResult:
        self._verify_seq += 1
        subject = record.engine
        request_id = f"narwhal-verify-{subject.id}-{self._verify_seq}"
        pair = self._pair(subject, phase, request_id)
        started = trio.current_time()
        partner: EngineState | None = None
        standby = False
        if isinstance(pair, VerifyResult):
            result = pair  # skipped: there is no pair the engine would accept
        else:
            partner, standby = pair.partner, pair.standby
            result = await self.prober.verify(pair, self.ctx.config)
            result = attribute(
                pair, self.verdicts.excused(subject, "verification", started, result)
            )
        refusal = result.refusal
        if isinstance(refusal, ModelRefusal):
            model_refused(refusal.engine, refusal.message, self.ctx.config)
        elif refusal is not None:
            key_refused(refusal.engine, refusal.status, refusal.message, self.ctx.config)
        duration = trio.current_time() - started
        retried = retry and resent(result)
        outcome = "retried" if retried else result.outcome
        self.metrics.verifications.labels(subject.id, purpose, outcome).inc()
        verification = VerificationReport(
            request_id=request_id,
            purpose=purpose,
            phase=phase,
            partner=None if partner is None else partner.id,
            standby=standby,
            outcome=outcome,
            detail=result.detail + ("; not counted: sending another pair" if retried else ""),
            duration_s=round(duration, 6),
        )
        record.last_verification = verification
        log.log(
            logging.INFO if result.outcome == "ok" else logging.WARNING,
            "%s verification of %s (%s): %s: %s",
            purpose,
            subject.id,
            phase,
            outcome,
            verification.detail,
            extra={
                "event": "verification",
                "engine": subject.id,
                "request_id": verification.request_id,
                "purpose": verification.purpose,
                "phase": verification.phase,
                "partner": verification.partner,
                "standby": verification.standby,
                "outcome": verification.outcome,
                "detail": verification.detail,
                "duration_s": verification.duration_s,
            },
        )
        return result

    def _pair(self, subject: EngineState, phase: str, request_id: str) -> VerifyPair | VerifyResult:
        """The subject runs the leg under test; the other leg runs on the least busy
        available engine of the other role, or on the subject itself if there is none.

        An SGLang prefill or decode server (a fixed role) accepts only its own leg of a
        bootstrap pair: a local pair's plain requests are refused with 400, and an
        aggregate server never joins a bootstrap room. So its partner is a disaggregated
        server of the other role; failing an available one, one that answers its health
        probe but waits for readmission itself (a fleet that restarted as a whole would
        otherwise never readmit anything); failing that, the verification is skipped as
        inconclusive, which keeps the engine out until a partner is back. A standby
        engine that refuses Narwhal's API key is passed over, since its leg would be
        refused; when only such engines answer, the skip names them. A standby
        partner is no known-good reference, so only a failure certainly the subject's
        counts against it (`attribute`); a pair that passes readmits the subject alone,
        the partner waits for its own verification.
        """
        if phase not in PHASES or subject.role == "both":
            return VerifyPair(subject, phase, subject, subject, request_id)
        fixed = subject.fixed_role is not None
        if fixed:
            phase = subject.role  # the only leg it serves, whichever breaker asked
        other: Phase = "decode" if phase == "prefill" else "prefill"
        roles = (other,) if fixed else (other, "both")
        now = trio.current_time()
        peers = [
            engine
            for engine in self.ctx.fleet
            if engine is not subject and engine.dialect is subject.dialect and engine.role in roles
        ]
        candidates = [e for e in peers if e.unavailable_reason(now, other) is None]
        standby = False
        if not candidates and fixed:
            answering = [e for e in peers if self._standby(e)]
            # One that refuses Narwhal's key or the model would refuse its leg (an
            # available one never does: the refusal takes it out of placement).
            candidates = [e for e in answering if _refusal(e) is None]
            standby = True
            if not candidates:
                role = subject.fixed_role
                refused = "; ".join(f"{e.id} {_refusal(e)}" for e in answering)
                missing = (
                    f"no {other} engine that answers its health probe takes narwhal's API "
                    f"key and serves the model to pair with {subject.id} ({refused}; {role})"
                    if answering
                    else f"no {other} engine answers its health probe to pair with "
                    f"{subject.id} ({role})"
                )
                return VerifyResult("inconclusive", f"skipped: {missing}")
        if not candidates:
            return VerifyPair(subject, phase, subject, subject, request_id)
        partner = min(
            candidates,
            key=lambda e: (
                e.control_pool.statistics().in_use,
                e.load.prefill_inflight + e.load.decode_active,
                e.id,
            ),
        )
        if phase == "prefill":
            return VerifyPair(subject, phase, subject, partner, request_id, standby)
        return VerifyPair(subject, phase, partner, subject, request_id, standby)

    def _standby(self, engine: EngineState) -> bool:
        """Up but not yet readmitted: its last health probe passed, and only recovery
        keeps it out (the operator's drain and reload's removal are respected)."""
        if engine.drained or engine.removed:
            return False
        record = self.verdicts.records.get(engine.id)
        probe = None if record is None else record.last_probe
        return probe is not None and probe.outcome == "ok"
