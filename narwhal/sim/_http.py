"""A small HTTP/1.1 server and client on h11 + trio.

Built directly on h11 because the simulator must not be the bottleneck of the router
benchmarks: stack-feasibility.md measured hypercorn at about 4x a bare h11 server per request
and about 0.1 ms per SSE chunk. Only what the engines' clients need is here: keep-alive,
Content-Length and chunked bodies, an idle timeout like uvicorn's, and prompt detection of a
client that closes its connection while its request is being served.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import attrs
import h11
import trio

from .._files import read_file

MAX_BODY = 32 * 1024 * 1024
_READ = 65536
# Bytes of a pipelined next request we buffer while a response is in progress.
_MAX_PIPELINED = 1024 * 1024


_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


class ClientGone(Exception):
    """The peer closed the connection (or reset it) while we were serving it."""


class DropConnection(Exception):
    """Raised by a handler to close the TCP connection at once, mid-response."""


@attrs.define(eq=False)
class HttpRequest:
    method: str
    target: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


class Responder:
    """What a handler uses to answer: one JSON/text body, or a stream of chunks."""

    def __init__(self, stream: trio.abc.Stream, conn: h11.Connection) -> None:
        self._stream = stream
        self._conn = conn
        self.started = False
        self.status = 0
        self.finished = False

    async def _send(self, data: bytes) -> None:
        try:
            await self._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            raise ClientGone() from None

    def _head(self, status: int, headers: list[tuple[str, str]]) -> bytes:
        self.started = True
        self.status = status
        out = self._conn.send(
            h11.Response(
                status_code=status,
                headers=[("server", "uvicorn"), *headers],
                reason=_REASONS.get(status, b""),
            )
        )
        assert out is not None
        return out

    async def send(
        self,
        status: int,
        body: bytes,
        *,
        content_type: str | None = "application/json",
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        hdrs = [("content-length", str(len(body)))]
        if content_type is not None:
            hdrs.insert(0, ("content-type", content_type))
        if headers:
            hdrs.extend(headers)
        data = self._head(status, hdrs)
        if body:
            data += self._conn.send(h11.Data(data=body)) or b""
        data += self._conn.send(h11.EndOfMessage()) or b""
        self.finished = True
        await self._send(data)

    async def send_json(
        self, status: int, obj: Any, *, headers: list[tuple[str, str]] | None = None
    ) -> None:
        await self.send(status, json.dumps(obj).encode(), headers=headers)

    async def start_stream(
        self,
        status: int,
        *,
        content_type: str = "text/event-stream; charset=utf-8",
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        # No Content-Length: h11 frames the body with chunked transfer-encoding.
        hdrs = [("content-type", content_type)]
        if headers:
            hdrs.extend(headers)
        await self._send(self._head(status, hdrs))

    async def send_chunk(self, data: bytes) -> None:
        await self._send(self._conn.send(h11.Data(data=data)) or b"")

    async def end_stream(self, last: bytes = b"") -> None:
        out = b""
        if last:
            out += self._conn.send(h11.Data(data=last)) or b""
        out += self._conn.send(h11.EndOfMessage()) or b""
        self.finished = True
        await self._send(out)


Handler = Callable[[HttpRequest, Responder], Awaitable[None]]
# How an engine opens a connection to a peer (host, port): TCP unless a test's in-memory
# network stands in for it.
Connect = Callable[[str, int], Awaitable[trio.abc.Stream]]


@attrs.define
class ServerStats:
    connections: int = 0
    open_connections: int = 0
    requests: int = 0
    disconnects: int = 0


async def serve_connection(
    stream: trio.abc.Stream, handler: Handler, *, idle_timeout_s: float, stats: ServerStats
) -> None:
    """Serve one keep-alive connection until either side closes it."""
    stats.connections += 1
    stats.open_connections += 1
    try:
        await _serve(stream, handler, idle_timeout_s, stats)
    except (trio.BrokenResourceError, trio.ClosedResourceError, ClientGone, OSError):
        pass
    finally:
        stats.open_connections -= 1
        with trio.move_on_after(1.0, shield=True):
            await trio.aclose_forcefully(stream)


async def _serve(
    stream: trio.abc.Stream, handler: Handler, idle_timeout_s: float, stats: ServerStats
) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
    while True:
        try:
            with trio.fail_after(idle_timeout_s):
                request = await _read_request(stream, conn)
        except trio.TooSlowError:
            return
        except h11.RemoteProtocolError as exc:
            await _send_bad_request(stream, conn, exc)
            return
        if request is None:
            return
        stats.requests += 1
        resp = Responder(stream, conn)
        gone = await _run_handler(stream, conn, handler, request, resp)
        if gone:
            stats.disconnects += 1
            return
        if not resp.finished:
            # A handler that raised before answering: the connection state is unknown.
            return
        if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
            return
        try:
            conn.start_next_cycle()
        except h11.LocalProtocolError:
            return


async def _read_request(stream: trio.abc.Stream, conn: h11.Connection) -> HttpRequest | None:
    head: h11.Request | None = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            # A socket's bytes are taken as they are; a memory stream's bytearray copied.
            conn.receive_data(bytes(await stream.receive_some(_READ)))
            continue
        if isinstance(event, h11.Request):
            head = event
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > MAX_BODY:
                raise h11.RemoteProtocolError("request body too large", error_status_hint=413)
        elif isinstance(event, h11.EndOfMessage):
            assert head is not None
            target = head.target.decode("latin-1")
            path, _, query = target.partition("?")
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers}
            return HttpRequest(
                method=head.method.decode("ascii"),
                target=target,
                path=path,
                query=query,
                headers=headers,
                body=bytes(body),
            )
        elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
            return None


async def _send_bad_request(
    stream: trio.abc.Stream, conn: h11.Connection, exc: h11.RemoteProtocolError
) -> None:
    if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
        return
    body = json.dumps({"detail": str(exc)}).encode()
    try:
        data = conn.send(
            h11.Response(
                status_code=exc.error_status_hint,
                headers=[
                    ("content-type", "application/json"),
                    ("content-length", str(len(body))),
                    ("connection", "close"),
                ],
            )
        )
        data = (data or b"") + (conn.send(h11.Data(data=body)) or b"")
        data += conn.send(h11.EndOfMessage()) or b""
        await stream.send_all(data)
    except (h11.LocalProtocolError, trio.BrokenResourceError, OSError):
        pass


async def _run_handler(
    stream: trio.abc.Stream,
    conn: h11.Connection,
    handler: Handler,
    request: HttpRequest,
    resp: Responder,
) -> bool:
    """Run the handler while watching the socket; True when the client went away."""
    gone = False

    async def watch(cancel: trio.CancelScope) -> None:
        nonlocal gone
        buffered = 0
        while True:
            try:
                data = await stream.receive_some(_READ)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                data = b""
            if not data:
                gone = True
                cancel.cancel()
                return
            # A pipelined next request: keep it for the next cycle, within bounds.
            buffered += len(data)
            try:
                conn.receive_data(bytes(data))
            except RuntimeError:
                return
            if buffered > _MAX_PIPELINED:
                return

    crashed: Exception | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch, nursery.cancel_scope)
        try:
            await handler(request, resp)
        except (ClientGone, DropConnection):
            gone = True
        except Exception as exc:
            crashed = exc
        finally:
            nursery.cancel_scope.cancel()
    if crashed is not None and not gone and not resp.started:
        # A handler bug must not take the engine down; answer like a framework would.
        body = {
            "error": {
                "message": f"Internal server error: {crashed!r}",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        }
        try:
            await resp.send_json(500, body)
        except ClientGone:
            return True
    return gone


# -- client -----------------------------------------------------------------------------------


@attrs.frozen
class ClientResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


async def request(
    host: str,
    port: int,
    method: str,
    path: str,
    body: Any = None,
    *,
    headers: dict[str, str] | None = None,
    max_body: int = 4 * 1024 * 1024,
    connect: Connect = trio.open_tcp_stream,
) -> ClientResponse:
    """One request on a fresh connection (engine-to-engine side channel; callers time out).

    Raises OSError when the peer is unreachable and h11.RemoteProtocolError on a broken reply.
    """
    stream = await connect(host, port)
    try:
        conn = h11.Connection(h11.CLIENT)
        payload = b"" if body is None else json.dumps(body).encode()
        hdrs = [("host", f"{host}:{port}"), ("connection", "close")]
        if body is not None:
            hdrs.append(("content-type", "application/json"))
        hdrs.append(("content-length", str(len(payload))))
        if headers:
            hdrs.extend(headers.items())
        out = conn.send(h11.Request(method=method, target=path, headers=hdrs)) or b""
        if payload:
            out += conn.send(h11.Data(data=payload)) or b""
        out += conn.send(h11.EndOfMessage()) or b""
        try:
            await stream.send_all(out)
        except trio.BrokenResourceError as exc:
            raise h11.RemoteProtocolError(f"connection broken: {exc}") from None
        status = 0
        resp_headers: dict[str, str] = {}
        data = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                try:
                    conn.receive_data(bytes(await stream.receive_some(_READ)))
                except trio.BrokenResourceError as exc:
                    # A reset (the peer restarting, say) is a broken reply too.
                    raise h11.RemoteProtocolError(f"connection broken: {exc}") from None
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
                resp_headers = {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                data += event.data
                if len(data) > max_body:
                    raise h11.RemoteProtocolError("response too large")
            elif isinstance(event, h11.EndOfMessage):
                return ClientResponse(status=status, headers=resp_headers, body=bytes(data))
            elif isinstance(event, h11.ConnectionClosed):
                raise h11.RemoteProtocolError("connection closed before the response ended")
    finally:
        with trio.move_on_after(1.0, shield=True):
            await trio.aclose_forcefully(stream)


_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


@functools.cache
def _ephemeral_low() -> int:
    try:
        return int(read_file(_EPHEMERAL_RANGE, limit=64).split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere a port that is taken is skipped anyway


async def listen_outside_ephemeral_range(host: str) -> list[trio.SocketListener]:
    """Listeners on a free port below the kernel's ephemeral range.

    A simulated engine that goes down and comes up binds its port again. An ephemeral
    port may meanwhile be the source port of one of the router's outgoing connections,
    and then the bind fails (EADDRINUSE). Ports below the range are never handed out as
    source ports, so only another listener can hold one, and that is tried again here."""
    low = _ephemeral_low()
    ports = random.Random().sample(range(max(1024, low - 12_000), low), 64)
    for port in ports:
        try:
            return await trio.open_tcp_listeners(port, host=host)
        except OSError:
            continue
    return await trio.open_tcp_listeners(0, host=host)
