"""The probe loop: one task per engine that probes it and runs what falls due.

Owns
  `ProbeLoop`: every recovery.health.interval_s, GET /health (and /version for the
  engine's identity) on the control pool; the key check after each good probe while the
  engine refuses Narwhal's API key; the context-length reading; restart holds (from
  /version here, from /metrics through `observe_metrics`); breaker and quarantine
  timers; and, after each wake, the verification that is due (`Verification`).

Invariants
  The loop wakes at the instant something is due (an open breaker's open_s, a
  quarantine's end, a restart hold's recovery.restart_hold_s, a readmission), at once on
  a counted failure, and when another engine leaving placement leaves this one, waiting
  for readmission, the last to take its role's work (`Verdicts.left_placement`).
  A replica of a cluster starts each loop `index / count` of an interval later than the
  first member would (its `Share`), so replicas restarted together spread their probes.
  Engines present at startup get one probe before the router reports ready, and
  engines a reload adds get one before placement can see them (`first_probe`): one that
  fails it starts ejected and is probed like any other, so it is readmitted (after a
  restart hold and a verification) when it comes up.

Errors
  A /version refused for Narwhal's API key (SGLang guards it) marks the engine
  auth-refused unless a key check at once accepts the key (then only /version is guarded
  more); it is logged once until /version answers again. While the engine refuses the
  key (`EngineState.auth_refused`, set on a 401/403 by the request path or by recovery's
  own requests), each good probe is followed by a key check: GET /v1/models, which the
  engine guards with its --api-key where it leaves its health route open. HTTP 200
  clears the refusal and the engine takes work again (one `engine_auth_recovered` log
  line); a refusal keeps it out, and any other failure too, the health probes judging
  the engine itself.
"""

from __future__ import annotations

import logging
import math

import attrs
import trio

from ..fleet import EngineState, key_refused
from ._breaker import BreakerEvent
from ._evidence import KeyCheck, KeyRefusal, LoadSample, Prober, ProbeResult
from ._health import Verdict
from ._record import EngineRecovery
from ._verdicts import Verdicts, work
from ._verify import Verification

log = logging.getLogger("narwhal.recovery")


class ProbeLoop:
    """Each engine's probe loop (`run`) and what its probes find out."""

    def __init__(self, verdicts: Verdicts, prober: Prober, verification: Verification) -> None:
        self.verdicts = verdicts
        self.ctx = verdicts.ctx
        self.metrics = verdicts.metrics
        self.prober = prober
        self.verification = verification

    async def first_probe(self, record: EngineRecovery, when: str) -> None:
        result = await self._probe_once(record)
        if result.outcome == "failed":
            change = record.health.eject(f"failed its first probe ({when}): {result.detail}")
            self.verdicts.health_changed(record, change)

    async def run(
        self,
        record: EngineRecovery,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with trio.CancelScope() as scope:
            record.scope = scope
            task_status.started()
            # Replicas of one cluster restarted together would probe each engine at the
            # same instants for good: each starts its loops a fraction of an interval
            # apart, by its place among the members.
            share = self.ctx.fleet.share
            interval = self.ctx.config.recovery.health.interval_s
            next_probe = trio.current_time() + interval * (1 + share.index / share.count)
            while True:
                now = trio.current_time()
                cut = self.verdicts.backoff_cut(record, now)
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
                await self.verification.verify_due(record)

    def _timers(self, record: EngineRecovery, now: float) -> None:
        for breaker in record.breakers.values():
            due = breaker.due()
            if due is not None and now >= due:
                transition = breaker.handle(BreakerEvent.OPEN_ELAPSED, now)
                if transition is not None:
                    self.verdicts.breaker_changed(transition)
        engine = record.engine
        if record.quarantine_active and now >= engine.quarantined_until:
            record.quarantine_active = False
            self.verdicts.changed(
                engine.id, "quarantine", None, "quarantined", "released", "quarantine expired"
            )

    async def _probe_once(self, record: EngineRecovery) -> ProbeResult:
        engine = record.engine
        config = self.ctx.config
        started = trio.current_time()
        result = await self.prober.health(engine, config)
        result = self.verdicts.excused(engine, "health_probe", started, result)
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
        elif result.outcome == "ok":
            # /version answered without refusing the key, if with no identity (SGLang
            # 0.5.23 has no /version: 404).
            record.identity_refused = False
            if result.identity is not None:
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
                engine.recovery_model_listed()
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
                engine.recovery_reachable()
                self.verdicts.changed(
                    engine.id, "reachability", None, "unreachable", "reachable", result.detail
                )
            elif result.outcome != "failed":
                # Sent before the leg failed, or no answer either way: ask again at once
                # (a failed probe leaves it to the probe interval and the health streak).
                record.probe_now = record.probe_now or started < record.unreachable_at
        if result.outcome == "ok":
            now = trio.current_time()
            ejected = record.health.verdict is Verdict.EJECTED
            alone = self.verdicts.alone(record) if record.waiting(now) else None
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
                    notes.append(self.verification.backoff_note(record, alone))
                change = record.health.probe_ok(health, alone, notes=notes)
                self.verdicts.health_changed(record, change)
            if alone is not None:
                self._cut_hold(record, now, alone)
            # Not again if this probe's /version refusal was just checked.
            checked = record.last_key_check_at is not None and record.last_key_check_at >= started
            if record.engine.auth_refused is not None and not checked:
                await self._check_key(record)
        elif result.outcome == "failed":
            self.verdicts.health_changed(record, record.health.probe_failed(health, result.detail))

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
            f"{window} ran out: slow beats refusing all {work(record.engine)} work"
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
        engine.recovery_key_accepted()
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
        record = self.verdicts.record_for(engine)
        if record is None:
            return
        restarted = record.identity.observe_metrics(
            sample.started_at, sample.prompt_tokens, sample.gauges_pending
        )
        if restarted is not None:
            self._start_hold(record, restarted)
            if self.verdicts.alone(record) is not None:
                # Its hold ends at a good probe (`_cut_hold`): not a probe interval later.
                record.probe_now = True

    def _start_hold(self, record: EngineRecovery, reason: str) -> None:
        now = trio.current_time()
        hold_s = self.ctx.config.recovery.restart_hold_s
        fresh = record.hold.start(now, reason, hold_s)
        record.identity.new_instance()
        record.engine.context_due = True
        record.engine.recovery_hold()
        record.engine.recovery_new_instance()
        # Latency history and pending observations describe the previous instance.
        record.residuals.clear()
        record.pending.clear()
        # A new instance: its speed is not the old one's (verification and residuals judge),
        # and the verifications its predecessor failed say nothing of it.
        record.latency_until = -math.inf
        record.failed_verifications = 0
        record.readmit_after = -math.inf
        self.verdicts.changed(
            record.engine.id,
            "hold",
            None,
            "released" if fresh else "held",
            "held",
            f"restart detected: {reason}; held for recovery.restart_hold_s={hold_s} "
            "and until verified",
        )
        record.wake.set()
