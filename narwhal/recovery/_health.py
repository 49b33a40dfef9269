"""Per-engine health verdicts, latency residuals and restart holds. Pure: no I/O, no clock.

Owns
  `HealthTracker` (the health verdict: up, ejected, verifying), `ResidualWindow` (latency
  residuals against the profile), `RestartHold` and `IdentityTracker` (restarts), and
  the frozen snapshot of each that the state document shows.

Invariants
  Every method takes the time and the settings it needs; none reads a clock or sends a
  request, so each can be tested without sockets. A change of verdict is returned
  (`VerdictChange`), never logged here: the caller reports it (`Verdicts.changed`).
  A probe that could not run because the control pool was exhausted is no evidence either
  way and leaves the verdict and the streaks unchanged (docs/design.md#deadlines).
"""

from __future__ import annotations

import enum
import statistics
from collections import deque
from collections.abc import Iterable, Mapping

import attrs

from ..config import Health as HealthConfig

Identity = tuple[tuple[str, str], ...]


class Verdict(enum.Enum):
    UP = "up"
    EJECTED = "ejected"
    VERIFYING = "verifying"


@attrs.frozen
class VerdictChange:
    old: Verdict
    new: Verdict
    reason: str


@attrs.frozen(kw_only=True)
class HealthSnapshot:
    verdict: Verdict
    reason: str | None
    consecutive_failures: int
    good_probes: int
    ejected_total: int
    readmit_shortcuts_total: int


class HealthTracker:
    """One engine's health verdict.

    up         the engine may take work (other flags permitting).
    ejected    recovery.health.failure_threshold consecutive failed /health probes, a
               failed first probe at startup, a failed readmission verification, or a
               latency-residual ejection. Nothing is placed on it; probing continues, so an
               engine that is down at startup is kept and readmitted when it comes up
               (a peer router drops such an engine for good).
    verifying  recovery.health.readmit_successes consecutive good probes after an
               ejection, or one when no other engine in placement takes the work of the
               engine's role (`Verdicts.last_of_role`): every request that needs that role
               is refused meanwhile, so each further probe interval is an outage of the
               whole service. Readmission waits for one verification leg pair to pass
               either way; that pair, not the probe streak, is what shows the engine serves.
               An engine ejected for latency waits recovery.health.window_s before its good
               probes count, unless its role has no other engine in placement.
    """

    def __init__(self) -> None:
        self.verdict = Verdict.UP
        self.reason: str | None = None
        self.consecutive_failures = 0
        self.good_probes = 0
        self.ejected_total = 0
        # Readmissions verified after fewer than readmit_successes good probes because
        # the engine's role had no other engine in placement.
        self.shortcuts_total = 0

    def _to(self, new: Verdict, reason: str) -> VerdictChange | None:
        old = self.verdict
        self.reason = reason if new is not Verdict.UP else None
        if new is old:
            return None
        self.verdict = new
        if new is Verdict.EJECTED:
            self.ejected_total += 1
            self.good_probes = 0
        return VerdictChange(old, new, reason)

    @property
    def ejected_reason(self) -> str | None:
        """What `EngineState.ejected` shows: set while ejected or being verified."""
        if self.verdict is Verdict.UP:
            return None
        return self.reason

    def probe_ok(
        self, config: HealthConfig, alone: str | None = None, *, notes: Iterable[str] = ()
    ) -> VerdictChange | None:
        """A good probe. `alone` says why no other engine in placement takes the work of
        this engine's role, if none does: then one good probe starts the verification.
        `notes` go into the reason of the change to verifying, if there is one."""
        self.consecutive_failures = 0
        if self.verdict is not Verdict.EJECTED:
            return None
        self.good_probes += 1
        needed = config.readmit_successes
        extra = "".join(f"; {note}" for note in notes)
        if self.good_probes >= needed:
            return self._to(
                Verdict.VERIFYING,
                f"{self.good_probes} good probe{'' if self.good_probes == 1 else 's'} "
                f"(recovery.health.readmit_successes="
                f"{needed}){extra}; verifying before readmission",
            )
        if alone is None:
            return None
        self.shortcuts_total += 1
        return self._to(
            Verdict.VERIFYING,
            f"{self.good_probes} good probe of recovery.health.readmit_successes={needed}, "
            f"enough while {alone}{extra}; verifying before readmission",
        )

    def probe_failed(self, config: HealthConfig, detail: str) -> VerdictChange | None:
        self.consecutive_failures += 1
        self.good_probes = 0
        if self.verdict is Verdict.VERIFYING:
            return self._to(Verdict.EJECTED, f"probe failed while verifying: {detail}")
        if self.verdict is Verdict.UP and self.consecutive_failures >= config.failure_threshold:
            return self._to(
                Verdict.EJECTED,
                f"{self.consecutive_failures} consecutive failed health probes "
                f"(recovery.health.failure_threshold={config.failure_threshold}): {detail}",
            )
        return None

    def eject(self, reason: str) -> VerdictChange | None:
        """Ejection that needs no streak: down at startup, latency residuals."""
        self.good_probes = 0
        return self._to(Verdict.EJECTED, reason)

    def verify_ok(self, detail: str) -> VerdictChange | None:
        return self._to(Verdict.UP, f"verification passed: {detail}")

    def verify_failed(self, detail: str) -> VerdictChange | None:
        self.good_probes = 0
        if self.verdict is Verdict.EJECTED:
            self.reason = f"verification failed: {detail}"
            return None
        return self._to(Verdict.EJECTED, f"verification failed: {detail}")

    def snapshot(self) -> HealthSnapshot:
        return HealthSnapshot(
            verdict=self.verdict,
            reason=self.reason,
            consecutive_failures=self.consecutive_failures,
            good_probes=self.good_probes,
            ejected_total=self.ejected_total,
            readmit_shortcuts_total=self.shortcuts_total,
        )


