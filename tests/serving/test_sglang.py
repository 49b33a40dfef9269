"""The SGLang dialect: both legs at once, paired by bootstrap room."""

from __future__ import annotations

from functools import partial
from typing import Any

import httpx
import trio

from narwhal.config import load_config
from narwhal.sim import Fleet, SimEngineSpec, serve_fleet
from narwhal.supervisor import Supervisor

from ..support import sse_json, wait_for
from .conftest import MODEL, Stack, fleet_config
from .test_failures import settled, terminal_error


async def sglang_stack(
    nursery: trio.Nursery, spec: SimEngineSpec | None = None, **serving: Any
) -> Stack:
    fleet: Fleet = await nursery.start(
        partial(serve_fleet, engines=2, speed=20.0, model=MODEL, dialect="sglang", spec=spec)
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


async def test_a_decode_failure_cancels_the_prefill_leg_at_once(nursery: trio.Nursery) -> None:
    # The prefill would otherwise sit in its bootstrap queue until SGLang's timeout (peer
    # routers hang here: sglang #9726). Only the router's cancel ends it.
    stack = await sglang_stack(nursery)
    stack.fleet[1].set_faults(error_status=503, leg="decode")
    started = trio.current_time()
    async with httpx.AsyncClient(timeout=20) as client:
        response = await client.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": True},
        )
    assert response.status_code == 503
    assert trio.current_time() - started < 2.0
    await settled(stack)
    assert stack.fleet[0].state()["counters"]["requests"]["prefill"] == 1


async def test_an_error_event_in_the_prefill_stream_fails_the_prefill(
    nursery: trio.Nursery,
) -> None:
    # The prefill leg shares the client's streamed body, so SGLang reports its late
    # errors inside a 200 stream. Read as success, the client got a 200 stream ending in
    # an error blamed on the decode engine, with no retry.
    stack = await sglang_stack(nursery)
    stack.fleet[0].set_faults(sse_error_after_tokens=0, leg="prefill")
    async with httpx.AsyncClient(timeout=20) as client:
        response = await client.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": True},
        )
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "engine_stream_error"
    assert "prefill engine p0" in response.json()["error"]["message"]
    metrics = stack.ctx.metrics.render().decode()
    assert (
        'narwhal_engine_failures_total{code="engine_stream_error",engine="p0",phase="prefill"} 1.0'
        in metrics
    )
    await settled(stack)


async def test_a_pair_holds_both_slots_before_it_sends_either_leg(nursery: trio.Nursery) -> None:
    # One decode slot, held 1.5 s by the first stream. The second pair's prefill must
    # not go out before its decode has a slot: it would wait in the prefill engine's
    # bootstrap queue, time out at serving.prefill_timeout_s and count against p0.
    stack = await sglang_stack(
        nursery, prefill_concurrency=1, decode_concurrency=1, prefill_timeout_s=0.5
    )
    stack.fleet[1].set_faults(stall_after_tokens=1, stall_s=1.5, leg="decode", count=1)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": True}
    statuses: list[int] = []

    async def one() -> None:
        async with httpx.AsyncClient(timeout=20) as client:
            statuses.append(
                (await client.post(f"{stack.url}/v1/completions", json=body)).status_code
            )

    async with trio.open_nursery() as requests:
        requests.start_soon(one)
        await wait_for(lambda: stack.ctx.fleet.get("d1").decode_active == 1)  # type: ignore[union-attr]
        requests.start_soon(one)
    assert statuses == [200, 200]
    assert "narwhal_engine_failures_total{" not in stack.ctx.metrics.render().decode()
    await settled(stack)
