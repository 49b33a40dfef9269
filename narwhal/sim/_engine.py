"""One simulated engine: its listener, scheduler loop, fault state, counters and outcomes.

Owns: `SimEngine`, which picks its protocol at start-up (`_vllm.VLLMProtocol` or
`_sglang.SGLangProtocol`, by the spec's dialect) and serves the routes every engine has
(/health, /metrics, /v1/models, /tokenize, /reset_prefix_cache, the generation endpoints
of `_api`, the simulator's /_sim/ control routes and `_kv`'s side channel) plus the
protocol's own; and, when its spec has kv_events, the KV event publisher (`_events`),
which gets the cache's events once per step.
Invariants: the dialect is read once, here, to pick the protocol; everything that differs
between vLLM and SGLang is asked of it. Simulated time is trio's clock; every duration
from the spec is divided by its speed.
See: `_kv` (leases and the side channel), `_run` (one request), narwhal/sim/__init__.py.
"""

from __future__ import annotations

import random
import secrets
import sys
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import trio

from . import _http
from ._api import Api
from ._core import SchedulerCore
from ._events import EventPublisher
from ._faults import FaultSpec, FaultSpecError, parse_faults
from ._http import HttpRequest, Responder
from ._kv import KvStore
from ._metrics import EngineMetrics, Gauges, count_streaming, make_registry, render
from ._protocol import EngineProtocol, Routes
from ._records import PHASES, Counters, Lease, RemoteKV, ReqCtx, Room
from ._sglang import SGLangProtocol
from ._spec import Dialect, SimEngineSpec
from ._tokenizer import Tokenizer
from ._vllm import VLLMProtocol

# If the step loop falls this far behind its own schedule (CPU saturation), it stops
# trying to catch up and restarts the timeline from now.
_MAX_LAG_S = 0.02
# The protocol each dialect speaks.
PROTOCOLS: dict[Dialect, type[EngineProtocol]] = {"vllm": VLLMProtocol, "sglang": SGLangProtocol}


