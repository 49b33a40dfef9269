"""A lean HTTP/1.1 server on h11 + trio for Narwhal's ASGI app: a measurement prototype.

    .venv/bin/python tools/bench/dev/lean_server.py serve --config narwhal.json

runs `narwhal serve` (every argument is the daemon's) with this server in place of
narwhal.serving.serve_app. tools/bench/overhead.py starts it as its `narwhal-lean` target,
which answers whether Narwhal should own its server instead of hypercorn
(docs/design.md#http-server). It is not the production server and is not meant to become
one as it stands.

Owns: the happy path only. Keep-alive, Content-Length (and chunked) request bodies, a
response written as it is sent (a stream as chunked) with a Date header, the app run in
the connection's own task (no per-request task, no memory channel), a disconnect watch
that reads the socket, and a write first tried synchronously and else bounded by
serving.client_stall_s. It keeps the production server's accept bursts and connection
accounting by reusing them (`narwhal.serving._server._accept_loop`, `OpenConnections`),
so the comparison is of the per-request and per-chunk path only.

Left out (what the production server does and an owned one would have to): protocol
errors answered with the error envelope, HTTP/2 refusal, the head limit on complete
heads, a half-closed client told from a gone one, lingering before a close with unread
bytes, the idle-connection eviction beyond what `OpenConnections` does here, pipelining
beyond buffering the next request, and graceful shutdown beyond a deadline.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Awaitable, Callable, Hashable, MutableMapping
from email.utils import formatdate
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

import h11
import trio

from narwhal.config import Listen
from narwhal.serving import _server
from narwhal.serving._connections import OpenConnections

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
App = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Any]

KEEP_ALIVE_S = 75.0  # as serve_app configures hypercorn
MAX_HEAD = 16 * 1024  # hypercorn's h11_max_incomplete_size
_READ = 64 * 1024
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_DISCONNECT: Message = {"type": "http.disconnect"}


_date_cache: list[tuple[int, bytes]] = [(0, b"")]


def _date() -> bytes:
    """RFC 9110 6.6.1's Date (as hypercorn sends it), formatted once a second."""
    now = int(time.time())
    second, text = _date_cache[0]
    if now != second:
        text = formatdate(now, usegmt=True).encode()
        _date_cache[0] = (now, text)
    return text


class _Exchange:
    """One request's ASGI receive and send, on its connection's h11 state and socket."""

    __slots__ = ("_body_done", "_closed", "_conn", "_head", "_is_head", "_stall_s", "_stream")

    def __init__(
        self,
        stream: trio.SocketStream,
        conn: h11.Connection,
        stall_s: Callable[[], float],
        *,
        is_head: bool,
    ) -> None:
        self._stream = stream
        self._conn = conn
        self._stall_s = stall_s
        self._is_head = is_head
        self._body_done = False
        self._closed = False
        self._head = b""  # a status line held back to go out with the first body bytes

    async def receive(self) -> Message:
        if self._body_done:
            return await self._until_disconnect()
        body = b""
        conn = self._conn
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                if body:
                    return {"type": "http.request", "body": body, "more_body": True}
                try:
                    data = await self._stream.receive_some(_READ)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return _DISCONNECT
                if not data:
                    return _DISCONNECT
                conn.receive_data(data)
            elif type(event) is h11.Data:
                body += event.data
            elif type(event) is h11.EndOfMessage:
                self._body_done = True
                return {"type": "http.request", "body": body, "more_body": False}
            else:
                return _DISCONNECT

    async def _until_disconnect(self) -> Message:
        # After the body the next message is the client leaving. Bytes of a pipelined
        # request are kept for the next cycle; the end cannot be seen behind them.
        while True:
            try:
                data = await self._stream.receive_some(_READ)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return _DISCONNECT
            if not data:
                return _DISCONNECT
            self._conn.receive_data(data)
            if len(self._conn.trailing_data[0]) > MAX_HEAD:
                await trio.sleep_forever()

    async def send(self, message: Message) -> None:
        if self._closed:
            return
        conn = self._conn
        if message["type"] == "http.response.start":
            status = message["status"]
            self._head = (
                conn.send(
                    h11.Response(
                        status_code=status,
                        headers=[*message.get("headers", ()), (b"date", _date())],
                        reason=_REASONS.get(status, b""),
                    )
                )
                or b""
            )
            return
        body = message.get("body", b"")
        data = self._head
        self._head = b""
        if body and not self._is_head:
            data += conn.send(h11.Data(data=body)) or b""
        if not message.get("more_body", False):
            data += conn.send(h11.EndOfMessage()) or b""
        if data:
            await self._write(data)

    async def _write(self, data: bytes) -> None:
        # Nearly every write fits the socket buffer: try it without the scheduler.
        sock = self._stream.socket
        try:
            sent = os.write(sock.fileno(), data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._close()
            return
        if sent == len(data):
            return
        view = memoryview(data)[sent:]
        try:
            with trio.move_on_after(self._stall_s()) as stall:
                while view:
                    view = view[await sock.send(view) :]
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            self._close()
            return
        if stall.cancelled_caught:
            self._close()

    def _close(self) -> None:
        # The disconnect watch, waiting on this socket, wakes up closed and reports it.
        self._closed = True
        self._stream.socket.close()

    @property
    def closed(self) -> bool:
        return self._closed


def _scope(request: h11.Request, client: tuple[str, int], server: tuple[str, int]) -> Scope:
    path, _, query = request.target.partition(b"?")
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": request.http_version.decode("ascii"),
        "method": request.method.decode("ascii"),
        "scheme": "http",
        "path": unquote(path.decode("ascii")),
        "raw_path": path,
        "query_string": query,
        "root_path": "",
        "headers": list(request.headers),
        "client": client,
        "server": server,
        "extensions": {},
    }


