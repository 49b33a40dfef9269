"""A worker process's side of the plane (docs/architecture.md#workers).

Owns
  `run_worker`: the channel to the core from the descriptor the core handed down, and
  the worker's own work beside it, for as long as the core is there.

Invariants
  The core going (its end of the channel closes when its process dies, however it dies)
  cancels the worker's work at once: a worker never serves without its core, whose
  decisions it cannot take alone. The worker then exits and systemd, which restarts the
  core's unit, brings up new workers with it.
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable

import trio

from ._channel import CallHandler, Channel, NoteHandler


async def run_worker(
    channel_fd: int,
    *,
    index: int,
    on_call: CallHandler,
    on_note: NoteHandler,
    work: Callable[[Channel], Awaitable[None]],
) -> str:
    """Run `work` with the core's channel until either ends; why the channel ended, or
    "done" when `work` returned first."""
    sock = socket.socket(fileno=channel_fd)
    channel = Channel(
        trio.SocketStream(trio.socket.from_stdlib_socket(sock)),
        peer="the core",
        on_call=on_call,
        on_note=on_note,
    )
    ended = "done"
    async with trio.open_nursery() as nursery:
        await nursery.start(channel.run)

        async def watch() -> None:
            nonlocal ended
            ended = await channel.wait_gone()
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        await work(channel)
        channel.close(f"worker {index} is done")
    return ended
