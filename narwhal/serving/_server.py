"""Serving the ASGI app with hypercorn on trio, with client backpressure enforced.

hypercorn's trio TCPServer writes every response chunk inside a shielded cancel scope.
A client that stops reading fills its socket buffer, `send_all` blocks, and the shield
means no deadline can interrupt it: the request would hold its engine stream forever.
Manual 4.3 wants the opposite (client backpressure closes the connection immediately),
so the connection class below bounds each write by serving.client_stall_s and aborts
the connection when it cannot complete. A write interrupted after some bytes went out
also aborts the connection, because the HTTP stream is no longer well formed.

This relies on hypercorn's TCPServer/WorkerContext classes, which are not documented
API; tests/serving/test_server.py fails if a hypercorn upgrade changes them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from functools import partial
from typing import Any, cast

import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, Event, RawData
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ASGIFramework, ConnectionState

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class _StallBoundTCPServer(TCPServer):
    stall_s: float = 0.5

    async def protocol_send(self, event: Event) -> None:
        if not isinstance(event, RawData):
            await super().protocol_send(event)
            return
        async with self.send_lock:
            sent = 0
            data = memoryview(event.data)
            aborted = False
            try:
                with trio.move_on_after(self.stall_s) as stall:
                    while sent < len(data):
                        sent += await self.stream.socket.send(data[sent:])
                aborted = stall.cancelled_caught
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                aborted = True
            except BaseException:
                if sent:
                    self.stream.socket.close()
                raise
            if aborted:
                self.stream.socket.close()
                await self.protocol.handle(Closed())


async def serve_app(
    app: App,
    *,
    host: str,
    port: int,
    client_stall_s: float,
    shutdown: trio.Event,
    graceful_timeout_s: float = 5.0,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until `shutdown` is set; started() reports the bound (host, port) pairs."""
    config = HypercornConfig()
    config.keep_alive_timeout = 75.0
    config.graceful_timeout = graceful_timeout_s
    config.accesslog = None
    config.errorlog = None
    context = WorkerContext(None)
    wrapped = ASGIWrapper(cast(ASGIFramework, app))
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = [
        (str(listener.socket.getsockname()[0]), int(listener.socket.getsockname()[1]))
        for listener in listeners
    ]
    server_class = type("NarwhalTCPServer", (_StallBoundTCPServer,), {"stall_s": client_stall_s})
    async with trio.open_nursery() as connections:
        async with trio.open_nursery() as accepting:
            await accepting.start(
                partial(
                    trio.serve_listeners,
                    partial(server_class, wrapped, config, context, ConnectionState({})),
                    listeners,
                    handler_nursery=connections,
                )
            )
            task_status.started(bound)
            await shutdown.wait()
            accepting.cancel_scope.cancel()
        # Idle keep-alive connections close now; busy ones get graceful_timeout_s.
        await context.terminated.set()
        connections.cancel_scope.deadline = trio.current_time() + graceful_timeout_s
