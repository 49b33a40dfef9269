"""A small HTTP/1.1 client connection pool on h11 and trio.

Why not httpx: httpcore 1.0.9's pool rescans every connection for every queued request
(`_assign_requests_to_connections`), so its cost per request grows with the number of
connections; past ~32 in flight one core is spent on pool bookkeeping (measured in
../shared/notes/stack-feasibility.md: 63 ms CPU per request at 256 in flight). A router
holding hundreds of concurrent LLM streams cannot afford that. This pool does O(1) work
per request: a FIFO `CapacityLimiter` bounds connections in use, and idle keep-alive
connections sit on a LIFO stack.

The pool imposes no read timeouts: deadlines belong to the caller's cancel scopes. It
does own the two timeouts that are about the pool itself, `pool_timeout_s` (waiting for
a connection slot) and `connect_timeout_s` (TCP connect).
"""

from __future__ import annotations

import errno
import select
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import attrs
import h11
import trio

Headers = Sequence[tuple[bytes, bytes]]

_RECEIVE_BYTES = 65536


class TransportError(Exception):
    """The engine could not be reached or the connection broke (transient)."""


class ConnectError(TransportError):
    """TCP connect failed or timed out; nothing reached the engine."""


class RemoteProtocolError(TransportError):
    """The engine closed the connection or sent something that is not HTTP/1.1."""


class PoolTimeout(Exception):
    """No connection slot within pool_timeout_s: local starvation, not an engine fault."""


class ResponseTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"response body exceeds {limit} bytes")
        self.limit = limit


@attrs.frozen
class PoolStatistics:
    max_connections: int
    in_use: int
    idle: int
    waiting: int
    opened_total: int
    reused_total: int


class _Connection:
    __slots__ = ("h11", "last_used", "stream")

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(our_role=h11.CLIENT, max_incomplete_event_size=65536)
        self.last_used = trio.current_time()

    def peer_closed_or_spoke(self) -> bool:
        """An idle keep-alive connection must be silent; readable means EOF or junk."""
        poller = select.poll()
        poller.register(self.stream.socket.fileno(), select.POLLIN)
        return bool(poller.poll(0))


