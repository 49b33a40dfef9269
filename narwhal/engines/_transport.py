"""A small HTTP/1.1 client connection pool on trio, with its own response parser.

Why not httpx: httpcore 1.0.9's pool rescans every connection for every queued request
(`_assign_requests_to_connections`), so its cost per request grows with the number of
connections; past ~32 in flight one core is spent on pool bookkeeping (measured: 63 ms
CPU per request at 256 in flight). A router holding hundreds of concurrent LLM streams
cannot afford that. This pool does O(1) work per request: a FIFO `CapacityLimiter` bounds
connections in use, and idle keep-alive connections sit on a LIFO stack.

Why not h11 either: a relayed token is one chunk of a chunked body, and h11's general
state machine cost ~40 % of the router's CPU on the streaming overhead benchmark (py-spy,
64 streams). The client side of HTTP/1.1 that an engine needs is small: we write the
request ourselves and parse a response head, then a body framed by Content-Length,
chunked transfer coding, or the connection's close. The parser is strict where being
lenient would hide a broken or hostile engine (bad status line, header syntax, framing
conflicts, sizes past `_LINE_LIMIT`) and checks the status line before the head is
complete, so a peer that is not HTTP at all is refused at its first line.

The pool imposes no read timeouts: deadlines belong to the caller's cancel scopes. It
does own the two timeouts that are about the pool itself, `pool_timeout_s` (waiting for
a connection slot) and `connect_timeout_s` (TCP connect).

The network is a seam: the pool opens its connections with `connect(host, port)`
(`trio.open_tcp_stream` unless told otherwise) and speaks over whatever
`trio.abc.Stream` it gets. Tests hand it one end of an in-memory stream pair
(tests/engines/memory.py), so the request path runs under a MockClock with no sockets,
as httpcore's mock backend allows. Sockets keep three fast paths the abstract stream
has no words for (a write that skips the scheduler, a poll that finds an idle
connection the engine closed, a close without a checkpoint); other streams go the
general way (`_Connection`).
"""

from __future__ import annotations

import errno
import os
import re
import select
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import attrs
import trio

Headers = Sequence[tuple[bytes, bytes]]
# How a pool opens a connection to (host, port). OSError means it could not (refused,
# unroutable); the pool bounds it by connect_timeout_s.
Connect = Callable[[str, int], Awaitable[trio.abc.Stream]]

_RECEIVE_BYTES = 65536
# The response head, a chunk-size line and the trailer section may each be this long.
_LINE_LIMIT = 65536

_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([1-9][0-9]{2})(?: [^\x00-\x08\x0a-\x1f\x7f]*)?")
_FIELD = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*([^\x00-\x08\x0a-\x1f\x7f]*?)[ \t]*")
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,15})[ \t]*(?:;[^\x00-\x08\x0a-\x1f\x7f]*)?")
_UNSAFE_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")

# Body framing, and where a chunked body's parser stands.
_LENGTH, _CHUNKED, _UNTIL_CLOSE = "length", "chunked", "until-close"
_SIZE, _DATA, _DATA_END, _TRAILER = "size", "data", "data-end", "trailer"


class TransportError(Exception):
    """The engine could not be reached or the connection broke (transient)."""


