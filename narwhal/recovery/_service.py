"""The recovery service: breakers, quarantine, health ejection, restart holds, readmission.

It owns three of `EngineState`'s availability flags (`ejected`, `held_until`,
`quarantined_until`) and installs the per-phase breakers as `phase_gates`; drains and
pins belong to the operator (narwhalctl) and `removed` to reload.

Inputs
- Every engine leg's outcome, from the request path through `LegObserver`
  (`leg_ok` / `leg_failed`). Counted failures feed the failing phase's breaker and
  start recovery.failure_quarantine_s of quarantine (0 disables it); a leg that could
  not connect also takes the engine out until a health probe sent after it answers,
  and that probe goes out at once (`_unreachable`). Successes are
  kept, newest last and at most _PENDING_LEGS of them, as the engine's latency
  observations for the monitor's residual stage.
- One probe loop per engine: GET /health (and /version for the engine's identity)
  every recovery.health.interval_s on the control pool. A /version refused for
  Narwhal's API key (SGLang guards it) marks the engine auth-refused unless a key check
  at once accepts the key (then only /version is guarded more), and is logged once
  until /version answers again. While the engine refuses Narwhal's API key
  (`EngineState.auth_refused`, set on a 401/403 by the request path or by recovery's
  own requests), each good probe is followed by a key check: GET /v1/models, which the
  engine guards with its --api-key where it leaves its health route open. HTTP 200
  clears the refusal and the engine takes work again (one `engine_auth_recovered` log
  line); a refusal keeps it out, and any other failure too, the health probes judging
  the engine itself.
- The monitor's residual stage (`residual_pass`), at most once per engine per pass.

When something is due (an open breaker's open_s, a quarantine's end, a restart hold's
recovery.restart_hold_s, a readmission), the engine's loop wakes at that instant; a
counted failure wakes it at once, and so does another engine leaving placement when that
leaves this one, waiting for readmission, the last to take its role's work
(`_left_placement`), by whatever path: recovery's own verdicts, or a drain, a reload, a
role change or a refused key or model, which the fleet reports (`placement_changed`).
Verifications run inside the engine's loop, one at a time per engine, so an engine is
never verified twice concurrently, and after one that did not pass the next waits a
probe interval (longer after readmission verifications that failed in a row, unless its
role has no other engine: `_verification_failed`, `_backoff_cut`). A verification leg
answered with 401/403 marks that engine auth-refused, as the request path would
(`fleet.key_refused`): it is neither a failed verification nor a breaker's, since the
engine refuses the key, not the work. An auth-refused engine is not verified; once its
key check passes, at once.

Every verdict change is one JSON log line (`"event": "verdict"` with engine, phase,
kind, from, to, reason), one increment of narwhal_recovery_transitions_total, and an
entry in the bounded `recent_changes` list of the state document.

Engines present at startup get one probe before the router reports ready; an engine
that fails it starts ejected ("failed its first probe") and is probed like any other, so
it is readmitted (after a restart hold and a verification) when it comes up. Engines
added by a reload get the same first probe before placement can see them.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import attrs
import trio

from .._errors import EngineFailed
from ..config import Config
from ..fleet import EngineState, Phase, key_refused, model_refused
from ..signals import DecodeGaps
from ._breaker import BreakerEvent, BreakerSettings, BreakerState, Transition
from ._evidence import (
    KeyCheck,
    KeyRefusal,
    LoadSample,
    ModelRefusal,
    Prober,
    ProbeResult,
    VerifyPair,
    VerifyResult,
)
from ._expose import RecoveryMetrics, live_gauges, state_document
from ._health import (
    Verdict,
    VerdictChange,
)
from ._host import RecoveryHost
from ._probe import HttpProber
from ._record import PHASES, EngineRecovery, LegObservation

log = logging.getLogger("narwhal.recovery")

_RECENT_CHANGES = 200
# EngineFailed.code of an SGLang pair's failed KV transfer (serving's _transfer_failed).
_TRANSFER_FAILED = "kv_transfer_failed"
# EngineFailed.code of a leg that could not connect (serving's _engine_request).
_UNREACHABLE = "engine_unreachable"
# After consecutive failed readmission verifications the next waits twice as long as
# the one before, from one probe interval up to this many (`Recovery._verification_failed`),
# unless the engine's role has no other engine in placement (`Recovery._backoff_cut`).
_VERIFY_BACKOFF_MAX = 8


def _resent(result: VerifyResult) -> bool:
    """A verification pair that failed at once is sent again (`Recovery._verify`); one
    that ran out engine.first_token_timeout_s has waited its deadline already."""
    return result.outcome == "failed" and result.deadline_s is None


_R = TypeVar("_R", ProbeResult, VerifyResult)

# (engine, phase, observation) -> the latency the engine's profile predicts for that
# leg's `observed_s`, or None when there is no prediction (no profile, outside the
# measured domain).
Predictor = Callable[[EngineState, str, LegObservation], float | None]


def _attribute(pair: VerifyPair, result: VerifyResult) -> VerifyResult:
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


def _latest_predicted(
    predictor: Predictor, engine: EngineState, observations: list[LegObservation]
) -> tuple[LegObservation, float] | None:
    """The newest observation the profile predicts, with its prediction."""
    for observation in reversed(observations):
        predicted = predictor(engine, observation.phase, observation)
        if predicted is not None and math.isfinite(predicted) and predicted > 0:
            return observation, predicted
    return None


def _refusal(engine: EngineState) -> str | None:
    """Why `engine` would refuse a verification leg whatever its health: Narwhal's key
    (`fleet.key_refused`) or the model (`fleet.model_refused`)."""
    if engine.auth_refused is not None:
        return engine.auth_refused
    if engine.model_missing is not None:
        return f"does not serve the model ({engine.model_missing})"
    return None


def _work(engine: EngineState) -> Phase:
    """The work of `engine`'s role, as placement names it."""
    return "aggregate" if engine.role == "both" else engine.role


