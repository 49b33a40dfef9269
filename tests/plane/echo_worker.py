"""A worker for the pool's tests: answers `pid` and `echo`, and answers every client
connection on the shared listening socket with its pid."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable

import trio

from narwhal.plane import Channel
from narwhal.plane._worker import run_worker


async def on_call(name: str, payload: object, reply: Callable[[object], None]) -> object:
    if name == "pid":
        return os.getpid()
    return payload


def on_note(name: str, payload: object) -> None:
    pass


async def main() -> None:
    index, listen_fd, channel_fd = (int(arg) for arg in sys.argv[1:4])
    listening = trio.socket.from_stdlib_socket(socket.socket(fileno=listen_fd))

    async def work(channel: Channel) -> None:
        channel.note("up", os.getpid())
        while True:
            conn, _ = await listening.accept()
            with conn:
                await conn.send(str(os.getpid()).encode())

    why = await run_worker(channel_fd, index=index, on_call=on_call, on_note=on_note, work=work)
    print(f"worker {index} stops: {why}", flush=True)


if __name__ == "__main__":
    trio.run(main)
