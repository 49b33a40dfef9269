"""Recovery's bookkeeping for one engine instance.

Owns
  `EngineRecovery`: one engine's breakers (installed as its `phase_gates`), health
  verdict, restart hold, identity, latency residuals and pending leg observations
  (`LegObservation`), readmission backoff, SGLang transfer failures, last probe, key
  check and verification, and the wake event and cancel scope of its probe loop.

Invariants
  One record per `EngineState` instance: a reload that replaces an engine gets a new
  record. What is due, wanted or waiting is read from here (`next_due`,
  `readmission_wanted`, `breaker_wanted`, `waiting`), by the loop and by whoever wakes it.
"""

from __future__ import annotations

import math
from collections import deque

import attrs
import trio

from ..config import Config
from ..fleet import EngineState
from ..signals import DecodeGaps
from ._breaker import Breaker, BreakerSettings, BreakerState
from ._evidence import KeyCheck, ProbeResult
from ._expose import RecoveryEngine, VerificationReport, engine_snapshot
from ._health import HealthTracker, IdentityTracker, ResidualWindow, RestartHold, Verdict

PHASES = ("prefill", "decode")
# Successful legs kept per engine between two monitor passes. The profile predicts only
# some legs (uncontended prefill legs inside its domain, decode legs with enough clean
# token gaps at a load inside its domain), and on a busy engine most legs
# are not of that kind; keeping only the last one would let a busy, slow engine's
# residuals go missing most passes, while a few dozen cover a pass at any load the
# fleet can serve.
_PENDING_LEGS = 64
_TRANSFER_FAILURES = 1024


@attrs.frozen
class LegObservation:
    """One successful engine leg and the router-side load on the engine as it ended."""

    engine_id: str
    phase: str
    duration_s: float
    at: float
    prompt_tokens: int
    prefill_inflight: int
    prefill_tokens_inflight: int
    decode_active: int
    decode_tokens: int
    contended: bool = False  # another leg shared the engine during this one
    gaps: DecodeGaps | None = None  # a streamed leg's token intervals

    @property
    def observed_s(self) -> float:
        """What a residual compares with the prediction: a decode leg's median token
        interval (its duration is its output's length), any other leg's duration."""
        if self.phase == "decode" and self.gaps is not None:
            return self.gaps.median_s
        return self.duration_s


class EngineRecovery:
    """Recovery's bookkeeping for one `EngineState` instance."""

    def __init__(self, engine: EngineState, config: Config) -> None:
        self.engine = engine
        settings = BreakerSettings.from_config(config.recovery.breaker)
        self.breakers = {phase: Breaker(engine.id, phase, settings) for phase in PHASES}
        self.health = HealthTracker()
        self.hold = RestartHold()
        self.identity = IdentityTracker()
        self.residuals = ResidualWindow()
        self.pending: deque[LegObservation] = deque(maxlen=_PENDING_LEGS)
        # Ejected for latency: good probes do not count toward readmission before this,
        # unless no other engine in placement takes its role's work.
        self.latency_until = -math.inf
        self.latency_cuts_total = 0
        # Readmission verifications of this instance that failed in a row, and when the
        # next may run (`Verification.verify_due`).
        self.failed_verifications = 0
        self.readmit_after = -math.inf
        self.readmit_wait_s = 0.0
        # When this engine's SGLang pairs failed their KV transfer, within the breaker
        # window (`TransferAttribution`).
        # (time, leg number, partner) of each; legs are numbered by answered legs and these.
        self.transfer_failures: deque[tuple[float, int, str]] = deque(maxlen=_TRANSFER_FAILURES)
        self.legs_seen = 0
        self.wake = trio.Event()
        self.scope: trio.CancelScope | None = None
        self.next_verify_at = -math.inf
        self.quarantine_active = False
        # When a leg last failed to connect (`LegAccounting._unreachable`); only a probe sent
        # after it may return the engine to placement.
        self.unreachable_at = -math.inf
        self.probe_now = False
        self.last_probe: ProbeResult | None = None
        self.last_probe_at: float | None = None
        # The identity check's refusal was logged; until /version answers again.
        self.identity_refused = False
        self.last_key_check: KeyCheck | None = None
        self.last_key_check_at: float | None = None
        self.last_verification: VerificationReport | None = None
        engine.phase_gates.update(self.breakers)

    def readmission_wanted(self) -> bool:
        verdict = self.health.verdict
        return verdict is Verdict.VERIFYING or (self.hold.active and verdict is Verdict.UP)

    def waiting(self, now: float) -> bool:
        """Out of placement and waiting to be verified for readmission: ejected, or held
        for the rest of recovery.restart_hold_s (what `Verdicts.alone` can cut short)."""
        return self.health.verdict is Verdict.EJECTED or self.hold.waiting(now)

    def breaker_wanted(self) -> bool:
        # While ejected or held, the readmission verification comes first.
        return (
            self.health.verdict is Verdict.UP
            and not self.hold.active
            and any(b.state is BreakerState.HALF_OPEN for b in self.breakers.values())
        )

    def next_due(self, *, backoff_cut: bool = False) -> float:
        """When the engine's loop has something to do next; with `backoff_cut`, a
        readmission verification does not wait for `readmit_after`
        (`Verdicts.backoff_cut`)."""
        times = [due for b in self.breakers.values() if (due := b.due()) is not None]
        if self.quarantine_active:
            times.append(self.engine.quarantined_until)
        # While the engine refuses Narwhal's key its legs would be refused too: the key
        # check (after each good probe) comes first.
        if self.engine.auth_refused is None:
            if self.readmission_wanted():
                hold_due = self.hold.verify_after if self.hold.active else -math.inf
                backoff = -math.inf if backoff_cut else self.readmit_after
                times.append(max(self.next_verify_at, hold_due, backoff))
            if self.breaker_wanted():
                times.append(self.next_verify_at)
        return min(times, default=math.inf)

    def snapshot(self, now: float, *, backoff_cut: bool = False) -> RecoveryEngine:
        return engine_snapshot(self, now, backoff_cut=backoff_cut)
