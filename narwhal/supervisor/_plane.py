"""The daemon as the decision core of W worker processes (serving.workers;
docs/architecture.md#workers).

Owns
  `Plane`: the client listener, bound here and handed down; the `WorkerPool`; the
  `DecisionCore` that answers the workers; the `mirror` note that tells them the engines'
  load every `MIRROR_INTERVAL_S`; reloads (the configuration in force to every worker,
  which changes its engines as the core did); the drain (cancelling what the grace left).

Invariants
  What is eventually consistent across processes, and by how much: a worker's reads of
  the engines' decode and prefill load (the load of the token gaps it summarises), their
  context lengths and the fleet's standing lag the core's by at most `MIRROR_INTERVAL_S`
  plus the channel's latency; the KV a streamed leg generates reaches the core's ledger in steps of
  `GROWTH_REPORT_TOKENS` tokens, the rest at the leg's end. Admission, the queue,
  placement, phase slots, the retained ceiling and the retry budget are the core's alone:
  exact.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import trio

from .._errors import NarwhalError
from .._records import JsonObject
from ..config import Config
from ..plane import Channel, PeerGone
from ..plane._core import DecisionCore
from ..plane._pool import WorkerPool
from ..serving import ServingContext

log = logging.getLogger("narwhal.plane")

MIRROR_INTERVAL_S = 0.02
# A scrape or a state read waits at most this long for a worker's part.
REPORT_TIMEOUT_S = 1.0


def worker_count(config: Config) -> int:
    """serving.workers in processes: 0 is one per CPU this process may run on."""
    if config.serving.workers == 0:
        return len(os.sched_getaffinity(0))
    return config.serving.workers


def worker_command(index: int, channel_fd: int, listen_fds: list[int]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "narwhal.plane.worker",
        str(index),
        str(channel_fd),
        *(str(fd) for fd in listen_fds),
    ]


class Plane:
    def __init__(self, ctx: ServingContext, count: int) -> None:
        self.ctx = ctx
        self.core = DecisionCore(ctx)
        self.count = count
        self.pool: WorkerPool | None = None
        self._listeners: list[trio.SocketListener] = []
        ctx.worker_metrics = self.metrics
        ctx.worker_states = self.states

    async def run(
        self,
        host: str,
        port: int,
        *,
        task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind the client listener (OSError when it cannot be), start the workers, and
        mirror the engines to them until cancelled; started() reports the bound
        addresses once every worker has started."""
        listeners = self._listeners = await trio.open_tcp_listeners(port, host=host)
        bound = [
            (str(listener.socket.getsockname()[0]), int(listener.socket.getsockname()[1]))
            for listener in listeners
        ]
        pool = self.pool = WorkerPool(
            self.count,
            command=worker_command,
            listening=[listener.socket.fileno() for listener in listeners],
            handlers=self.core.handlers,
        )
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(pool.run)
                nursery.start_soon(self._mirror, pool)
                task_status.started(bound)
                await pool.wait_stopped()
                nursery.cancel_scope.cancel()
        finally:
            for listener in listeners:
                listener.socket.close()

    async def _mirror(self, pool: WorkerPool) -> None:
        sent: object = None
        starts = -1
        while True:
            mirror = self.core.mirror()
            # A new worker needs it even if nothing changed.
            restarted = sum(stats.starts for stats in pool.statistics())
            if mirror != sent or restarted != starts:
                pool.broadcast("mirror", mirror)
                sent, starts = mirror, restarted
            await trio.sleep(MIRROR_INTERVAL_S)

    async def metrics(self) -> list[bytes]:
        """Every running worker's /metrics exposition (a worker that does not answer
        within `REPORT_TIMEOUT_S` is left out)."""
        answers = await self._ask("metrics")
        return [answer for _, answer in answers if isinstance(answer, bytes)]

    async def states(self) -> list[JsonObject]:
        """Each worker's section of /narwhal/state, with its process."""
        assert self.pool is not None
        answers = dict(await self._ask("state"))
        sections: list[JsonObject] = []
        for stats in self.pool.statistics():
            section: JsonObject = {
                "index": stats.index,
                "pid": stats.pid,
                "starts": stats.starts,
                "last_exit": stats.last_exit,
            }
            answer = answers.get(stats.index)
            if isinstance(answer, dict):
                section.update(answer)
            sections.append(section)
        return sections

    async def _ask(self, name: str) -> list[tuple[int, object]]:
        if self.pool is None:
            return []
        answers: list[tuple[int, object]] = []

        async def ask(index: int, channel: Channel) -> None:
            with trio.move_on_after(REPORT_TIMEOUT_S), contextlib.suppress(PeerGone):
                answers.append((index, await channel.call(name)))

        async with trio.open_nursery() as nursery:
            for index, channel in self.pool.indexed_channels():
                nursery.start_soon(ask, index, channel)
        return answers

    def reloaded(self, config: Config) -> None:
        """Every worker takes `config`, the configuration now in force, for its new
        requests, and makes its engines' changes as the core made them."""
        if self.pool is not None:
            self.pool.broadcast("config", config)

    def cancel_requests(self, error: NarwhalError) -> None:
        """Every worker cancels its retained requests with `error` (the drain's grace is
        over)."""
        if self.pool is not None:
            self.pool.broadcast("cancel", error)

    async def stop(self, grace_s: float) -> None:
        """The workers finish their requests and exit, for at most `grace_s`."""
        if self.pool is None:
            return
        self.pool.stop()
        with trio.move_on_after(grace_s):
            await self.pool.wait_stopped()
