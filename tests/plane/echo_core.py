"""A core for the pool's tests: one echo worker; prints the worker's pid once it is up."""

from __future__ import annotations

import socket
from collections.abc import Callable

import trio

from narwhal.plane._channel import CallHandler, NoteHandler
from narwhal.plane._pool import WorkerPool
from tests.plane.test_pool import command


async def main() -> None:
    up = trio.Event()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)

    def handlers(index: int) -> tuple[CallHandler, NoteHandler]:
        async def on_call(name: str, payload: object, reply: Callable[[object], None]) -> object:
            return None

        def on_note(name: str, payload: object) -> None:
            print(payload, flush=True)
            up.set()

        return on_call, on_note

    pool = WorkerPool(1, command=command, listening=[sock.fileno()], handlers=handlers)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pool.run)
        await up.wait()
        await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(main)
