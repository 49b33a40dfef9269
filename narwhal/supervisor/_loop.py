"""Event-loop lag: how long a task that became runnable waits for the router's one trio
loop to run it.

Narwhal is one process with one event loop. Every await on a request's path (reading
the body, each engine response, each client write) waits its turn behind whatever else
is runnable, so when the process runs out of CPU (too many streams for one core) that
wait grows first, on every request at once, before any engine looks slow: the overhead
benchmark's added TTFT at 64 streams is mostly this. Every `LAG_PROBE_S` a probe task
yields to the scheduler while runnable and records how long it took to be run again, in
the `narwhal_event_loop_lag_seconds` histogram and, for the last `LAG_WINDOW` probes, in
`/narwhal/state` (`supervisor.loop`).

It measures the yield, not how late a timer fired: epoll waits in whole milliseconds,
rounded up, so timer wakeups run up to 1 ms late even on an idle loop (0.6 ms on average
in the overhead benchmark at one client), while I/O readiness, what the request path
waits for, is not delayed that way.
"""

from __future__ import annotations

from collections import deque

import trio
from prometheus_client import CollectorRegistry, Histogram

LAG_PROBE_S = 0.25
LAG_WINDOW = 240  # the last minute of probes
LAG_BUCKETS = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
)  # fmt: skip


class LoopLag:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._recent: deque[float] = deque(maxlen=LAG_WINDOW)
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
            await trio.sleep(LAG_PROBE_S)
            start = trio.current_time()
            await trio.lowlevel.cancel_shielded_checkpoint()
            self.observe(trio.current_time() - start)

    def observe(self, lag_s: float) -> None:
        lag_s = max(0.0, lag_s)
        self._recent.append(lag_s)
        self._histogram.observe(lag_s)

    def state(self) -> dict[str, object]:
        recent = sorted(self._recent)
        n = len(recent)

        def at(q: float) -> float | None:
            return round(recent[round(q * (n - 1))], 6) if n else None

        return {
            "probe_interval_s": LAG_PROBE_S,
            "samples": n,
            "lag_p50_s": at(0.5),
            "lag_p99_s": at(0.99),
            "lag_max_s": at(1.0),
        }
