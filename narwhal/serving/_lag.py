"""Event-loop lag: how long a task that became runnable waits for the router's one trio
loop to run it, and whether that wait, not an engine, explains a deadline that expired.

Narwhal is one process with one event loop. Every await on a request's path (reading
the body, each engine response, each client write) waits its turn behind whatever else
is runnable, so when the process runs out of CPU (too many streams for one core, a flood
of refusals) that wait grows first, on every request at once, before any engine looks
slow: the overhead benchmark's added TTFT at 64 streams is mostly this. Every
`LAG_PROBE_S` a probe task yields to the scheduler while runnable and records how long
it took to be run again, in the `narwhal_event_loop_lag_seconds` histogram and, for the
last `LAG_WINDOW` probes, in `/narwhal/state` (`supervisor.loop`).

The histogram measures the yield, not how late a timer fired: epoll waits in whole
milliseconds, rounded up, so timer wakeups run up to 1 ms late even on an idle loop (0.6
ms on average in the overhead benchmark at one client), while I/O readiness, what the
request path waits for, is not delayed that way.

Excusing deadlines (`excuse`). A deadline that expires while the loop is starved says
nothing about the engine: the answer may have sat in the socket buffer, unread. Health
probes timing out under a client flood would otherwise eject healthy engines, and
first-token timeouts would open their breakers, turning the router's overload into a
fleet outage. So evidence about time (a probe's or a leg's deadline that expired, a
leg's duration for the latency residuals) is not held against an engine when the loop
lagged by at least `EXCUSE_SHARE` of that time (and at least `EXCUSE_FLOOR_S`) while it
was measured: a leg waits on the loop about a dozen times, so at that lag the router
alone can spend the whole deadline. For this the probe also records how late its timer
fired (one long synchronous stall shows only there), and a probe that is due but has
not run yet counts with its wait so far.

Pacing (`Paced`). Work that many tasks become ready for in the same pass (answers to
requests whose deadlines expired together) is spread over passes, so that the loop
keeps polling I/O meanwhile.
"""

from __future__ import annotations

from collections import deque

import attrs
import trio
from prometheus_client import CollectorRegistry, Histogram

LAG_PROBE_S = 0.25
LAG_WINDOW = 240  # the last minute of probes, on an idle loop
LAG_BUCKETS = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
)  # fmt: skip
EXCUSE_SHARE = 0.1
# Below this no lag excuses anything: timer wakeups alone run up to 1 ms late.
EXCUSE_FLOOR_S = 0.01


@attrs.frozen(kw_only=True)
class LagStatistics:
    """The last `LAG_WINDOW` probes (the state document's `supervisor.loop`); the lags
    are None before the first."""

    probe_interval_s: float
    samples: int
    lag_p50_s: float | None
    lag_p99_s: float | None
    lag_max_s: float | None


class LoopLag:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._recent: deque[float] = deque(maxlen=LAG_WINDOW)
        # (when measured, the longer of the yield's wait and the timer's lateness)
        self._stalls: deque[tuple[float, float]] = deque(maxlen=LAG_WINDOW)
        # When the probe should run next (its timer's deadline, or the moment it yielded);
        # None before the first.
        self._due: float | None = None
        self._histogram = Histogram(
            "narwhal_event_loop_lag_seconds",
            "How long a runnable task waited for the event loop to run it (one probe "
            f"every {LAG_PROBE_S} s): the wait every await on a request's path adds.",
            buckets=LAG_BUCKETS,
            registry=registry,
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            due = self._due = trio.current_time() + LAG_PROBE_S
            await trio.sleep_until(due)
            woke = self._due = trio.current_time()
            await trio.lowlevel.cancel_shielded_checkpoint()
            now = trio.current_time()
            self.observe(now - woke, late_s=woke - due, at=now)

    def observe(self, lag_s: float, *, late_s: float = 0.0, at: float | None = None) -> None:
        lag_s = max(0.0, lag_s)
        self._recent.append(lag_s)
        self._histogram.observe(lag_s)
        if at is not None:
            self._stalls.append((at, max(lag_s, late_s)))

    def worst_since(self, since: float) -> float:
        """The longest the probe waited for the loop, in probes that ended at or after
        `since` and in the one due now, if it has not run yet."""
        now = trio.current_time()
        worst = 0.0 if self._due is None else max(0.0, now - self._due)
        for at, stall in reversed(self._stalls):
            if at < since:
                break
            worst = max(worst, stall)
        return worst

    def starved(self, deadline_s: float, *, since: float | None = None) -> float | None:
        """The loop's worst lag while a deadline of `deadline_s` ran until now (or since
        `since`), if it was at least EXCUSE_SHARE of it and EXCUSE_FLOOR_S: enough for the
        router alone to have spent the deadline. None otherwise."""
        start = trio.current_time() - deadline_s if since is None else since
        worst = self.worst_since(start)
        return worst if worst >= max(EXCUSE_SHARE * deadline_s, EXCUSE_FLOOR_S) else None

    def excuse(self, deadline_s: float, *, since: float | None = None) -> str | None:
        """Why a deadline of `deadline_s` that expired just now (or a duration measured
        from `since`) is not held against an engine (`starved`); None when it is."""
        worst = self.starved(deadline_s, since=since)
        if worst is None:
            return None
        return (
            f"the router's own event loop lagged {worst:.3g} s meanwhile (at least "
            f"{EXCUSE_SHARE:.0%} of {deadline_s:.3g} s): router overload, not held "
            "against the engine"
        )

    def state(self) -> LagStatistics:
        recent = sorted(self._recent)
        n = len(recent)

        def at(q: float) -> float | None:
            return round(recent[round(q * (n - 1))], 6) if n else None

        return LagStatistics(
            probe_interval_s=LAG_PROBE_S,
            samples=n,
            lag_p50_s=at(0.5),
            lag_p99_s=at(0.99),
            lag_max_s=at(1.0),
        )


class Paced:
    """Work that many tasks become ready for at once, at most `per_pass` per pass of the
    scheduler.

    trio runs every task that is runnable when a pass begins before it polls for I/O
    again. Request deadlines that expire together (a slowloris's POSTs, opened together,
    reach serving.body_timeout_s together) make that many tasks runnable in one pass,
    and each answers, logs and counts its request in one step: no other client is read
    or written until all of them are done (with 2,048 of them another client waited up
    to 0.67 s, tools/bench/body_timeouts.py). `turn()` returns in a later pass than the
    one it is called in, to at most `per_pass` callers per pass, so I/O is polled
    between them. It is a CapacityLimiter taken and given back at once: acquiring yields
    even when a token is free, and a token given back goes to the longest waiter, which
    then runs in the next pass.
    """

    def __init__(self, per_pass: int) -> None:
        self._limiter = trio.CapacityLimiter(per_pass)

    async def turn(self) -> None:
        async with self._limiter:
            pass
