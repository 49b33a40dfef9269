"""The worker processes around the decision core (docs/architecture.md#workers).

Owns
  `WorkerPool`: starts `count` worker processes, each with the client listening sockets
  (`listening`, descriptors) and its end of a `Channel` to the core handed down, serves each
  channel with the core's handlers, and starts a worker again when it exits.

Invariants
  A worker that exits, is killed or stops reading its channel is gone at once for the
  core: its channel's running calls are cancelled, which releases everything they held
  for its requests, and `on_lost` is told before the worker starts again. Restarts back
  off (`RESTART_BACKOFF_S`, doubling, at most `RESTART_BACKOFF_MAX_S`) and the backoff
  resets once a worker has run `RESTART_BACKOFF_MAX_S`. A worker sees its core go when its
  channel ends, and stops itself: no worker outlives its core. Stopping the pool (the
  nursery's cancellation) kills the workers; their listening socket stays the core's.
"""

from __future__ import annotations

import logging
import signal
import socket
from collections.abc import Callable

import attrs
import trio

from ._channel import CallHandler, Channel, NoteHandler

log = logging.getLogger("narwhal.plane")

RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 30.0
# A worker asked to stop gets this long for its in-flight requests before SIGKILL.
STOP_GRACE_S = 5.0

# The argv that starts worker `index`, given the channel's and the listening sockets'
# descriptor numbers in the child.
Command = Callable[[int, int, list[int]], list[str]]
# The core's handlers for worker `index`'s channel.
Handlers = Callable[[int], tuple[CallHandler, NoteHandler]]


@attrs.frozen
class WorkerStatistics:
    index: int
    pid: int | None
    starts: int
    last_exit: str | None


@attrs.define(eq=False)
class _Worker:
    index: int
    pid: int | None = None
    starts: int = 0
    last_exit: str | None = None
    channel: Channel | None = None
    stopped: trio.Event = attrs.field(factory=trio.Event)


class WorkerPool:
    def __init__(
        self,
        count: int,
        *,
        command: Command,
        listening: list[int],
        handlers: Handlers,
        on_lost: Callable[[int, str], None] = lambda index, why: None,
    ) -> None:
        if count < 1:
            raise ValueError(f"a worker pool has count={count}; must be >= 1")
        self._command = command
        self._listening = listening
        self._handlers = handlers
        self._on_lost = on_lost
        self._workers = [_Worker(index) for index in range(count)]
        self._up = [trio.Event() for _ in range(count)]
        self._stopping = False

    def __repr__(self) -> str:
        running = sum(worker.pid is not None for worker in self._workers)
        return f"<WorkerPool [{running}/{len(self._workers)} running]>"

    def statistics(self) -> tuple[WorkerStatistics, ...]:
        return tuple(WorkerStatistics(w.index, w.pid, w.starts, w.last_exit) for w in self._workers)

    def broadcast(self, name: str, payload: object = None) -> None:
        """Note `name` to every running worker."""
        for channel in self.channels():
            channel.note(name, payload)

    def indexed_channels(self) -> tuple[tuple[int, Channel], ...]:
        """The channels of the workers running now, with their workers' indexes."""
        return tuple(
            (w.index, w.channel)
            for w in self._workers
            if w.channel is not None and w.channel.gone is None
        )

    def channels(self) -> tuple[Channel, ...]:
        """The channels of the workers running now."""
        return tuple(channel for _, channel in self.indexed_channels())

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep every worker running; `started` once each has said it is up (its `up`
        note) once."""
        async with trio.open_nursery() as nursery:
            for worker in self._workers:
                nursery.start_soon(self._keep, worker)
            for up in self._up:
                await up.wait()
            task_status.started()

    def stopping(self) -> bool:
        """Whether `stop` was called (a method: it changes while a worker runs)."""
        return self._stopping

    def stop(self) -> None:
        """Ask every worker to finish its requests and exit; none is started again."""
        self._stopping = True
        for channel in self.channels():
            channel.note("stop")

    async def wait_stopped(self) -> None:
        """Until every worker process has exited."""
        for worker in self._workers:
            await worker.stopped.wait()

    async def _keep(self, worker: _Worker) -> None:
        backoff = RESTART_BACKOFF_S
        while not self.stopping():
            started = trio.current_time()
            why = await self._run_once(worker)
            worker.last_exit = why
            if self.stopping():
                break
            log.warning(
                "worker %d is gone: %s",
                worker.index,
                why,
                extra={"event": "worker_lost", "worker": worker.index, "reason": why},
            )
            self._on_lost(worker.index, why)
            if trio.current_time() - started >= RESTART_BACKOFF_MAX_S:
                backoff = RESTART_BACKOFF_S
            await trio.sleep(backoff)
            backoff = min(RESTART_BACKOFF_MAX_S, backoff * 2)
        worker.stopped.set()

    async def _run_once(self, worker: _Worker) -> str:
        """Run `worker` until it or its channel ends; why it ended."""
        ours, theirs = socket.socketpair()
        listen_fds = self._listening
        try:
            process = await trio.lowlevel.open_process(
                self._command(worker.index, theirs.fileno(), listen_fds),
                pass_fds=(*listen_fds, theirs.fileno()),
            )
        except OSError as exc:
            ours.close()
            return f"it could not be started: {exc}"
        finally:
            theirs.close()
        on_call, on_note = self._handlers(worker.index)
        up = self._up[worker.index]

        def noted(name: str, payload: object) -> None:
            if name == "up":
                up.set()
            on_note(name, payload)

        channel = Channel(
            trio.SocketStream(trio.socket.from_stdlib_socket(ours)),
            peer=f"worker {worker.index}",
            on_call=on_call,
            on_note=noted,
        )
        worker.pid, worker.channel = process.pid, channel
        worker.starts += 1
        exited: str | None = None
        try:
            async with trio.open_nursery() as nursery:

                async def wait_exit() -> None:
                    nonlocal exited
                    returned = await process.wait()
                    exited = _exit_reason(returned)
                    channel.close(exited)

                nursery.start_soon(wait_exit)
                await channel.run()
                # The channel ended first (the worker stopped reading or closed it): a
                # worker we cannot talk to is not one: it goes too.
                with trio.move_on_after(STOP_GRACE_S):
                    await process.wait()
                nursery.cancel_scope.cancel()
        finally:
            worker.pid = None
            if process.returncode is None:
                process.kill()
                with trio.CancelScope(shield=True):
                    await process.wait()
        return exited or f"its channel ended ({channel.gone}); it was killed"


def _exit_reason(status: int) -> str:
    if status < 0:
        try:
            return f"it was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"it was killed by signal {-status}"
    return f"it exited with status {status}"