async def _read_head(stream: trio.SocketStream, conn: h11.Connection) -> h11.Request | None:
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(_READ)
            conn.receive_data(data)
            if not data:
                continue  # h11 then reports ConnectionClosed (or raises, mid-head)
        elif type(event) is h11.Request:
            return event
        else:
            return None


async def serve_connection(
    app: App,
    stream: trio.SocketStream,
    *,
    stall_s: Callable[[], float],
    open_connections: OpenConnections,
) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
    key: Hashable = stream
    sock = stream.socket
    client = sock.getpeername()[:2]
    server = sock.getsockname()[:2]
    while True:
        open_connections.idle(key, sock.close)
        try:
            with trio.move_on_after(KEEP_ALIVE_S):
                request = await _read_head(stream, conn)
        except (h11.RemoteProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
            return
        finally:
            open_connections.busy(key)
        if request is None:
            return
        exchange = _Exchange(stream, conn, stall_s, is_head=request.method == b"HEAD")
        await app(_scope(request, client, server), exchange.receive, exchange.send)
        if exchange.closed or conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
            return  # closing, or the body unread: the connection cannot be reused
        conn.start_next_cycle()


async def serve_app(
    app: App,
    *,
    host: str,
    port: int,
    client_stall_s: float | Callable[[], float],
    shutdown: trio.Event,
    graceful_timeout_s: float = 5.0,
    open_connections: OpenConnections | None = None,
    protocol_error: Callable[[Any], None] | None = None,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """narwhal.serving.serve_app's signature and accept path, with this server's
    connections (`protocol_error` is never called: errors close the connection)."""
    del protocol_error
    if open_connections is None:
        open_connections = OpenConnections(Listen().max_open_connections)
    stall_s = client_stall_s if callable(client_stall_s) else (lambda: client_stall_s)
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = [
        (str(listener.socket.getsockname()[0]), int(listener.socket.getsockname()[1]))
        for listener in listeners
    ]

    async def handler(stream: trio.SocketStream) -> None:
        await serve_connection(app, stream, stall_s=stall_s, open_connections=open_connections)

    async with trio.open_nursery() as connections:
        async with trio.open_nursery() as accepting:
            for listener in listeners:
                accepting.start_soon(
                    _server._accept_loop, listener, handler, connections, open_connections
                )
            task_status.started(bound)
            await shutdown.wait()
            accepting.cancel_scope.cancel()
        connections.cancel_scope.deadline = trio.current_time() + graceful_timeout_s


def main() -> int:
    from narwhal.cli import daemon
    from narwhal.supervisor import _supervisor

    # What the supervisor calls to serve each listener; nothing else changes.
    setattr(_supervisor, "serve_app", serve_app)  # noqa: B010
    sys.argv[0] = "narwhal"
    return int(daemon.main() or 0)


if __name__ == "__main__":
    raise SystemExit(main())
