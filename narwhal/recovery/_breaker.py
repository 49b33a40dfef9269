"""Circuit breakers, one per engine per phase: an explicit, pure state machine.

Owns
  `Breaker` (one phase, prefill or decode, of one engine), the `TRANSITIONS` table every
  path through it is a row of, `RECORDED`, where a failure is remembered, and
  `BreakerSnapshot`, what the state document shows of a breaker.

Invariants
  A breaker never sees a socket or a clock: recovery feeds it events with the current
  time and acts on the transitions it returns, so it is tested without I/O.
  Only failures whose `EngineFailed.counts_against_engine` is true reach it: transport
  failures, engine 5xx, timeouts, broken streams. Client errors (4xx caused by the
  request) and 429 (the engine is busy, not broken) never do. A failure is charged to
  the phase of the leg that failed, so a prefill failure never touches the decode
  breaker of the pair's decode engine (a peer router opens both); an aggregate leg ran
  both phases on one engine and is charged to both of its breakers.
  Counting is by window, not by streak: the breaker opens when, within
  recovery.breaker.window_s, at least recovery.breaker.failure_threshold counted
  failures happened AND they are at least recovery.breaker.failure_ratio of the phase's
  legs there. The ratio matters at volume: an engine serving a hundred legs a second
  with one fault in a thousand reaches any count in a window, and must stay in service.
  Failure times are kept only up to the threshold, and legs are counted in ten buckets
  per window, so memory stays bounded under any rate.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Mapping

import attrs

from ..config import Breaker as BreakerConfig


class BreakerState(enum.Enum):
    """closed: placement may use the phase. open: the phase takes no new work; resident
    requests finish where they are. half_open: recovery.breaker.open_s has passed and a
    functional verification runs on the control pool (a complete prefill leg and a
    complete decode leg, each bounded by engine.first_token_timeout_s); still no new
    work."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@attrs.frozen(kw_only=True)
class BreakerSnapshot:
    """One breaker in the state document (`recovery.engines.<id>.breakers.<phase>`)."""

    state: BreakerState
    failures_in_window: int
    failure_threshold: int
    reopens_in_s: float | None  # while open
    opened_total: int
    reason: str | None  # of the last transition


class BreakerEvent(enum.Enum):
    FAILURE = "failure"  # a counted leg failure on the request path
    SUCCESS = "success"  # a leg of that phase finished well (only counted, never a move)
    OPEN_ELAPSED = "open_elapsed"  # the driver's timer: opened_at + open_s reached
    VERIFY_OK = "verify_ok"
    VERIFY_FAILED = "verify_failed"
    # No evidence either way, so the verdict stays as it was: the control pool had no free
    # connection (docs/design.md#deadlines), a standby partner may have failed the pair, or a leg
    # was refused for Narwhal's API key (the engine is not faulty; the key check comes first).
    VERIFY_INCONCLUSIVE = "verify_inconclusive"


@attrs.frozen
class BreakerSettings:
    failure_threshold: int
    window_s: float
    open_s: float
    failure_ratio: float = 0.0

    @classmethod
    def from_config(cls, config: BreakerConfig) -> BreakerSettings:
        return cls(config.failure_threshold, config.window_s, config.open_s, config.failure_ratio)


@attrs.frozen
class Transition:
    """A verdict change, for the log line, the metric and the state document."""

    engine: str
    phase: str
    old: BreakerState
    new: BreakerState
    event: BreakerEvent
    reason: str
    at: float


Guard = Callable[["Breaker", float], bool]


def _threshold_reached(breaker: Breaker, now: float) -> bool:
    failures = breaker.failures
    settings = breaker.settings
    if len(failures) < settings.failure_threshold or now - failures[0] > settings.window_s:
        return False
    failed, total = breaker.legs_in_window(now)
    return total > 0 and failed / total >= settings.failure_ratio


def _below_threshold(breaker: Breaker, now: float) -> bool:
    return not _threshold_reached(breaker, now)


def _open_time_over(breaker: Breaker, now: float) -> bool:
    return now >= breaker.opened_at + breaker.settings.open_s


@attrs.frozen
class Row:
    """One transition: in `state`, on `event`, when `guard` holds, go to `to`."""

    guard: Guard | None
    to: BreakerState


_C, _O, _H = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN
_E = BreakerEvent

# Rows are tried in order; the first whose guard holds wins. A (state, event) pair that
# is absent is ignored: it cannot change the verdict (e.g. a verification result that
# arrives after a reload reset the breaker).
TRANSITIONS: Mapping[tuple[BreakerState, BreakerEvent], tuple[Row, ...]] = {
    (_C, _E.FAILURE): (Row(_threshold_reached, _O), Row(_below_threshold, _C)),
    (_O, _E.FAILURE): (Row(None, _O),),
    (_H, _E.FAILURE): (Row(None, _H),),
    (_O, _E.OPEN_ELAPSED): (Row(_open_time_over, _H),),
    (_H, _E.VERIFY_OK): (Row(None, _C),),
    (_H, _E.VERIFY_FAILED): (Row(None, _O),),
    (_H, _E.VERIFY_INCONCLUSIVE): (Row(None, _H),),
}

