"""Event-loop lag: how late the router's one trio loop runs a task whose timer expired.

Narwhal is one process with one event loop. Every await on a request's path (reading
the body, each engine response, each client write) waits its turn behind whatever else
is runnable, so when the process runs out of CPU (too many streams for one core) that
wait grows first, on every request at once, before any engine looks slow: the overhead
benchmark's added TTFT at 64 streams is mostly this. A probe task sleeps to a deadline
every `LAG_PROBE_S` and records how late it woke, in the `narwhal_event_loop_lag_seconds`
histogram and, for the last `LAG_WINDOW` probes, in `/narwhal/state` (`supervisor.loop`).

What it costs: one wakeup per probe interval. What it does not see: a loop blocked for
longer than a probe interval shows as one late sample, not several.
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
            "How late the event loop ran a task whose timer expired (one probe every "
            f"{LAG_PROBE_S} s): the wait every await on a request's path adds.",
            buckets=LAG_BUCKETS,
            registry=registry,
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        deadline = trio.current_time() + LAG_PROBE_S
        while True:
            await trio.sleep_until(deadline)
            now = trio.current_time()
            self.observe(now - deadline)
            deadline = now + LAG_PROBE_S

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
