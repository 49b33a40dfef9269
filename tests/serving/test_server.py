"""The HTTP server's own parts: burst accepts and listener shutdown, on loopback."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import socket
from collections.abc import AsyncIterator, MutableMapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from http import HTTPStatus
from typing import Any, cast

import h2.config
import h2.connection
import h2.errors
import h2.events
import httpx
import pytest
import trio
import trio.testing
from hypercorn.config import Config as HypercornConfig

from narwhal._errors import MalformedRequest
from narwhal.serving import serve_app
from narwhal.serving._client import eager
from narwhal.serving._connections import OpenConnections
from narwhal.serving._server import (
    _accept_until_cancelled,
    _ClientLeft,
    _ClientWatch,
    accept_pending,
)


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
            first, stopped = accept_pending(listening, 3)
            rest, stopped_again = accept_pending(listening, 10)
            assert (len(first), len(rest), stopped, stopped_again) == (3, 2, None, None)
            assert accept_pending(listening, 10) == ([], None)
            assert {host for _, host in first + rest} == {"127.0.0.1"}
            for stream, _ in first + rest:
                stream.socket.close()
        finally:
            for client in clients:
                client.close()


class _ExhaustedListening:
    """A listening socket whose accept() fails with EMFILE `failures` times, then finds the
    backlog empty. It is readable until then: its descriptor is one end of a socket pair
    with a byte waiting, read when the backlog is found empty."""

    def __init__(self, failures: int) -> None:
        self._readable, self._writer = socket.socketpair()
        self._writer.send(b"x")
        self.failures = failures
        self.attempts = 0

    def fileno(self) -> int:
        return self._readable.fileno()

    def accept(self) -> tuple[socket.socket, Any]:
        self.attempts += 1
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        self._readable.recv(1)
        raise BlockingIOError

    def close(self) -> None:
        self._readable.close()
        self._writer.close()


async def _never_called(stream: trio.SocketStream) -> None:
    raise AssertionError("no connection was accepted")


async def test_running_out_of_descriptors_is_one_episode_retried_every_tenth_of_a_second(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.server")
    failed: list[str] = []
    limit = OpenConnections(8, on_accept_failed=failed.append)
    listening = _ExhaustedListening(failures=30)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                _accept_until_cancelled,
                cast(socket.socket, listening),
                _never_called,
                nursery,
                limit,
            )
            await trio.sleep(1.0)
            assert limit.statistics().accept_failing
            await trio.sleep(2.5)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
    finally:
        listening.close()
    assert (listening.attempts, len(failed), limit.statistics().accept_failures) == (31, 30, 30)
    assert not limit.statistics().accept_failing
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        (
            "WARNING",
            "accepting client connections failed: Too many open files (EMFILE), 0 open, "
            "listen.max_open_connections=8; retrying every 0.1 s while connections wait, "
            "logged again when it works",
        ),
        ("INFO", "accepting client connections again after 3.0 s; 30 attempt(s) failed"),
    ]


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


class _Holding:
    """Answers `/hold` only once released (or notes that its client left); anything
    else at once."""

    def __init__(self) -> None:
        self.started = trio.Event()
        self.release = trio.Event()
        self.disconnected = trio.Event()

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/hold":
            await receive()  # the empty body
            self.started.set()
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    if (await receive())["type"] == "http.disconnect":
                        self.disconnected.set()
                        nursery.cancel_scope.cancel()

                nursery.start_soon(watch)
                await self.release.wait()
                nursery.cancel_scope.cancel()
            if self.disconnected.is_set():
                return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"hello"})


# Two requests in one write (HTTP/1.1 pipelining): hypercorn stops reading the
# connection while the first is answered, with the second already buffered.
_PIPELINED = b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\nGET / HTTP/1.1\r\nhost: x\r\n\r\n"


async def test_a_client_that_leaves_with_a_pipelined_request_behind_is_seen_to_leave() -> None:
    app = _Holding()
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        ((host, port),) = await nursery.start(
            partial(serve_app, app, host="127.0.0.1", port=0, client_stall_s=1.0, shutdown=shutdown)
        )
        client = await trio.open_tcp_stream(host, port)
        await client.send_all(_PIPELINED)
        await app.started.wait()
        await client.aclose()
        with trio.fail_after(5):
            await app.disconnected.wait()
        shutdown.set()


async def test_pipelined_requests_are_answered_in_order() -> None:
    app = _Holding()
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        ((host, port),) = await nursery.start(
            partial(serve_app, app, host="127.0.0.1", port=0, client_stall_s=1.0, shutdown=shutdown)
        )
        async with await trio.open_tcp_stream(host, port) as client:
            await client.send_all(_PIPELINED)
            await app.started.wait()
            await trio.testing.wait_all_tasks_blocked()  # the server waits, watching
            app.release.set()
            reply = b""
            with trio.fail_after(5):
                while reply.count(b"hello") < 2:
                    reply += await client.receive_some(65536)
        assert reply.count(b"HTTP/1.1 200") == 2
        assert not app.disconnected.is_set()
        shutdown.set()


@pytest.mark.parametrize("closed_by", ["client", "server"])
async def test_the_watch_ends_with_the_connection_whichever_side_ends_it(closed_by: str) -> None:
    # The client's end (once it is seen gone, here at once), and the server's own close
    # after a failed write: either one must reach the read loop as the client leaving,
    # never as another exception.
    ours, theirs = trio.socket.socketpair()
    with ours, theirs:
        watch = _ClientWatch(ours, trio.lowlevel.checkpoint)
        await watch.clear()
        left: list[bool] = []

        async def wait() -> None:
            try:
                await watch.wait()
            except _ClientLeft:
                left.append(True)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            (ours if closed_by == "server" else theirs).close()
        assert left == [True]


async def test_the_watch_is_an_event_when_a_half_closed_client_is_not_gone() -> None:
    ours, theirs = trio.socket.socketpair()
    with ours, theirs:
        watch = _ClientWatch(ours, trio.sleep_forever)
        await watch.clear()
        theirs.shutdown(socket.SHUT_WR)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch.wait)
            await trio.testing.wait_all_tasks_blocked()
            await watch.set()


async def test_the_watch_is_an_event_when_the_client_stays() -> None:
    ours, theirs = trio.socket.socketpair()
    with ours, theirs:
        watch = _ClientWatch(ours, trio.lowlevel.checkpoint)
        await watch.clear()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch.wait)
            await trio.testing.wait_all_tasks_blocked()
            await watch.set()
        # More bytes waiting: the watch cannot see past them and waits for the event.
        await theirs.send(b"GET / HTTP/1.1")
        await watch.clear()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch.wait)
            await trio.testing.wait_all_tasks_blocked()
            theirs.close()
            await trio.testing.wait_all_tasks_blocked()
            await watch.set()


@pytest.mark.parametrize("requests", [0, 1])
async def test_a_client_that_ends_its_connection_while_idle_is_closed_at_once(
    requests: int,
) -> None:
    # Before a request or between two: hypercorn's keep-alive timer used to hold the
    # connection (its socket, task and slot) for the whole keep-alive timeout, 75 s.
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        ((host, port),) = await nursery.start(
            partial(
                serve_app, _hello, host="127.0.0.1", port=0, client_stall_s=1.0, shutdown=shutdown
            )
        )
        async with await trio.open_tcp_stream(host, port) as client:
            for _ in range(requests):
                await client.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                reply = b""
                with trio.fail_after(5):
                    while b"hello" not in reply:
                        reply += await client.receive_some(65536)
            await client.send_eof()
            with trio.fail_after(5):
                while await client.receive_some(65536):
                    pass
        shutdown.set()


_GET = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"


async def _hello_received(client: trio.SocketStream) -> None:
    reply = b""
    with trio.fail_after(5):
        while b"hello" not in reply:
            reply += await client.receive_some(65536)


async def _answered(client: trio.SocketStream) -> None:
    await client.send_all(_GET)
    await _hello_received(client)


def _waiting_client(host: str, port: int) -> socket.socket:
    """A connection with a request sent: on loopback the connect completes in the
    listen backlog whether or not the server accepts it."""
    sock = socket.create_connection((host, port), timeout=5)
    sock.sendall(_GET)
    sock.setblocking(False)
    return sock


@asynccontextmanager
async def _served(app: Any, **options: Any) -> AsyncIterator[tuple[str, int]]:
    """The app served on a loopback port (with serve_app's `options`), until exit."""
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        ((host, port),) = await nursery.start(
            partial(
                serve_app,
                app,
                host="127.0.0.1",
                port=0,
                client_stall_s=1.0,
                shutdown=shutdown,
                **options,
            )
        )
        yield host, port
        shutdown.set()


def _limited(app: Any, limit: OpenConnections) -> AbstractAsyncContextManager[tuple[str, int]]:
    """The app served on a loopback port with `limit` on open connections, until exit."""
    return _served(app, open_connections=limit)


async def _reply(client: socket.socket) -> bytes:
    """What a raw client socket reads until the app's hello has come."""
    reply = b""
    with trio.fail_after(5):
        while b"hello" not in reply:
            await trio.lowlevel.wait_readable(client)
            reply += client.recv(65536)
    return reply


async def _closed_by_server(client: trio.SocketStream) -> None:
    with trio.fail_after(5):
        while await client.receive_some(65536):
            pass


async def test_at_the_connection_limit_the_longest_idle_connection_makes_room() -> None:
    app = _Holding()
    limit = OpenConnections(4)
    async with _limited(app, limit) as (host, port):
        busy = await trio.open_tcp_stream(host, port)
        await busy.send_all(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
        await app.started.wait()
        idle = [await trio.open_tcp_stream(host, port) for _ in range(3)]
        # Each goes idle once its response is over, a little after the client has it.
        for client in [*idle, idle[0]]:  # idle[1] is then the longest idle
            await _answered(client)
            await trio.testing.wait_all_tasks_blocked()
        assert repr(limit) == "<OpenConnections 4/4, 3 idle>"
        with _waiting_client(host, port) as fifth:
            await _closed_by_server(idle[1])
            assert (await _reply(fifth)).startswith(b"HTTP/1.1 200")
        await idle.pop(1).aclose()
        stats = limit.statistics()
        assert (stats.limit_reached, stats.shed) == (1, 1)
        await _answered(idle[0])  # the others are served as before
        await _answered(idle[1])
        app.release.set()
        await _hello_received(busy)
        for client in [busy, *idle]:
            await client.aclose()


async def test_at_the_connection_limit_with_none_idle_a_new_connection_waits() -> None:
    app = _Holding()
    limit = OpenConnections(4)
    async with _limited(app, limit) as (host, port):
        held = [await trio.open_tcp_stream(host, port) for _ in range(4)]
        for client in held:
            await client.send_all(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
        await app.started.wait()
        with _waiting_client(host, port) as fifth:
            # All tasks blocked includes a poll of ready sockets: every request has
            # reached the app, and the accept loop has seen the fifth connection and
            # left it in the backlog.
            await trio.testing.wait_all_tasks_blocked()
            assert repr(limit) == "<OpenConnections 4/4, 0 idle | at limit>"
            assert limit.statistics().limit_reached == 1
            with pytest.raises(BlockingIOError):
                fifth.recv(65536)
            # The held requests end; their connections go idle, and the longest idle
            # one makes room for the fifth.
            app.release.set()
            reply = await _reply(fifth)
            assert reply.startswith(b"HTTP/1.1 200")
        stats = limit.statistics()
        assert (stats.limit_reached, stats.shed) == (1, 1)
        for client in held:
            await client.aclose()


async def _read_to_end(client: trio.SocketStream) -> bytes:
    reply = b""
    with trio.fail_after(5):
        while data := await client.receive_some(65536):
            reply += data
    return reply


@pytest.mark.parametrize(
    ("raw", "status", "message", "code"),
    [
        (
            b"GARBAGE\r\n\r\n",
            400,
            "malformed HTTP/1.1 request: illegal request line: bytearray(b'GARBAGE')",
            "malformed_request",
        ),
        (
            b"GET / HTTP/1.1\r\n\r\n",
            400,
            "malformed HTTP/1.1 request: Missing mandatory Host: header",
            "malformed_request",
        ),
        (
            # Not yet complete: h11 bounds what it holds of an event it cannot parse yet.
            b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 20000,
            431,
            "request head larger than 16384 bytes",
            "request_head_too_large",
        ),
        (
            # Complete, in one read: h11 itself checks only a head still arriving.
            b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 20000 + b"\r\n\r\n",
            431,
            "request head larger than 16384 bytes",
            "request_head_too_large",
        ),
        (
            # h11 parses any HTTP/d.d request line, and served this one as HTTP/1.1
            # (with no Host, which only 1.1 requires).
            b"GET / HTTP/2.0\r\n\r\n",
            505,
            "HTTP/2.0 request refused: this listener serves HTTP/1.1 only",
            "http_version_not_supported",
        ),
        (
            b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip\r\n\r\n",
            501,
            "malformed HTTP/1.1 request: Only Transfer-Encoding: chunked is supported",
            "unsupported_transfer_encoding",
        ),
        (
            b"GET / HTTP/1.1\r\nhost: x\r\n" + b"no-colon" * 40 + b"\r\n\r\n",
            400,
            "malformed HTTP/1.1 request: illegal header line: bytearray(b'"
            + "no-colon" * 20
            + "no-c...",  # h11's reason cut to 200 characters
            "malformed_request",
        ),
    ],
)
async def test_a_request_h11_cannot_parse_is_reported_and_answered_with_the_envelope(
    raw: bytes, status: int, message: str, code: str
) -> None:
    # hypercorn answers it itself: the answer had no body, and nothing in Narwhal heard of it.
    reported: list[MalformedRequest] = []
    async with (
        _served(_hello, protocol_error=reported.append) as (host, port),
        await trio.open_tcp_stream(host, port) as client,
    ):
        await client.send_all(raw)
        reply = await _read_to_end(client)
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 %d %s" % (status, HTTPStatus(status).phrase.encode())
    assert {b"connection: close", b"content-type: application/json"} <= set(lines)
    assert b"content-length: %d" % len(body) in lines
    envelope = {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": None,
            "code": code,
        }
    }
    assert json.loads(body) == envelope
    assert [(e.status, e.envelope()) for e in reported] == [(status, envelope)]


async def _status(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
    """Answers with the status its path names (`/404`), after reading the body."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body", False):
        pass
    status = int(scope["path"].strip("/"))
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": b"hello"})


@pytest.mark.parametrize(
    ("request_head", "status_lines"),
    [
        (b"GET /200 HTTP/1.1\r\nhost: x\r\n\r\n", [b"HTTP/1.1 200 OK"]),
        (b"GET /404 HTTP/1.1\r\nhost: x\r\n\r\n", [b"HTTP/1.1 404 Not Found"]),
        (b"GET /503 HTTP/1.0\r\n\r\n", [b"HTTP/1.1 503 Service Unavailable"]),
        # No registered phrase: an empty one, as before.
        (b"GET /599 HTTP/1.1\r\nhost: x\r\n\r\n", [b"HTTP/1.1 599 "]),
    ],
)
async def test_status_lines_carry_the_reason_phrase_of_their_status(
    request_head: bytes, status_lines: list[bytes]
) -> None:
    # hypercorn gave h11 no reason, and every status line went out as `HTTP/1.1 200 `.
    async with _served(_status) as (host, port), await trio.open_tcp_stream(host, port) as client:
        await client.send_all(request_head)
        reply = b""
        with trio.fail_after(5):
            while b"hello" not in reply:
                reply += await client.receive_some(65536)
    assert re.findall(rb"(HTTP/1\.1 [^\r]*)\r\n", reply) == status_lines


@pytest.mark.parametrize(
    ("sent", "part", "detail"),
    [
        (b"GET / HTTP/1.1\r\nhost: x\r\n", "head", ""),
        (b"GET / HTT", "head", ""),
        (
            b"POST /200 HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nabc",
            "body",
            " (received 3 bytes, expected 10)",
        ),
        (
            b"POST /200 HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab",
            "body",
            " (incomplete chunked read)",
        ),
    ],
)
async def test_a_request_cut_short_by_a_half_close_is_answered_with_the_envelope(
    sent: bytes, part: str, detail: str
) -> None:
    # A client that ends its sending side in the middle of a request still reads: it
    # got a bare 400, and nothing counted or logged it.
    reported: list[MalformedRequest] = []
    async with _served(_status, protocol_error=reported.append) as (host, port):
        async with await trio.open_tcp_stream(host, port) as client:
            await client.send_all(sent)
            await client.send_eof()
            reply = await _read_to_end(client)
        # The same server answers well-formed requests as before, without reporting.
        async with await trio.open_tcp_stream(host, port) as client:
            await client.send_all(b"GET /200 HTTP/1.1\r\nhost: x\r\n\r\n")
            await _hello_received(client)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    message = (
        f"incomplete request: the client ended its side of the connection in the "
        f"request {part}{detail}"
    )
    envelope = {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": None,
            "code": "request_incomplete",
        }
    }
    assert json.loads(body) == envelope
    assert [(e.status, e.envelope()) for e in reported] == [(400, envelope)]


_POST_ABC = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nabc"


@pytest.mark.parametrize(
    "writes",
    [
        [b"\r\n" + _GET],
        [b"\r\n\r\n" + _GET],
        [b"\n" + _GET],
        [b"\r", b"\n" + _GET],
        [b"\r\n", _GET],
        # After a POST body, as old clients send it (RFC 9112 2.2), in the same write as
        # the next request.
        [_POST_ABC + b"\r\n" + _GET],
        [_GET, b"\r\n", _GET],
    ],
)
async def test_empty_lines_before_a_request_line_are_ignored(writes: list[bytes]) -> None:
    # RFC 9112 2.2: a server SHOULD ignore at least one empty line received before the
    # request line. They were refused, 400 "no request line received".
    reported: list[MalformedRequest] = []
    expected = sum(write.count(b"HTTP/1.1\r\n") for write in writes)
    async with (
        _served(_hello, protocol_error=reported.append) as (host, port),
        await trio.open_tcp_stream(host, port) as client,
    ):
        reply = b""
        for write in writes:
            await client.send_all(write)
            await trio.testing.wait_all_tasks_blocked()  # read apart
        with trio.fail_after(5):
            while reply.count(b"hello") < expected:
                reply += await client.receive_some(65536)
    assert reply.count(b"HTTP/1.1 200 OK") == expected
    assert reported == []


@pytest.mark.parametrize(
    "request_head",
    [
        b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        b"GET / HTTP/1.0\r\n\r\n",
    ],
)
@pytest.mark.parametrize("after", [_GET, b"GARBAGE\r\n\r\n", b"\x00" * 100_000])
async def test_what_follows_a_request_that_closes_its_connection_is_dropped(
    request_head: bytes, after: bytes
) -> None:
    # RFC 9112 9.6: a server that receives `close` MUST NOT process further requests on
    # that connection; it answers this one and closes. What followed it was refused
    # instead (400 "Got data when expecting EOF"), and the request went unanswered.
    reported: list[MalformedRequest] = []
    async with (
        _served(_hello, protocol_error=reported.append) as (host, port),
        await trio.open_tcp_stream(host, port) as client,
    ):
        await client.send_all(request_head + after)
        reply = await _read_to_end(client)
    assert reply.count(b"HTTP/1.1 ") == 1
    assert reply.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"hello" in reply
    assert reported == []


async def test_bytes_sent_while_a_closing_request_is_answered_are_dropped() -> None:
    app = _Holding()
    reported: list[MalformedRequest] = []
    async with (
        _served(app, protocol_error=reported.append) as (host, port),
        await trio.open_tcp_stream(host, port) as client,
    ):
        await client.send_all(b"GET /hold HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        await app.started.wait()
        await client.send_all(_GET + b"GARBAGE" * 1000)
        await trio.testing.wait_all_tasks_blocked()
        app.release.set()
        await _hello_received(client)
        # The client can finish sending and still read the rest: the answer is not reset.
        await client.send_all(b"x" * 100_000)
        await client.send_eof()
        await _read_to_end(client)
    assert not app.disconnected.is_set()
    assert reported == []


@pytest.mark.parametrize(
    ("sent", "answers", "probed"),
    [
        (b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n", 1, True),
        (b"POST /hold HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n", 1, True),
        (b"GET /hold HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n", 1, True),
        # HTTP/1.0 has no interim responses (RFC 9110 15.2).
        (b"GET /hold HTTP/1.0\r\n\r\n", 1, False),
        # Pipelined: the second request is still buffered when the client half-closes.
        (_PIPELINED, 2, True),
    ],
)
async def test_a_complete_request_followed_by_a_half_close_is_answered(
    sent: bytes, answers: int, probed: bool
) -> None:
    # A client that ends its sending side after its request (`nc -N`, `shutdown(SHUT_WR)`)
    # still reads. The end of its stream was taken for the client leaving, and the
    # request was cancelled unanswered.
    app = _Holding()
    async with (
        _served(app) as (host, port),
        await trio.open_tcp_stream(host, port) as client,
    ):
        await client.send_all(sent)
        await client.send_eof()
        await app.started.wait()
        await trio.testing.wait_all_tasks_blocked()  # the server has seen the end
        app.release.set()
        reply = await _read_to_end(client)
    assert not app.disconnected.is_set()
    assert reply.count(b"hello") == reply.count(b"HTTP/1.1 200 OK\r\n") == answers
    # An answer waited for is preceded by `100 Continue`: see the next test.
    continued = b"HTTP/1.1 100 Continue\r\n\r\n"
    assert reply.startswith(continued + b"HTTP/1.1 200 OK\r\n" if probed else b"HTTP/1.1 200 OK")
    assert (continued in reply) == probed


@pytest.mark.parametrize("sent", [b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n", _PIPELINED])
async def test_a_client_that_closes_after_a_complete_request_is_seen_to_leave(
    sent: bytes,
) -> None:
    # Its end of stream is the same as a half-close's: the server tells them apart by
    # writing an interim `100 Continue`, which the kernel of a closed client answers
    # with a reset.
    app = _Holding()
    async with _served(app) as (host, port):
        client = await trio.open_tcp_stream(host, port)
        await client.send_all(sent)
        await app.started.wait()
        await client.aclose()
        with trio.fail_after(5):
            await app.disconnected.wait()


def _head(size: int, version: bytes = b"1.1") -> bytes:
    """A GET whose head is `size` bytes, its blank line included."""
    start = b"GET / HTTP/" + version + b"\r\nhost: x\r\nx-pad: "
    return start + b"a" * (size - len(start) - 4) + b"\r\n\r\n"


_HEAD_TOO_LARGE = b'"code":"request_head_too_large"'


@pytest.mark.parametrize("arrival", ["in one write", "in two writes", "behind a request"])
async def test_the_head_limit_holds_however_the_head_arrives(arrival: str) -> None:
    # A head that is complete in one read was served, whatever its size (h11 bounds its
    # buffer only while it waits for more): 16 kB, then 16 kB more, made 32 kB.
    big = _head(30000)
    reported: list[MalformedRequest] = []
    async with (
        _served(_hello, protocol_error=reported.append) as (host, port),
        await trio.open_tcp_stream(host, port) as client,
    ):
        if arrival == "in two writes":
            await client.send_all(big[:16000])
            await trio.testing.wait_all_tasks_blocked()  # the server has read it, and waits
            await client.send_all(big[16000:])
        elif arrival == "behind a request":
            await client.send_all(_GET + big)
        else:
            await client.send_all(big)
        reply = await _read_to_end(client)
    assert reply.count(b"HTTP/1.1 200") == (arrival == "behind a request")
    assert reply.count(b"HTTP/1.1 431") == reply.count(_HEAD_TOO_LARGE) == 1
    assert [e.status for e in reported] == [431]


async def test_the_head_limit_counts_the_head_alone() -> None:
    # A head of exactly the limit is served; so is one that arrives in the same read as
    # the large body before it, or with another request behind it.
    body = b"b" * 40000
    post = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    reported: list[MalformedRequest] = []
    async with (
        _served(_hello, protocol_error=reported.append) as (host, port),
        await trio.open_tcp_stream(host, port) as client,
    ):
        await client.send_all(_head(16384) + post + _head(16384) + _GET)
        reply = b""
        with trio.fail_after(5):
            while reply.count(b"hello") < 4:
                reply += await client.receive_some(65536)
        await client.send_all(_head(16385))
        reply = await _read_to_end(client)
    assert reply.startswith(b"HTTP/1.1 431")
    assert _HEAD_TOO_LARGE in reply
    assert [e.status for e in reported] == [431]


class _Recording:
    """Answers hello, noting the HTTP version and headers each request came with."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, list[tuple[bytes, bytes]]]] = []

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            raise RuntimeError("http only")
        self.requests.append((scope["http_version"], list(scope["headers"])))
        await _hello(scope, receive, send)


_H2C_UPGRADE = (
    b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
    b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n"
)


async def test_an_h2c_upgrade_is_ignored_and_the_request_served_as_http_1_1() -> None:
    # hypercorn answered 101 Switching Protocols and went on in HTTP/2 frames.
    app = _Recording()
    reported: list[MalformedRequest] = []
    async with (
        _served(app, protocol_error=reported.append) as (host, port),
        await trio.open_tcp_stream(host, port) as client,
    ):
        reply = b""
        for answered, request in enumerate(
            [
                _H2C_UPGRADE,
                _H2C_UPGRADE.replace(b"Upgrade: h2c", b"Upgrade: foo, H2C"),
                _GET,  # the connection goes on in HTTP/1.1
            ],
            start=1,
        ):
            await client.send_all(request)
            with trio.fail_after(5):
                while reply.count(b"hello") < answered:
                    reply += await client.receive_some(65536)
    assert reply.count(b"HTTP/1.1 200") == 3
    assert b" 101 " not in reply
    assert reported == []
    assert [version for version, _ in app.requests] == ["1.1"] * 3
    assert [name for name, _ in app.requests[0][1]] == [b"host", b"connection", b"http2-settings"]


async def test_a_client_opening_with_the_http2_preface_is_told_to_use_http_1_1() -> None:
    # h11 parses the preface's first line, `PRI * HTTP/2.0`, as a request, on which
    # hypercorn switched the connection to HTTP/2 and served the request.
    h2_client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    h2_client.initiate_connection()
    request = [(":method", "GET"), (":path", "/"), (":scheme", "http"), (":authority", "x")]
    h2_client.send_headers(1, request, end_stream=True)
    reported: list[MalformedRequest] = []
    async with (
        _served(_hello, protocol_error=reported.append) as (host, port),
        await trio.open_tcp_stream(host, port) as client,
    ):
        await client.send_all(h2_client.data_to_send())
        reply = await _read_to_end(client)
    message = (
        "HTTP/2 connection preface (prior knowledge) refused with GOAWAY HTTP_1_1_REQUIRED: "
        "this listener serves HTTP/1.1 only"
    )
    settings, goaway = h2_client.receive_data(reply)
    assert isinstance(settings, h2.events.RemoteSettingsChanged)
    assert isinstance(goaway, h2.events.ConnectionTerminated)
    assert (goaway.error_code, goaway.last_stream_id, goaway.additional_data) == (
        h2.errors.ErrorCodes.HTTP_1_1_REQUIRED,
        0,
        message.encode(),
    )
    assert [(e.status, e.code, e.message) for e in reported] == [
        (505, "http_version_not_supported", message)
    ]


async def test_a_refused_client_that_is_still_sending_gets_to_read_its_answer() -> None:
    # The server closed with the client's later bytes unread, which resets the
    # connection: the client's next write failed (broken pipe) before it read its
    # answer, as an HTTP/2 client through httpx did with its request frames.
    h2_client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    h2_client.initiate_connection()
    async with (
        _served(_hello) as (host, port),
        await trio.open_tcp_stream(host, port) as client,
    ):
        await client.send_all(h2_client.data_to_send())
        await trio.testing.wait_all_tasks_blocked()  # answered
        request = [(":method", "POST"), (":path", "/"), (":scheme", "http"), (":authority", "x")]
        h2_client.send_headers(1, request)
        await client.send_all(h2_client.data_to_send())
        await trio.testing.wait_all_tasks_blocked()
        h2_client.send_data(1, b"x" * 1000, end_stream=True)
        await client.send_all(h2_client.data_to_send())
        await client.send_eof()
        reply = await _read_to_end(client)
    _, goaway = h2_client.receive_data(reply)
    assert isinstance(goaway, h2.events.ConnectionTerminated)
    assert goaway.error_code == h2.errors.ErrorCodes.HTTP_1_1_REQUIRED


_TOO_LARGE = b'{"error":{"code":"request_too_large"}}'


async def _refuse_unread(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
    """Answers 413 without reading the body, as the app does for one over
    serving.max_request_bytes."""
    if scope["type"] != "http":
        return
    headers = [(b"content-length", b"%d" % len(_TOO_LARGE)), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": _TOO_LARGE})


_UNREAD_HEAD = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 200000\r\n\r\n"


async def test_a_client_the_app_refused_while_it_sends_its_body_gets_to_read_the_answer() -> None:
    # The server closed with the body's later bytes unread, which resets the
    # connection: the client's next write failed (broken pipe) before it read its
    # answer. The kernel kept the answer readable here, but a client that stops at the
    # failed write never reads it, and a reset may take it with it (RFC 9112 9.6).
    async with (
        _served(_refuse_unread) as (host, port),
        await trio.open_tcp_stream(host, port) as client,
    ):
        await client.send_all(_UNREAD_HEAD + b"x" * 1000)
        await trio.testing.wait_all_tasks_blocked()  # answered
        for _ in range(4):
            await client.send_all(b"x" * 49750)
            await trio.testing.wait_all_tasks_blocked()
        await client.send_eof()
        reply = await _read_to_end(client)
    assert reply.startswith(b"HTTP/1.1 413 Request Entity Too Large\r\n")
    assert reply.endswith(b"\r\n\r\n" + _TOO_LARGE)


async def test_a_client_may_stop_sending_once_its_answer_has_begun() -> None:
    # The app refused the body unread: a client that then ends its side made no error.
    reported: list[MalformedRequest] = []
    async with (
        _served(_refuse_unread, protocol_error=reported.append) as (host, port),
        await trio.open_tcp_stream(host, port) as client,
    ):
        await client.send_all(_UNREAD_HEAD + b"x" * 1000)
        await trio.testing.wait_all_tasks_blocked()  # answered
        await client.send_eof()
        reply = await _read_to_end(client)
    assert reply.startswith(b"HTTP/1.1 413 Request Entity Too Large\r\n")
    assert reported == []


async def test_a_client_the_app_refused_is_waited_for_a_second_at_most(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with (
        _served(_refuse_unread) as (host, port),
        await trio.open_tcp_stream(host, port) as client,
    ):
        await client.send_all(_UNREAD_HEAD)
        reply = b""
        while not reply.endswith(_TOO_LARGE):
            reply += await client.receive_some(65536)
        answered = trio.current_time()
        # The server ended its side at the answer; it closes when the linger ends, and
        # a write then fails.
        assert await client.receive_some(65536) == b""
        await trio.sleep(0.999)
        for _ in range(2):  # the first write after a close would still succeed
            await client.send_all(b"x")
            await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(0.002)
        await client.send_all(b"x")  # the server's kernel answers it with a reset
        with pytest.raises(trio.BrokenResourceError):
            await client.send_all(b"x")
    assert trio.current_time() - answered == pytest.approx(1.001)


async def test_a_hypercorn_read_timeout_is_refused_not_served_without_narwhal_s_read_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # hypercorn's Config takes its defaults from class attributes. With a read_timeout
    # the server kept hypercorn's read loop, without the error envelope, the HTTP/1.1
    # only rule and the head limit, and nothing said so.
    monkeypatch.setattr(HypercornConfig, "read_timeout", 5.0)
    message = (
        "hypercorn read_timeout=5.0 is not supported: narwhal's read loop, which "
        "envelopes protocol errors, serves HTTP/1.1 only and holds the head limit, "
        "does not apply it"
    )
    with pytest.raises(RuntimeError, match=rf"^{re.escape(message)}$"), trio.fail_after(5):
        await serve_app(_hello, host="127.0.0.1", port=0, client_stall_s=1.0, shutdown=trio.Event())
