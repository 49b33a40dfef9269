from __future__ import annotations

from collections.abc import Awaitable, Callable
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

Handler = Callable[[trio.SocketStream, h11.Connection, h11.Request, bytes], Awaitable[None]]


class TinyServer:
    """A raw h11 server whose per-request behaviour each test scripts."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.disconnects = 0
        self.disconnected = trio.Event()
        self.port = 0

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(trio.serve_listeners, self._connection, listeners))
            task_status.started()

    def _disconnect(self) -> None:
        self.disconnects += 1
        self.disconnected.set()

    async def _connection(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request: h11.Request | None = None
                body = b""
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        data = await stream.receive_some(65536)
                        if not data:
                            self._disconnect()
                            return
                        conn.receive_data(data)
                    elif isinstance(event, h11.Request):
                        request = event
                    elif isinstance(event, h11.Data):
                        body += event.data
                    elif isinstance(event, h11.EndOfMessage):
                        break
                    elif isinstance(event, h11.ConnectionClosed):
                        self._disconnect()
                        return
                assert request is not None
                await self.handler(stream, conn, request, body)
                if conn.our_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._disconnect()
        finally:
            await trio.aclose_forcefully(stream)


async def respond(
    stream: trio.SocketStream, conn: h11.Connection, status: int, chunks: list[bytes]
) -> None:
    data = conn.send(h11.Response(status_code=status, headers=[("transfer-encoding", "chunked")]))
    assert data is not None
    await stream.send_all(data)
    for chunk in chunks:
        part = conn.send(h11.Data(data=chunk))
        assert part is not None
        await stream.send_all(part)
    end = conn.send(h11.EndOfMessage())
    assert end is not None
    await stream.send_all(end)


async def echo(
    stream: trio.SocketStream, conn: h11.Connection, req: h11.Request, body: bytes
) -> None:
    await respond(stream, conn, 200, [req.method + b" " + req.target + b" ", body])


async def start(nursery: trio.Nursery, handler: Handler) -> TinyServer:
    server = TinyServer(handler)
    await nursery.start(server.serve)
    return server


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
        stream: trio.SocketStream, conn: h11.Connection, req: h11.Request, body: bytes
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


async def test_pool_timeout_when_every_connection_is_in_use(
    nursery: trio.Nursery, io_clock: trio.testing.MockClock
) -> None:
    release = trio.Event()

    async def held(
        stream: trio.SocketStream, conn: h11.Connection, req: h11.Request, body: bytes
    ) -> None:
        await release.wait()
        await respond(stream, conn, 200, [b"ok"])

    server = await start(nursery, held)
    pool = pool_for(server, max_connections=1, pool_timeout_s=5.0)

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
    assert trio.current_time() - started == pytest.approx(5.0)
    assert pool.statistics().in_use == 1
    release.set()


async def test_connection_refused_is_a_connect_error() -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    await listener.aclose()
    pool = ConnectionPool(
        "127.0.0.1", port, max_connections=2, connect_timeout_s=1.0, pool_timeout_s=1.0
    )
    with pytest.raises(ConnectError, match="connection refused"):
        async with pool.request(b"GET", b"/"):
            pass
    assert pool.statistics().in_use == 0


async def test_engine_dropping_mid_body_is_a_protocol_error(nursery: trio.Nursery) -> None:
    async def crash(
        stream: trio.SocketStream, conn: h11.Connection, req: h11.Request, body: bytes
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
    nursery: trio.Nursery,
) -> None:
    async def endless(
        stream: trio.SocketStream, conn: h11.Connection, req: h11.Request, body: bytes
    ) -> None:
        data = conn.send(h11.Response(status_code=200, headers=[("transfer-encoding", "chunked")]))
        assert data is not None
        await stream.send_all(data)
        for _ in range(10_000):
            await stream.send_all(conn.send(h11.Data(data=b"x" * 100)) or b"")
            await trio.sleep(0.001)

    server = await start(nursery, endless)
    pool = pool_for(server)
    async with pool.request(b"GET", b"/") as response:
        await response.receive_some()
    with trio.fail_after(5):
        await server.disconnected.wait()
    assert pool.statistics() == pool.statistics().__class__(
        max_connections=4, in_use=0, idle=0, waiting=0, opened_total=1, reused_total=0
    )


async def test_idle_connection_closed_by_the_engine_is_not_reused(nursery: trio.Nursery) -> None:
    async def close_after(
        stream: trio.SocketStream, conn: h11.Connection, req: h11.Request, body: bytes
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
        stream: trio.SocketStream, conn: h11.Connection, req: h11.Request, body: bytes
    ) -> None:
        await respond(stream, conn, 200, [b"a" * 600, b"b" * 600])

    server = await start(nursery, big)
    pool = pool_for(server)
    with pytest.raises(ResponseTooLarge, match="exceeds 1000 bytes"):
        async with pool.request(b"GET", b"/") as response:
            await response.aread(1000)
    assert pool.statistics().idle == 0


async def test_resize_in_place_applies_to_waiters(
    nursery: trio.Nursery, io_clock: trio.testing.MockClock
) -> None:
    release = trio.Event()

    async def held(
        stream: trio.SocketStream, conn: h11.Connection, req: h11.Request, body: bytes
    ) -> None:
        await release.wait()
        await respond(stream, conn, 200, [b"ok"])

    server = await start(nursery, held)
    pool = pool_for(server, max_connections=1, pool_timeout_s=100.0)
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
