"""A worker process of the multi-process plane (docs/architecture.md#workers).

    python -m narwhal.plane.worker INDEX CHANNEL_FD LISTEN_FD...

Started by its core's `WorkerPool`, never by hand. It serves clients on the listening
sockets the core handed down, and takes every request's global decisions from the core
over the channel (`RemoteDecisions`). The configuration is the core's, asked for at
start and sent again on each reload; the engines' load and context lengths come as the
core's periodic `mirror` note.
"""

from __future__ import annotations

import logging
import socket
import sys
from collections.abc import Callable
from functools import partial

import trio

from .. import _logging
from .._errors import NarwhalError
from ..config import Config, diff
from ..fleet import EngineState
from ..prefix import PromptKey
from ..serving._app import App
from ..serving._context import ServingContext
from ..serving._decisions import Standing
from ..serving._server import serve_app
from ..serving._state import worker_section
from ..supervisor._reload import fresh_engines, swap_engines
from ..supervisor._supervisor import CLEANUP_S
from ._channel import Channel
from ._remote import RemoteDecisions
from ._worker import run_worker

log = logging.getLogger("narwhal.plane")

Reply = Callable[[object], None]
# A worker asked to stop finishes its requests for at most this long.
STOP_GRACE_S = 5.0


class _CoreCaches:
    """Marks that the core keeps prefix caches: a worker asks them through its core."""

    def cached_tokens(self, engine_id: str, key: PromptKey, now: float) -> int:
        raise AssertionError("a worker's prefix-cache lookups go to its core")

    def routed(self, engine_id: str, key: PromptKey, now: float) -> None:
        raise AssertionError("a worker's prefix-cache lookups go to its core")


class Worker:
    """The worker's state: its context, built once the core has sent its config."""

    def __init__(self, index: int, listeners: list[trio.SocketListener]) -> None:
        self.index = index
        self.listeners = listeners
        self.ctx: ServingContext | None = None
        self.stop = trio.Event()
        self.standing: Standing | None = None  # the core's, as of its last mirror
        self._nursery: trio.Nursery | None = None

    async def on_call(self, name: str, payload: object, reply: Reply) -> object:
        ctx = self.ctx
        if name == "metrics":
            return b"" if ctx is None else ctx.metrics.render()
        if name == "state":
            return {} if ctx is None else worker_section(ctx)
        raise ValueError(f"a worker has no call `{name}`")

    def on_note(self, name: str, payload: object) -> None:
        ctx = self.ctx
        if name == "stop":
            self.stop.set()
        elif ctx is None:
            return
        elif name == "cancel":
            assert isinstance(payload, NarwhalError)
            ctx.cancel_requests(payload)
        elif name == "config":
            assert isinstance(payload, Config)
            self.reload(ctx, payload)
        elif name == "mirror":
            assert isinstance(payload, tuple)
            engines, chars_per_token, self.standing = payload
            ctx.measured_chars_per_token = chars_per_token
            for engine_id, (active, tokens, prefills, length, note) in engines.items():
                engine = ctx.fleet.get(engine_id)
                if engine is not None:
                    engine.load.mirror(active, tokens, prefills)
                    engine.set_context(length, note)

    def reload(self, ctx: ServingContext, config: Config) -> None:
        """Take the core's reloaded configuration (the one in force there): new requests
        snapshot it, and the engines it adds, replaces or removes change here as in the
        core (`swap_engines`). A retired instance's legs finish on it; it is closed once
        every request that could have one is past its deadline."""
        old = ctx.config
        plan = diff(old, config)
        fresh = fresh_engines(ctx, config, plan)
        ctx.take_config(config)
        logging.getLogger("narwhal").setLevel(config.log.level.upper())
        for engine in swap_engines(ctx, config, plan, fresh):
            if self._nursery is not None:
                bound = old.serving.request_timeout_s + CLEANUP_S
                self._nursery.start_soon(_close_after, ctx, engine, bound)

    async def work(self, channel: Channel) -> None:
        config = await channel.call("config")
        assert isinstance(config, Config)
        # The daemon's log: the same JSON lines on the same stderr, each with its worker.
        _logging.configure(config.log.level, worker=self.index)
        ctx = self.ctx = ServingContext(config)
        ctx.decide_with = lambda config, endpoint: RemoteDecisions(
            ctx, config, channel, endpoint, mirrored=lambda: self.standing
        )
        ctx.prefix_caches = _CoreCaches()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(ctx.loop_lag.run)
                async with trio.open_nursery() as serving:
                    await serving.start(
                        partial(
                            serve_app,
                            App(ctx),
                            host="",
                            port=0,
                            listeners=self.listeners,
                            client_stall_s=lambda: ctx.config.serving.client_stall_s,
                            shutdown=self.stop,
                            graceful_timeout_s=STOP_GRACE_S,
                            open_connections=ctx.connections,
                            protocol_error=ctx.client_protocol_error,
                        )
                    )
                    channel.note("up", self.index)  # serving: the pool reports it started
                # serve_app returned: `stop`, and its connections are done or past grace.
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                await ctx.fleet.aclose()


async def _close_after(ctx: ServingContext, engine: EngineState, delay_s: float) -> None:
    await trio.sleep(delay_s)
    with trio.move_on_after(CLEANUP_S, shield=True):
        await engine.aclose()
    ctx.fleet.forget(engine)


async def main(argv: list[str]) -> None:
    index, channel_fd, *listen_fds = (int(arg) for arg in argv)
    listeners = [
        trio.SocketListener(trio.socket.from_stdlib_socket(socket.socket(fileno=fd)))
        for fd in listen_fds
    ]
    worker = Worker(index, listeners)
    why = await run_worker(
        channel_fd, index=index, on_call=worker.on_call, on_note=worker.on_note, work=worker.work
    )
    log.info("worker %d stops: %s", index, why, extra={"event": "worker_stopped"})


if __name__ == "__main__":
    trio.run(main, sys.argv[1:])