# However the window and interval are configured, a window never holds more than this.
_MAX_RESIDUALS = 4096


@attrs.frozen(kw_only=True)
class ResidualSnapshot:
    samples: int
    median_ratio: float | None


class ResidualWindow:
    """One engine's latency residuals within recovery.health.window_s.

    The ratio of an observed leg latency to the latency the engine's profile predicts for
    it: a prefill leg's duration, a decode leg's median token interval (against the
    profile's interval at the engine's load during the stream). Each monitor pass
    contributes at most one per engine (docs/design.md#role-control), so a window of
    recovery.health.window_s holds at most window_s / controller.monitor_interval_s of them; once it
    holds recovery.health.min_samples, a median ratio at or above recovery.health.eject_ratio ejects
    the engine. The median, not the mean: one slow leg behind a long prompt must not eject a healthy
    engine.
    """

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=_MAX_RESIDUALS)

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, now: float, ratio: float, window_s: float) -> None:
        self._samples.append((now, ratio))
        self._trim(now, window_s)

    def _trim(self, now: float, window_s: float) -> None:
        while self._samples and now - self._samples[0][0] > window_s:
            self._samples.popleft()

    def clear(self) -> None:
        self._samples.clear()

    def median(self) -> float | None:
        if not self._samples:
            return None
        return statistics.median(ratio for _, ratio in self._samples)

    def verdict(self, now: float, config: HealthConfig) -> str | None:
        """The ejection reason when the window says eject, else None."""
        self._trim(now, config.window_s)
        if len(self._samples) < config.min_samples:
            return None
        median = self.median()
        assert median is not None
        if median < config.eject_ratio:
            return None
        return (
            f"latency: median observed/predicted ratio {median:.2f} over "
            f"{len(self._samples)} residuals in recovery.health.window_s={config.window_s} "
            f">= recovery.health.eject_ratio={config.eject_ratio}"
        )

    def snapshot(self) -> ResidualSnapshot:
        median = self.median()
        return ResidualSnapshot(
            samples=len(self._samples),
            median_ratio=None if median is None else round(median, 4),
        )


