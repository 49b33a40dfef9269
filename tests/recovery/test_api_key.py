"""Recovery probes against engines started with --api-key."""

from __future__ import annotations

import pytest
import trio

from narwhal.recovery import HttpProber, VerifyPair, VerifyResult
from narwhal.sim._spec import Dialect

from .test_sim_faults import prober_pair

KEY = "sk-recovery-key"


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_probes_carry_the_key_and_a_refused_key_is_named(
    nursery: trio.Nursery, dialect: Dialect
) -> None:
    fleet, config, p0, d0 = await prober_pair(nursery, dialect, api_key=KEY)
    prober = HttpProber()
    pair = VerifyPair(d0, "decode", p0, d0, f"narwhal-verify-{dialect}")
    assert (await prober.health(d0, config)).outcome == "ok"
    assert await prober.verify(pair, config) == VerifyResult(
        "ok", "prefill on p0, decode on d0 completed"
    )
    fleet[1].set_api_key("another-key")
    # Health routes stay open on both engines; only the verification legs are refused.
    assert (await prober.health(d0, config)).outcome == "ok"
    # A refused key is d0's own doing, whatever its partner did.
    assert await prober.verify(pair, config) == VerifyResult(
        "failed",
        "prefill on p0, decode on d0: decode leg on d0 returned HTTP 401: the engine "
        "refused narwhal's API key (engine.api_key_file)",
        culprit="d0",
    )
    for engine in (p0, d0):
        await engine.aclose()
