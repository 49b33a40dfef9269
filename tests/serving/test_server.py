"""The HTTP server's own parts: burst accepts and listener shutdown, on loopback."""

from __future__ import annotations

import socket
from collections.abc import MutableMapping
from functools import partial
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from narwhal.serving import serve_app
from narwhal.serving._client import eager
from narwhal.serving._server import accept_pending


def _listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    sock.setblocking(False)
    return sock


async def test_every_pending_connection_is_accepted_without_yielding() -> None:
    with _listening() as listening:
        clients = [socket.create_connection(listening.getsockname()) for _ in range(5)]
        try:
            # Loopback connects complete in the kernel's backlog before accept().
            first = accept_pending(listening, 3)
            rest = accept_pending(listening, 10)
            assert (len(first), len(rest)) == (3, 2)
            assert accept_pending(listening, 10) == []
            for stream in first + rest:
                stream.socket.close()
        finally:
            for client in clients:
                client.close()


async def _hello(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hello"})


async def test_a_burst_of_new_connections_is_served_and_shutdown_closes_the_port() -> None:
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        ((host, port),) = await nursery.start(
            partial(
                serve_app, _hello, host="127.0.0.1", port=0, client_stall_s=1.0, shutdown=shutdown
            )
        )
        answers: list[int] = []

        async def one() -> None:
            # A fresh connection per request, all at once.
            async with httpx.AsyncClient(timeout=30) as client:
                answers.append((await client.get(f"http://{host}:{port}/")).status_code)

        async with trio.open_nursery() as clients:
            for _ in range(100):
                clients.start_soon(one)
        assert answers == [200] * 100
        shutdown.set()
    # The listener closed with the server: a new connection is refused, not left waiting.
    with pytest.raises(OSError):
        await trio.open_tcp_stream(host, port)


async def test_eager_receive_takes_a_queued_message_without_a_scheduler_pass() -> None:
    send, receive = trio.open_memory_channel[dict[str, object]](4)
    eager_receive = eager(receive.receive)
    message = {"type": "http.request", "body": b"{}", "more_body": False}
    await send.send(message)
    with trio.testing.assert_no_checkpoints():
        assert await eager_receive() == message

    async def later() -> None:
        await send.send({"type": "http.disconnect"})

    async with trio.open_nursery() as nursery:
        nursery.start_soon(later)
        with trio.testing.assert_checkpoints():  # nothing queued: it waits
            assert await eager_receive() == {"type": "http.disconnect"}

    async def other() -> dict[str, object]:
        return {}

    assert eager(other) is other  # anything but a memory channel's receive: as it was