# Where a failure is remembered for the window before the guards run. Only while
# closed: failures of requests placed before the breaker opened say nothing new.
RECORDED: frozenset[tuple[BreakerState, BreakerEvent]] = frozenset({(_C, _E.FAILURE)})
_BUCKETS = 10


class Breaker:
    """One engine phase's breaker; `blocked(now)` makes it an `EngineState` phase gate."""

    def __init__(self, engine_id: str, phase: str, settings: BreakerSettings) -> None:
        self.engine_id = engine_id
        self.phase = phase
        self.settings = settings
        self.state = BreakerState.CLOSED
        self.failures: deque[float] = deque(maxlen=settings.failure_threshold)
        # [bucket start, failed legs, all legs], oldest first; at most _BUCKETS + 1.
        self._legs: deque[list[float]] = deque()
        self.opened_at = -1.0
        self.last_reason = ""
        self.opened_total = 0

    def __repr__(self) -> str:
        return f"<Breaker {self.engine_id}/{self.phase} {self.state.value.upper()}>"

    def configure(self, settings: BreakerSettings) -> None:
        """Reload: new limits apply from now on; the state and recent failures stay."""
        self.settings = settings
        self.failures = deque(self.failures, maxlen=settings.failure_threshold)

    def blocked(self, now: float) -> str | None:
        if self.state is BreakerState.OPEN:
            return f"{self.phase} breaker open"
        if self.state is BreakerState.HALF_OPEN:
            return f"{self.phase} breaker half-open (verifying)"
        return None

    def due(self) -> float | None:
        """When the driver must fire OPEN_ELAPSED, if the breaker is open."""
        if self.state is BreakerState.OPEN:
            return self.opened_at + self.settings.open_s
        return None

    def failures_in_window(self, now: float) -> int:
        return sum(1 for at in self.failures if now - at <= self.settings.window_s)

    def _count_leg(self, now: float, failed: bool) -> None:
        width = self.settings.window_s / _BUCKETS
        legs = self._legs
        if not legs or now >= legs[-1][0] + width:
            legs.append([now, 0.0, 0.0])
        legs[-1][1] += failed
        legs[-1][2] += 1
        while legs and legs[0][0] + width < now - self.settings.window_s:
            legs.popleft()

    def legs_in_window(self, now: float) -> tuple[float, float]:
        """(failed, all) legs of this phase within about the last window_s."""
        horizon = now - self.settings.window_s - self.settings.window_s / _BUCKETS
        failed = total = 0.0
        for start, bucket_failed, bucket_total in self._legs:
            if start >= horizon:
                failed += bucket_failed
                total += bucket_total
        return failed, total

    def handle(self, event: BreakerEvent, now: float, detail: str = "") -> Transition | None:
        """Apply one event; returns the transition when the state changed."""
        key = (self.state, event)
        if event is BreakerEvent.SUCCESS:
            if self.state is BreakerState.CLOSED:
                self._count_leg(now, failed=False)
            return None
        if key in RECORDED:
            self.failures.append(now)
            self._count_leg(now, failed=True)
        for row in TRANSITIONS.get(key, ()):
            if row.guard is None or row.guard(self, now):
                return self._enter(row.to, event, now, detail)
        return None

    def _enter(
        self, new: BreakerState, event: BreakerEvent, now: float, detail: str
    ) -> Transition | None:
        old = self.state
        if new is old:
            return None
        self.state = new
        reason = self._reason(event, detail)
        self.last_reason = reason
        if new is BreakerState.OPEN:
            self.opened_at = now
            self.opened_total += 1
        if new is BreakerState.CLOSED:
            self.failures.clear()
            self._legs.clear()
        return Transition(self.engine_id, self.phase, old, new, event, reason, now)

    def _reason(self, event: BreakerEvent, detail: str) -> str:
        s = self.settings
        suffix = f" (last: {detail})" if detail else ""
        if event is BreakerEvent.FAILURE:
            return (
                f"{s.failure_threshold} counted {self.phase} failures, at least "
                f"recovery.breaker.failure_ratio={s.failure_ratio} of its legs, within "
                f"recovery.breaker.window_s={s.window_s}{suffix}"
            )
        if event is BreakerEvent.OPEN_ELAPSED:
            return f"open for recovery.breaker.open_s={s.open_s}; verifying"
        if event is BreakerEvent.VERIFY_OK:
            return f"verification passed{suffix}"
        if event is BreakerEvent.VERIFY_FAILED:
            return f"verification failed{suffix}"
        return detail

    def snapshot(self, now: float) -> BreakerSnapshot:
        due = self.due()
        return BreakerSnapshot(
            state=self.state,
            failures_in_window=self.failures_in_window(now),
            failure_threshold=self.settings.failure_threshold,
            reopens_in_s=None if due is None else round(max(0.0, due - now), 3),
            opened_total=self.opened_total,
            reason=self.last_reason or None,
        )