class ConnectError(TransportError):
    """TCP connect failed or timed out; nothing reached the engine. `timeout_s`: the
    connect deadline that ran out, None when the connect failed outright (refused,
    unroutable): a deadline can also run out because the router's own loop lagged."""

    def __init__(self, message: str, *, timeout_s: float | None = None) -> None:
        super().__init__(message)
        self.timeout_s = timeout_s


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
    __slots__ = ("buffer", "eof", "last_used", "socket", "stream")

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        # Set for a socket, whose fast paths the methods below take.
        self.socket = stream.socket if isinstance(stream, trio.SocketStream) else None
        self.buffer = bytearray()  # received, not yet parsed
        self.eof = False
        self.last_used = trio.current_time()

    def peer_closed_or_spoke(self) -> bool:
        """An idle keep-alive connection must be silent; readable means EOF or junk.

        Only a socket can be asked without reading from it; any other stream is taken
        as silent, and a request on one its peer closed fails as it would had the
        engine closed it just after this check."""
        if self.socket is None:
            return False
        poller = select.poll()
        poller.register(self.socket.fileno(), select.POLLIN)
        return bool(poller.poll(0))

    def write_now(self, data: bytes) -> int:
        """Bytes of `data` a socket took at once, without the scheduler (0 when its buffer
        is full, and always for another stream); OSError when the connection is broken."""
        if self.socket is None:
            return 0
        try:
            return os.write(self.socket.fileno(), data)
        except BlockingIOError:
            return 0

    async def close(self) -> None:
        """Close at once, even when cancelled. A socket is closed without a checkpoint:
        this runs in the `finally` of every request that does not reuse its connection."""
        if self.socket is not None:
            self.socket.close()
        else:
            await trio.aclose_forcefully(self.stream)

    async def fill(self) -> None:
        """Append what the stream has next; sets `eof` when the engine closed."""
        try:
            data = await self.stream.receive_some(_RECEIVE_BYTES)
        except (trio.BrokenResourceError, OSError) as exc:
            raise RemoteProtocolError(f"connection broken while reading: {exc}") from None
        if data:
            self.buffer += data
        else:
            self.eof = True

    def take_line(self, what: str) -> bytes | None:
        """One line without its CRLF (a bare LF also ends it), or None until it is complete."""
        buffer = self.buffer
        end = buffer.find(b"\n")
        if end < 0:
            if len(buffer) > _LINE_LIMIT:
                raise RemoteProtocolError(f"{what} exceeds {_LINE_LIMIT} bytes")
            return None
        if end > _LINE_LIMIT:
            raise RemoteProtocolError(f"{what} exceeds {_LINE_LIMIT} bytes")
        line = bytes(buffer[: end - 1 if end and buffer[end - 1] == 13 else end])
        del buffer[: end + 1]
        return line


def _bad(what: str, line: bytes) -> RemoteProtocolError:
    shown = line[:60] + (b"..." if len(line) > 60 else b"")
    return RemoteProtocolError(f"invalid HTTP from engine: {what} {shown!r}")


async def _read_head(conn: _Connection) -> tuple[int, bool, list[tuple[bytes, bytes]]]:
    """Status, HTTP/1.1?, headers (names lower-cased) of the next final response."""
    while True:
        status_line = None
        headers: list[tuple[bytes, bytes]] = []
        size = 0
        while True:
            what = "response head" if status_line is not None else "status line"
            line = conn.take_line(what)
            if line is None:
                if status_line is None and not _could_be_http(conn.buffer):
                    raise _bad("not an HTTP/1.x status line:", bytes(conn.buffer))
                if conn.eof:
                    raise RemoteProtocolError(
                        "engine closed the connection before the response head ended"
                    )
                await conn.fill()
                continue
            size += len(line) + 2
            if size > _LINE_LIMIT:
                raise RemoteProtocolError(f"response head exceeds {_LINE_LIMIT} bytes")
            if status_line is None:
                match = _STATUS_LINE.fullmatch(line)
                if match is None:
                    raise _bad("not an HTTP/1.x status line:", line)
                status_line = match
            elif not line:
                break
            else:
                field = _FIELD.fullmatch(line)
                if field is None:
                    raise _bad("malformed header line", line)
                headers.append((field[1].lower(), field[2]))
        status = int(status_line[2])
        if status == 101:
            raise RemoteProtocolError("engine switched protocols (HTTP 101)")
        if status >= 200:
            return status, status_line[1] == b"1", headers


def _could_be_http(pending: bytearray) -> bool:
    """A partial first line that can still become `HTTP/1.x ...`."""
    prefix = bytes(pending[:7])
    return b"HTTP/1."[: len(prefix)] == prefix


def _framing(status: int, headers: list[tuple[bytes, bytes]]) -> tuple[str, int]:
    """How the body ends (RFC 9112 section 6.3), and its length when it has one."""
    if status in (204, 304):
        return _LENGTH, 0
    codings = [v.strip().lower() for k, v in headers if k == b"transfer-encoding"]
    lengths = {v for k, v in headers if k == b"content-length"}
    if codings:
        if lengths:
            # A proxy and we could disagree on where the body ends; refuse both.
            raise RemoteProtocolError("engine sent both Transfer-Encoding and Content-Length")
        if codings != [b"chunked"]:
            raise RemoteProtocolError(f"unsupported transfer-encoding {b', '.join(codings)!r}")
        return _CHUNKED, 0
    if lengths:
        if len(lengths) > 1 or not all(v.isdigit() for v in lengths):
            raise RemoteProtocolError(f"invalid content-length {sorted(lengths)!r}")
        return _LENGTH, int(lengths.pop())
    return _UNTIL_CLOSE, 0