class SimEngine:
    """One engine instance. A restart replaces the instance (new id, empty KV)."""

    def __init__(
        self,
        spec: SimEngineSpec,
        *,
        index: int,
        host: str,
        port: int,
        generation: int = 0,
        on_restart: Callable[[], None] | None = None,
        connect: _http.Connect = trio.open_tcp_stream,
    ) -> None:
        self.spec = spec
        # How this engine reaches its peers (the KV side channel).
        self.connect = connect
        # Mutable so a test can rotate one engine's key (EngineHandle.set_api_key).
        self.api_key = spec.api_key
        self.index = index
        self.host = host
        self.port = port
        self.generation = generation
        self.label = str(index)
        seed_key = f"{spec.seed}/{index}/{generation}"
        self.instance_id = str(uuid.UUID(int=random.Random(seed_key).getrandbits(128), version=4))
        self.core = SchedulerCore(
            spec.timing,
            seed=seed_key,
            prefix_caching=spec.prefix_caching,
            kv_events=spec.kv_events is not None,
        )
        self.publisher = EventPublisher(spec.kv_events) if spec.kv_events is not None else None
        self._hex = random.Random(seed_key + "/ids")
        self.tokenizer = Tokenizer()
        self.counters = Counters()
        self.metrics = EngineMetrics()
        self.started_at = time.time()
        self.protocol = PROTOCOLS[spec.dialect](self)
        self.registry = make_registry(self.protocol.collector())
        self.outcomes: deque[dict[str, Any]] = deque(maxlen=spec.outcome_ring)
        self.kv = KvStore(self, seed=seed_key)
        # Decode requests with remote KV that arrived and have not pulled yet (heartbeats).
        self.awaiting_kv: set[ReqCtx] = set()
        # Requests accepted but held before the scheduler (slow first token, SGLang bootstrap).
        self.pending = 0
        self.faults: FaultSpec | None = None
        self._fault_remaining: int | None = None
        self._fault_set_at = 0.0
        self.http_stats = _http.ServerStats()
        self.up = False
        # How far the step loop fell behind its own timeline (CPU saturation).
        self.step_lag_resets = 0
        self.max_step_lag_s = 0.0
        self._wakeup = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._listener_scope: trio.CancelScope | None = None
        self._listener_done = trio.Event()
        self._on_restart = on_restart
        self.api = Api(self)
        self._routes = self._make_routes()

    # -- identity -------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.advertised_host}:{self.port}"

    @property
    def advertised_host(self) -> str:
        # A wildcard bind is not an address a peer can dial; the fleet is on this host.
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    @property
    def speed(self) -> float:
        return self.spec.speed

    def new_hex(self, n: int = 8) -> str:
        return f"{self._hex.getrandbits(4 * n):0{n}x}"

    @property
    def rooms(self) -> dict[int, Room]:
        """SGLang's bootstrap rooms on this (prefill) engine."""
        return self.kv.rooms

    # -- lifecycle ------------------------------------------------------------------------
    async def run(
        self, *, listen: bool = True, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until cancelled. Without `listen` no port is opened: connections come
        from whoever calls `serve_stream` (a test's in-memory network)."""
        publisher = self.publisher
        if publisher is not None:
            publisher.open()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._step_loop)
                nursery.start_soon(self.kv.run_reaper)
                nursery.start_soon(self.protocol.run)
                if publisher is not None:
                    nursery.start_soon(publisher.serve_replay)
                if listen:
                    await nursery.start(self._serve_listener)
                else:
                    self.up = True
                task_status.started()
        finally:
            if publisher is not None:
                publisher.close()

    async def _serve_listener(self, *, task_status: trio.TaskStatus[None]) -> None:
        if self.port == 0:
            listeners = await _http.listen_outside_ephemeral_range(self.host)
            self.port = listeners[0].socket.getsockname()[1]
        else:
            listeners = await trio.open_tcp_listeners(self.port, host=self.host)
        self._listener_done = trio.Event()
        try:
            with trio.CancelScope() as scope:
                self._listener_scope = scope
                async with trio.open_nursery() as conns:
                    await conns.start(
                        partial(
                            trio.serve_listeners,
                            self.serve_stream,
                            listeners,
                            handler_nursery=conns,
                        )
                    )
                    self.up = True
                    task_status.started()
        finally:
            self.up = False
            for listener in listeners:
                with trio.move_on_after(1.0, shield=True):
                    await listener.aclose()
            self._listener_done.set()

    async def go_down(self) -> None:
        """Close the listener and drop every connection: peers get connection refused."""
        if self._listener_scope is not None and self.up:
            self._listener_scope.cancel()
            await self._listener_done.wait()

    async def come_up(self) -> None:
        if self.up or self._nursery is None:
            return
        await self._nursery.start(self._serve_listener)

    async def _down_for(self, seconds: float) -> None:
        await self.go_down()
        await trio.sleep(seconds)
        await self.come_up()

    async def serve_stream(self, stream: trio.abc.Stream) -> None:
        """Serve one client connection until either side closes it."""
        await _http.serve_connection(
            stream, self._dispatch, idle_timeout_s=self.spec.keep_alive_s, stats=self.http_stats
        )

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` in the engine's nursery, for the engine's life (nothing once
        it has stopped)."""
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)

    # -- scheduling loop ------------------------------------------------------------------
    def wake_scheduler(self) -> None:
        self._wakeup.set()

    async def _step_loop(self) -> None:
        core = self.core
        protocol = self.protocol
        speed = self.spec.speed
        prev_end: float | None = None
        while True:
            self._wakeup = trio.Event()
            plan = core.schedule()
            for r in plan.pulls:
                r.owner.wake()
            if not protocol.load_reported:
                protocol.note_step(plan.empty, bool(plan.decodes))
            if plan.empty:
                prev_end = None
                await self._wakeup.wait()
                continue
            now = trio.current_time()
            if prev_end is not None and now - prev_end > 0:
                lag = now - prev_end
                self.max_step_lag_s = max(self.max_step_lag_s, lag)
                if lag > _MAX_LAG_S:
                    # The CPU could not keep up: simulated time is now running slow.
                    self.step_lag_resets += 1
                    prev_end = None
            start = now if prev_end is None else prev_end
            duration = plan.duration_s
            slowdown = self.faults.decode_slowdown if self.faults is not None else None
            if slowdown is not None and plan.decodes:
                duration *= slowdown
            end = start + duration / speed
            await trio.sleep_until(end)
            result = core.complete(plan)
            if self.publisher is not None:
                # One batch per step, after it ran, as vLLM's scheduler publishes.
                self.publisher.publish(core.pool.take_events())
            now = trio.current_time()
            metrics = self.metrics
            for r in result.progressed:
                ctx: ReqCtx = r.owner
                if ctx.first_token_at is None:
                    ctx.first_token_at = now
                    metrics.ttft.observe(now - ctx.arrival)
                else:
                    metrics.itl.observe(now - ctx.last_token_at)
                ctx.last_token_at = now
                ctx.event.set()
            metrics.generation_tokens += len(result.progressed)
            protocol.count_generated(metrics, result.progressed)
            for r in result.finished:
                ctx = r.owner
                metrics.e2e.observe(now - ctx.arrival)
                if r.hold_kv:
                    self.kv.hold(ctx, now)
            prev_end = end

    # -- faults ---------------------------------------------------------------------------
    def set_faults(self, spec: FaultSpec | None) -> None:
        self.faults = spec
        self._fault_remaining = spec.count if spec is not None else None
        self._fault_set_at = trio.current_time()
        if spec is not None and spec.down_s and self._nursery is not None:
            self.counters.downs_injected += 1
            self._nursery.start_soon(self._down_for, spec.down_s)

    def request_faults(self, leg: str, header: FaultSpec | None) -> FaultSpec | None:
        """The faults one request runs with: its own header, else the engine's (counted)."""
        if header is not None:
            return header if header.applies_to(leg) else None
        spec = self.faults
        if spec is None or not spec.applies_to(leg):
            return None
        if not spec.has_request_faults and spec.lease_s is None:
            return None
        if self._fault_remaining is not None:
            if self._fault_remaining <= 0:
                return None
            self._fault_remaining -= 1
        return spec

    def healthy(self) -> bool:
        spec = self.faults
        if spec is None:
            return True
        if spec.unhealthy:
            return False
        if spec.health_flap_period_s:
            elapsed = trio.current_time() - self._fault_set_at
            return int(elapsed / spec.health_flap_period_s) % 2 == 0
        return True

    def lease_for(self, faults: FaultSpec | None) -> float:
        if faults is not None and faults.lease_s is not None:
            return faults.lease_s
        return self.spec.scaled(self.spec.lease_s)

    # -- outcomes -------------------------------------------------------------------------
    def record(
        self,
        ctx: ReqCtx | None,
        *,
        request_id: str,
        phase: str,
        outcome: str,
        status: int,
        tokens: int = 0,
        armed_fault: bool = False,
    ) -> None:
        counters = self.counters
        if outcome == "ok":
            counters.completed[phase] += 1
        elif outcome == "aborted":
            counters.aborted[phase] += 1
        else:
            counters.errors[phase] += 1
        if ctx is not None:
            # Like vLLM, only requests that reached the engine count as finished.
            reason = {"ok": "length", "aborted": "abort"}.get(outcome, "error")
            self.metrics.success[reason] = self.metrics.success.get(reason, 0) + 1
            count_streaming(self.metrics.streaming_requests, ctx.stream)
        self.outcomes.append(
            {
                "request_id": request_id,
                "internal_id": ctx.internal_id if ctx is not None else None,
                "phase": phase,
                "outcome": outcome,
                "status": status,
                "tokens": tokens,
                "armed_fault": armed_fault or (ctx is not None and ctx.armed_fault),
                "at": trio.current_time(),
                # Wall clock, comparable with other processes on the host (trio's clock
                # is per process): the reliability soak orders legs against its clients.
                "wall": time.time(),
            }
        )

    # -- state ----------------------------------------------------------------------------
    def gauges(self) -> Gauges:
        core = self.core
        return Gauges(
            running=len(core.running),
            waiting=len(core.waiting) + len(core.pulling) + self.pending,
            kv_usage=core.kv_usage,
            preemptions=core.preemptions,
            used_tokens=core.resident_tokens(),
            capacity_tokens=core.timing.kv_capacity_tokens,
            published=self.protocol.load_reported,
            prefix_queries=core.pool.queries if core.pool.caching else None,
            prefix_hits=core.pool.hits,
        )

    def state(self, *, outcomes: int | None = None) -> dict[str, Any]:
        core = self.core
        leases = self.kv.leases
        ring = list(self.outcomes)
        if outcomes is not None:
            ring = ring[-outcomes:] if outcomes > 0 else []
        faults = None
        if self.faults is not None:
            faults = self.faults.to_json()
            if self._fault_remaining is not None:
                faults["remaining"] = self._fault_remaining
        return {
            "engine": self.label,
            "index": self.index,
            "instance_id": self.instance_id,
            "generation": self.generation,
            "url": self.url,
            "up": self.up,
            "healthy": self.healthy(),
            "dialect": self.spec.dialect,
            "disaggregation_mode": self.spec.disaggregation_mode,
            "model": self.spec.model,
            "build": self.spec.build,
            "speed": self.spec.speed,
            "lease_s": self.spec.lease_s,
            "running": len(core.running),
            "waiting": len(core.waiting) + self.pending,
            "pulling": len(core.pulling),
            "steps": core.steps,
            # Non-zero resets mean the process was CPU-bound and ran slower than the law.
            "step_lag": {"resets": self.step_lag_resets, "max_s": self.max_step_lag_s},
            "kv": {
                "resident_tokens": core.resident_tokens(),
                "capacity_tokens": core.timing.kv_capacity_tokens,
                "used_blocks": core.used_blocks,
                "total_blocks": core.timing.total_blocks,
                "block_size": core.timing.block_size,
                "usage": core.kv_usage,
            },
            "prefix_cache": {
                "enabled": self.spec.prefix_caching,
                "cached_blocks": core.pool.cached_blocks,
                "queries_tokens": core.pool.queries,
                "hits_tokens": core.pool.hits,
            },
            "kv_events": None
            if self.publisher is None
            else {
                "endpoint": self.publisher.endpoint,
                "replay_endpoint": self.publisher.replay_endpoint,
                "topic": self.publisher.config.topic,
                "batches": self.publisher.published,
            },
            "leases": {
                "held": len(leases),
                "tokens": sum(lease.tokens for lease in leases.values()),
                "in_transfer": sum(1 for lease in leases.values() if lease.in_transfer),
                "expired_recent": list(self.kv.expired)[-20:],
            },
            "counters": {**attrs.asdict(self.counters), "preemptions": core.preemptions},
            "http": attrs.asdict(self.http_stats),
            "faults": faults,
            "outcomes": ring,
        }

    # -- HTTP dispatch --------------------------------------------------------------------
    def _make_routes(self) -> Routes:
        api = self.api
        routes: Routes = {
            ("POST", "/v1/completions"): partial(api.generate, chat=False),
            ("POST", "/v1/chat/completions"): partial(api.generate, chat=True),
            ("POST", "/tokenize"): self.protocol.tokenize,
            ("GET", "/health"): self.serve_health,
            ("GET", "/v1/models"): api.models,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/_sim/state"): self._state,
            ("GET", "/_sim/faults"): self._get_faults,
            ("POST", "/_sim/faults"): self._post_faults,
            ("DELETE", "/_sim/faults"): self._delete_faults,
            ("POST", "/_sim/restart"): self._restart,
            ("POST", "/reset_prefix_cache"): self._reset_prefix_cache,
        }
        routes.update(self.kv.routes())
        routes.update(self.protocol.routes())
        return routes

    async def _dispatch(self, req: HttpRequest, resp: Responder) -> None:
        key = self.api_key
        if key is not None and self.protocol.requires_api_key(req.method, req.path):
            scheme, _, token = req.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(
                token.encode(), key.encode()
            ):
                # Both engines answer before routing, so an unknown path gets 401 too.
                await resp.send_json(401, {"error": "Unauthorized"})
                return
        route = self._routes.get((req.method, req.path))
        if route is None:
            if any(path == req.path for _, path in self._routes):
                await resp.send_json(405, {"detail": "Method Not Allowed"})
            else:
                await resp.send_json(404, {"detail": "Not Found"})
            return
        try:
            await route(req, resp)
        except (_http.ClientGone, _http.DropConnection, trio.Cancelled):
            raise
        except Exception:
            self.counters.handler_errors += 1
            traceback.print_exc(file=sys.stderr)
            raise

    async def serve_health(self, req: HttpRequest, resp: Responder) -> None:
        healthy = self.healthy()
        if not healthy:
            self.counters.health_failures_served += 1
        # An empty body without a content type, as uvicorn sends FastAPI's Response().
        await resp.send(200 if healthy else 503, b"", content_type=None)

    async def _metrics(self, req: HttpRequest, resp: Responder) -> None:
        stall = self.faults.metrics_stall_s if self.faults is not None else None
        if stall:
            self.counters.metrics_stalls_injected += 1
            await trio.sleep(stall)
        await resp.send(
            200, render(self.registry), content_type="text/plain; version=0.0.4; charset=utf-8"
        )

    async def _state(self, req: HttpRequest, resp: Responder) -> None:
        limit: int | None = None
        for part in req.query.split("&"):
            key, _, value = part.partition("=")
            if key == "outcomes" and value.isdigit():
                limit = int(value)
        await resp.send_json(200, self.state(outcomes=limit))

    async def _get_faults(self, req: HttpRequest, resp: Responder) -> None:
        await resp.send_json(200, self.state(outcomes=0)["faults"])

    async def _post_faults(self, req: HttpRequest, resp: Responder) -> None:
        try:
            spec = parse_faults(req.json())
        except (ValueError, FaultSpecError) as exc:
            await resp.send_json(400, {"error": str(exc)})
            return
        self.set_faults(spec)
        await resp.send_json(200, self.state(outcomes=0)["faults"])

    async def _delete_faults(self, req: HttpRequest, resp: Responder) -> None:
        self.set_faults(None)
        await resp.send_json(200, None)

    async def _reset_prefix_cache(self, req: HttpRequest, resp: Responder) -> None:
        """vLLM's (a dev-mode route there): forget every cached block unless some are
        held, with an AllBlocksCleared event, published at once (vLLM's waits for the
        next step)."""
        success = self.core.pool.reset()
        if self.publisher is not None:
            self.publisher.publish(self.core.pool.take_events())
        await resp.send_json(200, {"success": success})

    async def _restart(self, req: HttpRequest, resp: Responder) -> None:
        if self._on_restart is None:
            await resp.send_json(501, {"error": "this engine cannot restart itself"})
            return
        await resp.send_json(202, {"restarting": self.instance_id})
        self._on_restart()


__all__ = ["PHASES", "Counters", "Lease", "RemoteKV", "ReqCtx", "Room", "SimEngine"]
