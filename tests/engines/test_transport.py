from __future__ import annotations

import json
import re
from functools import partial

import h11
import pytest
import trio
import trio.testing

from narwhal.engines._transport import (
    ConnectError,
    ConnectionPool,
    PoolTimeout,
    RemoteProtocolError,
    ResponseTooLarge,
)
from narwhal.sim import SimEngineSpec

from .memory import Handler, MemoryNetwork, ScriptedEngine, respond, start_head


class LoopbackServer:
    """Listens on 127.0.0.1 (an ephemeral port) and runs `_connection` per connection."""

    port = 0

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(trio.serve_listeners, self._connection, listeners))
            task_status.started()

    async def _connection(self, stream: trio.SocketStream) -> None:
        raise NotImplementedError


class TinyServer(ScriptedEngine, LoopbackServer):
    """A scripted engine on a loopback socket."""

    async def _connection(self, stream: trio.SocketStream) -> None:
        await self.serve_stream(stream)


async def echo(
    stream: trio.abc.Stream, conn: h11.Connection, req: h11.Request, body: bytes
) -> None:
    await respond(stream, conn, 200, [req.method + b" " + req.target + b" ", body])


async def start(nursery: trio.Nursery, handler: Handler) -> TinyServer:
    server = TinyServer(handler)
    await nursery.start(server.serve)
    return server


# Where `on_memory` serves its engine.
PORT = 8000
JSON = [(b"content-type", b"application/json")]


def on_memory(nursery: trio.Nursery, handler: Handler) -> MemoryNetwork:
    """A network with a scripted engine at PORT."""
    network = MemoryNetwork(nursery)
    network.serve(PORT, ScriptedEngine(handler).serve_stream)
    return network


def pool_for(server: TinyServer, **kwargs: float) -> ConnectionPool:
    options: dict[str, float] = {
        "max_connections": 4,
        "connect_timeout_s": 1.0,
        "pool_timeout_s": 1.0,
    }
    options.update(kwargs)
    return ConnectionPool(
        "127.0.0.1",
        server.port,
        max_connections=int(options["max_connections"]),
        connect_timeout_s=options["connect_timeout_s"],
        pool_timeout_s=options["pool_timeout_s"],
    )


async def test_round_trip_reuses_the_keep_alive_connection(nursery: trio.Nursery) -> None:
    server = await start(nursery, echo)
    async with pool_for(server) as pool:
        for i in range(3):
            async with pool.request(b"POST", b"/v1/x", [], b"body%d" % i) as response:
                assert response.status == 200
                assert await response.aread(1000) == b"POST /v1/x body%d" % i
        stats = pool.statistics()
    assert (stats.opened_total, stats.reused_total, stats.idle, stats.in_use) == (1, 2, 1, 0)
    assert server.connections == 1


async def test_body_chunks_arrive_as_sent(nursery: trio.Nursery) -> None:
    gate = trio.Event()

    async def two_parts(
        stream: trio.abc.Stream, conn: h11.Connection, req: h11.Request, body: bytes
    ) -> None:
        data = conn.send(h11.Response(status_code=200, headers=[("transfer-encoding", "chunked")]))
        assert data is not None
        await stream.send_all(data + (conn.send(h11.Data(data=b"first")) or b""))
        await gate.wait()
        await stream.send_all(
            (conn.send(h11.Data(data=b"second")) or b"") + (conn.send(h11.EndOfMessage()) or b"")
        )

    server = await start(nursery, two_parts)
    async with pool_for(server) as pool, pool.request(b"GET", b"/") as response:
        assert await response.receive_some() == b"first"
        gate.set()
        assert await response.receive_some() == b"second"
        assert await response.receive_some() == b""


