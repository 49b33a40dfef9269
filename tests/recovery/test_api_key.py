"""Recovery probes against engines started with --api-key."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import trio

from narwhal.recovery import (
    ContextReading,
    HttpProber,
    KeyCheck,
    KeyRefusal,
    ProbeResult,
    VerifyPair,
    VerifyResult,
)
from narwhal.sim._spec import Dialect

from ..serving.conftest import Stack
from ..serving.test_api_key import complete, key_file
from ..serving.test_retries import requests
from ..support import wait_for
from .conftest import StartStack
from .fakes import WRONG_KEY
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
    # SGLang's /tokenize says its tokenizer's limit: the server's is on its model card.
    assert await prober.context(d0, config) == ContextReading(
        8192, "GET /v1/models max_model_len", listed=True
    )
    fleet[1].set_api_key("another-key")
    assert await prober.context(d0, config) == ContextReading(
        None, "GET /v1/models returned HTTP 401", final=False
    )
    # Health routes stay open on both engines; the verification legs and the key check
    # are refused, and SGLang's /version too, which the probe reports.
    health = await prober.health(d0, config)
    if dialect == "sglang":
        assert health == ProbeResult(
            "ok",
            f"GET /health returned HTTP 200; GET /version: {WRONG_KEY}",
            True,
            None,
            KeyRefusal(d0, 401, "Unauthorized"),
        )
    else:
        assert (health.outcome, health.refusal) == ("ok", None)
    # Refused, not failed: the engine is not faulty, and recovery judges it as the
    # request path does.
    assert await prober.verify(pair, config) == VerifyResult(
        "refused",
        f"prefill on p0, decode on d0: decode leg on d0: {WRONG_KEY}",
        refusal=KeyRefusal(d0, 401, "Unauthorized"),
    )
    assert await prober.check_key(d0, config) == KeyCheck("refused", f"GET /v1/models: {WRONG_KEY}")
    await fleet[1].go_down()
    assert (await prober.check_key(d0, config)).outcome == "failed"
    for engine in (p0, d0):
        await engine.aclose()


NO_KEY = (
    "the engine requires an API key and narwhal sends none (HTTP 401: Unauthorized); "
    "set engine.api_key_file to the key of the engine's --api-key"
)


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_probes_of_an_engine_that_wants_a_key_when_none_is_configured_say_so(
    nursery: trio.Nursery, dialect: Dialect
) -> None:
    # No engine.api_key_file: the fix is to configure one, not to check the one sent.
    fleet, config, p0, d0 = await prober_pair(nursery, dialect)
    for handle in fleet:
        handle.set_api_key(KEY)
    prober = HttpProber()
    health = await prober.health(d0, config)
    if dialect == "sglang":
        assert health.detail == f"GET /health returned HTTP 200; GET /version: {NO_KEY}"
    pair = VerifyPair(d0, "decode", p0, d0, f"narwhal-verify-{dialect}")
    verification = await prober.verify(pair, config)
    assert verification.outcome == "refused"
    # SGLang's legs run at once: whichever is refused first is named.
    legs = "prefill leg on p0" if dialect == "vllm" else "(prefill leg on p0|decode leg on d0)"
    pattern = f"prefill on p0, decode on d0: {legs}: {re.escape(NO_KEY)}"
    assert re.fullmatch(pattern, verification.detail), verification.detail
    assert await prober.check_key(d0, config) == KeyCheck("refused", f"GET /v1/models: {NO_KEY}")
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


def events(caplog: pytest.LogCaptureFixture, *names: str) -> list[tuple[str, str]]:
    return [
        (r.levelname, r.getMessage()) for r in caplog.records if r.__dict__.get("event") in names
    ]


async def test_an_engine_restarted_with_another_key_is_out_for_the_key_not_failed(
    start_stack: StartStack, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal")
    stack = await start_stack(
        sim={"api_key": KEY}, engine={"api_key_file": key_file(tmp_path, KEY)}
    )
    p0 = stack.ctx.fleet.get("p0")
    assert p0 is not None
    stack.fleet[0].set_api_key("another-key")
    await stack.fleet[0].restart()
    # Held for the restart, then verified: vLLM's /version is open, so the verification
    # legs are the first to meet the key.
    await wait_for(lambda: p0.auth_refused is not None)
    refused = "refused narwhal's API key (HTTP 401)"
    state = await stack.state()
    assert next(e for e in state["engines"] if e["id"] == "p0")["unavailable_reason"] == (
        f"auth refused: {refused}"
    )
    recovery = state["recovery"]["engines"]["p0"]
    assert recovery["auth"]["refused"] == refused
    assert recovery["last_verification"]["outcome"] == "refused"
    assert recovery["last_verification"]["detail"] == (
        f"prefill on p0, decode on d1: prefill leg on p0: {WRONG_KEY}"
    )
    # Not a failed verification: no ejection, no breaker, only the restart hold.
    assert recovery["hold"]["active"]
    assert (recovery["health"]["verdict"], recovery["health"]["ejected_total"]) == ("up", 0)
    assert recovery["breakers"]["prefill"]["opened_total"] == 0
    assert events(caplog, "engine_auth_refused") == [
        (
            "ERROR",
            "engine p0 refused narwhal's API key (HTTP 401: Unauthorized); check "
            "engine.api_key_file against the engine's --api-key; it takes no new work until "
            "it accepts the key again (checked with each health probe, "
            "recovery.health.interval_s=0.05) or a reload",
        )
    ]

    stack.fleet[0].set_api_key(KEY)  # relaunched with narwhal's key: verified, then back
    await wait_for(lambda: p0.unavailable_reason(trio.current_time()) is None)
    recovery = (await stack.state())["recovery"]["engines"]["p0"]
    assert recovery["last_verification"]["outcome"] == "ok"
    assert not recovery["hold"]["active"]
    assert events(caplog, "engine_auth_recovered") == [
        (
            "INFO",
            "engine p0 accepts narwhal's requests again (GET /v1/models returned HTTP 200); "
            f"it was out with auth refused: {refused}; still out: restart hold",
        )
    ]
    assert [c["to"] for c in state["recovery"]["recent_changes"] if c["engine"] == "p0"] == ["held"]
    assert (await complete(stack)).status_code == 200


async def test_an_sglang_engine_refusing_the_key_on_version_is_taken_out_by_the_probe(
    start_stack: StartStack, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal")
    stack = await start_stack(
        sglang=True, sim={"api_key": KEY}, engine={"api_key_file": key_file(tmp_path, KEY)}
    )
    p0 = stack.ctx.fleet.get("p0")
    assert p0 is not None
    record = stack.supervisor.recovery.record("p0")  # type: ignore[union-attr]
    assert record is not None
    # SGLang 0.5.23 has no /version (404): no identity, but its key check answers first.
    assert record.identity.identity is None
    stack.fleet[0].set_api_key("another-key")
    # No request needed: SGLang guards every path, so the next probe meets the refusal.
    await wait_for(lambda: p0.auth_refused is not None)
    await wait_for(lambda: key_checks(stack, "refused") >= 2)
    refused = f"GET /health returned HTTP 200; GET /version: {WRONG_KEY}"
    recovery = (await stack.state())["recovery"]["engines"]["p0"]
    assert recovery["health"]["last_probe"]["detail"] == refused
    assert recovery["auth"]["refused"] == "refused narwhal's API key (HTTP 401)"
    # Once each, though every probe since was refused.
    assert events(caplog, "identity_refused") == [
        (
            "WARNING",
            f"probe of p0: {refused}; until /version answers, its restarts show only on its "
            "/metrics or when it stops answering",
        )
    ]
    assert [level for level, _ in events(caplog, "engine_auth_refused")] == ["ERROR"]

    stack.fleet[0].set_api_key(KEY)
    await wait_for(lambda: p0.unavailable_reason(trio.current_time()) is None)
    await wait_for(lambda: not record.identity_refused)  # /version takes the key again
    stack.fleet[0].set_api_key("another-key")  # refused again: said again
    await wait_for(lambda: len(events(caplog, "identity_refused")) == 2)
