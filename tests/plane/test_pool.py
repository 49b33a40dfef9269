from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable

import pytest
import trio

from narwhal.plane import PeerGone
from narwhal.plane._channel import CallHandler, NoteHandler
from narwhal.plane._pool import WorkerPool

Reply = Callable[[object], None]


def command(index: int, channel_fd: int, listen_fds: list[int]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tests.plane.echo_worker",
        str(index),
        str(listen_fds[0]),
        str(channel_fd),
    ]


class Core:
    """The core's side: counts each worker's `up` notes, records losses."""

    def __init__(self) -> None:
        self.ups: list[tuple[int, object]] = []
        self.lost: list[tuple[int, str]] = []
        self.changed = trio.Event()

    def handlers(self, index: int) -> tuple[CallHandler, NoteHandler]:
        async def on_call(name: str, payload: object, reply: Reply) -> object:
            return None

        def on_note(name: str, payload: object) -> None:
            self.ups.append((index, payload))
            self.changed.set()

        return on_call, on_note

    def on_lost(self, index: int, why: str) -> None:
        self.lost.append((index, why))
        self.changed.set()

    async def wait_for(self, condition: Callable[[], bool]) -> None:
        while not condition():
            self.changed = trio.Event()
            await self.changed.wait()


def listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    sock.setblocking(False)
    return sock


async def ask_pid(port: int) -> int:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        data = b""
        while chunk := await stream.receive_some(64):
            data += chunk
    return int(data)


async def test_workers_share_the_listener_and_a_killed_one_is_restarted_and_reported() -> None:
    core = Core()
    sock = listener()
    port = sock.getsockname()[1]
    pool = WorkerPool(
        2,
        command=command,
        listening=[sock.fileno()],
        handlers=core.handlers,
        on_lost=core.on_lost,
    )
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run)
            await core.wait_for(lambda: len(core.ups) == 2)
            pids = {stats.pid for stats in pool.statistics()}
            assert pids == {pid for _, pid in core.ups}
            assert len(pool.channels()) == 2
            assert [await pool.channels()[i].call("pid") for i in range(2)] == [
                pool.statistics()[0].pid,
                pool.statistics()[1].pid,
            ]
            # Both serve the one listening socket the core handed down.
            assert {await ask_pid(port) for _ in range(4)} <= pids

            victim = pool.statistics()[0].pid
            assert victim is not None
            channel = pool.channels()[0]
            os.kill(victim, signal.SIGKILL)
            with pytest.raises(PeerGone, match=r"^worker 0 is gone: "):
                await channel.call("echo", 1)
            await core.wait_for(lambda: len(core.ups) == 3)
            assert core.lost == [(0, "it was killed by SIGKILL")]
            restarted = pool.statistics()[0]
            assert restarted.starts == 2
            assert restarted.pid not in pids
            assert await ask_pid(port) in {restarted.pid, pool.statistics()[1].pid}
            nursery.cancel_scope.cancel()
    assert all(stats.pid is None for stats in pool.statistics())
    sock.close()


async def test_a_worker_stops_when_its_core_goes() -> None:
    core = Core()
    sock = listener()
    pool = WorkerPool(
        1, command=command, listening=[sock.fileno()], handlers=core.handlers, on_lost=core.on_lost
    )
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run)
            await core.wait_for(lambda: len(core.ups) == 1)
            # The core's end closes as it would when the core's process dies.
            pool.channels()[0].close("the core died")
            await core.wait_for(lambda: len(core.lost) == 1)
            # The worker saw the end of its channel and exited by itself, not killed.
            assert core.lost == [(0, "it exited with status 0")]
            nursery.cancel_scope.cancel()
    sock.close()


async def test_a_worker_exits_when_its_core_is_killed() -> None:
    core = await trio.lowlevel.open_process(
        [sys.executable, "-m", "tests.plane.echo_core"], stdout=subprocess.PIPE
    )
    try:
        with trio.fail_after(30):
            assert core.stdout is not None
            line = await core.stdout.receive_some(64)
            worker = int(line)
            pidfd = os.pidfd_open(worker)
            try:
                core.kill()  # SIGKILL: nothing of the core's code runs
                await core.wait()
                # The worker's pidfd becomes readable when it exits.
                await trio.lowlevel.wait_readable(pidfd)
            finally:
                os.close(pidfd)
    finally:
        if core.returncode is None:
            core.kill()
            await core.wait()
