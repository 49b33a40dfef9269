"""A fleet of engines started with --api-key, end to end through Narwhal."""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from narwhal._records import to_json
from narwhal.config import load_config
from narwhal.sim import Fleet, serve_fleet
from narwhal.supervisor import Supervisor

from ..support import sse_json
from .conftest import MODEL, Stack, StartStack, fleet_config
from .test_failures import settled
from .test_retries import RETRYING, requests
from .test_sglang import sglang_stack

KEY = "sk-engine-key-0123456789"
ROTATED = "sk-engine-key-rotated-9876"
PROMPT = "tokenisation of ordinary english prose " * 4
# What Narwhal logs, once, when p0 first refuses its key (default recovery settings).
REFUSED_LOG = (
    "engine p0 refused narwhal's API key (HTTP 401: Unauthorized); check engine.api_key_file "
    "against the engine's --api-key; it takes no new work until it accepts the key again "
    "(checked with each health probe, recovery.health.interval_s=2.0) or a reload"
)


def key_file(tmp_path: Path, key: str = KEY) -> str:
    path = tmp_path / "engine-api-key"
    path.write_text(key + "\n")
    return str(path)


async def keyed_stack(
    start_stack: StartStack, tmp_path: Path, roles: list[str] | None = None, **sections: Any
) -> Stack:
    return await start_stack(
        roles,
        sim={"api_key": KEY},
        engine={"api_key_file": key_file(tmp_path), **sections.pop("engine", {})},
        **sections,
    )


async def complete(stack: Stack, **body: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, **body},
        )


