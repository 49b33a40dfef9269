"""The lean h11 server prototype (tools/bench/dev/lean_server.py) serves the happy path it
is measured on: keep-alive, a Content-Length body, a streamed (chunked) answer and a JSON
one."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx
import trio
from lean_server import serve_app

Message = MutableMapping[str, Any]


async def _app(
    scope: Message,
    receive: Callable[[], Awaitable[Message]],
    send: Callable[[Message], Awaitable[None]],
) -> None:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for part in (b"a", b"b", b"c"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    answer = b'{"echo":"' + body + b'"}'
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(answer))]
    await send({"type": "http.response.start", "status": 201, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


async def test_keep_alive_bodies_streams_and_json() -> None:
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        [(host, port)] = await nursery.start(
            lambda task_status: serve_app(
                _app,
                host="127.0.0.1",
                port=0,
                client_stall_s=1.0,
                shutdown=shutdown,
                task_status=task_status,
            )
        )
        peers: list[object] = []
        transport = httpx.AsyncHTTPTransport()
        async with httpx.AsyncClient(
            base_url=f"http://{host}:{port}", transport=transport
        ) as client:

            async def trace(event: str, info: dict[str, Any]) -> None:
                if event == "connection.connect_tcp.complete":
                    peers.append(info["return_value"])

            json_answer = await client.post("/x", content=b"hi", extensions={"trace": trace})
            stream_answer = await client.post("/stream", content=b"", extensions={"trace": trace})
        assert (json_answer.status_code, json_answer.json()) == (201, {"echo": "hi"})
        assert json_answer.reason_phrase == "Created"
        assert "date" in json_answer.headers
        assert stream_answer.headers["transfer-encoding"] == "chunked"
        assert stream_answer.content == b"abc"
        assert len(peers) == 1  # both requests on one connection
        shutdown.set()