@attrs.frozen(kw_only=True)
class HoldSnapshot:
    active: bool
    reason: str | None
    verify_in_s: float | None  # while held: until the verification may run
    cut_short: str | None  # why the wait for recovery.restart_hold_s was cut short
    holds_total: int
    cut_short_total: int


class RestartHold:
    """Set on a detected restart (`IdentityTracker`); lifted only by a passing verification.

    A restarted engine's KV and any handoff in flight are gone and its warm-up state is
    unknown. It is held out of placement for recovery.restart_hold_s and then until a
    verification pair passes. While no other engine in placement takes its role's work,
    the wait ends at its first good probe (`cut`): a cold engine beats refusing all of
    that work.
    """

    def __init__(self) -> None:
        self.active = False
        self.reason: str | None = None
        self.since = 0.0
        self.verify_after = 0.0
        self.holds_total = 0
        # Why the wait for recovery.restart_hold_s was cut short, while it is.
        self.cut_reason: str | None = None
        self.cuts_total = 0

    def start(self, now: float, reason: str, hold_s: float) -> bool:
        """Returns False when a hold was already in force (the clock restarts anyway:
        a second restart during the hold resets the warm-up it was waiting for)."""
        fresh = not self.active
        self.active = True
        self.reason = reason
        self.since = now
        self.verify_after = now + hold_s
        self.cut_reason = None
        if fresh:
            self.holds_total += 1
        return fresh

    def waiting(self, now: float) -> bool:
        """Held, and the verification waits for recovery.restart_hold_s still."""
        return self.active and now < self.verify_after

    def cut(self, now: float, reason: str) -> None:
        """The verification need not wait for the rest of recovery.restart_hold_s; the
        hold itself lasts until one passes."""
        assert self.waiting(now), "no hold is waiting to be cut"
        self.verify_after = now
        self.cut_reason = reason
        self.cuts_total += 1

    def clear(self) -> bool:
        was = self.active
        self.active = False
        self.reason = None
        self.cut_reason = None
        return was

    def snapshot(self, now: float) -> HoldSnapshot:
        return HoldSnapshot(
            active=self.active,
            reason=self.reason,
            verify_in_s=(round(max(0.0, self.verify_after - now), 3) if self.active else None),
            cut_short=self.cut_reason,
            holds_total=self.holds_total,
            cut_short_total=self.cuts_total,
        )


@attrs.frozen(kw_only=True)
class IdentitySnapshot:
    identity: Mapping[str, str] | None  # what /version said
    unreachable: bool
    process_start_time_seconds: float | None
    prompt_tokens_total: float | None