def _keep_alive(http11: bool, headers: list[tuple[bytes, bytes]]) -> bool:
    if not http11:
        return False
    for key, value in headers:
        if key == b"connection" and b"close" in [t.strip() for t in value.lower().split(b",")]:
            return False
    return True


class Response:
    """A response whose body is read incrementally; valid inside `ConnectionPool.request`."""

    __slots__ = (
        "_conn",
        "_done",
        "_error",
        "_framing",
        "_remaining",
        "_state",
        "_trailer_bytes",
        "headers",
        "keep_alive",
        "status",
    )

    def __init__(
        self, conn: _Connection, status: int, http11: bool, headers: list[tuple[bytes, bytes]]
    ) -> None:
        self._conn = conn
        self._framing, self._remaining = _framing(status, headers)
        self._done = self._framing is _LENGTH and not self._remaining
        self._state = _SIZE
        self._trailer_bytes = 0
        self._error: RemoteProtocolError | None = None
        self.status = status
        self.headers = headers
        self.keep_alive = self._framing is not _UNTIL_CLOSE and _keep_alive(http11, headers)

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
        one client write instead of one per chunk). Seeing the end of the message here,
        in the read that brought it, also lets a caller that stops at the stream's own
        terminator (SSE `[DONE]`) hand a complete, reusable connection back to the pool.
        A protocol error found after some data is raised by the next call, once the
        data before it was delivered, as it would be unbatched.
        """
        return await self._read(batch=True)

    async def _read(self, *, batch: bool) -> bytes:
        if self._error is not None:
            raise self._error
        conn = self._conn
        while (data := self._step()) is None:
            if conn.eof:
                if self._framing is _UNTIL_CLOSE:
                    self._done = True
                    return b""
                raise RemoteProtocolError("engine closed the connection mid-body (truncated)")
            await conn.fill()
        if not data or not batch:
            return data
        parts = [data]
        while True:
            try:
                more = self._step()
            except RemoteProtocolError as exc:
                self._error = exc
                break
            if not more:
                break
            parts.append(more)
        return data if len(parts) == 1 else b"".join(parts)

    def _step(self) -> bytes | None:
        """The next body bytes already received (one chunk's worth at most), b"" at the
        end of the body, None when more must be read from the socket."""
        buffer = self._conn.buffer
        while not self._done:
            if self._framing is _UNTIL_CLOSE:
                if not buffer:
                    return None
                data = bytes(buffer)
                buffer.clear()
                return data
            state = self._state
            if self._framing is _LENGTH or state is _DATA:
                if not buffer:
                    return None
                size = min(self._remaining, len(buffer))
                data = bytes(buffer[:size])
                del buffer[:size]
                self._remaining -= size
                if not self._remaining:
                    if self._framing is _LENGTH:
                        self._done = True
                    else:
                        self._state = _DATA_END
                return data
            if state is _DATA_END:
                ending = self._conn.take_line("chunk data end")
                if ending is None:
                    return None
                if ending:
                    raise _bad("chunk data not followed by CRLF:", ending)
                self._state = _SIZE
                continue
            line = self._conn.take_line("chunk size line" if state is _SIZE else "trailer")
            if line is None:
                return None
            if state is _SIZE:
                match = _CHUNK_SIZE.fullmatch(line)
                if match is None:
                    raise _bad("invalid chunk size line", line)
                self._remaining = int(match[1], 16)
                self._state = _DATA if self._remaining else _TRAILER
            elif not line:
                self._done = True
            else:
                # Trailer fields are not used; they are bounded like a head.
                self._trailer_bytes += len(line) + 2
                if self._trailer_bytes > _LINE_LIMIT or _FIELD.fullmatch(line) is None:
                    raise _bad("invalid or oversized trailer", line)
        return b""

    async def aread(self, limit: int) -> bytes:
        """The whole body, refusing to retain more than `limit` bytes."""
        parts: list[bytes] = []
        size = 0
        while chunk := await self.receive_available():
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
        api_key: str | None = None,
        connect: Connect = trio.open_tcp_stream,
    ) -> None:
        self.host = host
        self.port = port
        # Used for each new connection, so replacing it applies from the next one.
        self.connect = connect
        self._host_header = f"{host}:{port}".encode()
        self._auth = b""
        self.set_api_key(api_key)
        self._limiter = trio.CapacityLimiter(max_connections)
        self._idle: list[_Connection] = []
        # Idle connections a smaller pool no longer keeps, closed at the next await.
        self._surplus: list[_Connection] = []
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
        """Applied in place on reload; requests in flight keep their connections. Idle
        connections beyond the new size are closed at the pool's next request (or its
        close), and a finished request's connection is kept only while there is room."""
        self._limiter.total_tokens = max_connections
        self._surplus += self._idle[max_connections:]
        del self._idle[max_connections:]

    def configure(self, *, connect_timeout_s: float, pool_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.pool_timeout_s = pool_timeout_s

    def set_api_key(self, api_key: str | None) -> None:
        """Send `authorization: Bearer <api_key>` on every request from now on (None: no
        credential). Requests already sent keep the header they went out with; on reload
        this is how a rotated key takes effect."""
        if api_key is None:
            self._auth = b""
            return
        value = b"Bearer " + api_key.encode("ascii", "replace")
        # The loader admits only printable ASCII; checked again because a bad key here
        # would inject headers. The message must not contain the key.
        if _UNSAFE_VALUE.search(value) or not api_key.isascii():
            raise ValueError("refusing an API key that cannot be sent in an HTTP header")
        self._auth = b"authorization: %s\r\n" % value

    @property
    def sends_api_key(self) -> bool:
        return bool(self._auth)

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
            # Bytes after the end of the response would be read as the next one's.
            reusable = response.complete and response.keep_alive and not conn.buffer
        finally:
            self._in_use -= 1
            self._limiter.release_on_behalf_of(borrower)
            if conn is not None:
                if reusable and not self._closed and len(self._idle) < self._limiter.total_tokens:
                    conn.last_used = trio.current_time()
                    self._idle.append(conn)
                else:
                    await conn.close()

    async def _checkout(self) -> _Connection:
        await self._close_surplus()
        now = trio.current_time()
        while self._idle:
            conn = self._idle.pop()
            if now - conn.last_used < self.idle_ttl_s and not conn.peer_closed_or_spoke():
                self._reused_total += 1
                return conn
            await conn.close()
        try:
            with trio.fail_after(self.connect_timeout_s):
                stream = await self.connect(self.host, self.port)
        except trio.TooSlowError:
            raise ConnectError(
                f"connect to {self.host}:{self.port} exceeded "
                f"engine.connect_timeout_s={self.connect_timeout_s}",
                timeout_s=self.connect_timeout_s,
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
        lines = [
            b"%s %s HTTP/1.1\r\nhost: %s\r\n%s" % (method, target, self._host_header, self._auth)
        ]
        for name, value in headers:
            # Values may carry client-chosen text (a request id); no header injection.
            if _UNSAFE_VALUE.search(value) or _FIELD.fullmatch(name + b":") is None:
                raise ValueError(f"refusing to send header {name!r}: {value!r}")
            lines.append(b"%s: %s\r\n" % (name, value))
        if body or method == b"POST":
            lines.append(b"content-length: %d\r\n" % len(body))
        lines.append(b"\r\n")
        lines.append(body)
        data = b"".join(lines)
        try:
            # A request nearly always fits the socket buffer at once. Writing it
            # synchronously first skips send_all's pass through the scheduler (trio yields
            # even after a send that completed): under load each pass is a full queue,
            # paid by every engine request before it is even sent. The wait for the
            # response head below is the request's checkpoint.
            sent = conn.write_now(data)
            if sent < len(data):
                await conn.stream.send_all(memoryview(data)[sent:])
        except (trio.BrokenResourceError, OSError) as exc:
            raise RemoteProtocolError(f"connection broken while sending: {exc}") from None
        status, http11, response_headers = await _read_head(conn)
        return Response(conn, status, http11, response_headers)

    async def __aenter__(self) -> ConnectionPool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._closed = True
        self._surplus += self._idle
        self._idle = []
        await self._close_surplus()
        await trio.lowlevel.checkpoint()

    async def _close_surplus(self) -> None:
        while self._surplus:
            await self._surplus.pop().close()


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
