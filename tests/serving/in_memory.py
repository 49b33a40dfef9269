"""Narwhal's request path in front of simulated engines, in one process with no sockets.

Owns: `MemoryStack` and `start_memory_stack`. The engines are narwhal-sim's, served on a
`MemoryNetwork` (tests/engines/memory.py); Narwhal is its serving context and client app,
called through httpx's ASGI transport (no hypercorn, no listener). Under an autojump
MockClock a deadline fires at its exact virtual time and nothing waits for real time.
Invariants: the engine pools are the fleet's own, with their `connect` routed through
the network; what the app answers is what the client listener would send, less what
hypercorn adds (framing, client backpressure). The sim engines have no listener:
`go_down` and `restart` do nothing here; tests of those stay on `start_stack`.
See: tests/serving/conftest.py (`start_stack`, the same stack on loopback sockets).
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import httpx
import trio

from narwhal.config import Config, load_config
from narwhal.serving import App, ServingContext, state_document
from narwhal.sim import EngineHandle, Fleet, SimEngineSpec

from ..engines.memory import HOST, MemoryNetwork
from .conftest import MODEL, fleet_config

# Engine i listens at FIRST_PORT + i.
FIRST_PORT = 9000


@attrs.define
class MemoryStack:
    network: MemoryNetwork
    fleet: Fleet
    ctx: ServingContext
    app: App
    config: Config

    def client(self) -> httpx.AsyncClient:
        """A client of the app, which sees it as the loopback address 127.0.0.1."""
        return httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://narwhal"
        )

    async def state(self) -> dict[str, Any]:
        """`/narwhal/state` as a client would read it (a JSON document)."""
        await trio.lowlevel.checkpoint()
        document: dict[str, Any] = json.loads(json.dumps(state_document(self.ctx)))
        return document


async def start_memory_stack(
    nursery: trio.Nursery,
    roles: list[str] | None = None,
    *,
    speed: float = 20.0,
    **sections: Any,
) -> MemoryStack:
    """Sim engines in `roles` (1P1D by default) and Narwhal in front of them; `sections`
    override the configuration's, as `start_stack`'s do."""
    roles = roles or ["prefill", "decode"]
    network = MemoryNetwork(nursery)
    spec = SimEngineSpec(model=MODEL, speed=speed)
    fleet = Fleet(spec, HOST)
    for index in range(len(roles)):
        engine = await network.serve_sim(
            FIRST_PORT + index, attrs.evolve(spec, seed=spec.seed + index), index=index
        )
        fleet.engines.append(EngineHandle(fleet, index, engine))
    config = load_config(fleet_config(fleet, roles, **sections))
    ctx = ServingContext(config)
    network.attach(ctx.fleet)
    return MemoryStack(network, fleet, ctx, App(ctx), config)
