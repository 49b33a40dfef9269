"""Per-engine bookkeeping records: counters, leases, remote KV, SGLang rooms, requests."""

from __future__ import annotations

from typing import Any

import attrs
import trio

from ._core import CoreRequest
from ._faults import FaultSpec

PHASES = ("prefill", "decode", "aggregate")


def _phase_counter() -> dict[str, int]:
    return dict.fromkeys(PHASES, 0)


@attrs.define
class Counters:
    requests: dict[str, int] = attrs.Factory(_phase_counter)
    completed: dict[str, int] = attrs.Factory(_phase_counter)
    aborted: dict[str, int] = attrs.Factory(_phase_counter)
    errors: dict[str, int] = attrs.Factory(_phase_counter)
    rejected_invalid: int = 0
    rejected_queue_full: int = 0
    errors_injected: int = 0
    crashes_injected: int = 0
    sse_errors_injected: int = 0
    stalls_injected: int = 0
    slow_first_tokens_injected: int = 0
    kv_pull_failures_injected: int = 0
    downs_injected: int = 0
    # /health answers of 503 caused by `unhealthy` or `health_flap_period_s`.
    health_failures_served: int = 0
    # /metrics answers held back by `metrics_stall_s`.
    metrics_stalls_injected: int = 0
    leases_created: int = 0
    leases_released: int = 0
    kv_expired: int = 0
    kv_served: int = 0
    # SGLang prefill: KV freed at once because its decoder left before taking it.
    kv_receiver_gone: int = 0
    kv_pulled: int = 0
    kv_pull_failed: int = 0
    heartbeats_sent: int = 0
    heartbeats_received: int = 0
    heartbeats_failed: int = 0
    handler_errors: int = 0


@attrs.define(eq=False)
class Lease:
    """KV blocks a producer keeps for a decoder (vLLM NIXL lease, docs/design.md#kv-lease)."""

    id: str
    request_id: str
    blocks: list[int]
    tokens: int
    duration: float
    expiry: float
    in_transfer: bool = False
    # The decoder gave up while a transfer was running: free when the transfer unwinds.
    released: bool = False


@attrs.define(eq=False)
class RemoteKV:
    """Where a decode request's KV lives: a vLLM producer or an SGLang bootstrap room."""

    host: str
    port: int
    num_tokens: int
    engine_id: str = ""
    request_id: str = ""
    block_ids: Any = None
    room: int | None = None
    # The producer's prefix-cache hit (vLLM remote_prefill_cached_tokens), if it said.
    prefill_cached_tokens: int | None = None


@attrs.define(eq=False)
class Room:
    """SGLang pairing state on the prefill side, keyed by bootstrap_room."""

    room: int
    d_arrived: trio.Event = attrs.Factory(trio.Event)
    done: trio.Event = attrs.Factory(trio.Event)
    lease: Lease | None = None
    failure: str | None = None
    d_present: bool = False
    # The registered decoder went away before it had the KV.
    d_gone: bool = False

    def fail(self, reason: str) -> None:
        if not self.done.is_set():
            self.failure = reason
            self.done.set()


@attrs.define(eq=False)
class ReqCtx:
    request_id: str
    internal_id: str
    phase: str
    core: CoreRequest
    arrival: float
    faults: FaultSpec | None = None
    # The faults were armed on the engine (POST /_sim/faults), not sent in the request's
    # own header: recorded with the outcome, so a soak can tell whose leg an armed fault hit.
    armed_fault: bool = False
    remote: RemoteKV | None = None
    room: Room | None = None
    lease_s: float = 0.0
    lease: Lease | None = None
    event: trio.Event = attrs.Factory(trio.Event)
    first_token_at: float | None = None
    last_token_at: float = 0.0
    # Set when the engine fails the request after it was accepted (KV load failure).
    failure: str | None = None
    failure_outcome: str = "error"
    # Whether its answer streams (SGLang counts its tokens by it).
    stream: bool = False

    def wake(self) -> None:
        self.event.set()

    async def wait_change(self) -> None:
        await self.event.wait()
        self.event = trio.Event()
