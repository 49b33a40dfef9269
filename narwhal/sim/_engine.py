"""One simulated engine: scheduler loop, KV leases, the engine-to-engine side channel,
fault state, counters and the non-generation endpoints.

The OpenAI endpoints live in `_api`; this module owns everything they share.
"""

from __future__ import annotations

import functools
import heapq
import random
import secrets
import sys
import time
import traceback
import uuid
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import attrs
import h11
import trio

from .._files import read_file
from . import _http
from ._api import Api
from ._core import SchedulerCore
from ._faults import FaultSpec, FaultSpecError, parse_faults
from ._http import HttpRequest, Responder
from ._metrics import EngineMetrics, Gauges, count_streaming, make_registry, render
from ._records import PHASES, Counters, Lease, RemoteKV, ReqCtx, Room
from ._spec import SimEngineSpec
from ._timing import Noise
from ._tokenizer import Tokenizer

# If the step loop falls this far behind its own schedule (CPU saturation), it stops
# trying to catch up and restarts the timeline from now.
_MAX_LAG_S = 0.02
# Wall-clock bound on an engine-to-engine control call (heartbeat, release notice).
_CONTROL_TIMEOUT_S = 5.0
# Wall-clock bound on a NIXL-style pull beyond its transfer time.
_PULL_SLACK_S = 10.0
_MAX_ROOMS = 65_536
_MIN_HEARTBEAT_S = 0.001
_EXPIRED_RING = 1_000
# SGLang's --decode-log-interval: a decode server reports its load every this many steps.
_DECODE_LOG_INTERVAL = 40


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
    ) -> None:
        self.spec = spec
        # Mutable so a test can rotate one engine's key (EngineHandle.set_api_key).
        self.api_key = spec.api_key
        self.index = index
        self.host = host
        self.port = port
        self.generation = generation
        self.label = str(index)
        seed_key = f"{spec.seed}/{index}/{generation}"
        self.instance_id = str(uuid.UUID(int=random.Random(seed_key).getrandbits(128), version=4))
        self.core = SchedulerCore(spec.timing, seed=seed_key)
        self._xfer_noise = Noise(spec.timing.noise_sigma, seed_key + "/xfer")
        self._hex = random.Random(seed_key + "/ids")
        self.tokenizer = Tokenizer()
        self.counters = Counters()
        self.metrics = EngineMetrics()
        self.started_at = time.time()
        timing = spec.timing
        self.registry = make_registry(
            self.metrics,
            self._gauges,
            dialect=spec.dialect,
            model=spec.model,
            engine=self.label,
            cache_info={
                "block_size": str(timing.block_size),
                "cache_dtype": "auto",
                "enable_prefix_caching": "False",
                "gpu_memory_utilization": "0.9",
                "num_cpu_blocks": "None",
                "num_gpu_blocks": str(timing.total_blocks),
            },
            started_at=self.started_at,
            kv_connector=spec.kv_connector,
            # SGLang's label of its server mode.
            engine_type=spec.disaggregation_mode.replace("null", "unified"),
        )
        # SGLang sets its load gauges when its scheduler first reports: at its first batch,
        # on a decode server at its first log interval or its first idle tick after
        # serving (`_note_report`). vLLM has them from the start.
        self.load_reported = spec.dialect == "vllm"
        self._decode_steps = 0
        self.outcomes: deque[dict[str, Any]] = deque(maxlen=spec.outcome_ring)
        self.expired_leases: deque[str] = deque(maxlen=_EXPIRED_RING)
        self.leases: dict[str, Lease] = {}
        self._lease_heap: list[tuple[float, int, str]] = []
        self._lease_seq = 0
        self._lease_changed = trio.Event()
        self.rooms: OrderedDict[int, Room] = OrderedDict()
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
        self._routes: dict[tuple[str, str], Callable[[HttpRequest, Responder], Awaitable[None]]]
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

    # -- lifecycle ------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._step_loop)
            nursery.start_soon(self._reaper_loop)
            nursery.start_soon(self._heartbeat_loop)
            await nursery.start(self._serve_listener)
            task_status.started()

    async def _serve_listener(self, *, task_status: trio.TaskStatus[None]) -> None:
        if self.port == 0:
            listeners = await _listen_outside_ephemeral_range(self.host)
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
                            self._on_connection,
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

    async def _on_connection(self, stream: trio.SocketStream) -> None:
        await _http.serve_connection(
            stream, self._dispatch, idle_timeout_s=self.spec.keep_alive_s, stats=self.http_stats
        )

    # -- scheduling loop ------------------------------------------------------------------
    def wake_scheduler(self) -> None:
        self._wakeup.set()

    async def _step_loop(self) -> None:
        core = self.core
        speed = self.spec.speed
        prev_end: float | None = None
        while True:
            self._wakeup = trio.Event()
            plan = core.schedule()
            for r in plan.pulls:
                r.owner.wake()
            if not self.load_reported:
                self._note_report(plan.empty, bool(plan.decodes))
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
            if self.spec.dialect == "sglang":
                for r in result.progressed:
                    count_streaming(metrics.streaming_generation_tokens, r.owner.stream)
            for r in result.finished:
                ctx = r.owner
                metrics.e2e.observe(now - ctx.arrival)
                if r.hold_kv:
                    self._create_lease(ctx, now)
            prev_end = end

    def _note_report(self, idle: bool, decodes: bool) -> None:
        """Whether this step is the SGLang scheduler's first load report."""
        if idle:
            self.load_reported = self._decode_steps > 0
        elif self.spec.disaggregation_mode != "decode":
            self.load_reported = True
        elif decodes:
            self._decode_steps += 1
            self.load_reported = self._decode_steps >= _DECODE_LOG_INTERVAL

    # -- KV leases (producer side) ---------------------------------------------------------
    def _create_lease(self, ctx: ReqCtx, now: float) -> None:
        r = ctx.core
        lease = Lease(
            id=ctx.internal_id,
            request_id=ctx.request_id,
            blocks=r.blocks,
            tokens=r.computed,
            duration=ctx.lease_s,
            expiry=now + ctx.lease_s,
        )
        r.blocks = []
        self.leases[lease.id] = lease
        ctx.lease = lease
        self.counters.leases_created += 1
        self._push_lease(lease)
        if ctx.room is not None:
            ctx.room.lease = lease
            ctx.room.done.set()
            if ctx.room.d_gone:
                self._receiver_gone(lease)

    def _push_lease(self, lease: Lease) -> None:
        self._lease_seq += 1
        heapq.heappush(self._lease_heap, (lease.expiry, self._lease_seq, lease.id))
        self._lease_changed.set()

    def free_lease(self, lease: Lease) -> None:
        if self.leases.pop(lease.id, None) is lease:
            self.core.release_held(lease.blocks, lease.tokens)
            lease.blocks = []
            self.wake_scheduler()

    def extend_lease(self, lease: Lease, now: float) -> None:
        # vLLM: max(old, now + 2/3 of the lease), so a late heartbeat never shortens it.
        lease.expiry = max(lease.expiry, now + lease.duration * 2.0 / 3.0)

    async def _reaper_loop(self) -> None:
        heap = self._lease_heap
        while True:
            self._lease_changed = trio.Event()
            now = trio.current_time()
            while heap and heap[0][0] <= now:
                _, _, lease_id = heapq.heappop(heap)
                lease = self.leases.get(lease_id)
                if lease is None:
                    continue
                if lease.in_transfer:
                    continue  # the transfer's end frees it or re-arms the timer
                if lease.expiry > now:
                    self._push_lease(lease)  # extended by a heartbeat since it was queued
                    continue
                self._expire(lease)
            deadline = heap[0][0] if heap else float("inf")
            with trio.move_on_at(deadline):
                await self._lease_changed.wait()

    def _expire(self, lease: Lease) -> None:
        self.counters.kv_expired += 1
        self.metrics.kv_expired += 1
        self.expired_leases.append(lease.id)
        room = next((r for r in self.rooms.values() if r.lease is lease), None)
        if room is not None:
            room.fail("KV cache released by the prefill instance before transfer")
        self.free_lease(lease)

    # -- heartbeats (decode side) ---------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        # vLLM heartbeats every lease/6; the floor keeps absurd speed factors from spinning.
        interval = max(self.spec.scaled(self.spec.lease_s) / 6.0, _MIN_HEARTBEAT_S)
        while True:
            await trio.sleep(interval)
            groups: dict[tuple[str, int, str], list[str]] = {}
            for ctx in self.awaiting_kv:
                rk = ctx.remote
                if rk is None or rk.room is not None:
                    continue
                groups.setdefault((rk.host, rk.port, rk.engine_id), []).append(rk.request_id)
            assert self._nursery is not None
            for (host, port, engine_id), ids in groups.items():
                self._nursery.start_soon(self._send_heartbeat, host, port, engine_id, ids)

    async def _send_heartbeat(self, host: str, port: int, engine_id: str, ids: list[str]) -> None:
        self.counters.heartbeats_sent += 1
        body = {"engine_id": engine_id, "request_ids": ids}
        try:
            with trio.fail_after(_CONTROL_TIMEOUT_S):
                await _http.request(host, port, "POST", "/_sim/nixl/heartbeat", body)
        except (OSError, trio.TooSlowError, h11.ProtocolError):
            self.counters.heartbeats_failed += 1

    def notify_release(self, rk: RemoteKV) -> None:
        """Tell the producer we will never pull (vLLM notifies P with an empty block list)."""
        if self._nursery is not None and rk.room is None:
            self._nursery.start_soon(self._send_release, rk)

    async def _send_release(self, rk: RemoteKV) -> None:
        body = {"engine_id": rk.engine_id, "request_ids": [rk.request_id]}
        try:
            with trio.fail_after(_CONTROL_TIMEOUT_S):
                await _http.request(rk.host, rk.port, "POST", "/_sim/nixl/release", body)
        except (OSError, trio.TooSlowError, h11.ProtocolError):
            pass

    async def pull(self, ctx: ReqCtx) -> str | None:
        """Fetch the producer's KV over HTTP; None on success, else why it failed."""
        rk = ctx.remote
        assert rk is not None
        if ctx.faults is not None and ctx.faults.kv_pull_fail:
            self.counters.kv_pull_failures_injected += 1
            return "injected KV pull failure"
        if rk.room is not None:
            path = "/_sim/bootstrap/transfer"
            body: dict[str, Any] = {
                "room": rk.room,
                "num_tokens": rk.num_tokens,
                "decode": self.url,
            }
            limit = self.spec.scaled(self.spec.waiting_timeout_s)
        else:
            path = "/_sim/nixl/pull"
            body = {
                "engine_id": rk.engine_id,
                "request_id": rk.request_id,
                "block_ids": rk.block_ids,
                "num_tokens": rk.num_tokens,
            }
            limit = self.spec.scaled(self.spec.timing.kv_transfer_s(rk.num_tokens)) * 3
            limit += _PULL_SLACK_S
        try:
            with trio.fail_after(limit):
                resp = await _http.request(rk.host, rk.port, "POST", path, body)
        except trio.TooSlowError:
            return "timed out waiting for KV"
        except (OSError, h11.ProtocolError):
            return "producer unreachable"
        if resp.status == 200:
            return None
        try:
            reason = str(resp.json().get("error", resp.status))
        except (ValueError, AttributeError):
            reason = f"status {resp.status}"
        return reason

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
    def _gauges(self) -> Gauges:
        core = self.core
        return Gauges(
            running=len(core.running),
            waiting=len(core.waiting) + len(core.pulling) + self.pending,
            kv_usage=core.kv_usage,
            preemptions=core.preemptions,
            used_tokens=core.resident_tokens(),
            capacity_tokens=core.timing.kv_capacity_tokens,
            published=self.load_reported,
        )

    def state(self, *, outcomes: int | None = None) -> dict[str, Any]:
        core = self.core
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
            "leases": {
                "held": len(self.leases),
                "tokens": sum(lease.tokens for lease in self.leases.values()),
                "in_transfer": sum(1 for lease in self.leases.values() if lease.in_transfer),
                "expired_recent": list(self.expired_leases)[-20:],
            },
            "counters": {**attrs.asdict(self.counters), "preemptions": core.preemptions},
            "http": attrs.asdict(self.http_stats),
            "faults": faults,
            "outcomes": ring,
        }

    # -- HTTP dispatch --------------------------------------------------------------------
    def _make_routes(
        self,
    ) -> dict[tuple[str, str], Callable[[HttpRequest, Responder], Awaitable[None]]]:
        api = self.api
        routes: dict[tuple[str, str], Callable[[HttpRequest, Responder], Awaitable[None]]] = {
            ("POST", "/v1/completions"): partial(api.generate, chat=False),
            ("POST", "/v1/chat/completions"): partial(api.generate, chat=True),
            ("POST", "/tokenize"): api.tokenize,
            ("GET", "/health"): self._health,
            ("GET", "/v1/models"): api.models,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/_sim/state"): self._state,
            ("GET", "/_sim/faults"): self._get_faults,
            ("POST", "/_sim/faults"): self._post_faults,
            ("DELETE", "/_sim/faults"): self._delete_faults,
            ("POST", "/_sim/restart"): self._restart,
            ("POST", "/_sim/nixl/heartbeat"): self._nixl_heartbeat,
            ("POST", "/_sim/nixl/pull"): self._nixl_pull,
            ("POST", "/_sim/nixl/release"): self._nixl_release,
            ("POST", "/_sim/bootstrap/transfer"): self._bootstrap_transfer,
        }
        if self.spec.dialect == "vllm":
            # SGLang 0.5.23 has no /version (404): /get_server_info says its version.
            routes[("GET", "/version")] = self._version
        else:
            routes.update(
                {
                    ("POST", "/v1/tokenize"): api.tokenize,
                    ("GET", "/health_generate"): self._health,
                    ("GET", "/get_server_info"): api.server_info,
                    ("GET", "/get_model_info"): api.model_info,
                    ("GET", "/flush_cache"): api.flush_cache,
                    ("POST", "/flush_cache"): api.flush_cache,
                }
            )
        return routes

    async def _dispatch(self, req: HttpRequest, resp: Responder) -> None:
        key = self.api_key
        if key is not None and requires_api_key(self.spec.dialect, req.method, req.path):
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

    async def _health(self, req: HttpRequest, resp: Responder) -> None:
        healthy = self.healthy()
        if not healthy:
            self.counters.health_failures_served += 1
        # An empty body without a content type, as uvicorn sends FastAPI's Response().
        await resp.send(200 if healthy else 503, b"", content_type=None)

    async def _version(self, req: HttpRequest, resp: Responder) -> None:
        document = {"version": self.spec.version}
        if not self.spec.stock_version:
            document.update(build=self.spec.build, instance_id=self.instance_id)
        await resp.send_json(200, document)

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

    async def _restart(self, req: HttpRequest, resp: Responder) -> None:
        if self._on_restart is None:
            await resp.send_json(501, {"error": "this engine cannot restart itself"})
            return
        await resp.send_json(202, {"restarting": self.instance_id})
        self._on_restart()

    # -- side channel (producer) ----------------------------------------------------------
    async def _side_body(self, req: HttpRequest, resp: Responder) -> dict[str, Any] | None:
        try:
            body = req.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            await resp.send_json(400, {"error": "body must be a JSON object"})
            return None
        if "engine_id" in body and body["engine_id"] != self.instance_id:
            # A restarted producer has a new id and none of the old blocks.
            await resp.send_json(410, {"error": "engine id mismatch (producer restarted?)"})
            return None
        return body

    async def _nixl_heartbeat(self, req: HttpRequest, resp: Responder) -> None:
        body = await self._side_body(req, resp)
        if body is None:
            return
        self.counters.heartbeats_received += 1
        now = trio.current_time()
        extended: list[str] = []
        unknown: list[str] = []
        for rid in body.get("request_ids") or []:
            lease = self.leases.get(str(rid))
            if lease is None:
                unknown.append(str(rid))
            else:
                self.extend_lease(lease, now)
                extended.append(lease.id)
        await resp.send_json(200, {"extended": extended, "unknown": unknown})

    async def _nixl_release(self, req: HttpRequest, resp: Responder) -> None:
        body = await self._side_body(req, resp)
        if body is None:
            return
        released = 0
        for rid in body.get("request_ids") or []:
            lease = self.leases.get(str(rid))
            if lease is None:
                continue
            self.counters.leases_released += 1
            released += 1
            if lease.in_transfer:
                lease.released = True
            else:
                self.free_lease(lease)
        await resp.send_json(200, {"released": released})

    async def _nixl_pull(self, req: HttpRequest, resp: Responder) -> None:
        body = await self._side_body(req, resp)
        if body is None:
            return
        lease = self.leases.get(str(body.get("request_id")))
        if lease is None:
            reason = "KV blocks expired or unknown"
            if str(body.get("request_id")) in self.expired_leases:
                reason = "KV blocks expired (lease ran out before the pull)"
            await resp.send_json(410, {"error": reason})
            return
        if lease.in_transfer:
            await resp.send_json(409, {"error": "KV blocks are already being transferred"})
            return
        wanted = body.get("block_ids")
        if wanted is not None and _flatten(wanted) != lease.blocks:
            await resp.send_json(410, {"error": "block ids do not match the lease"})
            return
        await self._transfer(lease, resp)

    async def _transfer(self, lease: Lease, resp: Responder) -> None:
        """Hold the blocks for the transfer time, then free them (the pull succeeded)."""
        lease.in_transfer = True
        seconds = (
            self.spec.scaled(self.spec.timing.kv_transfer_s(lease.tokens)) * self._xfer_noise()
        )
        done = False
        try:
            await trio.sleep(seconds)
            done = True
        finally:
            lease.in_transfer = False
            if done:
                self.counters.kv_served += 1
                self.metrics.xfer.observe(seconds)
                self.free_lease(lease)
            elif lease.released:
                self.free_lease(lease)
            elif lease.id in self.leases:
                self._push_lease(lease)  # the puller vanished: back under the lease timer
        await resp.send_json(200, {"ok": True, "tokens": lease.tokens, "seconds": seconds})

    # -- SGLang bootstrap (prefill side) --------------------------------------------------
    def room(self, room_id: int) -> Room:
        room = self.rooms.get(room_id)
        if room is None:
            room = Room(room=room_id)
            self.rooms[room_id] = room
            while len(self.rooms) > _MAX_ROOMS:
                _, old = self.rooms.popitem(last=False)
                old.fail("bootstrap room evicted")
        return room

    def drop_room(self, room: Room) -> None:
        if self.rooms.get(room.room) is room:
            del self.rooms[room.room]

    async def _bootstrap_transfer(self, req: HttpRequest, resp: Responder) -> None:
        body = await self._side_body(req, resp)
        if body is None:
            return
        if self.spec.disaggregation_mode != "prefill":
            # Only a prefill server runs a bootstrap server; a decoder pointed anywhere
            # else finds nothing to pair with.
            await resp.send_json(
                404,
                {"error": "no bootstrap server: not launched with --disaggregation-mode prefill"},
            )
            return
        room_id = body.get("room")
        if not isinstance(room_id, int):
            await resp.send_json(400, {"error": "room must be an integer"})
            return
        room = self.room(room_id)
        if room.d_present:
            await resp.send_json(409, {"error": f"bootstrap room {room_id} already has a receiver"})
            return
        room.d_present = True
        room.d_arrived.set()
        try:
            await room.done.wait()
            # Forget the room before answering, so a decoder that has its KV never finds it.
            self.drop_room(room)
            lease = room.lease
            if room.failure is not None or lease is None or lease.id not in self.leases:
                await resp.send_json(500, {"error": room.failure or "prefill failed"})
                return
            await self._transfer(lease, resp)
        finally:
            self.drop_room(room)
            room.d_gone = True
            lease = room.lease
            if lease is not None and lease.id in self.leases and not lease.in_transfer:
                self._receiver_gone(lease)

    def _receiver_gone(self, lease: Lease) -> None:
        # SGLang's prefill server pushes the KV into slots its decoder set aside and
        # frees it when the push ends; with the decoder gone the push fails at once. It
        # never holds KV waiting for a pull, so without this a decode leg cancelled after
        # registering pinned the prefill's KV for the whole bootstrap timeout.
        self.counters.kv_receiver_gone += 1
        self.free_lease(lease)