class Recovery:
    """Implements `LegObserver`; `run` is a supervisor service (start protocol)."""

    def __init__(
        self,
        ctx: RecoveryHost,
        *,
        prober: Prober | None = None,
        predictor: Predictor | None = None,
    ) -> None:
        self.ctx = ctx
        self.prober: Prober = prober or HttpProber()
        self.predictor = predictor
        # Awaited when a restarted engine has passed its verification, before its hold is
        # lifted: a restart may be an upgrade, and the supervisor then compares the
        # engine's build with its profile's (a stale profile is dropped, not used).
        self.before_release: Callable[[EngineState], Awaitable[None]] | None = None
        self._records: dict[str, EngineRecovery] = {}
        # Records of engines a reload is replacing: the new instance is adopted (and
        # probed) while the old one is still in placement, until `retire` ends it.
        self._replaced: list[EngineRecovery] = []
        self._nursery: trio.Nursery | None = None
        self._verify_seq = 0
        self.recent_changes: deque[dict[str, object]] = deque(maxlen=_RECENT_CHANGES)
        self.metrics = RecoveryMetrics.register(ctx.metrics.registry)
        ctx.metrics.add_live_gauges(self._gauges)
        ctx.fleet.watch(self.placement_changed)

    # ------------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            records = [self._adopt(engine) for engine in self.ctx.fleet]
            async with trio.open_nursery() as first:
                for record in records:
                    first.start_soon(self._first_probe, record, "startup")
            for record in records:
                await nursery.start(self._engine_loop, record)
            task_status.started()

    def _adopt(self, engine: EngineState) -> EngineRecovery:
        record = EngineRecovery(engine, self.ctx.config)
        previous = self._records.get(engine.id)
        if previous is not None and previous.engine is not engine:
            self._replaced.append(previous)
        self._records[engine.id] = record
        return record

    async def admit(self, engine: EngineState) -> None:
        """A reload added `engine`: probe it once and start its loop, before placement
        can see it (the caller adds it to the fleet afterwards)."""
        assert self._nursery is not None, "recovery is not running"
        record = self._adopt(engine)
        await self._first_probe(record, "added by reload")
        await self._nursery.start(self._engine_loop, record)

    def retire(self, engine: EngineState) -> None:
        """A reload removed (or replaced) `engine`: stop probing that instance."""
        record = self._record_for(engine)
        if record is None:
            return
        if self._records.get(engine.id) is record:
            del self._records[engine.id]
        else:
            self._replaced.remove(record)
        if record.scope is not None:
            record.scope.cancel()

    def reconfigure(self, config: Config) -> None:
        settings = BreakerSettings.from_config(config.recovery.breaker)
        for record in self._records.values():
            for breaker in record.breakers.values():
                breaker.configure(settings)
            record.wake.set()

    def record(self, engine_id: str) -> EngineRecovery | None:
        return self._records.get(engine_id)

    def _record_for(self, engine: EngineState) -> EngineRecovery | None:
        record = self._records.get(engine.id)
        if record is not None and record.engine is engine:
            return record
        return next((r for r in self._replaced if r.engine is engine), None)

    # ------------------------------------------------------------------ LegObserver

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
        record = self._record_for(engine)
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
        record.pending.append(
            LegObservation(
                engine_id=engine.id,
                phase=phase,
                duration_s=duration_s,
                at=trio.current_time(),
                prompt_tokens=prompt_tokens,
                prefill_inflight=engine.prefill_inflight,
                contended=contended,
                prefill_tokens_inflight=engine.prefill_tokens_inflight,
                decode_active=engine.decode_active,
                decode_tokens=engine.decode_tokens,
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
            if failure.code == _TRANSFER_FAILED and failure.partner_id is not None:
                self._transfer_failed(engine, failure, failure.partner_id)
            return
        record = self._record_for(engine)
        if record is None:
            return
        self._count(record, phase, failure.message, failure.code)
        if failure.code == _UNREACHABLE:
            self._unreachable(record, phase, failure.message)

    def _unreachable(self, record: EngineRecovery, phase: str, message: str) -> None:
        """A leg could not connect to the engine: out of placement until a health probe
        sent after this answers, and that probe goes out at once.

        An engine that refuses connections fails every leg at once, so it looks idle and
        placement sends it most new requests; until its probes had failed
        recovery.health.failure_threshold times, each of those failed (a streamed one
        with its 200 sent, so not retried: manual 4.3). Out at once, it costs its role
        one probe's round trip when the refusal was a blip, and its requests go to the
        role's other engines meanwhile."""
        engine = record.engine
        record.unreachable_at = trio.current_time()
        record.probe_now = True
        record.wake.set()
        if engine.unreachable is not None:
            return
        engine.unreachable = f"{phase} leg could not connect ({message}); until a probe answers"
        self._changed(engine.id, "reachability", None, "reachable", "unreachable", message)

    def _count(self, record: EngineRecovery, phase: str, message: str, code: str) -> None:
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
                self._breaker_changed(transition)
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
                    self._changed(
                        engine.id,
                        "quarantine",
                        None,
                        "released",
                        "quarantined",
                        f"counted {phase} failure ({code}); excluded from placement for "
                        f"recovery.failure_quarantine_s={quarantine_s}",
                    )
                record.quarantine_active = True
                engine.quarantined_until = until
        record.wake.set()

    def _transfer_failed(
        self, reporter: EngineState, failure: EngineFailed, partner_id: str
    ) -> None:
        """An SGLang pair's KV transfer failed: count it against the engine of the pair
        that fails its transfers while its peers' succeed, if either does.

        The failure itself does not say which engine caused it (`_flow._transfer_failed`),
        so it counts against neither by default. But an engine whose KV path is broken
        while it otherwise answers (a bad NIC, a wedged transfer backend) fails nearly
        every leg it is paired for, and a decode engine failing fast looks idle, so
        placement prefers it: kept in, it would fail most requests for as long as it
        stays broken. So the failure is recorded for both engines and counted against
        one of them when it has failed recovery.breaker.failure_threshold transfers
        within recovery.breaker.window_s, they are at least
        recovery.breaker.failure_ratio of its legs since the first of them (as its
        breaker counts), they were with at least two partners (or the only one available
        of the other role), and another available engine of its role has answered legs
        and failed under half that ratio of its legs within the window: the fleet's
        transfers work, this engine's fail with whomever it is paired. A partner of a
        broken engine fails its transfers with that one engine only (and, since a decode
        engine that fails fast looks idle and draws most pairs, a large share of its
        recent legs), so it is not counted; an engine alone in its role is never
        counted, as before (nothing to compare it with). Once counted, its breaker and
        quarantine judge it as they do any engine's failures."""
        now = trio.current_time()
        window = self.ctx.config.recovery.breaker.window_s
        involved: list[tuple[EngineRecovery, str]] = []
        other = {"prefill": "decode", "decode": "prefill"}
        partner = self.ctx.fleet.get(partner_id)
        for engine, phase, other_id in (
            (reporter, failure.phase, partner_id),
            (partner, other.get(failure.phase, ""), reporter.id),
        ):
            record = None if engine is None else self._record_for(engine)
            if record is not None and phase in PHASES:
                record.legs_seen += 1
                record.transfer_failures.append((now, record.legs_seen, other_id))
                while record.transfer_failures and now - record.transfer_failures[0][0] > window:
                    record.transfer_failures.popleft()
                involved.append((record, phase))
        settings = self.ctx.config.recovery.breaker
        ratio, threshold = settings.failure_ratio, settings.failure_threshold
        for record, phase in involved:
            recent = record.transfer_failures
            if len(recent) < threshold:
                continue
            failed, legs = threshold, record.legs_seen - recent[-threshold][1] + 1
            if failed < ratio * legs:
                continue
            partners = {partner for _, _, partner in list(recent)[-threshold:]}
            if len(partners) < min(2, self._partners_available(record.engine)):
                continue
            peer = self._transferring_peer(record, phase, now, ratio / 2)
            if peer is None:
                continue
            message = (
                f"{failure.message}; counted against {record.engine.id}: {failed} of its "
                f"last {legs} legs failed their KV transfer within "
                f"recovery.breaker.window_s={window}, while {peer}"
            )
            self._count(record, phase, message, _TRANSFER_FAILED)

    def _transfer_share(self, record: EngineRecovery, phase: str, now: float) -> tuple[int, int]:
        """(failed transfers, legs) of a peer's `phase` within the breaker window: its
        answered legs (the breaker's count, while closed) and its failed transfers."""
        breaker = record.breakers[phase]
        counted, total = breaker.legs_in_window(now)
        window = breaker.settings.window_s
        failed = sum(1 for at, _, _ in record.transfer_failures if now - at <= window)
        return failed, failed + int(total - counted)

    def _partners_available(self, subject: EngineState) -> int:
        """How many engines of the other role could pair with `subject`: those in
        service, or out only for failures (a breaker, quarantine), which is how a
        broken partner leaves, and must not make the one it failed with look alone."""
        other = "decode" if subject.role == "prefill" else "prefill"
        count = 0
        for engine in self.ctx.fleet:
            record = self._record_for(engine)
            if (
                record is not None
                and engine.role == other
                and engine.dialect is subject.dialect
                and not (engine.removed or engine.drained or record.hold.active)
                and record.health.verdict is Verdict.UP
                and engine.auth_refused is None
                and engine.model_missing is None
            ):
                count += 1
        return count

    def _transferring_peer(
        self, record: EngineRecovery, phase: str, now: float, below: float
    ) -> str | None:
        """Another available engine of the same role whose transfers mostly work, as
        "ID failed F of its N", or None."""
        subject = record.engine
        for engine in self.ctx.fleet:
            peer = self._record_for(engine)
            if (
                peer is None
                or engine is subject
                or engine.role != subject.role
                or engine.dialect is not subject.dialect
                or engine.unavailable_reason(now, "prefill" if phase == "prefill" else "decode")
                is not None
            ):
                continue
            failed, legs = self._transfer_share(peer, phase, now)
            if legs > failed and failed < below * legs:
                return f"{engine.id} failed {failed} of its {legs}"
        return None

    # ------------------------------------------------------------------ per-engine loop

    async def _first_probe(self, record: EngineRecovery, when: str) -> None:
        result = await self._probe_once(record)
        if result.outcome == "failed":
            change = record.health.eject(f"failed its first probe ({when}): {result.detail}")
            self._health_changed(record, change)

    async def _engine_loop(
        self,
        record: EngineRecovery,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with trio.CancelScope() as scope:
            record.scope = scope
            task_status.started()
            next_probe = trio.current_time() + self.ctx.config.recovery.health.interval_s
            while True:
                now = trio.current_time()
                cut = self._backoff_cut(record, now)
                due = now if record.probe_now else min(next_probe, record.next_due(backoff_cut=cut))
                if due > now:
                    with trio.move_on_at(due):
                        await record.wake.wait()
                    if record.wake.is_set():
                        record.wake = trio.Event()
                now = trio.current_time()
                self._timers(record, now)
                if now >= next_probe or record.probe_now:
                    await self._probe(record)
                    interval = self.ctx.config.recovery.health.interval_s
                    next_probe = trio.current_time() + interval
                await self._verify_due(record)

    def _timers(self, record: EngineRecovery, now: float) -> None:
        for breaker in record.breakers.values():
            due = breaker.due()
            if due is not None and now >= due:
                transition = breaker.handle(BreakerEvent.OPEN_ELAPSED, now)
                if transition is not None:
                    self._breaker_changed(transition)
        engine = record.engine
        if record.quarantine_active and now >= engine.quarantined_until:
            record.quarantine_active = False
            self._changed(
                engine.id, "quarantine", None, "quarantined", "released", "quarantine expired"
            )

    async def _probe_once(self, record: EngineRecovery) -> ProbeResult:
        engine = record.engine
        config = self.ctx.config
        started = trio.current_time()
        result = await self.prober.health(engine, config)
        result = self._excused(engine, "health_probe", started, result)
        record.last_probe = result
        record.last_probe_at = trio.current_time()
        self.metrics.probes.labels(engine.id, result.outcome).inc()
        fields = {
            "event": "probe",
            "engine": engine.id,
            "outcome": result.outcome,
            "detail": result.detail,
        }
        # Every failed probe of an engine in service is a warning; once it is ejected
        # (which is logged with its reason) the repeats go to debug, so an engine that is
        # down for hours does not flood the log. The state shows the last probe anyway.
        level = logging.WARNING if record.health.verdict is Verdict.UP else logging.DEBUG
        if result.outcome == "inconclusive":
            log.log(level, "probe of %s inconclusive: %s", engine.id, result.detail, extra=fields)
            return result
        if result.refusal is not None:
            await self._identity_refused(record, result.refusal, result.detail)
        elif result.identity is not None:
            record.identity_refused = False
            engine.version = dict(result.identity).get("version")
        restarted = record.identity.observe(result.reachable, result.identity)
        if result.outcome == "failed":
            log.log(
                level,
                "probe of %s failed: %s",
                engine.id,
                result.detail,
                extra={**fields, "consecutive": record.health.consecutive_failures + 1},
            )
        else:
            log.debug("probe of %s ok", engine.id, extra=fields)
        if restarted is not None:
            self._start_hold(record, restarted)
        if result.outcome == "failed":
            # It may come back as another instance, launched with another context.
            engine.context_due = True
        elif engine.context_due and result.refusal is None:
            await self._read_context(engine)
        return result

    async def _read_context(self, engine: EngineState) -> None:
        """Learn the context length `engine` refuses requests beyond, which the request
        path checks requests against before any leg. A change is logged: once known, as
        info; when not, a warning, since the request path then leaves the refusal to the
        engine."""
        refusals = engine.model_refusals
        reading = await self.prober.context(engine, self.ctx.config)
        engine.context_due = not reading.final
        if engine.model_missing is not None:
            if reading.listed and engine.model_refusals == refusals:
                engine.model_missing = None
                log.info(
                    "engine %s: its /v1/models lists model %r (engines[].model) now; it "
                    "takes new work again",
                    engine.id,
                    engine.spec.model,
                    extra={"event": "engine_model_served", "engine": engine.id},
                )
            else:
                # Asked again at each good probe until it is listed (`model_refused`).
                engine.context_due = True
        if not engine.set_context(reading.length, reading.detail):
            return
        fields = {
            "event": "engine_context",
            "engine": engine.id,
            "context_length": reading.length,
            "detail": reading.detail,
        }
        if reading.length is not None:
            log.info(
                "engine %s: context length %d (%s)",
                engine.id,
                reading.length,
                reading.detail,
                extra=fields,
            )
        else:
            log.warning(
                "engine %s: context length unknown (%s); requests are not checked "
                "against it, and one past it is refused by the engine itself",
                engine.id,
                reading.detail,
                extra=fields,
            )
        if reading.listed is False and engine.model_missing is None:
            # Not out of placement for it (`fleet.model_refused` says why), but the likely
            # cause of every request it is about to refuse, so said as such.
            log.warning(
                "engine %s does not list model %r (engines[].model) in /v1/models; if it "
                "refuses requests for it (vLLM answers 404), the first refused one takes it "
                "out of placement: check the engine's --served-model-name",
                engine.id,
                engine.spec.model,
                extra={"event": "engine_model_unlisted", "engine": engine.id},
            )

    async def _identity_refused(
        self, record: EngineRecovery, refusal: KeyRefusal, detail: str
    ) -> None:
        """The identity check (GET /version) met 401/403. SGLang guards /version and the
        generation routes alike, so the request path would meet the refusal too, and it
        is judged as a refused leg is (`fleet.key_refused`), unless the key check (the
        dialect's key_check_path, guarded as generation is) accepts the key at once: then
        only /version is guarded more (an admin-only route, a proxy), and the engine stays
        in placement. Otherwise an engine in service would leave placement at every probe
        and come back at every key check. Until /version answers, a restart shows only
        on /metrics or when the engine stops answering; that is logged once."""
        engine = record.engine
        taken = False
        if engine.auth_refused is None:
            check = await self.prober.check_key(engine, self.ctx.config)
            self._key_checked(record, check)
            taken = check.outcome == "accepted"
            if taken:
                detail = f"{detail}, though {check.detail}: only /version refuses the key"
        if not taken:
            key_refused(refusal.engine, refusal.status, refusal.message, self.ctx.config)
        if record.identity_refused:
            return
        record.identity_refused = True
        log.warning(
            "probe of %s: %s; until /version answers, its restarts show only on its "
            "/metrics or when it stops answering",
            engine.id,
            detail,
            extra={"event": "identity_refused", "engine": engine.id, "detail": detail},
        )

    async def _probe(self, record: EngineRecovery) -> None:
        started = trio.current_time()
        record.probe_now = False
        result = await self._probe_once(record)
        health = self.ctx.config.recovery.health
        engine = record.engine
        if engine.unreachable is not None:
            if result.outcome == "ok" and started >= record.unreachable_at:
                engine.unreachable = None
                self._changed(
                    engine.id, "reachability", None, "unreachable", "reachable", result.detail
                )
            elif result.outcome != "failed":
                # Sent before the leg failed, or no answer either way: ask again at once
                # (a failed probe leaves it to the probe interval and the health streak).
                record.probe_now = record.probe_now or started < record.unreachable_at
        if result.outcome == "ok":
            now = trio.current_time()
            ejected = record.health.verdict is Verdict.EJECTED
            alone = self._alone(record) if record.waiting(now) else None
            if now < record.latency_until and alone is None:
                # A slow engine answers its probes and passes a verification pair (both
                # bounded, not timed against the profile) as soon as it is ejected; the
                # residuals that ejected it covered recovery.health.window_s, so it stays
                # out as long before its good probes count. Not when no other engine
                # takes its role's work (then `_latency_cut`).
                record.health.consecutive_failures = 0
            else:
                notes: list[str] = []
                if ejected and now < record.latency_until:
                    notes.append(self._latency_cut(record, now))
                if ejected and now < record.readmit_after:
                    notes.append(self._backoff_note(record, alone))
                change = record.health.probe_ok(health, alone, notes=notes)
                self._health_changed(record, change)
            if alone is not None:
                self._cut_hold(record, now, alone)
            # Not again if this probe's /version refusal was just checked.
            checked = record.last_key_check_at is not None and record.last_key_check_at >= started
            if record.engine.auth_refused is not None and not checked:
                await self._check_key(record)
        elif result.outcome == "failed":
            self._health_changed(record, record.health.probe_failed(health, result.detail))

    def _alone(self, record: EngineRecovery) -> str | None:
        """Why this engine's readmission need not wait, or None: no other engine in
        placement takes its role's work (`_last_of_role`), so every request needing that
        role is refused until it is back, and each probe interval it waits costs the
        whole service. Then one good probe starts its verification, not
        recovery.health.readmit_successes (`HealthTracker.probe_ok`); its good probes
        count within a latency ejection's recovery.health.window_s (`_latency_cut`); and
        a restart hold's verification need not wait for recovery.restart_hold_s
        (`_cut_hold`). The probe streak guards against an engine that answers /health
        while it flaps, the latency window against a slow one coming back at once, and
        the hold gives a restarted one time to warm up: each is worth less than serving
        the role at all. The verification pair that follows (a real prefill and decode)
        still has to pass, and a broken engine fails it and stays out. A drained or
        removed engine would stay out of placement anyway, so it gets no shortcut."""
        engine = record.engine
        if engine.drained or engine.removed:
            return None
        if not self._last_of_role(engine, trio.current_time()):
            return None
        return f"no other engine in placement takes {_work(engine)} work"

    def _latency_cut(self, record: EngineRecovery, now: float) -> str:
        """A latency-ejected engine's good probes count before recovery.health.window_s
        ran out: it was ejected for being slow, not down, and its role has no other
        engine in placement now (its peers left after the ejection, which left one)."""
        left = record.latency_until - now
        record.latency_until = -math.inf
        record.latency_cuts_total += 1
        window = self.ctx.config.recovery.health.window_s
        return (
            f"counted {left:.1f} s before its latency ejection's recovery.health.window_s="
            f"{window} ran out: slow beats refusing all {_work(record.engine)} work"
        )

    def _cut_hold(self, record: EngineRecovery, now: float, alone: str) -> None:
        """A restarted engine whose role has no other engine in placement is verified at
        its first good probe, not after recovery.restart_hold_s: the hold waits for a
        warm-up, and a cold engine serves its role's requests where none would be served
        meanwhile. The hold lasts until the verification passes (and `before_release`
        has compared the engine's build), as any hold does."""
        hold = record.hold
        if not hold.waiting(now):
            return
        reason = (
            f"cut short {hold.verify_after - now:.1f} s before recovery.restart_hold_s="
            f"{self.ctx.config.recovery.restart_hold_s} ran out, at a good probe, "
            f"while {alone}"
        )
        hold.cut(now, reason)
        log.warning(
            "restart hold of %s %s: verifying before placement",
            record.engine.id,
            reason,
            extra={"event": "restart_hold_cut", "engine": record.engine.id, "reason": reason},
        )

    async def _check_key(self, record: EngineRecovery) -> None:
        """Whether an engine that refused Narwhal's API key takes it now. Only an accepted
        key clears the refusal; a refused check does not set one (a refused leg or
        identity check does, through `fleet.key_refused`). Nor does a 200 clear a refusal
        recorded while the check was under way: that refusal may be newer than the 200
        (cleared, the next request would be refused again), so the next check decides."""
        engine = record.engine
        refusals = engine.auth_refusals
        result = await self.prober.check_key(engine, self.ctx.config)
        stale = engine.auth_refusals != refusals
        if result.outcome == "accepted" and stale:
            newer = "sent before the engine's latest refusal, which it does not clear"
            result = attrs.evolve(result, detail=f"{result.detail}; {newer}")
        self._key_checked(record, result)
        fields = {
            "engine": engine.id,
            "outcome": result.outcome,
            "detail": result.detail,
        }
        refused = engine.auth_refused
        if result.outcome != "accepted" or refused is None or stale:
            log.debug(
                "key check of %s: %s: %s",
                engine.id,
                result.outcome,
                result.detail,
                extra={"event": "auth_check", **fields},
            )
            return
        engine.auth_refused = None
        # A verification the refusal held back (a restart hold, a half-open breaker) is
        # due now that the engine takes the key.
        record.next_verify_at = -math.inf
        still = engine.unavailable_reason(trio.current_time())
        log.info(
            "engine %s accepts narwhal's requests again (%s)%s; it was out with auth refused: %s%s",
            engine.id,
            result.detail,
            " and takes new work" if still is None else "",
            refused,
            "" if still is None else f"; still out: {still}",
            extra={"event": "engine_auth_recovered", **fields},
        )

    def _key_checked(self, record: EngineRecovery, result: KeyCheck) -> None:
        record.last_key_check = result
        record.last_key_check_at = trio.current_time()
        self.metrics.key_checks.labels(record.engine.id, result.outcome).inc()

    def observe_metrics(self, engine: EngineState, sample: LoadSample) -> None:
        """The monitor scraped `engine`'s /metrics: a restart may show there."""
        record = self._record_for(engine)
        if record is None:
            return
        restarted = record.identity.observe_metrics(sample.started_at, sample.prompt_tokens)
        if restarted is not None:
            self._start_hold(record, restarted)
            if self._alone(record) is not None:
                # Its hold ends at a good probe (`_cut_hold`): not a probe interval later.
                record.probe_now = True

    def _start_hold(self, record: EngineRecovery, reason: str) -> None:
        now = trio.current_time()
        hold_s = self.ctx.config.recovery.restart_hold_s
        fresh = record.hold.start(now, reason, hold_s)
        record.identity.new_instance()
        record.engine.context_due = True
        record.engine.held_until = math.inf
        # Latency history and pending observations describe the previous instance.
        record.residuals.clear()
        record.pending.clear()
        # A new instance: its speed is not the old one's (verification and residuals judge),
        # and the verifications its predecessor failed say nothing of it.
        record.latency_until = -math.inf
        record.failed_verifications = 0
        record.readmit_after = -math.inf
        self._changed(
            record.engine.id,
            "hold",
            None,
            "released" if fresh else "held",
            "held",
            f"restart detected: {reason}; held for recovery.restart_hold_s={hold_s} "
            "and until verified",
        )
        record.wake.set()

    async def _verify_due(self, record: EngineRecovery) -> None:
        now = trio.current_time()
        if now < record.next_verify_at or record.engine.auth_refused is not None:
            return
        engine = record.engine
        backoff_over = now >= record.readmit_after or self._backoff_cut(record, now)
        due = not record.hold.waiting(now) and backoff_over
        if record.readmission_wanted() and due:
            result = await self._verify(record, "readmission", _work(engine))
            if result.outcome == "ok":
                record.failed_verifications = 0
                self._health_changed(record, record.health.verify_ok(result.detail))
                if record.hold.active and self.before_release is not None:
                    await self.before_release(engine)
                cut = record.hold.cut_reason
                if record.hold.clear():
                    engine.held_until = -math.inf
                    released = "verification passed"
                    if cut is not None:
                        released += f"; the hold was {cut}"
                    self._changed(engine.id, "hold", None, "held", "released", released)
            elif result.outcome == "failed":
                detail = self._verification_failed(record)
                change = record.health.verify_failed(result.detail + detail)
                self._health_changed(record, change)
            # Neither "refused" nor "inconclusive" says anything of the engine's health.
            if result.outcome != "ok":
                record.next_verify_at = trio.current_time() + self._interval()
            return
        if record.breaker_wanted():
            for breaker in record.breakers.values():
                if breaker.state is not BreakerState.HALF_OPEN:
                    continue
                result = await self._verify(record, "breaker", breaker.phase)
                event = {
                    "ok": BreakerEvent.VERIFY_OK,
                    "failed": BreakerEvent.VERIFY_FAILED,
                    "inconclusive": BreakerEvent.VERIFY_INCONCLUSIVE,
                    "refused": BreakerEvent.VERIFY_INCONCLUSIVE,
                }[result.outcome]
                transition = breaker.handle(event, trio.current_time(), result.detail)
                if transition is not None:
                    self._breaker_changed(transition)
                if result.outcome != "ok":
                    record.next_verify_at = trio.current_time() + self._interval()
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
        its role (`_alone`) the wait is one probe interval all the same (`_backoff_cut`),
        and the ejection's reason says that too."""
        record.failed_verifications += 1
        failed = record.failed_verifications
        if failed < 2:
            return ""
        interval = self._interval()
        wait = interval * min(2 ** (failed - 1), _VERIFY_BACKOFF_MAX)
        record.readmit_after = trio.current_time() + wait
        record.readmit_wait_s = wait
        detail = (
            f"; {failed} failed in a row, so the next waits {wait:g} s (doubling from "
            f"recovery.health.interval_s={interval}, up to {_VERIFY_BACKOFF_MAX} of them)"
        )
        alone = self._alone(record)
        if alone is not None:
            detail += f", or {interval:g} s while {alone}"
        return detail

    def _backoff_cut(self, record: EngineRecovery, now: float) -> bool:
        """Whether a readmission verification that `_verification_failed`'s backoff holds
        back may run a probe interval after the last one instead: while no other engine
        in placement takes its role's work (`_alone`), and only then.

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
        return self._alone(record) is not None

    def _backoff_note(self, record: EngineRecovery, alone: str | None) -> str:
        """The readmission backoff, for the reason of a change to verifying."""
        failed = f"{record.failed_verifications} verifications failed in a row"
        if alone is None:
            return f"{failed}, so it waits until {record.readmit_wait_s:g} s after the last"
        return (
            f"{failed}, so it would wait until {record.readmit_wait_s:g} s after the last, "
            f"but waits {self._interval():g} s while its role has no other engine"
        )

    def _excused(self, engine: EngineState, evidence: str, started: float, result: _R) -> _R:
        """`result`, or inconclusive if it failed on a deadline the router's own event
        loop lag explains (`LoopLag.excuse`): probes timing out while a client flood
        starves the loop would otherwise eject healthy engines."""
        if result.outcome != "failed" or result.deadline_s is None:
            return result
        excuse = self.ctx.loop_lag.excuse(result.deadline_s, since=started)
        if excuse is None:
            return result
        self.metrics.excused.labels(engine.id, evidence).inc()
        return attrs.evolve(result, outcome="inconclusive", detail=f"{result.detail}; {excuse}")

    def _interval(self) -> float:
        return self.ctx.config.recovery.health.interval_s

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
        if _resent(result):
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
            result = _attribute(pair, self._excused(subject, "verification", started, result))
        refusal = result.refusal
        if isinstance(refusal, ModelRefusal):
            model_refused(refusal.engine, refusal.message, self.ctx.config)
        elif refusal is not None:
            key_refused(refusal.engine, refusal.status, refusal.message, self.ctx.config)
        duration = trio.current_time() - started
        retried = retry and _resent(result)
        outcome = "retried" if retried else result.outcome
        self.metrics.verifications.labels(subject.id, purpose, outcome).inc()
        verification: dict[str, object] = {
            "request_id": request_id,
            "purpose": purpose,
            "phase": phase,
            "partner": None if partner is None else partner.id,
            "standby": standby,
            "outcome": outcome,
            "detail": result.detail + ("; not counted: sending another pair" if retried else ""),
            "duration_s": round(duration, 6),
        }
        record.last_verification = verification
        log.log(
            logging.INFO if result.outcome == "ok" else logging.WARNING,
            "%s verification of %s (%s): %s: %s",
            purpose,
            subject.id,
            phase,
            outcome,
            verification["detail"],
            extra={"event": "verification", "engine": subject.id, **verification},
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
        counts against it (`_attribute`); a pair that passes readmits the subject alone,
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
                e.prefill_inflight + e.decode_active,
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
        record = self._records.get(engine.id)
        probe = None if record is None else record.last_probe
        return probe is not None and probe.outcome == "ok"

    # ------------------------------------------------------------------ residuals

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
        for record in list(self._records.values()):
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
                if self._last_of_role(record.engine, now):
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
                self._health_changed(record, record.health.eject(reason))
        return residuals

    def _last_of_role(self, engine: EngineState, now: float) -> bool:
        """No other engine in placement takes the work of `engine`'s role now, so without
        it every request that needs that role is refused (`no_engine_available`).

        What placement does with a role (manual 5, `placement.choose`): a prefill or
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

    # ------------------------------------------------------------------ verdicts

    def _health_changed(self, record: EngineRecovery, change: VerdictChange | None) -> None:
        record.engine.ejected = record.health.ejected_reason
        if change is None:
            return
        if change.new is Verdict.EJECTED:
            record.next_verify_at = -math.inf
        self._changed(
            record.engine.id, "health", None, change.old.value, change.new.value, change.reason
        )
        record.wake.set()

    def placement_changed(self, engine: EngineState) -> None:
        """The fleet's watcher (`Fleet.watch`): `engine` changed role, or was drained,
        undrained, removed by a reload, or found refusing Narwhal's API key or not serving
        its model, by narwhalctl, a reload, the role controller or the request path. Any
        of these may leave a role without an engine in placement, or make a waiting
        engine (this one, undrained or given an empty role) the last of its role:
        `_left_placement`.

        Two waiting engines of one role do not wake each other's probes in turn through
        here: their probes and verdicts change none of these, but for a key refusal,
        which is reported once until a key check clears it (`EngineState.auth_refused`;
        a model refusal comes only from the request path), and a verification still waits
        for `next_verify_at`."""
        self._left_placement()

    def _left_placement(self, left: str | None = None) -> None:
        """An engine left placement (or one phase of it), or changed what it takes: if
        that leaves a waiting engine the last to take its role's work, it is probed at
        once, and its readmission goes ahead at that probe (`_alone`), not at its next
        probe interval. Waiting: ejected, or held for recovery.restart_hold_s, with a
        good last probe; an engine verifying while a failed verification's backoff holds
        it back is woken for its verification (`_backoff_cut`).

        Recovery's own changes (`_changed`) count only from in service, and not for the
        engine that `left` (its own verdict, or its probe, decides for itself): one back
        to ejected after a failed verification takes nothing out of placement, and two
        waiting engines of one role must not wake each other's probes in turn. Every
        other change comes through `placement_changed`."""
        now = trio.current_time()
        for record in self._records.values():
            if record.engine.id == left or record.probe_now:
                continue
            if record.readmission_wanted() and self._backoff_cut(record, now):
                record.wake.set()
                continue
            probe = record.last_probe
            if probe is None or probe.outcome != "ok":
                continue
            if record.waiting(now) and self._alone(record) is not None:
                record.probe_now = True
                record.wake.set()

    def _breaker_changed(self, transition: Transition) -> None:
        self._changed(
            transition.engine,
            "breaker",
            transition.phase,
            transition.old.value,
            transition.new.value,
            transition.reason,
        )
        record = self._records.get(transition.engine)
        if record is not None:
            if transition.new is BreakerState.HALF_OPEN:
                record.next_verify_at = -math.inf
            record.wake.set()

    def _changed(
        self, engine_id: str, kind: str, phase: str | None, old: str, new: str, reason: str
    ) -> None:
        self.metrics.transitions.labels(engine_id, kind, phase or "", old, new).inc()
        entry: dict[str, object] = {
            "at": round(trio.current_time() - self.ctx.started_at, 6),
            "engine": engine_id,
            "kind": kind,
            "phase": phase,
            "from": old,
            "to": new,
            "reason": reason,
        }
        self.recent_changes.append(entry)
        worse = new in ("open", "ejected", "held", "quarantined", "unreachable")
        if worse and old in ("up", "closed", "released", "reachable"):
            self._left_placement(left=engine_id)
        where = f"{engine_id}/{phase}" if phase else engine_id
        log.log(
            logging.WARNING if worse else logging.INFO,
            "%s %s: %s -> %s: %s",
            kind,
            where,
            old,
            new,
            reason,
            extra={"event": "verdict", **{k: v for k, v in entry.items() if k != "at"}},
        )

    # ------------------------------------------------------------------ introspection

    def state(self) -> dict[str, object]:
        now = trio.current_time()
        return state_document(self._records, self.recent_changes, self._backoff_cut, now)

    def _gauges(self) -> Iterator[tuple[str, str, list[str], list[tuple[list[str], float]]]]:
        return live_gauges(list(self._records.values()), trio.current_time())