async def test_a_keyed_pd_fleet_serves_streaming_and_non_streaming(
    start_stack: StartStack, tmp_path: Path
) -> None:
    stack = await keyed_stack(start_stack, tmp_path)
    plain = await complete(stack)
    assert plain.status_code == 200, plain.text
    assert plain.json()["choices"][0]["finish_reason"] == "length"
    streamed = await complete(stack, stream=True)
    assert streamed.status_code == 200, streamed.text
    assert sse_json(streamed.content)[-1]["choices"][0]["finish_reason"] == "length"
    async with httpx.AsyncClient(timeout=30) as client:
        chat = await client.post(
            f"{stack.url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
    assert chat.status_code == 200, chat.text
    # Both legs ran disaggregated, and each prompt was counted by the engine's /tokenize.
    assert (requests(stack, 0, "prefill"), requests(stack, 1, "decode")) == (3, 3)
    state = await settled(stack)
    assert state["requests"]["token_counts"] == {"exact": 3}
    # The startup preflight (health and a verification pair over the control pool) passed.
    assert all(e["available"] for e in state["engines"]), state["engines"]


async def test_a_keyed_sglang_fleet_serves_and_counts_tokens(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # SGLang guards /tokenize, /version and /get_server_info too.
    stack = await sglang_stack(nursery, api_key=KEY, engine={"api_key_file": key_file(tmp_path)})
    assert (await complete(stack)).status_code == 200
    streamed = await complete(stack, stream=True)
    assert sse_json(streamed.content)[-1]["choices"][0]["finish_reason"] == "length"
    state = await settled(stack)
    assert state["requests"]["token_counts"] == {"exact": 2}


async def test_an_engine_refusing_the_key_leaves_placement_and_the_request_is_retried(
    start_stack: StartStack, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stack = await keyed_stack(
        start_stack, tmp_path, ["prefill", "prefill", "decode", "decode"], serving=RETRYING
    )
    stack.fleet[0].set_api_key(ROTATED)  # relaunched with another key; Narwhal not told
    response = await complete(stack)
    # Not the request's fault: retried on an engine that takes the key.
    assert response.status_code == 200
    assert requests(stack, 1, "prefill") == 1  # (the refusal precedes p0's own books)
    assert stack.ctx.metrics.retries.labels("engine_auth_failed")._value.get() == 1
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [REFUSED_LOG]
    # p0 would refuse every request: it takes no new work, and says why.
    assert (await complete(stack)).status_code == 200
    assert requests(stack, 1, "prefill") == 2
    assert stack.ctx.metrics.retries.labels("engine_auth_failed")._value.get() == 1
    state = await settled(stack)
    p0 = next(e for e in state["engines"] if e["id"] == "p0")
    assert p0["unavailable_reason"] == "auth refused: refused narwhal's API key (HTTP 401)"
    # Not faulty either: its breaker counts nothing.
    assert state["recovery"]["engines"]["p0"]["breakers"]["prefill"]["failures_in_window"] == 0
    assert KEY not in json.dumps(state)
    assert ROTATED not in json.dumps(state)


async def test_a_refused_tokenize_takes_the_engine_out_like_a_refused_leg(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # SGLang guards /tokenize; p0, first in config order, counts the prompt.
    # The operator's view of the refusal (serving.expose_engine_details): it names why.
    stack = await sglang_stack(
        nursery,
        api_key=KEY,
        engine={"api_key_file": key_file(tmp_path)},
        expose_engine_details=True,
    )
    stack.fleet[0].set_api_key(ROTATED)
    response = await complete(stack)
    # The estimate stands in for the count, and the only prefill engine is out.
    assert response.status_code == 503
    assert response.json()["error"]["message"] == (
        "no prefill engine is available (p0: auth refused: refused narwhal's API key (HTTP 401))"
    )
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [REFUSED_LOG]
    state = await settled(stack)
    assert state["requests"]["token_count_fallbacks"] == {"engine_auth": 1}
    metrics = stack.ctx.metrics.registry
    assert (
        metrics.get_sample_value("narwhal_token_count_fallbacks_total", {"reason": "engine_auth"})
        == 1
    )


async def test_a_proxy_refusing_vllm_tokenize_fails_the_request_over(
    start_stack: StartStack, tmp_path: Path
) -> None:
    # Stock vLLM leaves /tokenize open; a proxy in front of it guarding every route may not.
    stack = await keyed_stack(start_stack, tmp_path, ["prefill", "prefill", "decode", "decode"])

    async def forbidden(req: Any, resp: Any) -> None:
        await resp.send_json(403, {"error": {"message": "Forbidden", "code": 403}})

    stack.fleet[0].engine._routes[("POST", "/tokenize")] = forbidden
    stack.fleet[0].set_api_key(ROTATED)
    assert (await complete(stack)).status_code == 200
    assert (requests(stack, 0, "prefill"), requests(stack, 1, "prefill")) == (0, 1)
    state = await settled(stack)
    assert state["requests"]["token_count_fallbacks"] == {"engine_auth": 1}
    p0 = next(e for e in state["engines"] if e["id"] == "p0")
    assert p0["unavailable_reason"] == "auth refused: refused narwhal's API key (HTTP 403)"


async def test_a_secured_fleet_without_a_configured_key_says_so(start_stack: StartStack) -> None:
    # The engines' health routes are open, so they look healthy; their /v1 routes are not.
    # With serving.expose_engine_details, the answer names the engine and the fix.
    stack = await start_stack(sim={"api_key": KEY}, serving={"expose_engine_details": True})
    response = await complete(stack)
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "engine_auth_failed"
    assert error["message"] == (
        "prefill engine p0 requires an API key and narwhal sends none (HTTP 401: "
        "Unauthorized); set engine.api_key_file to the key of the engine's --api-key"
    )
    # The only prefill engine is out of placement now, and the answer says why.
    response = await complete(stack, stream=True)
    assert response.status_code == 503
    assert response.json()["error"]["message"] == (
        "no prefill engine is available (p0: auth refused: requires an API key and narwhal "
        "sends none (HTTP 401))"
    )
    state = await settled(stack)
    assert state["recovery"]["engines"]["p0"]["breakers"]["prefill"]["failures_in_window"] == 0


async def test_a_rotated_key_takes_effect_on_reload_and_never_shows(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="narwhal")
    fleet: Fleet = await nursery.start(
        partial(serve_fleet, engines=2, speed=20.0, model=MODEL, api_key=KEY)
    )
    path = tmp_path / "narwhal.json"
    key_path = key_file(tmp_path)
    document = fleet_config(fleet, ["prefill", "decode"], engine={"api_key_file": key_path})
    path.write_text(json.dumps(document))
    config = load_config(document)
    supervisor: Supervisor = await nursery.start(Supervisor(config, config_path=str(path)).run)
    stack = Stack(fleet, supervisor, config)
    assert (await complete(stack)).status_code == 200

    for handle in fleet:
        handle.set_api_key(ROTATED)
    assert (await complete(stack)).json()["error"]["code"] == "engine_auth_failed"

    await trio.Path(key_path).write_text(ROTATED + "\n")
    result = await supervisor.reload()
    assert result.applied
    assert result.plan is not None
    assert result.plan.summary() == [
        'engines[p0].api_key: "<redacted>" -> "<redacted>"',
        'engines[d1].api_key: "<redacted>" -> "<redacted>"',
    ]
    assert (await complete(stack)).status_code == 200
    assert (await complete(stack, stream=True)).status_code == 200

    # A reload that cannot read the key keeps the running key, and says why.
    await trio.Path(key_path).write_text("")
    refused = await supervisor.reload()
    assert not refused.applied
    assert refused.errors == (
        f"engine.api_key_file: {json.dumps(key_path)}: the file is empty; expected the engines' API key",
    )
    assert (await complete(stack)).status_code == 200

    state = await stack.state()
    reloads = [to_json(reload) for reload in supervisor.reloads]
    shown = json.dumps(state) + caplog.text + json.dumps(reloads)
    assert "<redacted>" in shown
    assert KEY not in shown
    assert ROTATED not in shown