def _flatten(block_ids: Any) -> list[int]:
    # Newer vLLM nests one list per KV-cache group; older sends a flat list.
    if isinstance(block_ids, list) and block_ids and isinstance(block_ids[0], list):
        return [b for group in block_ids for b in group]
    return list(block_ids) if isinstance(block_ids, list) else []


__all__ = ["PHASES", "Counters", "Lease", "RemoteKV", "ReqCtx", "Room", "SimEngine"]


def requires_api_key(dialect: str, method: str, path: str) -> bool:
    """Whether an engine started with --api-key demands the key for this request.

    As the engines do it: vLLM's AuthenticationMiddleware guards only paths under /v1
    (/tokenize, /health, /metrics and /version stay open); SGLang's guards every path
    but /health* and /metrics*, so its /tokenize, /version and /get_server_info need the
    key. Neither guards OPTIONS. The simulator's own /_sim/ routes (control and the KV
    transfer between simulated engines) stand in for no engine route and stay open.
    """
    if method == "OPTIONS" or path.startswith("/_sim/"):
        return False
    if dialect == "vllm":
        return path.startswith("/v1")
    return not path.startswith(("/health", "/metrics"))


_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


@functools.cache
def _ephemeral_low() -> int:
    try:
        return int(read_file(_EPHEMERAL_RANGE, limit=64).split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere a port that is taken is skipped anyway


async def _listen_outside_ephemeral_range(host: str) -> list[trio.SocketListener]:
    """Listeners on a free port below the kernel's ephemeral range.

    A simulated engine that goes down and comes up binds its port again. An ephemeral
    port may meanwhile be the source port of one of the router's outgoing connections,
    and then the bind fails (EADDRINUSE). Ports below the range are never handed out as
    source ports, so only another listener can hold one, and that is tried again here."""
    low = _ephemeral_low()
    ports = random.Random().sample(range(max(1024, low - 12_000), low), 64)
    for port in ports:
        try:
            return await trio.open_tcp_listeners(port, host=host)
        except OSError:
            continue
    return await trio.open_tcp_listeners(0, host=host)