class IdentityTracker:
    """Notices restarts from /version identity changes, unreachable periods, and
    /metrics process start times and counter resets.

    An engine has restarted when any of these shows it: GET /version reports another
    instance id, build or version; it answers again after being unreachable, unless its
    /version names the instance id it named before (unreachable, not restarted); its
    /metrics reports another `process_start_time_seconds`; its prompt-token counter
    (`vllm:prompt_tokens_total`, `sglang:prompt_tokens_total`) went backwards; or its load
    gauges went missing after it had published them (SGLang).

    Stock vLLM and SGLang report only their version on /version, so a restart quicker than
    the health probe interval leaves no trace there; the monitor reads /metrics every pass.
    vLLM with one API server (its default) serves prometheus_client's process collector,
    whose `process_start_time_seconds` is fixed for the life of a process. vLLM with
    several API servers and SGLang use prometheus multiprocess mode, which has no process
    metrics, but a counter restarts from zero with its process (Prometheus reads a decrease
    as a reset the same way): an engine that had prefilled anything is seen restarting by
    its first scrape, which comes before it has prefilled as much again. SGLang 0.5.23's
    counters are labelled, so a fresh process has no series until it serves a request; but
    it has no load gauges either until its scheduler first reports, and a process that has
    published them keeps them: gauges gone missing show a restart before any request.
    """

    def __init__(self) -> None:
        self.identity: Identity | None = None
        self.unreachable = False
        self.start_time: float | None = None
        self.prompt_tokens: dict[str, float] | None = None
        # The engine's /metrics had its load gauges (an SGLang server publishes them once
        # its scheduler has reported, for the life of its process).
        self.gauges_published = False
        # A restart was detected: the next identity seen is the new instance's baseline.
        self._identity_stale = False

    def observe(self, reachable: bool | None, identity: Identity | None) -> str | None:
        """Record one probe; returns why the engine is considered restarted, or None.

        `reachable` is None when the probe cannot tell (a timeout), which changes nothing.
        """
        reason: str | None = None
        if reachable is False:
            self.unreachable = True
            return None
        if reachable and self.unreachable:
            self.unreachable = False
            if not self._same_instance(identity):
                reason = "answered again after being unreachable"
        if identity is not None:
            stale, self._identity_stale = self._identity_stale, False
            if self.identity is not None and identity != self.identity and not stale:
                changed = _describe_change(self.identity, identity)
                reason = f"identity changed ({changed})" if reason is None else reason
            self.identity = identity
        return reason

    def _same_instance(self, identity: Identity | None) -> bool:
        """`identity` names the process instance that answered before: it went unreachable
        (its listener closed, its connections dropped) without restarting, so it keeps its
        KV and warm-up state, and a restart hold would only keep a sound engine out. Only
        an instance id tells; a version or build is the same across a restart."""
        if identity is None or self.identity is None or self._identity_stale:
            return False
        instance = dict(identity).get("instance_id")
        return instance is not None and instance == dict(self.identity).get("instance_id")

    def observe_metrics(
        self,
        start_time: float | None,
        prompt_tokens: Iterable[tuple[str, float]] | None,
        gauges_pending: bool = False,
    ) -> str | None:
        """Record one /metrics scrape: `process_start_time_seconds` and the prompt-token
        counter per series (label text, value), each None when the engine does not report
        it, and whether its load gauges are not published yet (a fresh SGLang server's);
        returns why the engine is considered restarted, or None.

        Only a series seen in both scrapes is compared, so a rank whose series appears or
        disappears is not a reset."""
        reason: str | None = None
        if gauges_pending and self.gauges_published:
            reason = (
                "its load gauges went missing (a fresh process publishes them only once its "
                "scheduler has reported)"
            )
        self.gauges_published = not gauges_pending
        if start_time is not None:
            known, self.start_time = self.start_time, start_time
            if known is not None and start_time != known:
                reason = f"process_start_time_seconds changed ({known!r} -> {start_time!r})"
        if prompt_tokens is not None:
            before, self.prompt_tokens = self.prompt_tokens, dict(prompt_tokens)
            for series, value in self.prompt_tokens.items():
                old = (before or {}).get(series)
                if old is not None and value < old and reason is None:
                    reason = f"prompt_tokens_total{series} went backwards ({old:g} -> {value:g})"
        return reason

    def new_instance(self) -> None:
        """A restart was detected (by any signal): what the other signals remember
        describes the old instance, so the next thing each sees is the new instance's
        baseline, not a second restart."""
        self.unreachable = False
        self.start_time = None
        self.prompt_tokens = None
        self.gauges_published = False
        self._identity_stale = True

    def snapshot(self) -> IdentitySnapshot:
        return IdentitySnapshot(
            identity=dict(self.identity) if self.identity is not None else None,
            unreachable=self.unreachable,
            process_start_time_seconds=self.start_time,
            prompt_tokens_total=None
            if self.prompt_tokens is None
            else sum(self.prompt_tokens.values()),
        )


def _describe_change(old: Identity, new: Identity) -> str:
    before, after = dict(old), dict(new)
    parts = [
        f"{key} {before.get(key)!s} -> {after.get(key)!s}"
        for key in sorted(set(before) | set(after))
        if before.get(key) != after.get(key)
    ]
    return ", ".join(parts)
