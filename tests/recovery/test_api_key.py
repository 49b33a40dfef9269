"""Recovery probes against engines started with --api-key."""

from __future__ import annotations

from functools import partial

import pytest
import trio

from narwhal.config import Config, EngineSpec, Secret
from narwhal.fleet import EngineState, Role
from narwhal.recovery import HttpProber, VerifyPair, VerifyResult
from narwhal.sim import DisaggregationMode, Fleet, serve_fleet
from narwhal.sim._spec import Dialect

from ..serving.conftest import MODEL

KEY = "sk-recovery-key"
ROLES: tuple[Role, Role] = ("prefill", "decode")


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_probes_carry_the_key_and_a_refused_key_is_named(
    nursery: trio.Nursery, dialect: Dialect
) -> None:
    modes: tuple[DisaggregationMode, ...] | None = (
        ("prefill", "decode") if dialect == "sglang" else None
    )
    fleet: Fleet = await nursery.start(
        partial(
            serve_fleet,
            engines=2,
            speed=20.0,
            model=MODEL,
            dialect=dialect,
            disaggregation_modes=modes,
            api_key=KEY,
        )
    )
    specs = tuple(
        EngineSpec(
            id=f"{role[0]}0",
            url=handle.url,
            dialect=dialect,
            role=role,
            model=MODEL,
            bootstrap_port=handle.port if dialect == "sglang" else None,
            api_key=Secret(KEY),
        )
        for handle, role in zip(fleet, ROLES, strict=True)
    )
    config = Config(engines=specs)
    p0, d0 = (EngineState(spec, config) for spec in specs)
    prober = HttpProber()
    pair = VerifyPair(d0, "decode", p0, d0, f"narwhal-verify-{dialect}")
    assert (await prober.health(d0, config)).outcome == "ok"
    assert await prober.verify(pair, config) == VerifyResult(
        "ok", "prefill on p0, decode on d0 completed"
    )
    fleet[1].set_api_key("another-key")
    # Health routes stay open on both engines; only the verification legs are refused.
    assert (await prober.health(d0, config)).outcome == "ok"
    assert await prober.verify(pair, config) == VerifyResult(
        "failed",
        "prefill on p0, decode on d0: decode leg on d0 returned HTTP 401: the engine "
        "refused narwhal's API key (engine.api_key_file)",
    )
    for engine in (p0, d0):
        await engine.aclose()
