"""The supervisor: one nursery that owns everything running beside the requests.

`Supervisor.run` uses the start protocol: it reports started only once the HTTP
listener is bound, with the supervisor itself as the value, so tests and the daemon
both get the bound address and a handle to ask for shutdown.
"""

from __future__ import annotations

import logging
from functools import partial

import trio

from ..config import Config
from ..serving import App, ServingContext, serve_app

log = logging.getLogger("narwhal.supervisor")


class Supervisor:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.ctx: ServingContext | None = None
        self.bound: list[tuple[str, int]] = []
        self._shutdown = trio.Event()

    @property
    def url(self) -> str:
        host, port = self.bound[0]
        return f"http://{host}:{port}"

    def request_shutdown(self) -> None:
        self._shutdown.set()

    async def run(
        self, *, task_status: trio.TaskStatus[Supervisor] = trio.TASK_STATUS_IGNORED
    ) -> None:
        config = self.config
        ctx = ServingContext(config)
        self.ctx = ctx
        try:
            async with trio.open_nursery() as nursery:
                self.bound = await nursery.start(
                    partial(
                        serve_app,
                        App(ctx),
                        host=config.listen.host,
                        port=config.listen.port,
                        client_stall_s=config.serving.client_stall_s,
                        shutdown=self._shutdown,
                        graceful_timeout_s=config.recovery.shutdown_grace_s,
                    )
                )
                log.info("listening", extra={"event": "listening", "url": self.url})
                task_status.started(self)
                await self._shutdown.wait()
                ctx.accepting = False
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(2.0):
                await ctx.fleet.aclose()
