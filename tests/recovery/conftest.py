from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import pytest
import trio

from narwhal.config import load_config
from narwhal.sim import DisaggregationMode, Fleet, serve_fleet
from narwhal.supervisor import Supervisor

from ..serving.conftest import MODEL, Stack, fleet_config
from ..support import FakeFileLimit
from .fakes import merge

# Fast recovery settings for tests against the simulator (real sockets, real time).
FAST: dict[str, Any] = {
    "recovery": {
        "restart_hold_s": 0.2,
        "health": {"interval_s": 0.05, "failure_threshold": 2, "readmit_successes": 2},
        "breaker": {"failure_threshold": 3, "window_s": 10.0, "open_s": 0.3},
    },
    "engine": {"health_timeout_s": 1.0, "first_token_timeout_s": 2.0},
    "controller": {"monitor_interval_s": 0.1},
}

StartStack = Callable[..., Awaitable[Stack]]


@pytest.fixture
def start_stack(nursery: trio.Nursery) -> StartStack:
    """A simulated fleet plus a Narwhal with fast recovery settings, both on loopback."""

    async def start(
        roles: list[str] | None = None,
        *,
        speed: float = 20.0,
        sim: dict[str, Any] | None = None,
        down_at_start: tuple[int, ...] = (),
        sglang: bool = False,
        supervisor: dict[str, Any] | None = None,
        **sections: Any,
    ) -> Stack:
        roles = roles or ["prefill", "decode"]
        # An SGLang server's role is its launch mode; role `both` is an aggregate server.
        launch: dict[str, DisaggregationMode] = {
            "prefill": "prefill",
            "decode": "decode",
            "both": "null",
        }
        modes = [launch[role] for role in roles] if sglang else None
        fleet: Fleet = await nursery.start(
            partial(
                serve_fleet,
                engines=len(roles),
                speed=speed,
                model=MODEL,
                dialect="sglang" if sglang else "vllm",
                disaggregation_modes=modes,
                **(sim or {}),
            )
        )
        for index in down_at_start:
            await fleet[index].go_down()
        document = merge(fleet_config(fleet, roles), merge(FAST, sections))
        if sglang:
            # narwhal-sim serves a prefill server's bootstrap endpoints on its HTTP port.
            for spec, handle in zip(document["engines"], fleet, strict=True):
                spec.update(dialect="sglang", bootstrap_port=handle.port)
        config = load_config(document)
        options = {"open_files": FakeFileLimit().limit(), **(supervisor or {})}
        runner: Supervisor = await nursery.start(Supervisor(config, **options).run)
        return Stack(fleet, runner, config)

    return start
