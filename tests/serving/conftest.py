from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import attrs
import pytest
import trio

from narwhal.config import Config, load_config
from narwhal.sim import DisaggregationMode, Fleet, SimEngineSpec, serve_fleet
from narwhal.sim._spec import Dialect
from narwhal.supervisor import Supervisor

from ..support import FakeFileLimit, InFront

MODEL = "sim-llama-3-8b"


@attrs.define
class Stack(InFront):
    fleet: Fleet
    supervisor: Supervisor
    config: Config


# The SGLang launch mode of an engine in each role.
SGLANG_MODES: dict[str, DisaggregationMode] = {
    "prefill": "prefill",
    "decode": "decode",
    "both": "null",
}


async def pd_sim_fleet(
    nursery: trio.Nursery,
    dialect: Dialect = "vllm",
    *,
    spec: SimEngineSpec | None = None,
    api_key: str | None = None,
    roles: tuple[str, ...] = ("prefill", "decode"),
) -> Fleet:
    """Simulated engines for `roles`, by default a 1P1D fleet (SGLang's launched in their
    roles' modes); `api_key`: started with --api-key."""
    modes = [SGLANG_MODES[role] for role in roles] if dialect == "sglang" else None
    fleet: Fleet = await nursery.start(
        partial(
            serve_fleet,
            engines=len(roles),
            speed=20.0,
            model=MODEL,
            dialect=dialect,
            spec=spec,
            disaggregation_modes=modes,
            api_key=api_key,
        )
    )
    return fleet


def fleet_config(fleet: Fleet, roles: list[str], **sections: Any) -> dict[str, Any]:
    engines = [
        {"id": f"{role[0]}{i}", "url": handle.url, "role": role, "model": MODEL}
        for i, (handle, role) in enumerate(zip(fleet, roles, strict=True))
    ]
    document: dict[str, Any] = {
        "engines": engines,
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"host": "127.0.0.1", "port": 0},
        "serving": {"admission": "open"},
        # The role controller is tested on its own; here it would move engines under
        # tests that place requests on purpose. Tests that want it pass controller=...
        "controller": {"enabled": False},
    }
    for key, value in sections.items():
        document[key] = {**document.get(key, {}), **value}
    return document


StartStack = Callable[..., Awaitable[Stack]]


@pytest.fixture
def start_stack(nursery: trio.Nursery) -> StartStack:
    """A simulated fleet plus a Narwhal in front of it, both on loopback."""

    async def start(
        roles: list[str] | None = None,
        *,
        speed: float = 20.0,
        sim: dict[str, Any] | None = None,
        profiles: Any = None,
        **sections: Any,
    ) -> Stack:
        roles = roles or ["prefill", "decode"]
        fleet: Fleet = await nursery.start(
            partial(serve_fleet, engines=len(roles), speed=speed, model=MODEL, **(sim or {}))
        )
        config = load_config(fleet_config(fleet, roles, **sections))
        supervisor: Supervisor = await nursery.start(
            Supervisor(config, profiles=profiles, open_files=FakeFileLimit().limit()).run
        )
        return Stack(fleet, supervisor, config)

    return start