class _Steps(trio.abc.Instrument):
    """Counts how often one task is run by the scheduler."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.steps += 1


async def test_sending_a_request_costs_no_pass_through_the_scheduler(
    nursery: trio.Nursery,
) -> None:
    # Under load every pass is a full queue of other requests' work, so the path to a
    # first token should wait on the loop only for answers, never after its own writes.
    async def at_once(
        stream: trio.abc.Stream, conn: h11.Connection, req: h11.Request, body: bytes
    ) -> None:
        head = conn.send(
            h11.Response(status_code=200, headers=[("content-length", str(len(body)))])
        )
        assert head is not None
        await stream.send_all(
            head + (conn.send(h11.Data(data=body)) or b"") + (conn.send(h11.EndOfMessage()) or b"")
        )

    server = await start(nursery, at_once)
    async with pool_for(server) as pool:
        async with pool.request(b"POST", b"/", [], b"warm") as response:
            await response.aread(100)  # the connection is open and idle now
        steps = _Steps(trio.lowlevel.current_task())
        trio.lowlevel.add_instrument(steps)
        try:
            async with pool.request(b"POST", b"/", [], b"x" * 1000) as response:
                assert await response.aread(5000) == b"x" * 1000
        finally:
            trio.lowlevel.remove_instrument(steps)
    # Run once, when the answer (head and body in one write) arrived. It was 5 when the
    # request went out with send_all.
    assert steps.steps == 1


async def test_a_body_larger_than_the_socket_buffers_arrives_whole(nursery: trio.Nursery) -> None:
    async def length(
        stream: trio.abc.Stream, conn: h11.Connection, req: h11.Request, body: bytes
    ) -> None:
        await trio.sleep(0.05)  # the client's first write fills the buffers and stops
        await respond(stream, conn, 200, [b"%d %d" % (len(body), hash(body) & 0xFFFF)])

    body = bytes(range(256)) * (16 * 1024)  # 4 MiB
    server = await start(nursery, length)
    async with pool_for(server) as pool, pool.request(b"POST", b"/", [], body) as response:
        assert await response.aread(100) == b"%d %d" % (len(body), hash(body) & 0xFFFF)


async def test_pool_timeout_when_every_connection_is_in_use(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    release = trio.Event()

    async def held(
        stream: trio.abc.Stream, conn: h11.Connection, req: h11.Request, body: bytes
    ) -> None:
        await release.wait()
        await respond(stream, conn, 200, [b"ok"])

    pool = on_memory(nursery, held).pool(PORT, max_connections=1, pool_timeout_s=5.0)

    async def hold_one() -> None:
        async with pool.request(b"GET", b"/") as response:
            await response.aread(100)

    nursery.start_soon(hold_one)
    await trio.testing.wait_all_tasks_blocked()
    assert pool.statistics().in_use == 1
    started = trio.current_time()
    with pytest.raises(PoolTimeout, match=r"engine.pool_timeout_s=5.0"):
        async with pool.request(b"GET", b"/"):
            pass
    assert trio.current_time() - started == 5.0
    assert pool.statistics().in_use == 1
    release.set()


async def test_connection_refused_is_a_connect_error() -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    await listener.aclose()
    pool = ConnectionPool(
        "127.0.0.1", port, max_connections=2, connect_timeout_s=1.0, pool_timeout_s=1.0
    )
    with pytest.raises(ConnectError, match="connection refused") as refused:
        async with pool.request(b"GET", b"/"):
            pass
    assert refused.value.timeout_s is None
    assert pool.statistics().in_use == 0


async def test_a_connect_that_runs_out_its_deadline_says_which(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Refused outright the connect is the engine's answer; run out, it may be the
    # router's own loop that lagged, so the request path passes the deadline on for the
    # lag excuse (recovery's leg_failed).
    async def never(host: str, port: int) -> trio.abc.Stream:
        await trio.sleep_forever()
        raise AssertionError

    pool = ConnectionPool(
        "127.0.0.1", 9, max_connections=2, connect_timeout_s=1.5, pool_timeout_s=1.0, connect=never
    )
    with pytest.raises(ConnectError, match=r"exceeded engine\.connect_timeout_s=1\.5") as ran_out:
        async with pool.request(b"GET", b"/"):
            pass
    assert ran_out.value.timeout_s == 1.5
    assert trio.current_time() == 1.5
    assert pool.statistics().in_use == 0


async def test_engine_dropping_mid_body_is_a_protocol_error(nursery: trio.Nursery) -> None:
    async def crash(
        stream: trio.abc.Stream, conn: h11.Connection, req: h11.Request, body: bytes
    ) -> None:
        data = conn.send(h11.Response(status_code=200, headers=[("transfer-encoding", "chunked")]))
        assert data is not None
        await stream.send_all(data + (conn.send(h11.Data(data=b"partial")) or b""))
        await stream.aclose()

    server = await start(nursery, crash)
    pool = pool_for(server)
    async with pool.request(b"GET", b"/") as response:
        assert await response.receive_some() == b"partial"
        with pytest.raises(RemoteProtocolError):
            await response.receive_some()
    assert pool.statistics().idle == 0


async def test_abandoning_a_response_closes_the_connection_so_the_engine_sees_it(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    async def endless(
        stream: trio.abc.Stream, conn: h11.Connection, req: h11.Request, body: bytes
    ) -> None:
        await start_head(stream, conn, b"x" * 100)
        for _ in range(10_000):
            await trio.sleep(0.001)
            await stream.send_all(conn.send(h11.Data(data=b"x" * 100)) or b"")

    engine = ScriptedEngine(endless)
    network = MemoryNetwork(nursery)
    network.serve(PORT, engine.serve_stream)
    pool = network.pool(PORT)
    async with pool.request(b"GET", b"/") as response:
        await response.receive_some()
    with trio.fail_after(5):
        await engine.disconnected.wait()
    assert pool.statistics() == pool.statistics().__class__(
        max_connections=4, in_use=0, idle=0, waiting=0, opened_total=1, reused_total=0
    )
    # Not reused: the next request has a connection of its own.
    async with pool.request(b"GET", b"/") as response:
        await response.receive_some()
    assert (engine.connections, pool.statistics().opened_total) == (2, 2)


async def test_a_stalled_body_waits_for_the_callers_deadline_then_the_engine_sees_the_close(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # The pool has no read timeout of its own (deadlines belong to the caller), and a
    # deadline that ends a read mid-body closes the connection: the engine's cue to abort.
    gone_at: list[float] = []

    async def stall(
        stream: trio.abc.Stream, conn: h11.Connection, req: h11.Request, body: bytes
    ) -> None:
        await start_head(stream, conn, b"first")
        assert await stream.receive_some(100) == b""
        gone_at.append(trio.current_time())

    pool = on_memory(nursery, stall).pool(PORT)
    with trio.move_on_after(30) as deadline:
        async with pool.request(b"GET", b"/") as response:
            assert await response.receive_some() == b"first"
            await response.receive_some()
    assert deadline.cancelled_caught
    await trio.testing.wait_all_tasks_blocked()
    assert gone_at == [30.0]
    stats = pool.statistics()
    assert (stats.in_use, stats.idle, stats.opened_total) == (0, 0, 1)


async def test_an_idle_connection_is_reused_until_idle_ttl_s_then_replaced(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    engine = ScriptedEngine(echo)
    network = MemoryNetwork(nursery)
    network.serve(PORT, engine.serve_stream)
    pool = network.pool(PORT, idle_ttl_s=4.0)
    for pause_s in (0.0, 3.5, 4.0):
        await trio.sleep(pause_s)
        async with pool.request(b"GET", b"/") as response:
            assert await response.aread(100) == b"GET / "
    stats = pool.statistics()
    assert (stats.opened_total, stats.reused_total, stats.idle) == (2, 1, 1)
    await trio.testing.wait_all_tasks_blocked()
    assert (engine.connections, engine.disconnects) == (2, 1)


async def test_narwhal_sim_serves_a_pool_on_memory_streams(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # The simulator's own HTTP server, on the far end of a memory stream: keep-alive
    # between requests, and an abandoned stream aborted as over a socket.
    network = MemoryNetwork(nursery)
    sim = await network.serve_sim(PORT, SimEngineSpec(model="m"))
    pool = network.pool(PORT)

    def completion(max_tokens: int) -> bytes:
        document = {"model": "m", "prompt": "hi", "max_tokens": max_tokens, "stream": True}
        return json.dumps(document).encode()

    async with pool.request(b"POST", b"/v1/completions", JSON, completion(3)) as response:
        assert response.status == 200
        assert (await response.aread(100_000)).endswith(b"data: [DONE]\n\n")
    async with pool.request(b"POST", b"/v1/completions", JSON, completion(50)) as response:
        assert (await response.receive_some()).startswith(b"data: ")
    await trio.testing.wait_all_tasks_blocked()
    assert [o["outcome"] for o in sim.outcomes] == ["ok", "aborted"]
    stats = pool.statistics()
    assert (stats.opened_total, stats.reused_total, stats.idle) == (1, 1, 0)


async def test_idle_connection_closed_by_the_engine_is_not_reused(nursery: trio.Nursery) -> None:
    async def close_after(
        stream: trio.abc.Stream, conn: h11.Connection, req: h11.Request, body: bytes
    ) -> None:
        await respond(stream, conn, 200, [b"bye"])
        await stream.aclose()

    server = await start(nursery, close_after)
    async with pool_for(server) as pool:
        async with pool.request(b"GET", b"/") as response:
            assert await response.aread(100) == b"bye"
        with trio.fail_after(5):
            await server.disconnected.wait()
        async with pool.request(b"GET", b"/") as response:
            assert await response.aread(100) == b"bye"
        assert pool.statistics().opened_total == 2
        assert pool.statistics().reused_total == 0


async def test_body_over_the_limit_is_refused(nursery: trio.Nursery) -> None:
    async def big(
        stream: trio.abc.Stream, conn: h11.Connection, req: h11.Request, body: bytes
    ) -> None:
        await respond(stream, conn, 200, [b"a" * 600, b"b" * 600])

    server = await start(nursery, big)
    pool = pool_for(server)
    with pytest.raises(ResponseTooLarge, match="exceeds 1000 bytes"):
        async with pool.request(b"GET", b"/") as response:
            await response.aread(1000)
    assert pool.statistics().idle == 0


async def test_resize_in_place_applies_to_waiters(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    release = trio.Event()

    async def held(
        stream: trio.abc.Stream, conn: h11.Connection, req: h11.Request, body: bytes
    ) -> None:
        await release.wait()
        await respond(stream, conn, 200, [b"ok"])

    pool = on_memory(nursery, held).pool(PORT, max_connections=1, pool_timeout_s=100.0)
    done: list[int] = []

    async def one() -> None:
        async with pool.request(b"GET", b"/") as response:
            await response.aread(10)
            done.append(1)

    nursery.start_soon(one)
    nursery.start_soon(one)
    await trio.testing.wait_all_tasks_blocked()
    assert pool.statistics().in_use == 1
    assert pool.statistics().waiting == 1
    pool.resize(2)
    await trio.testing.wait_all_tasks_blocked()
    assert pool.statistics().in_use == 2
    release.set()


class RawServer(LoopbackServer):
    """Answers each request on a connection with the next scripted reply, byte for byte.

    A reply ending in `CLOSE` is followed by closing the connection.
    """

    CLOSE = b"<close>"

    def __init__(self, replies: list[bytes]) -> None:
        self.replies = list(replies)
        self.requests: list[bytes] = []
        self.connections = 0
        self.port = 0

    async def _connection(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        pending = b""
        async with stream:
            while self.replies:
                while b"\r\n\r\n" not in pending:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    pending += data
                head, _, pending = pending.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.lower() == b"content-length":
                        length = int(value)
                while len(pending) < length:
                    pending += await stream.receive_some(65536)
                self.requests.append(head + b"\r\n\r\n" + pending[:length])
                pending = pending[length:]
                reply = self.replies.pop(0)
                await stream.send_all(reply.removesuffix(self.CLOSE))
                if reply.endswith(self.CLOSE):
                    return
            await trio.sleep_forever()


async def raw_pool(nursery: trio.Nursery, replies: list[bytes]) -> tuple[RawServer, ConnectionPool]:
    server = RawServer(replies)
    await nursery.start(server.serve)
    pool = ConnectionPool(
        "127.0.0.1", server.port, max_connections=4, connect_timeout_s=1.0, pool_timeout_s=1.0
    )
    return server, pool


async def test_parser_reads_every_framing_and_keeps_the_connection(nursery: trio.Nursery) -> None:
    server, pool = await raw_pool(
        nursery,
        [
            b"HTTP/1.1 100 Continue\r\n\r\n"
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nhello",
            # Bare LF line ends, a chunk extension, upper-case hex and a trailer.
            b"HTTP/1.1 201 Created\ntransfer-encoding: chunked\n\n3;ext=1\nabc\nA\n0123456789\n"
            b"0\nx-trailer: 1\n\n",
            b"HTTP/1.1 204 No Content\r\n\r\n",
            b"HTTP/1.1 200\r\ncontent-length: 0\r\n\r\n",  # no reason phrase
        ],
    )
    async with pool:
        async with pool.request(b"POST", b"/a", [(b"x-request-id", b"r1")], b"{}") as response:
            assert response.status == 200
            assert response.header(b"content-type") == b"text/plain"
            assert await response.aread(100) == b"hello"
        async with pool.request(b"GET", b"/b") as response:
            assert response.status == 201
            assert await response.receive_some() == b"abc"
            assert await response.receive_some() == b"0123456789"
            assert await response.receive_some() == b""
        for status in (204, 200):
            async with pool.request(b"GET", b"/c") as response:
                assert response.status == status
                assert await response.aread(10) == b""
        stats = pool.statistics()
    assert (stats.opened_total, stats.reused_total) == (1, 3)
    assert server.requests[0] == (
        b"POST /a HTTP/1.1\r\nhost: 127.0.0.1:%d\r\nx-request-id: r1\r\n"
        b"content-length: 2\r\n\r\n{}" % server.port
    )


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\n\r\nuntil the end" + RawServer.CLOSE,
        b"HTTP/1.1 200 OK\r\nconnection: keep-alive, Close\r\ncontent-length: 2\r\n\r\nok",
        b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n",  # extra bytes
    ],
    ids=["until-close", "connection-close", "http-1.0", "bytes-after-the-end"],
)
async def test_connection_is_not_reused_when_the_response_says_so(
    nursery: trio.Nursery, reply: bytes
) -> None:
    _, pool = await raw_pool(nursery, [reply])
    async with pool, pool.request(b"GET", b"/") as response:
        body = await response.aread(100)
    assert body in (b"ok", b"until the end")
    assert pool.statistics().idle == 0


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (b"HTTP/2 200 OK\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 20 OK\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\ncontent-type : x\r\n\r\n", "malformed header line"),
        (b"HTTP/1.1 200 OK\r\na: b\r\n folded\r\n\r\n", "malformed header line"),
        (b"HTTP/1.1 200 OK\r\na: b\x01c\r\n\r\n", "malformed header line"),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n",
            "both Transfer-Encoding and Content-Length",
        ),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n", "unsupported transfer-encoding"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n", "content-length"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n", "content-length"),
        (b"HTTP/1.1 101 Switching\r\n\r\n", "switched protocols"),
        (b"HTTP/1.1 200 OK\r\ncontent-le" + RawServer.CLOSE, "before the response head ended"),
        (b"HTTP/1.1 200 OK\r\n" + b"x: " + b"y" * 70_000, "exceeds 65536 bytes"),
    ],
)
async def test_bad_heads_are_protocol_errors(
    nursery: trio.Nursery, reply: bytes, message: str
) -> None:
    _, pool = await raw_pool(nursery, [reply])
    with pytest.raises(RemoteProtocolError, match=message):
        async with pool.request(b"GET", b"/"):
            pass
    assert pool.statistics().idle == 0


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"zz\r\n", "invalid chunk size line"),
        (b"3\r\nabcX\r\n", "not followed by CRLF"),
        (b"3\r\nab" + RawServer.CLOSE, "truncated"),
        (b"3\r\nabc\r\n0\r\nnot a trailer\r\n\r\n", "invalid or oversized trailer"),
    ],
)
async def test_a_bad_chunked_body_fails_after_the_data_before_it(
    nursery: trio.Nursery, body: bytes, message: str
) -> None:
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    _, pool = await raw_pool(nursery, [head + b"2\r\nok\r\n" + body])
    async with pool.request(b"GET", b"/") as response:
        received = b""
        failure: RemoteProtocolError | None = None
        for _ in range(5):
            try:
                received += await response.receive_available()
            except RemoteProtocolError as exc:
                failure = exc
                break
        assert received.startswith(b"ok")
        assert failure is not None
        assert re.search(message, str(failure))
    assert pool.statistics().idle == 0


async def test_header_injection_is_refused_before_anything_is_sent(
    nursery: trio.Nursery,
) -> None:
    server, pool = await raw_pool(nursery, [b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"])
    with pytest.raises(ValueError, match="refusing to send header"):
        async with pool.request(b"GET", b"/", [(b"x-request-id", b"a\r\nx-evil: 1")]):
            pass
    await trio.testing.wait_all_tasks_blocked()
    assert server.requests == []
    assert pool.statistics().in_use == 0


async def test_the_api_key_goes_on_every_request_and_follows_set_api_key(
    nursery: trio.Nursery,
) -> None:
    seen: list[list[tuple[bytes, bytes]]] = []

    async def record(
        stream: trio.abc.Stream, conn: h11.Connection, req: h11.Request, body: bytes
    ) -> None:
        seen.append([(name, value) for name, value in req.headers if name == b"authorization"])
        await respond(stream, conn, 200, [b"ok"])

    server = await start(nursery, record)
    pool = ConnectionPool(
        "127.0.0.1",
        server.port,
        max_connections=2,
        connect_timeout_s=1.0,
        pool_timeout_s=1.0,
        api_key="first-key",
    )
    async with pool:
        for method in (b"GET", b"POST"):
            async with pool.request(method, b"/v1/x", [(b"x-request-id", b"r")]) as response:
                await response.aread(100)
        pool.set_api_key("rotated-key")
        async with pool.request(b"GET", b"/health") as response:
            await response.aread(100)
        pool.set_api_key(None)
        assert not pool.sends_api_key
        async with pool.request(b"GET", b"/health") as response:
            await response.aread(100)
    assert seen == [
        [(b"authorization", b"Bearer first-key")],
        [(b"authorization", b"Bearer first-key")],
        [(b"authorization", b"Bearer rotated-key")],
        [],
    ]


@pytest.mark.parametrize("key", ["a\r\nx-evil: 1", "a\nb", "clé", "a\x00"])
def test_a_key_that_would_inject_headers_is_refused_without_being_shown(key: str) -> None:
    pool = ConnectionPool(
        "127.0.0.1", 9, max_connections=1, connect_timeout_s=1.0, pool_timeout_s=1.0
    )
    with pytest.raises(ValueError) as refused:
        pool.set_api_key(key)
    assert str(refused.value) == "refusing an API key that cannot be sent in an HTTP header"
    assert not pool.sends_api_key


async def test_shrinking_the_pool_closes_the_idle_connections_it_no_longer_keeps(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    engine = ScriptedEngine(echo)
    network = MemoryNetwork(nursery)
    network.serve(PORT, engine.serve_stream)
    pool = network.pool(PORT, max_connections=3)
    gate = trio.Event()

    async def one() -> None:
        async with pool.request(b"GET", b"/") as response:
            await response.aread(100)
            await gate.wait()

    async with trio.open_nursery() as three:
        for _ in range(3):
            three.start_soon(one)
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
    assert pool.statistics().idle == 3
    pool.resize(1)
    assert pool.statistics().idle == 1
    async with pool.request(b"GET", b"/") as response:
        assert await response.aread(100) == b"GET / "
    await trio.testing.wait_all_tasks_blocked()
    # The two it let go were closed (the engine saw them leave), not left open.
    assert (engine.connections, engine.disconnects) == (3, 2)
    assert pool.statistics().idle == 1
