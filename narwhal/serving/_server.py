"""Serving the ASGI app with hypercorn on trio, with client backpressure enforced.

hypercorn's trio TCPServer writes every response chunk inside a shielded cancel scope.
A client that stops reading fills its socket buffer, `send_all` blocks, and the shield
means no deadline can interrupt it: the request would hold its engine stream forever.
docs/design.md#streaming-failures wants the opposite (client backpressure closes the connection
immediately), so the connection class below bounds each write by serving.client_stall_s and aborts
the connection when it cannot complete. A write interrupted after some bytes went out also aborts
the connection, because the HTTP stream is no longer well formed.

The same class also trims hypercorn's per-request and per-chunk scheduling costs (a
synchronous first write attempt, a cheaper keep-alive idle timer, no scope per read:
`serve_app` refuses hypercorn's read_timeout, which this read loop would not apply);
behaviour is hypercorn's.

Connections are accepted in bursts (`accept_pending`): trio's serve_listeners accepts one
connection per pass of the scheduler, so while the router is busy (a flood of requests on
established connections, each pass taking hundreds of ms) new connections wait in the
kernel's backlog for seconds before their first byte is read. One readiness wake-up now
accepts everything pending, up to `ACCEPT_BURST` and the room listen.max_open_connections
leaves (`OpenConnections`): at that limit the longest-idle connection is closed to make
room for a new one, and with none idle new ones wait in the backlog. Likewise per client
address at listen.max_open_connections_per_client, among that address's connections; with
none of them idle, the new one is answered 429 `connections_per_client` at once, before
its request is read (there is no request to wait for yet, and waiting for one would let
a client that trickles its head hold the connection), and closed as a refused request's
connection is (`_linger`).

hypercorn's HTTP/1.1 protocol stops reading a connection while a request is in flight
and bytes of another one (pipelined, or stray bytes after a body) are already buffered:
it waits on its `can_read` event, inside the read loop. A client that leaves then is
never seen to leave, so its request would hold its engines until a timer ends it, and
its engine leg would be charged with the failure. `_ClientWatch` replaces that event
and watches the socket for the end of the connection meanwhile.

The end of a client's stream is not always the client leaving: one that half-closed
after a complete request (`shutdown(SHUT_WR)`, `nc -N`) still reads its answer, and the
connection closes after it. Both send the same FIN, so until the answer begins such a
connection is written an interim `100 Continue`, which a client that closed instead
answers with a reset: it is gone, and its request cancelled as before (`_until_gone`).
A request the end of stream cuts short is answered 400 `request_incomplete`.

A request h11 cannot parse (a bad request line or header, a head over hypercorn's 16 kB, a
Transfer-Encoding other than chunked) is answered by hypercorn itself, with a bare
400/431/501 and no body. `_ClientProtocolErrors`, the h11 connection H11Protocol is given,
reports it (counted and logged by the caller) and gives that answer the error envelope.
It also follows RFC 9112 where h11 is stricter: empty lines before a request line are
ignored, and what follows a request that closes its connection is dropped unread.

The listener speaks HTTP/1.1 only. hypercorn's H11Protocol switches a connection to
HTTP/2 when the request h11 hands it is `PRI * HTTP/2.0` (the first line of HTTP/2's
connection preface, which h11 parses as a request) or carries `Upgrade: h2c`, and it has
no setting to turn either off (`alpn_protocols` is for TLS, which Narwhal does not
serve). The same h11 connection therefore hands it no such request: a request line of
another major version than 1 is refused 505 through the error path above (the preface
is answered in HTTP/2, a GOAWAY with HTTP_1_1_REQUIRED, and counted as a 505), and an
`Upgrade: h2c` header is dropped, so the request is served as the HTTP/1.1 request it
also is (RFC 9110 7.8 lets a server ignore an upgrade). Both act on the events
H11Protocol reads from the connection it is given, before it looks at them: no
hypercorn code is patched, and hypercorn 0.18's only ways into HTTP/2 on a connection
without TLS are these two requests (tests/serving/test_server.py fails if a later one
serves HTTP/2 to an h2c or a prior-knowledge client). The same connection also
holds h11's head limit to complete heads: h11 checks it only while a head is still
arriving, so a larger head that came in one read was served.

A connection that closes after an answer its client may still be sending to (a
protocol error's, the app's to a request whose body it left unread: a 413 over
serving.max_request_bytes, a 408 at serving.body_timeout_s, a 429 or 503 before the
body; or one to a request that closes its connection with more bytes behind it) first
ends its sending side and reads and drops what the client sends, for at most 1 s and
256 kB (`_linger`): closing with the client's bytes unread resets
the connection, and the client's next write fails before it reads why. hypercorn
closes after the app's answer from the app's task, so the read loop, the only task
that may read the stream, is stopped and lingers and closes instead.

This relies on hypercorn's TCPServer/WorkerContext classes (TCPServer's _read_data and
idle_task, H11Protocol's can_read and connection, that H11Protocol answers a
RemoteProtocolError from its connection's next_event by sending a Response with the
error's status hint through the same connection, and that it reports the end of a
connection through `send(Closed())`), which are not documented API, and on h11's
private receive buffer (`_ClientProtocolErrors._drop_buffered`);
tests/serving/test_server.py fails if a hypercorn or h11 upgrade changes them. They are
checked against the releases of `_hypercorn_pin.HYPERCORN_RANGE`, which pyproject.toml
pins and which is checked before they are imported; no other module imports hypercorn
(docs/design.md#http-server). Telling
a reset from an end of stream takes epoll (`_wait_reset`): the server runs on Linux.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
from collections.abc import Awaitable, Callable, Hashable, MutableMapping
from functools import partial
from http import HTTPStatus
from typing import Any, cast

import h11
import trio

from .._codes import ErrorCode
from .._errors import MalformedRequest, NarwhalError
from .._hypercorn_pin import (
    UnsupportedHypercorn,
    installed_hypercorn,
    require_supported_hypercorn,
    supported_text,
)
from ..config import Listen
from ._client import json_bytes
from ._connections import OpenConnections
from ._per_client import client_key

# Before hypercorn's private names are imported: a release outside the range they were
# checked against is refused by name, not by whatever it broke (see _hypercorn_pin).
require_supported_hypercorn()
try:
    from hypercorn.app_wrappers import ASGIWrapper
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.events import Closed, Event, RawData, Updated
    from hypercorn.protocol.h11 import H11Protocol
    from hypercorn.trio.task_group import TaskGroup
    from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
    from hypercorn.trio.worker_context import EventWrapper, WorkerContext
    from hypercorn.typing import ASGIFramework, ConnectionState
except ImportError as exc:
    raise UnsupportedHypercorn(
        f"hypercorn {installed_hypercorn()} is installed but lacks what narwhal's HTTP "
        f"server imports ({exc}): reinstall hypercorn{supported_text()}"
    ) from exc

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]
Handler = Callable[[trio.SocketStream], Awaitable[object]]

log = logging.getLogger("narwhal.server")

# Connections accepted per readiness wake-up of a listening socket: enough to empty a
# backlog in a few scheduler passes, bounded so one listener cannot hold the loop.
ACCEPT_BURST = 256
# accept() errors that mean "out of file descriptors or memory": wait, then retry.
_ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
# accept() errors about one connection that died in the backlog: skip it.
_ACCEPT_SKIP_ERRNOS = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM})
_ACCEPT_CAPACITY_PAUSE_S = 0.1
# After a protocol error's answer, what is read (and dropped) of the client's bytes
# before the connection closes: see _linger.
_LINGER_S = 1.0
_LINGER_BYTES = 256 * 1024


def accept_pending(
    listening: socket.socket, limit: int
) -> tuple[list[tuple[trio.SocketStream, str]], int | None]:
    """Every connection waiting on a non-blocking listening socket, up to `limit`, with
    its client's host, without yielding; and the errno that stopped it early if the
    process or system ran out of descriptors or memory (None: the backlog was emptied,
    or `limit` reached)."""
    streams: list[tuple[trio.SocketStream, str]] = []
    while len(streams) < limit:
        try:
            conn, address = listening.accept()
        except BlockingIOError:
            break
        except OSError as exc:
            if exc.errno in _ACCEPT_SKIP_ERRNOS:
                continue
            if exc.errno in _ACCEPT_CAPACITY_ERRNOS:
                return streams, exc.errno
            raise
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(conn))
        streams.append((stream, str(address[0])))
    return streams, None


async def _serve_connection(
    handler: Handler, stream: trio.SocketStream, open_connections: OpenConnections
) -> None:
    try:
        await handler(stream)
    finally:
        await trio.aclose_forcefully(stream)
        open_connections.closed(stream)


async def _linger(stream: trio.SocketStream) -> None:
    """Before a connection closes after an answer the client may still be sending to,
    end the sending side and read until the client closes (at most _LINGER_S and
    _LINGER_BYTES).

    Closing a socket with unread bytes resets the connection, and a client still
    sending (an HTTP/2 client's frames after its preface, the rest of an oversized
    head, or of a body the app refused) then fails its next write: an HTTP/2 client
    through httpx posting a body reported a broken pipe, not the GOAWAY, and a
    client that stops at the failed write never reads its 413 or 408 (httpx's
    HTTP/1.1 client reads on after one). Linux keeps an answer that arrived before
    the reset readable, but RFC 9112 9.6 warns that a reset may erase it first.
    The bounds keep what a refused client can hold (its connection slot) small.
    This runs in the task that reads the stream (the read loop's, or the refusal's),
    so nothing else is reading it."""
    try:
        await stream.send_eof()
        dropped = 0
        with trio.move_on_after(_LINGER_S):
            while dropped < _LINGER_BYTES:
                data = await stream.receive_some(MAX_RECV)
                if not data:
                    break
                dropped += len(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
        pass


def _answer(error: NarwhalError) -> bytes:
    """`error` as a whole HTTP/1.1 response that closes its connection."""
    body = json_bytes(error.envelope())
    head = [
        f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}".encode(),
        b"content-type: application/json",
        b"content-length: %d" % len(body),
        *(name + b": " + value for name, value in error.headers()),
        b"connection: close",
    ]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


async def _refuse_connection(
    stream: trio.SocketStream, error: NarwhalError, open_connections: OpenConnections
) -> None:
    """Answer a connection refused at accept with `error` without reading its request,
    and close it once the client has read it (at most _LINGER_S). The answer fits an
    empty socket buffer, so it goes out at once."""
    open_connections.refusing(stream, stream.socket.close)
    try:
        with trio.move_on_after(_LINGER_S):
            await stream.send_all(_answer(error))
        await _linger(stream)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await trio.aclose_forcefully(stream)
        open_connections.closed(stream)


async def _accept_loop(
    listener: trio.SocketListener,
    handler: Handler,
    connections: trio.Nursery,
    open_connections: OpenConnections,
) -> None:
    # A second descriptor for the same listening socket: the stdlib object accepts
    # synchronously (the socket is already non-blocking), trio's wakes us when ready.
    # Both close when accepting stops, so connections then get refused, not stranded.
    async with listener:
        with socket.socket(fileno=os.dup(listener.socket.fileno())) as listening:
            listening.setblocking(False)
            await _accept_until_cancelled(listening, handler, connections, open_connections)


async def _accept_until_cancelled(
    listening: socket.socket,
    handler: Handler,
    connections: trio.Nursery,
    open_connections: OpenConnections,
) -> None:
    while True:
        await trio.lowlevel.wait_readable(listening)
        if not open_connections.room():
            open_connections.limit_reached()
            while not open_connections.make_room():
                await open_connections.wait_room()
        streams, failed = accept_pending(listening, min(ACCEPT_BURST, open_connections.room()))
        for stream, host in streams:
            refusal = open_connections.opened(stream, client_key(host))
            if refusal is None:
                connections.start_soon(_serve_connection, handler, stream, open_connections)
            else:
                connections.start_soon(_refuse_connection, stream, refusal, open_connections)
        if failed is None:
            open_connections.accepted_all()
            continue
        # The listening socket stays readable while connections wait, so without a
        # pause this would spin; the connections accepted above get served meanwhile.
        open_connections.accept_failed(failed, _ACCEPT_CAPACITY_PAUSE_S)
        await trio.sleep(_ACCEPT_CAPACITY_PAUSE_S)


class _IdleTask:
    """hypercorn's TrioSingleTask (the keep-alive idle timer) at a lower cost per request.

    hypercorn restarts the idle timer whenever a connection finishes a response and stops
    it when the next request arrives. TrioSingleTask does that under a trio.Lock with
    `nursery.start`, which waits for the new task to run: a few scheduler passes and a
    temporary nursery per request. Neither is needed: restart and stop never await, so
    they cannot interleave, and the scope the timer runs in can be made before its task
    starts (cancelling it first means the timer never runs).

    The timer runs exactly while the connection has no request in flight, so it also
    tells `OpenConnections` which connections it may close to make room.
    """

    __slots__ = ("_close", "_connections", "_key", "_scope")

    def __init__(
        self, connections: OpenConnections, key: Hashable, close: Callable[[], None]
    ) -> None:
        self._scope: trio.CancelScope | None = None
        self._connections = connections
        self._key = key
        self._close = close

    async def restart(self, task_group: TaskGroup, action: Callable[[], Awaitable[None]]) -> None:
        if self._scope is not None:
            self._scope.cancel()
        self._scope = trio.CancelScope()
        task_group.spawn(_run_in, self._scope, action)
        self._connections.idle(self._key, self._close)

    async def stop(self) -> None:
        if self._scope is not None:
            self._scope.cancel()
        self._scope = None
        self._connections.busy(self._key)


async def _run_in(scope: trio.CancelScope, action: Callable[[], Awaitable[None]]) -> None:
    with scope:
        await action()


class _ClientLeft(Exception):
    """The connection ended while the protocol was not reading it."""


class _ClientWatch(EventWrapper):
    """H11Protocol's `can_read`, which also notices the client leaving while it is waited on.

    The protocol waits on it, inside the connection's read loop, while a response is
    being produced and the next request's bytes are already buffered. Meanwhile this
    peeks at the socket: a reset, or an end of stream after which `until_gone` returns
    (the client closed, not half-closed: see `_StallBoundTCPServer._until_gone`), raises
    `_ClientLeft` out of the protocol to the read loop, which then reports the
    connection closed, as it does for a client that leaves between requests. Peeking
    consumes nothing, so when more bytes are waiting in the kernel the end cannot be
    seen behind them without reading them, and the watch stops (the write of the
    response still notices a closed connection).
    """

    def __init__(
        self, sock: trio.socket.SocketType, until_gone: Callable[[], Awaitable[None]]
    ) -> None:
        super().__init__()
        self._socket = sock
        self._until_gone = until_gone
        self._watch: trio.CancelScope | None = None

    async def set(self) -> None:
        await super().set()
        if self._watch is not None:
            self._watch.cancel()

    async def wait(self) -> None:
        if self.is_set():
            return
        with trio.CancelScope() as self._watch:
            try:
                peeked = await self._socket.recv(1, socket.MSG_PEEK)
            except (OSError, trio.ClosedResourceError):
                # ClosedResourceError: a failed write closed the socket under us.
                raise _ClientLeft from None
            if not peeked:
                await self._until_gone()
                raise _ClientLeft
        self._watch = None
        await super().wait()


async def _wait_reset(sock: trio.socket.SocketType) -> None:
    """Until the connection fails (reset by the peer, or closed on both sides).

    At the end of the client's stream the socket is readable for good and writable while
    its buffer has room, so neither wait can tell a reset. An epoll instance watching it
    for no event still reports EPOLLERR and EPOLLHUP, and is itself readable then."""
    with select.epoll() as watch:
        watch.register(sock.fileno(), 0)
        await trio.lowlevel.wait_readable(watch.fileno())


# h11's message names what it could not parse, and quotes up to a whole header line of
# the client's bytes: the answer and the log keep this much of it.
_PROTOCOL_ERROR_CHARS = 200
_PROTOCOL_ERROR_CODES = {
    431: ErrorCode.REQUEST_HEAD_TOO_LARGE,
    501: ErrorCode.UNSUPPORTED_TRANSFER_ENCODING,
}
# How h11 words a request its client's end of stream cut short: in the head, and in the
# body (followed by what it was missing, in brackets).
_CUT_SHORT = (
    "peer unexpectedly closed connection",
    "peer closed connection without sending complete message body",
)


def _ignore_protocol_error(error: MalformedRequest) -> None:
    pass


class _Refused(h11.RemoteProtocolError):
    """A request h11 parsed that Narwhal does not serve, raised where h11 raises its own
    errors so that hypercorn answers it the same way."""

    def __init__(self, error: MalformedRequest) -> None:
        super().__init__(error.message, error_status_hint=error.status)
        self.error = error


def _is_h2_preface(request: h11.Request) -> bool:
    return request.method == b"PRI" and request.target == b"*" and request.http_version == b"2.0"


def _refuse_version(request: h11.Request) -> MalformedRequest:
    if _is_h2_preface(request):
        # Logged as "answered 505" with the HTTP/1.1 refusals; the client sees a GOAWAY.
        message = (
            "HTTP/2 connection preface (prior knowledge) refused with GOAWAY "
            "HTTP_1_1_REQUIRED: this listener serves HTTP/1.1 only"
        )
    else:
        version = request.http_version.decode("ascii")
        message = f"HTTP/{version} request refused: this listener serves HTTP/1.1 only"
    return MalformedRequest(message, status=505, code=ErrorCode.HTTP_VERSION_NOT_SUPPORTED)


def _h2_frame(kind: int, payload: bytes) -> bytes:
    # RFC 9113 4.1: 24-bit length, type, flags (none here), stream 0 (the connection).
    return len(payload).to_bytes(3, "big") + bytes([kind, 0]) + bytes(4) + payload


def _h2_refusal(message: str) -> bytes:
    """What a client that opened with HTTP/2's preface is answered, in HTTP/2: the
    server's preface (an empty SETTINGS frame, which must come first) and a GOAWAY with
    HTTP_1_1_REQUIRED, no stream processed, and `message` as its debug data. An
    HTTP/1.1 response reaches such a client as a malformed frame (curl 7.88: "Empty
    reply from server"); this it reports as what it is (curl: "received GOAWAY,
    error=13"; h2: ConnectionTerminated with HTTP_1_1_REQUIRED and the message)."""
    no_stream, http_1_1_required = 0, 0xD
    goaway = no_stream.to_bytes(4, "big") + http_1_1_required.to_bytes(4, "big")
    return _h2_frame(0x4, b"") + _h2_frame(0x7, goaway + message.encode())


def _offers_h2c(name: bytes, value: bytes) -> bool:
    return name.lower() == b"upgrade" and any(
        token.strip().lower() == b"h2c" for token in value.split(b",")
    )


def _without_h2c_upgrade(request: h11.Request) -> h11.Request:
    """`request` without an `Upgrade` header that offers h2c (or `request` itself)."""
    # This runs for every request: a list of the raw headers and a length test cost
    # about 3 µs for a typical client's dozen headers, iterating `request.headers`
    # (a Sequence, one __getitem__ per header) nearly twice that.
    headers = request.headers.raw_items()
    for name, value in headers:
        if len(name) == 7 and _offers_h2c(name, value):
            break
    else:
        return request
    return h11.Request(
        method=request.method,
        target=request.target,
        headers=[(name, value) for name, value in headers if not _offers_h2c(name, value)],
        http_version=request.http_version,
    )


class _ClientProtocolErrors(h11.Connection):
    """The h11 server connection of one client connection, which reports the client's
    protocol errors and answers them with the error envelope, and hands hypercorn only
    HTTP/1.x requests with a head within the limit.

    hypercorn's H11Protocol answers a RemoteProtocolError from `next_event` with a
    response of the error's status hint, `content-length: 0` and `connection: close`,
    sent through `send`, then closes. The error is recorded where h11 raises it, and
    from then on `send` turns that response into one with the envelope as its body: the
    instance's `send` is only replaced then, so the request path's sends (every response
    chunk) cost nothing more. A request cut short by the end of the client's stream is
    such an error too (400 `request_incomplete`): a client that half-closed still reads
    the answer. Once its answer has begun, the client may stop sending (after a 413), and
    that is no error.

    RFC 9112 is followed where h11 is stricter: empty lines before a request line are
    ignored (2.2; h11 refused "no request line received"), and what follows a request
    that closes the connection (`Connection: close`, HTTP/1.0) is dropped unread (9.6: it
    is never processed; h11 refused "Got data when expecting EOF", in place of the
    answer). Either way `unread` then makes the close linger, so that a client still
    sending gets to read its answer. Neither h11 nor hypercorn has a public way to drop
    bytes h11 has buffered (`_drop_buffered`, h11's private receive buffer).

    A request h11 parsed is refused the same way (`_Refused`) when its head is over the
    limit, or its version is not HTTP/1.x. h11 bounds only a head still arriving (its
    buffer, when it needs more data), so a larger head that arrived whole in one read,
    up to 64 kB, was served. The head's exact size is what was buffered when it began
    (`_head_bytes`: what was left at `start_next_cycle`, plus every byte received until
    h11 parsed it) less what is left after it. Counting uses h11's public interface
    only; the buffer is copied (`trailing_data`) at a new cycle, which is nearly always
    empty, and after a head only when what was buffered exceeds the limit.

    An `Upgrade: h2c` header is dropped from the request handed on; HTTP/2's preface is
    refused in HTTP/2 (`_answer`, which replaces the HTTP/1.1 response hypercorn sends).
    Every status line gets its status's reason phrase (`_with_reason`).
    """

    def __init__(
        self, *, max_incomplete_event_size: int, report: Callable[[MalformedRequest], None]
    ) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_incomplete_event_size)
        self._max_head = max_incomplete_event_size
        self._report = report
        self._error: MalformedRequest | None = None
        self._answer: bytes | None = None  # the error's answer, when not HTTP/1.1
        # The client may be sending what will not be read (after a protocol error's
        # answer, or a request that closes the connection): it must get to read its answer.
        self.unread = False
        self._head_bytes = 0

    def receive_data(self, data: bytes) -> None:
        state = self.their_state
        if state is h11.IDLE:
            if not self._head_bytes and data:
                data = data.lstrip(b"\r\n")  # empty lines before a request line
                if not data:
                    return
            self._head_bytes += len(data)
        elif state is h11.MUST_CLOSE and data:
            self.unread = True
            return
        super().receive_data(data)

    def start_next_cycle(self) -> None:
        super().start_next_cycle()
        # A pipelined request's bytes, already received, and any empty lines before it.
        pipelined = self.trailing_data[0]
        head = pipelined.lstrip(b"\r\n")
        if len(head) < len(pipelined):
            self._drop_buffered(len(pipelined) - len(head))
        self._head_bytes = len(head)

    def _drop_buffered(self, count: int) -> None:
        self._receive_buffer.maybe_extract_at_most(count)

    def send_with_data_passthrough(self, event: h11.Event) -> list[bytes] | None:
        # Every send goes through here: the request path's and the envelope's.
        return super().send_with_data_passthrough(_with_reason(event))

    def next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        state = self.their_state
        try:
            if state is not h11.IDLE:
                if state is h11.MUST_CLOSE and (buffered := len(self.trailing_data[0])):
                    # What came with the request's end, before receive_data dropped more.
                    self.unread = True
                    self._drop_buffered(buffered)
                return super().next_event()
            event = super().next_event()
            if type(event) is h11.Request:
                return self._admit(event)
            return event
        except h11.RemoteProtocolError as exc:
            if self._error is None:
                error = exc.error if isinstance(exc, _Refused) else self._describe(exc, state)
                if error is not None:
                    self._error = error
                    self.send = self._send_enveloped  # type: ignore[method-assign,assignment]
                    self._report(error)
            raise

    def _admit(self, request: h11.Request) -> h11.Request:
        if (
            self._head_bytes > self._max_head
            and self._head_bytes - len(self.trailing_data[0]) > self._max_head
        ):
            raise _Refused(self._head_too_large())
        if not request.http_version.startswith(b"1."):
            error = _refuse_version(request)
            if _is_h2_preface(request):
                self._answer = _h2_refusal(error.message)
            raise _Refused(error)
        return _without_h2c_upgrade(request)

    def _head_too_large(self) -> MalformedRequest:
        return MalformedRequest(
            f"request head larger than {self._max_head} bytes",
            status=431,
            code=_PROTOCOL_ERROR_CODES[431],
        )

    def _describe(self, exc: h11.RemoteProtocolError, state: object) -> MalformedRequest | None:
        """What the client is answered for the error h11 found in its request (`state`:
        the client's state then), or None when it is not the client's error: a request
        cut short after its answer began."""
        status = exc.error_status_hint
        if status == 431:
            return self._head_too_large()
        reason = str(exc)
        if reason.startswith(_CUT_SHORT):
            if self.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
                return None
            part = "head" if state is h11.IDLE else "body"
            missing = reason.removeprefix(_CUT_SHORT[1]) if state is h11.SEND_BODY else ""
            return MalformedRequest(
                "incomplete request: the client ended its side of the connection in the "
                f"request {part}{missing}",
                status=400,
                code=ErrorCode.REQUEST_INCOMPLETE,
            )
        if len(reason) > _PROTOCOL_ERROR_CHARS:
            reason = reason[: _PROTOCOL_ERROR_CHARS - 3] + "..."
        message = f"malformed HTTP/1.1 request: {reason}"
        return MalformedRequest(message, status=status, code=_PROTOCOL_ERROR_CODES.get(status))

    def _send_enveloped(self, event: h11.Event) -> bytes | None:
        error = self._error
        if error is None or not isinstance(event, h11.Response):
            return super().send(event)
        self._error = None  # one answer
        self.unread = True
        if self._answer is not None:
            super().send(event)  # h11 follows the answer hypercorn sends, and its end
            return self._answer
        body = json_bytes(error.envelope())
        kept = [
            (name, value)
            for name, value in event.headers
            if name not in (b"content-length", b"content-type")
        ]
        head = h11.Response(
            status_code=event.status_code,
            headers=[
                *kept,
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        )
        return (super().send(head) or b"") + (super().send(h11.Data(data=body)) or b"")


def _with_reason(event: h11.Event) -> h11.Event:
    """A response with the reason phrase of its status (`200 OK`), when it has none.

    hypercorn builds its h11 responses from the status code alone, and h11 writes the
    reason it is given, so every status line went out as `HTTP/1.1 200 ` with no phrase.
    RFC 9112 4 allows that, but some load tools (and proxies' access logs) read a
    status line without its phrase as a failed request. A status with no registered
    phrase keeps an empty one."""
    if not isinstance(event, h11.Response | h11.InformationalResponse) or event.reason:
        return event
    try:
        phrase = HTTPStatus(event.status_code).phrase
    except ValueError:
        return event
    return type(event)(
        status_code=event.status_code,
        headers=event.headers,
        http_version=event.http_version,
        reason=phrase,
    )


class _StallBoundTCPServer(TCPServer):
    # Read at each blocked write, so a reload's serving.client_stall_s applies to the
    # connections already open as well as to new ones.
    stall_s: Callable[[], float] = staticmethod(lambda: 0.5)
    open_connections: OpenConnections
    protocol_error: Callable[[MalformedRequest], None] = staticmethod(_ignore_protocol_error)

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        # The read loop's task and scope, while it runs: see protocol_send.
        self._reader: trio.lowlevel.Task | None = None
        self._reading = trio.CancelScope()
        self._connection: _ClientProtocolErrors | None = None
        # While a half-closed client's answer is awaited (`_answered_before_gone`), and
        # while a reset is waited for (`_until_gone`): see protocol_send and _close_socket.
        self._answering: trio.CancelScope | None = None
        self._resetting: trio.CancelScope | None = None
        self._socket_closed = False
        self.idle_task = _IdleTask(  # type: ignore[assignment]
            self.open_connections, self.stream, self.stream.socket.close
        )

    async def _read_data(self) -> None:
        try:
            await self._read_until_closed()
        finally:
            # The client ended the connection. hypercorn leaves the keep-alive timer
            # running, and the connection's task group waits for it: a client that
            # closed before a request or between two kept its socket, task and state
            # for the whole keep-alive timeout. A request in flight is not the timer's
            # (it stops at each request) and still gets to finish.
            await self.idle_task.stop()

    async def _read_until_closed(self) -> None:
        if isinstance(h11_protocol := getattr(self.protocol, "protocol", None), H11Protocol):
            h11_protocol.can_read = _ClientWatch(self.stream.socket, self._until_gone)
            # Nothing has been read yet: the connection hypercorn made is still unused.
            self._connection = _ClientProtocolErrors(
                max_incomplete_event_size=self.config.h11_max_incomplete_size,
                report=self.protocol_error,
            )
            h11_protocol.connection = self._connection
        self._reader = trio.lowlevel.current_task()
        # hypercorn's loop without its per-read `fail_after(inf)` scope (serve_app
        # refuses a read_timeout, which this loop would not apply).
        with self._reading:
            while True:
                try:
                    data = await self.stream.receive_some(MAX_RECV)
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    break
                if not data and self._answer_pending() and not await self._answered_before_gone():
                    break
                try:
                    await self.protocol.handle(RawData(bytes(data)))
                except _ClientLeft:
                    break
                if data == b"":
                    break
        self._reader = None
        if self._reading.cancelled_caught:
            # The app answered with the request's body unread: see protocol_send.
            await self._linger()
            await super().protocol_send(Closed())
        await self.protocol.handle(Closed())

    def _answer_pending(self) -> bool:
        """Whether the client's request has arrived whole and its answer has not begun."""
        connection = self._connection
        return (
            connection is not None
            and connection.their_state in (h11.DONE, h11.MUST_CLOSE)
            and connection.our_state is h11.SEND_RESPONSE
        )

    async def _answered_before_gone(self) -> bool:
        """At the end of the client's stream with its answer pending: True once the
        answer is complete (the connection goes idle or closes), False if the client is
        gone first. The end is then handed to the protocol, or the connection reported
        closed, as at any other end of stream."""
        with trio.CancelScope() as answering:
            self._answering = answering
            await self._until_gone()
        self._answering = None
        return answering.cancelled_caught

    async def _until_gone(self) -> None:
        """After the end of the client's stream with a request in flight: returns once
        the client is seen gone (else it waits, to be cancelled when the answer is out).

        A client that half-closed (`shutdown(SHUT_WR)`, `nc -N`: it has nothing more
        to send) is waiting for its answer; one that closed is gone, and its engine work
        should stop. Both send the same FIN. They differ once something is written to
        them: a closed socket's kernel answers with a reset. So before its answer has
        begun, an HTTP/1.1 client is written an interim `100 Continue`, which RFC 9110
        15.2 requires it to read past whether it asked for one or not (an HTTP/1.0
        client may not be sent one: it is seen gone at the write of its answer). The
        reset comes a round trip later; the answer's writes provoke it too.

        Once the answer has begun nothing more can be written to tell (a stream may be
        stalled for seconds), so an end of stream then is the client leaving, as it was
        before. A half-closing client sends its end with its request, long before."""
        connection = self._connection
        if connection is None or connection.our_state is not h11.SEND_RESPONSE:
            return
        if connection.their_http_version != b"1.0":
            probe = connection.send(h11.InformationalResponse(status_code=100, headers=[]))
            await self.protocol_send(RawData(probe or b""))
        with trio.CancelScope() as self._resetting:
            if not self._socket_closed:
                await _wait_reset(self.stream.socket)
        self._resetting = None

    def _close_socket(self) -> None:
        """Close the socket under the protocol (a write failed or stalled); a wait for a
        reset ends with it, the socket's epoll registration going with it."""
        self.stream.socket.close()
        self._socket_closed = True
        if self._resetting is not None:
            self._resetting.cancel()

    async def protocol_send(self, event: Event) -> None:
        if not isinstance(event, RawData):
            if self._answering is not None and (
                isinstance(event, Closed) or (isinstance(event, Updated) and event.idle)
            ):
                self._answering.cancel()  # the half-closed client's answer is out
            if isinstance(event, Closed) and self._answered_while_sending():
                if trio.lowlevel.current_task() is not self._reader:
                    if self._reader is not None:
                        # The app's task answered; only the read loop may read the
                        # stream, so it stops, lingers and closes.
                        self._reading.cancel()
                        return
                else:
                    await self._linger()
            await super().protocol_send(event)
            return
        data = memoryview(event.data)
        if not data:
            return  # h11's end of a Content-Length body: nothing to write
        sent = 0
        if self.send_lock.locked():
            await self.send_lock.acquire()
        else:
            # Nearly every write fits the socket buffer at once. Trying it synchronously
            # first skips the lock's and the stall scope's scheduler round trips (tens of
            # µs per SSE chunk); the relay loop still yields at its next engine read.
            try:
                sent = os.write(self.stream.socket.fileno(), data)
            except BlockingIOError:
                pass
            except OSError:
                self._close_socket()
                await self.protocol.handle(Closed())
                return
            if sent == len(data):
                return
            self.send_lock.acquire_nowait()  # still free: nothing was awaited since
        try:
            aborted = False
            try:
                with trio.move_on_after(self.stall_s()) as stall:
                    while sent < len(data):
                        sent += await self.stream.socket.send(data[sent:])
                aborted = stall.cancelled_caught
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                aborted = True
            except BaseException:
                if sent:
                    self._close_socket()
                raise
            if aborted:
                self._close_socket()
                await self.protocol.handle(Closed())
        finally:
            self.send_lock.release()

    def _answered_while_sending(self) -> bool:
        """Whether the connection closes after an answer the client may still be
        sending to: a protocol error's, or the app's to a request whose body it did not
        read to the end (a 413 over serving.max_request_bytes, a 408 at
        serving.body_timeout_s, a 429 or 503 before the body, a 404 with a body)."""
        connection = self._connection
        if connection is None:
            return False
        if connection.unread:
            connection.unread = False  # hypercorn may report the close more than once
            return True
        return connection.their_state is h11.SEND_BODY and connection.our_state in (
            h11.DONE,
            h11.MUST_CLOSE,
        )

    async def _linger(self) -> None:
        """`_linger` in the read loop's task (hypercorn types its stream for TLS, which
        Narwhal does not serve)."""
        await _linger(cast(trio.SocketStream, self.stream))


async def serve_app(
    app: App,
    *,
    host: str,
    port: int,
    client_stall_s: float | Callable[[], float],
    shutdown: trio.Event,
    graceful_timeout_s: float = 5.0,
    open_connections: OpenConnections | None = None,
    protocol_error: Callable[[MalformedRequest], None] = _ignore_protocol_error,
    listeners: list[trio.SocketListener] | None = None,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until `shutdown` is set; started() reports the bound (host, port) pairs.
    `listeners`: sockets bound already (a worker's, handed down by its core) instead of
    `host` and `port`.
    `client_stall_s`: the write stall limit, or where to read its current value.
    `open_connections`: the count and limit of open client connections (default: a
    fresh one at listen.max_open_connections' default). `protocol_error`: told of each
    request h11 could not parse, which is answered with its envelope."""
    if open_connections is None:
        open_connections = OpenConnections(Listen().max_open_connections)
    config = HypercornConfig()
    config.keep_alive_timeout = 75.0
    config.graceful_timeout = graceful_timeout_s
    config.accesslog = None
    config.errorlog = None
    if config.read_timeout is not None:
        # _StallBoundTCPServer's read loop replaces hypercorn's, which is the only one
        # that applies read_timeout: installing it regardless would ignore the setting,
        # and keeping hypercorn's loop for it (as this module once did) silently left
        # out the error envelope, the HTTP/1.1-only rule and the head limit.
        raise RuntimeError(
            f"hypercorn read_timeout={config.read_timeout} is not supported: narwhal's "
            "read loop, which envelopes protocol errors, serves HTTP/1.1 only and "
            "holds the head limit, does not apply it"
        )
    context = WorkerContext(None)
    wrapped = ASGIWrapper(cast(ASGIFramework, app))
    if listeners is None:
        listeners = await trio.open_tcp_listeners(port, host=host)
    bound = [
        (str(listener.socket.getsockname()[0]), int(listener.socket.getsockname()[1]))
        for listener in listeners
    ]
    stall_s = client_stall_s if callable(client_stall_s) else (lambda: client_stall_s)
    server_class = type(
        "NarwhalTCPServer",
        (_StallBoundTCPServer,),
        {
            "stall_s": staticmethod(stall_s),
            "open_connections": open_connections,
            "protocol_error": staticmethod(protocol_error),
        },
    )
    handler = cast(Handler, partial(server_class, wrapped, config, context, ConnectionState({})))
    async with trio.open_nursery() as connections:
        async with trio.open_nursery() as accepting:
            for listener in listeners:
                accepting.start_soon(_accept_loop, listener, handler, connections, open_connections)
            task_status.started(bound)
            await shutdown.wait()
            accepting.cancel_scope.cancel()
        # Idle keep-alive connections close now; busy ones get graceful_timeout_s.
        await context.terminated.set()
        connections.cancel_scope.deadline = trio.current_time() + graceful_timeout_s
