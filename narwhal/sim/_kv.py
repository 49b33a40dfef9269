"""KV one simulated engine holds for another, and the side channel that moves it.

Owns: `KvStore`, one per engine: the leases on KV a prefill leg keeps for its decoder
(expiry, heartbeat extension, release), SGLang's bootstrap rooms, the producer's side of
the simulator's engine-to-engine channel (``POST /_sim/nixl/{pull,heartbeat,release}``,
``POST /_sim/bootstrap/transfer``) and a decoder's request for its KV (`pull`).
Invariants: the mechanism is the same for both dialects; which leg waits for what, how a
decoder asks and what a failure says is the engine's protocol's (`kv_request`,
`kv_held`, `lease_expired`, `serves_bootstrap`). A lease's blocks stay held until it is
pulled, released, expired or its receiver is gone; a transfer in flight is never freed
under it. Every engine serves every side-channel route.
Errors: the side channel answers JSON ``{"error": reason}`` with 400 (bad body), 404 (no
bootstrap server), 409 (busy), 410 (expired, unknown, or the producer restarted).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any

import h11
import trio

from . import _http
from ._http import HttpRequest, Responder
from ._records import Lease, ReqCtx, Room
from ._timing import Noise

if TYPE_CHECKING:
    from ._engine import SimEngine
    from ._protocol import Routes

_MAX_ROOMS = 65_536
_EXPIRED_RING = 1_000


class KvStore:
    def __init__(self, engine: SimEngine, *, seed: str) -> None:
        self.e = engine
        self.leases: dict[str, Lease] = {}
        self.expired: deque[str] = deque(maxlen=_EXPIRED_RING)
        self.rooms: OrderedDict[int, Room] = OrderedDict()
        self._heap: list[tuple[float, int, str]] = []
        self._seq = 0
        self._changed = trio.Event()
        self._xfer_noise = Noise(engine.spec.timing.noise_sigma, seed + "/xfer")

    def routes(self) -> Routes:
        return {
            ("POST", "/_sim/nixl/heartbeat"): self._nixl_heartbeat,
            ("POST", "/_sim/nixl/pull"): self._nixl_pull,
            ("POST", "/_sim/nixl/release"): self._nixl_release,
            ("POST", "/_sim/bootstrap/transfer"): self._bootstrap_transfer,
        }

    # -- leases (producer side) ---------------------------------------------------------
    def hold(self, ctx: ReqCtx, now: float) -> None:
        """A finished prefill leg's KV, kept for its decoder for `ctx.lease_s`."""
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
        self.e.counters.leases_created += 1
        self._push(lease)
        self.e.protocol.kv_held(ctx, lease)

    def _push(self, lease: Lease) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (lease.expiry, self._seq, lease.id))
        self._changed.set()

    def free(self, lease: Lease) -> None:
        if self.leases.pop(lease.id, None) is lease:
            self.e.core.release_held(lease.blocks, lease.tokens)
            lease.blocks = []
            self.e.wake_scheduler()

    @staticmethod
    def extend(lease: Lease, now: float) -> None:
        # vLLM: max(old, now + 2/3 of the lease), so a late heartbeat never shortens it.
        lease.expiry = max(lease.expiry, now + lease.duration * 2.0 / 3.0)

    async def run_reaper(self) -> None:
        """Expire leases whose time ran out, for the engine's life."""
        heap = self._heap
        while True:
            self._changed = trio.Event()
            now = trio.current_time()
            while heap and heap[0][0] <= now:
                _, _, lease_id = heapq.heappop(heap)
                lease = self.leases.get(lease_id)
                if lease is None:
                    continue
                if lease.in_transfer:
                    continue  # the transfer's end frees it or re-arms the timer
                if lease.expiry > now:
                    self._push(lease)  # extended by a heartbeat since it was queued
                    continue
                self._expire(lease)
            deadline = heap[0][0] if heap else float("inf")
            with trio.move_on_at(deadline):
                await self._changed.wait()

    def _expire(self, lease: Lease) -> None:
        self.e.counters.kv_expired += 1
        self.e.metrics.kv_expired += 1
        self.expired.append(lease.id)
        self.e.protocol.lease_expired(lease)
        self.free(lease)

    # -- the side channel (producer side) ------------------------------------------------
    async def _side_body(self, req: HttpRequest, resp: Responder) -> dict[str, Any] | None:
        try:
            body = req.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            await resp.send_json(400, {"error": "body must be a JSON object"})
            return None
        if "engine_id" in body and body["engine_id"] != self.e.instance_id:
            # A restarted producer has a new id and none of the old blocks.
            await resp.send_json(410, {"error": "engine id mismatch (producer restarted?)"})
            return None
        return body

    async def _nixl_heartbeat(self, req: HttpRequest, resp: Responder) -> None:
        body = await self._side_body(req, resp)
        if body is None:
            return
        self.e.counters.heartbeats_received += 1
        now = trio.current_time()
        extended: list[str] = []
        unknown: list[str] = []
        for rid in body.get("request_ids") or []:
            lease = self.leases.get(str(rid))
            if lease is None:
                unknown.append(str(rid))
            else:
                self.extend(lease, now)
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
            self.e.counters.leases_released += 1
            released += 1
            if lease.in_transfer:
                lease.released = True
            else:
                self.free(lease)
        await resp.send_json(200, {"released": released})

    async def _nixl_pull(self, req: HttpRequest, resp: Responder) -> None:
        body = await self._side_body(req, resp)
        if body is None:
            return
        lease = self.leases.get(str(body.get("request_id")))
        if lease is None:
            reason = "KV blocks expired or unknown"
            if str(body.get("request_id")) in self.expired:
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
        spec = self.e.spec
        lease.in_transfer = True
        seconds = spec.scaled(spec.timing.kv_transfer_s(lease.tokens)) * self._xfer_noise()
        done = False
        try:
            await trio.sleep(seconds)
            done = True
        finally:
            lease.in_transfer = False
            if done:
                self.e.counters.kv_served += 1
                self.e.metrics.xfer.observe(seconds)
                self.free(lease)
            elif lease.released:
                self.free(lease)
            elif lease.id in self.leases:
                self._push(lease)  # the puller vanished: back under the lease timer
        await resp.send_json(200, {"ok": True, "tokens": lease.tokens, "seconds": seconds})

    # -- bootstrap rooms (the prefill side of SGLang's pair) -----------------------------
    def room(self, room_id: int) -> Room:
        room = self.rooms.get(room_id)
        if room is None:
            room = Room(room=room_id)
            self.rooms[room_id] = room
            while len(self.rooms) > _MAX_ROOMS:
                _, old = self.rooms.popitem(last=False)
                old.fail("bootstrap room evicted")
        return room

    def _drop_room(self, room: Room) -> None:
        if self.rooms.get(room.room) is room:
            del self.rooms[room.room]

    async def _bootstrap_transfer(self, req: HttpRequest, resp: Responder) -> None:
        body = await self._side_body(req, resp)
        if body is None:
            return
        if not self.e.protocol.serves_bootstrap():
            # A decoder pointed at anything but a prefill server finds nothing to pair with.
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
            self._drop_room(room)
            lease = room.lease
            if room.failure is not None or lease is None or lease.id not in self.leases:
                await resp.send_json(500, {"error": room.failure or "prefill failed"})
                return
            await self._transfer(lease, resp)
        finally:
            self._drop_room(room)
            room.d_gone = True
            lease = room.lease
            if lease is not None and lease.id in self.leases and not lease.in_transfer:
                self.receiver_gone(lease)

    def receiver_gone(self, lease: Lease) -> None:
        # SGLang's prefill server pushes the KV into slots its decoder set aside and
        # frees it when the push ends; with the decoder gone the push fails at once. It
        # never holds KV waiting for a pull, so without this a decode leg cancelled after
        # registering pinned the prefill's KV for the whole bootstrap timeout.
        self.e.counters.kv_receiver_gone += 1
        self.free(lease)

    # -- a decoder's request ------------------------------------------------------------
    async def pull(self, ctx: ReqCtx) -> str | None:
        """Fetch the producer's KV over HTTP; None on success, else why it failed."""
        rk = ctx.remote
        assert rk is not None
        if ctx.faults is not None and ctx.faults.kv_pull_fail:
            self.e.counters.kv_pull_failures_injected += 1
            return "injected KV pull failure"
        path, body, limit = self.e.protocol.kv_request(rk)
        try:
            with trio.fail_after(limit):
                resp = await _http.request(
                    rk.host, rk.port, "POST", path, body, connect=self.e.connect
                )
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


def _flatten(block_ids: Any) -> list[int]:
    # Newer vLLM nests one list per KV-cache group; older sends a flat list.
    if isinstance(block_ids, list) and block_ids and isinstance(block_ids[0], list):
        return [b for group in block_ids for b in group]
    return list(block_ids) if isinstance(block_ids, list) else []