class Response:
    """A response whose body is read incrementally; valid inside `ConnectionPool.request`."""

    __slots__ = ("_conn", "_done", "_error", "_starved", "headers", "status")

    def __init__(self, conn: _Connection, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._conn = conn
        self._done = False
        self._error: RemoteProtocolError | None = None
        self._starved = False
        self.status = status
        self.headers = headers

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def receive_some(self) -> bytes:
        """The next body bytes as they arrive, one HTTP chunk at a time; b"" at the end.

        One chunk per call is part of what callers measure: the profiler's decode probe
        times each read, so chunks that arrived together must still come one by one.
        """
        return await self._read(batch=False)

    async def receive_available(self) -> bytes:
        """Like receive_some, but everything already received at once.

        An engine that writes faster than we read packs several SSE chunks into one
        socket read; the relay passes them on in one go (one pass through the relay and
        one client write instead of one per chunk).
        """
        return await self._read(batch=True)

    async def _read(self, *, batch: bool) -> bytes:
        if self._error is not None:
            raise self._error
        while not self._done:
            if self._starved:
                # _buffered already saw h11 ask for data; asking again would redo its parse.
                self._starved = False
                await _receive(self._conn)
            event = await _next_event(self._conn)
            if isinstance(event, h11.Data):
                if event.data:
                    return self._buffered(bytes(event.data)) if batch else bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._done = True
            else:
                raise RemoteProtocolError(f"unexpected {type(event).__name__} in response body")
        return b""

    def _buffered(self, data: bytes) -> bytes:
        """`data` plus the body events h11 already holds, without reading the socket.

        Seeing the end of the message here, in the read that brought it, also lets a
        caller that stops at the stream's own terminator (SSE `[DONE]`) hand a complete,
        reusable connection back to the pool. A protocol error found here is raised by
        the next call, after the data before it was delivered, as it would be unbatched.
        """
        parts: list[bytes] | None = None
        while True:
            try:
                event = self._conn.h11.next_event()
            except h11.RemoteProtocolError as exc:
                self._error = RemoteProtocolError(f"invalid or truncated HTTP from engine: {exc}")
                break
            if isinstance(event, h11.Data):
                if parts is None:
                    parts = [data]
                parts.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                self._done = True
                break
            elif event is h11.NEED_DATA:
                self._starved = True
                break
            else:
                self._error = RemoteProtocolError(
                    f"unexpected {type(event).__name__} in response body"
                )
                break
        return data if parts is None else b"".join(parts)

    async def aread(self, limit: int) -> bytes:
        """The whole body, refusing to retain more than `limit` bytes."""
        parts: list[bytes] = []
        size = 0
        while chunk := await self.receive_some():
            size += len(chunk)
            if size > limit:
                raise ResponseTooLarge(limit)
            parts.append(chunk)
        return b"".join(parts)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while chunk := await self.receive_some():
            yield chunk

    @property
    def complete(self) -> bool:
        return self._done


async def _next_event(conn: _Connection) -> h11.Event:
    """The next h11 event, reading from the socket as needed; EOF and junk are errors."""
    while True:
        try:
            event = conn.h11.next_event()
        except h11.RemoteProtocolError as exc:
            raise RemoteProtocolError(f"invalid or truncated HTTP from engine: {exc}") from None
        if isinstance(event, h11.Event):
            return event
        if event is h11.PAUSED:
            raise RemoteProtocolError("engine sent data after the response ended")
        await _receive(conn)


async def _receive(conn: _Connection) -> None:
    try:
        data = await conn.stream.receive_some(_RECEIVE_BYTES)
    except (trio.BrokenResourceError, OSError) as exc:
        raise RemoteProtocolError(f"connection broken while reading: {exc}") from None
    # b"" tells h11 about EOF; it then reports a truncated message as an error.
    conn.h11.receive_data(data)


class ConnectionPool:
    """Keep-alive connections to one engine origin."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        max_connections: int,
        connect_timeout_s: float,
        pool_timeout_s: float,
        idle_ttl_s: float = 4.0,
    ) -> None:
        self.host = host
        self.port = port
        self._host_header = f"{host}:{port}".encode()
        self._limiter = trio.CapacityLimiter(max_connections)
        self._idle: list[_Connection] = []
        self._in_use = 0
        self._opened_total = 0
        self._reused_total = 0
        self._closed = False
        self.connect_timeout_s = connect_timeout_s
        self.pool_timeout_s = pool_timeout_s
        # Servers close idle keep-alive connections (uvicorn after 5 s); reusing one just
        # as it is closed loses the request, so idle connections retire before that.
        self.idle_ttl_s = idle_ttl_s

    def __repr__(self) -> str:
        stats = self.statistics()
        return (
            f"<ConnectionPool {self.host}:{self.port} "
            f"[{stats.in_use}/{stats.max_connections} in use, {stats.idle} idle, "
            f"{stats.waiting} waiting]>"
        )

    def statistics(self) -> PoolStatistics:
        limiter_stats = self._limiter.statistics()
        return PoolStatistics(
            max_connections=int(self._limiter.total_tokens),
            in_use=self._in_use,
            idle=len(self._idle),
            waiting=limiter_stats.tasks_waiting,
            opened_total=self._opened_total,
            reused_total=self._reused_total,
        )

    @property
    def in_use(self) -> int:
        """`statistics().in_use` without building the statistics (asked per request)."""
        return self._in_use

    def resize(self, max_connections: int) -> None:
        """Applied in place on reload; requests in flight keep their connections."""
        self._limiter.total_tokens = max_connections
        del self._idle[max_connections:]

    def configure(self, *, connect_timeout_s: float, pool_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.pool_timeout_s = pool_timeout_s

    @asynccontextmanager
    async def request(
        self, method: bytes, target: bytes, headers: Headers = (), body: bytes = b""
    ) -> AsyncIterator[Response]:
        """Send one request; yields once the response head has arrived.

        The connection returns to the pool only when the body was read to the end; any
        other exit (error, cancellation, early break) closes it, which is how the engine
        learns that the request was abandoned.
        """
        if self._closed:
            raise ConnectError(f"pool for {self.host}:{self.port} is closed")
        borrower = object()
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            # A free slot is the common case; the timeout scope is only needed to wait.
            self._limiter.acquire_on_behalf_of_nowait(borrower)
        except trio.WouldBlock:
            with trio.move_on_after(self.pool_timeout_s) as wait:
                await self._limiter.acquire_on_behalf_of(borrower)
            if wait.cancelled_caught:
                raise PoolTimeout(
                    f"no connection to {self.host}:{self.port} within "
                    f"engine.pool_timeout_s={self.pool_timeout_s}"
                ) from None
        self._in_use += 1
        conn: _Connection | None = None
        reusable = False
        try:
            conn = await self._checkout()
            response = await self._send(conn, method, target, headers, body)
            yield response
            reusable = (
                response.complete
                and conn.h11.our_state is h11.DONE
                and conn.h11.their_state is h11.DONE
            )
        finally:
            self._in_use -= 1
            self._limiter.release_on_behalf_of(borrower)
            if conn is not None:
                if reusable and not self._closed:
                    conn.h11.start_next_cycle()
                    conn.last_used = trio.current_time()
                    self._idle.append(conn)
                else:
                    conn.stream.socket.close()

    async def _checkout(self) -> _Connection:
        now = trio.current_time()
        while self._idle:
            conn = self._idle.pop()
            if now - conn.last_used < self.idle_ttl_s and not conn.peer_closed_or_spoke():
                self._reused_total += 1
                return conn
            conn.stream.socket.close()
        try:
            with trio.fail_after(self.connect_timeout_s):
                stream = await trio.open_tcp_stream(self.host, self.port)
        except trio.TooSlowError:
            raise ConnectError(
                f"connect to {self.host}:{self.port} exceeded "
                f"engine.connect_timeout_s={self.connect_timeout_s}"
            ) from None
        except OSError as exc:
            raise ConnectError(
                f"connect to {self.host}:{self.port} failed: {_reason(exc)}"
            ) from None
        self._opened_total += 1
        return _Connection(stream)

    async def _send(
        self, conn: _Connection, method: bytes, target: bytes, headers: Headers, body: bytes
    ) -> Response:
        all_headers = [(b"host", self._host_header), *headers]
        if body or method == b"POST":
            all_headers.append((b"content-length", b"%d" % len(body)))
        wire = conn.h11.send(h11.Request(method=method, target=target, headers=all_headers))
        assert wire is not None
        if body:
            data = conn.h11.send(h11.Data(data=body))
            assert data is not None
            wire += data
        end = conn.h11.send(h11.EndOfMessage())
        assert end is not None
        wire += end
        try:
            await conn.stream.send_all(wire)
        except (trio.BrokenResourceError, OSError) as exc:
            raise RemoteProtocolError(f"connection broken while sending: {exc}") from None
        while True:
            event = await _next_event(conn)
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                return Response(conn, event.status_code, list(event.headers))
            raise RemoteProtocolError(f"unexpected {type(event).__name__} before response")

    async def __aenter__(self) -> ConnectionPool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._closed = True
        for conn in self._idle:
            conn.stream.socket.close()
        self._idle.clear()
        await trio.lowlevel.checkpoint()


def _reason(exc: OSError) -> str:
    # trio's happy-eyeballs connect wraps the per-address errors in __cause__.
    causes: list[BaseException] = [exc]
    if isinstance(exc.__cause__, BaseExceptionGroup):
        causes.extend(exc.__cause__.exceptions)
    for cause in causes:
        if isinstance(cause, OSError) and cause.errno == errno.ECONNREFUSED:
            return "connection refused"
    for cause in causes:
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror.lower()
    return str(exc)
