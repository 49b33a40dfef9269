"""Recovery probes against engines started with --api-key."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio

from narwhal.recovery import HttpProber, KeyCheck, VerifyPair, VerifyResult
from narwhal.sim._spec import Dialect

from ..serving.conftest import Stack
from ..serving.test_api_key import complete, key_file
from ..serving.test_retries import requests
from ..support import wait_for
from .conftest import StartStack
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
    assert await prober.check_key(d0, config) == KeyCheck(
        "accepted", "GET /v1/models returned HTTP 200"
    )
    fleet[1].set_api_key("another-key")
    # Health routes stay open on both engines; the verification legs and the key check
    # are refused.
    assert (await prober.health(d0, config)).outcome == "ok"
    # A refused key is d0's own doing, whatever its partner did.
    assert await prober.verify(pair, config) == VerifyResult(
        "failed",
        "prefill on p0, decode on d0: decode leg on d0 returned HTTP 401: the engine "
        "refused narwhal's API key (engine.api_key_file)",
        culprit="d0",
    )
    assert await prober.check_key(d0, config) == KeyCheck(
        "refused",
        "GET /v1/models returned HTTP 401: the engine refused narwhal's API key "
        "(engine.api_key_file)",
    )
    await fleet[1].go_down()
    assert (await prober.check_key(d0, config)).outcome == "failed"
    for engine in (p0, d0):
        await engine.aclose()


def key_checks(stack: Stack, outcome: str) -> float:
    value = stack.ctx.metrics.registry.get_sample_value(
        "narwhal_auth_checks_total", {"engine": "p0", "outcome": outcome}
    )
    return value or 0.0


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_an_engine_that_takes_the_key_again_comes_back_without_a_reload(
    start_stack: StartStack, tmp_path: Path, caplog: pytest.LogCaptureFixture, dialect: Dialect
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal")
    stack = await start_stack(
        sglang=dialect == "sglang",
        sim={"api_key": KEY},
        engine={"api_key_file": key_file(tmp_path, KEY)},
    )
    p0 = stack.ctx.fleet.get("p0")
    assert p0 is not None
    stack.fleet[0].set_api_key("another-key")  # relaunched with another key
    response = await complete(stack)
    # vLLM refuses the prefill leg; SGLang already the /tokenize that counts the prompt,
    # which leaves no prefill engine to place the request on.
    code = {"vllm": "engine_auth_failed", "sglang": "no_engine_available"}[dialect]
    assert response.json()["error"]["code"] == code
    refused = "refused narwhal's API key (HTTP 401)"
    assert p0.unavailable_reason(trio.current_time()) == f"auth refused: {refused}"
    # Checked with each health probe and refused each time; the state shows when last.
    await wait_for(lambda: key_checks(stack, "refused") >= 2)
    auth = (await stack.state())["recovery"]["engines"]["p0"]["auth"]
    assert auth["refused"] == refused
    assert auth["last_check"]["outcome"] == "refused"
    assert 0 <= auth["last_check"]["age_s"] < 5.0

    stack.fleet[0].set_api_key(KEY)  # relaunched with narwhal's key
    await wait_for(lambda: p0.auth_refused is None)
    assert p0.unavailable_reason(trio.current_time()) is None
    response = await complete(stack)
    assert response.status_code == 200, response.text
    assert requests(stack, 0, "prefill") == 1  # served on p0 this time
    assert stack.supervisor.reloads == []
    assert key_checks(stack, "accepted") == 1
    recovered = [r for r in caplog.records if r.__dict__.get("event") == "engine_auth_recovered"]
    assert [r.__dict__["engine"] for r in recovered] == ["p0"]
