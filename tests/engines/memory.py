"""An in-memory network for the engine transport's seam, `ConnectionPool(connect=...)`.

Owns: `MemoryNetwork`, addresses at which engines serve connections: each time a pool
connects, the engine at that address gets one end of a `trio.testing.memory_stream_pair`
and the pool the other. An engine is any per-connection handler: `ScriptedEngine` (an
h11 server whose answers a test scripts) or narwhal-sim's own (`serve_sim`).
Invariants: no sockets and no real time. Bytes written are readable at once, so under
an autojump MockClock every deadline fires at its exact virtual time and a test waits
for nothing real. A pool's close is seen by the engine as the end of its stream, as a
socket's would be.
Errors: connecting to an address nobody serves raises ConnectionRefusedError, as TCP does.
See: narwhal/engines/_transport.py (the seam), tests/engines/test_transport.py.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Awaitable, Callable
from functools import partial

import h11
import trio
import trio.testing

from narwhal.engines import ConnectionPool
from narwhal.fleet import Fleet
from narwhal.sim import SimEngine, SimEngineSpec

HOST = "127.0.0.1"

StreamHandler = Callable[[trio.abc.Stream], Awaitable[None]]
Handler = Callable[[trio.abc.Stream, h11.Connection, h11.Request, bytes], Awaitable[None]]


class MemoryNetwork:
    """Engines reachable at (host, port) over memory streams; their connections run in
    `nursery`, which outlives the pools that connect."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._engines: dict[tuple[str, int], StreamHandler] = {}

    def serve(self, port: int, engine: StreamHandler, host: str = HOST) -> None:
        self._engines[host, port] = engine

    def stop(self, port: int, host: str = HOST) -> None:
        """Refuse new connections to the address (those open stay open)."""
        del self._engines[host, port]

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        await trio.lowlevel.checkpoint()
        engine = self._engines.get((host, port))
        if engine is None:
            raise ConnectionRefusedError(errno.ECONNREFUSED, os.strerror(errno.ECONNREFUSED))
        ours, theirs = trio.testing.memory_stream_pair()
        self._nursery.start_soon(_serve_one, engine, theirs)
        return ours

    def pool(
        self,
        port: int,
        *,
        max_connections: int = 4,
        connect_timeout_s: float = 1.0,
        pool_timeout_s: float = 1.0,
        idle_ttl_s: float = 4.0,
    ) -> ConnectionPool:
        return ConnectionPool(
            HOST,
            port,
            max_connections=max_connections,
            connect_timeout_s=connect_timeout_s,
            pool_timeout_s=pool_timeout_s,
            idle_ttl_s=idle_ttl_s,
            connect=self.connect,
        )

    def attach(self, fleet: Fleet) -> None:
        """Route the pools of every engine of `fleet` through this network, those a
        reload adds included; a pool's `connect` applies from its next connection."""
        fleet.connect = self.connect
        for engine in fleet:
            engine.serving_pool.connect = self.connect
            engine.control_pool.connect = self.connect

    async def serve_sim(self, port: int, spec: SimEngineSpec, *, index: int = 0) -> SimEngine:
        """A narwhal-sim engine at `port`, which reaches its peers (the KV side channel)
        through this network too."""
        engine = SimEngine(spec, index=index, host=HOST, port=port, connect=self.connect)
        await self._nursery.start(partial(engine.run, listen=False))
        self.serve(port, engine.serve_stream)
        return engine


async def _serve_one(engine: StreamHandler, stream: trio.abc.Stream) -> None:
    async with stream:
        await engine(stream)


class ScriptedEngine:
    """A raw h11 server; `handler` answers each request (`respond` for a plain one).
    Counts connections, and disconnects seen while reading or answering."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.disconnects = 0
        self.disconnected = trio.Event()

    def _disconnect(self) -> None:
        self.disconnects += 1
        self.disconnected.set()

    async def serve_stream(self, stream: trio.abc.Stream) -> None:
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
                        conn.receive_data(bytes(data))
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
    stream: trio.abc.Stream, conn: h11.Connection, status: int, chunks: list[bytes]
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


async def start_head(stream: trio.abc.Stream, conn: h11.Connection, first: bytes) -> None:
    """A chunked 200 and its first chunk, in one write; the rest is the caller's."""
    data = conn.send(h11.Response(status_code=200, headers=[("transfer-encoding", "chunked")]))
    assert data is not None
    await stream.send_all(data + (conn.send(h11.Data(data=first)) or b""))
