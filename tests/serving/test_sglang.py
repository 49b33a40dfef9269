"""The SGLang dialect: both legs at once, paired by bootstrap room."""

from __future__ import annotations

from functools import partial
from typing import Any

import httpx
import trio

from narwhal.config import load_config
from narwhal.sim import Fleet, SimEngineSpec, serve_fleet
from narwhal.supervisor import Supervisor

from ..support import sse_json
from .conftest import MODEL, Stack, fleet_config
from .test_failures import settled, terminal_error


async def sglang_stack(
    nursery: trio.Nursery,
    spec: SimEngineSpec | None = None,
    **serving: Any,
) -> Stack:
    fleet: Fleet = await nursery.start(
        partial(
            serve_fleet,
            engines=2,
            speed=20.0,
            model=MODEL,
            dialect="sglang",
            spec=spec,
            disaggregation_modes=("prefill", "decode"),
        )
    )
    document = fleet_config(fleet, ["prefill", "decode"], serving=serving)
    for entry, handle in zip(document["engines"], fleet, strict=True):
        entry["dialect"] = "sglang"
        # narwhal-sim serves the bootstrap endpoints on the engine's HTTP port.
        entry["bootstrap_port"] = handle.port
    config = load_config(document)
    supervisor: Supervisor = await nursery.start(Supervisor(config).run)
    return Stack(fleet, supervisor, config)


async def test_streaming_pair(nursery: trio.Nursery) -> None:
    stack = await sglang_stack(nursery)
    async with httpx.AsyncClient(timeout=20) as client:
        response = await client.post(
            f"{stack.url}/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5,
                "stream": True,
            },
        )
        plain = await client.post(
            f"{stack.url}/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 4}
        )
    assert response.status_code == 200
    events = sse_json(response.content)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert plain.status_code == 200
    assert plain.json()["usage"]["completion_tokens"] == 4
    prefill, decode = (handle.state() for handle in stack.fleet)
    assert prefill["counters"]["completed"]["prefill"] == 2
    assert decode["counters"]["completed"]["decode"] == 2
    await settled(stack)


async def test_usage_reaches_the_client_as_sglang_would_send_it(nursery: trio.Nursery) -> None:
    # SGLang's include_usage defaults to false even with stream_options present (unlike
    # vLLM): the router asks for the chunk for its own accounting and keeps it. Its
    # engines pack 4 tokens an event here, which only the usage count reveals.
    stack = await sglang_stack(nursery, spec=SimEngineSpec(stream_interval=4))
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 32, "stream": True}
    async with httpx.AsyncClient(timeout=20) as client:
        quiet = await client.post(
            f"{stack.url}/v1/completions", json={**body, "stream_options": {}}
        )
        asked = await client.post(
            f"{stack.url}/v1/completions",
            json={**body, "stream_options": {"include_usage": True}},
        )
    assert all(event["choices"] for event in sse_json(quiet.content))
    *_, usage = sse_json(asked.content)
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 32
    decode = stack.ctx.fleet.get("d1")
    assert decode is not None
    # Both streams reported their tokens to the router: two moves towards ~3.5 per event.
    assert decode.tokens_per_event > 1.6
    await settled(stack)


async def test_prefill_failure_cancels_the_decode_leg_at_once(nursery: trio.Nursery) -> None:
    stack = await sglang_stack(nursery)
    stack.fleet[0].set_faults(error_status=503, leg="prefill")
    started = trio.current_time()
    async with httpx.AsyncClient(timeout=20) as client:
        response = await client.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": True},
        )
    # A prefill failure is still an HTTP error (the stream was not committed yet), and
    # the decode leg does not hang on its bootstrap wait.
    assert response.status_code == 503
    assert trio.current_time() - started < 2.0
    await settled(stack)


async def test_decode_failure_after_commit(nursery: trio.Nursery) -> None:
    stack = await sglang_stack(nursery)
    stack.fleet[1].set_faults(crash_after_tokens=2, leg="decode")
    async with httpx.AsyncClient(timeout=20) as client:
        response = await client.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": "hello", "max_tokens": 20, "stream": True},
        )
    assert terminal_error(response)["code"] == "engine_connection_lost"
    await settled(stack)
