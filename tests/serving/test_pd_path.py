"""The request path through simulated P/D engines, seen by real clients."""

from __future__ import annotations

from typing import Any

import attrs
import httpx
import openai
import trio

from narwhal.profiles import FleetProfiles, ProfileCheck

from ..profiles.helpers import store_for
from ..support import sse_json, wait_for
from .conftest import MODEL, StartStack


def _openai_round_trip(base_url: str) -> dict[str, Any]:
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=20)
    try:
        completion = client.completions.create(
            model=MODEL, prompt="The capital of France", max_tokens=5
        )
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4
        )
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "stream please"}],
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text_stream = list(
            client.completions.create(model=MODEL, prompt="Once upon", max_tokens=3, stream=True)
        )
        return {
            "completion": (
                completion.choices[0].finish_reason,
                completion.usage and completion.usage.completion_tokens,
            ),
            "chat": (chat.choices[0].message.role, chat.usage and chat.usage.completion_tokens),
            "stream_roles": [c.choices[0].delta.role for c in chunks if c.choices][:1],
            "stream_text": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
            "stream_usage": [c.usage.completion_tokens for c in chunks if c.usage],
            "text_stream": [c.choices[0].finish_reason for c in text_stream if c.choices][-1],
        }
    finally:
        client.close()


async def test_openai_client_through_prefill_and_decode(start_stack: StartStack) -> None:
    stack = await start_stack(["prefill", "decode"])
    result = await trio.to_thread.run_sync(_openai_round_trip, f"{stack.url}/v1")
    assert result["completion"] == ("length", 5)
    assert result["chat"] == ("assistant", 4)
    assert result["stream_roles"] == ["assistant"]
    assert len(result["stream_text"].split()) >= 6
    assert result["stream_usage"] == [6]
    assert result["text_stream"] == "length"
    prefill, decode = (handle.state() for handle in stack.fleet)
    # Every request ran its prefill on p0 and its decode (with a KV pull) on d1.
    assert prefill["counters"]["completed"]["prefill"] == 4
    assert prefill["counters"]["completed"]["decode"] == 0
    assert decode["counters"]["completed"]["decode"] == 4
    assert decode["counters"]["kv_pulled"] == 4
    assert decode["counters"]["completed"]["prefill"] == 0
    state = await stack.state()
    assert state["requests"]["outcomes"] == {"ok": 4}
    assert state["requests"]["token_counts"] == {"exact": 4}


async def test_both_legs_carry_the_same_request_id(start_stack: StartStack) -> None:
    stack = await start_stack(["prefill", "decode"])
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": "x y z", "max_tokens": 2},
            headers={"x-request-id": "req-abc.1"},
        )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "req-abc.1"
    legs = [
        (o["phase"], o["request_id"]) for handle in stack.fleet for o in handle.state()["outcomes"]
    ]
    assert sorted(legs) == [("decode", "req-abc.1"), ("prefill", "req-abc.1")]


async def test_single_engine_with_both_roles_serves_aggregate(start_stack: StartStack) -> None:
    stack = await start_stack(["both"], controller={"min_prefill": 1, "min_decode": 1})
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": "a b c", "max_tokens": 3, "stream": True},
        )
    assert response.status_code == 200
    events = sse_json(response.content)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    counters = stack.fleet[0].state()["counters"]
    assert counters["completed"]["aggregate"] == 1
    assert counters["requests"]["prefill"] == counters["requests"]["decode"] == 0


async def test_tokenize_fallback_is_recorded(start_stack: StartStack) -> None:
    stack = await start_stack(["prefill", "decode"], engine={"tokenize": False})
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": "x" * 380, "max_tokens": 1},
        )
    assert response.status_code == 200
    state = await stack.state()
    assert state["requests"]["token_counts"] == {"fallback": 1}
    assert state["requests"]["token_count_fallbacks"] == {"disabled": 1}


async def test_exact_count_differs_from_the_chars_estimate(start_stack: StartStack) -> None:
    stack = await start_stack(["prefill", "decode"])
    seen: list[int | None] = []
    prompt = "tokenisation of ordinary english prose " * 10

    async def probe() -> None:
        async with httpx.AsyncClient(timeout=10) as client:
            await client.post(
                f"{stack.url}/v1/completions",
                json={"model": MODEL, "prompt": prompt, "max_tokens": 200},
            )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(probe)

        def in_flight() -> bool:
            records = list(stack.ctx.records.values())
            if records and records[0].prompt_tokens is not None:
                seen.append(records[0].prompt_tokens)
                return True
            return False

        await wait_for(in_flight)
    exact = seen[0]
    assert exact is not None
    assert exact != -(-len(prompt) // 3.8)


async def test_models_health_and_metrics(start_stack: StartStack) -> None:
    stack = await start_stack(["prefill", "decode"])
    await wait_for(lambda: all(e.context_length is not None for e in stack.ctx.fleet))
    # Engines of one model with different contexts: the card has the one both take.
    decode = stack.ctx.fleet.get("d1")
    assert decode is not None
    assert decode.context_length is not None
    decode.set_context(decode.context_length - 1000, "a smaller engine")
    async with httpx.AsyncClient(timeout=10) as client:
        models = (await client.get(f"{stack.url}/v1/models")).json()
        health = await client.get(f"{stack.url}/health")
        await client.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True},
        )
        metrics = (await client.get(f"{stack.admin_url}/metrics")).text
        missing = await client.get(f"{stack.url}/v2/nothing")
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [
        (MODEL, decode.context_length)
    ]
    assert health.status_code == 200
    assert 'narwhal_requests_total{endpoint="completions",outcome="ok"} 1.0' in metrics
    assert 'narwhal_engine_role{engine="p0",role="prefill"} 1.0' in metrics
    assert "narwhal_ttft_seconds_bucket" in metrics
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"


async def test_unknown_model_is_404_with_envelope(start_stack: StartStack) -> None:
    stack = await start_stack(["prefill", "decode"])
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.post(
            f"{stack.url}/v1/completions", json={"model": "gpt-9", "prompt": "x"}
        )
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "the model `gpt-9` does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "not_found",
        }
    }


async def test_a_route_asked_with_a_method_it_does_not_answer_is_405_with_allow(
    start_stack: StartStack,
) -> None:
    stack = await start_stack(["prefill", "decode"])
    async with httpx.AsyncClient(timeout=10) as client:
        get_chat = await client.get(f"{stack.url}/v1/chat/completions")
        post_health = await client.post(f"{stack.url}/health", content=b"{}")
        head_health = await client.head(f"{stack.url}/health")
        head_models = await client.head(f"{stack.url}/v1/models")
    assert get_chat.status_code == 405
    assert get_chat.headers["allow"] == "POST"
    assert get_chat.json() == {
        "error": {
            "message": "/v1/chat/completions answers POST, not GET",
            "type": "invalid_request_error",
            "param": None,
            "code": "method_not_allowed",
        }
    }
    assert post_health.status_code == 405
    assert post_health.headers["allow"] == "GET, HEAD"
    # HEAD is GET without the body: the same status and headers.
    for head in (head_health, head_models):
        assert head.status_code == 200
        assert head.headers["content-type"] == "application/json"
        assert int(head.headers["content-length"]) > 0
        assert head.content == b""


async def test_the_state_shows_each_engines_profiled_request_cap(
    start_stack: StartStack,
) -> None:
    urls = {"p0": "http://127.0.0.1:9", "d1": "http://127.0.0.1:9"}
    store = store_for(urls)
    capped = attrs.evolve(store.engines["d1"], max_num_seqs=128)
    store = attrs.evolve(store, engines={**store.engines, "d1": capped})
    check = ProfileCheck(store=store, usable=frozenset(urls), messages=(), configured=tuple(urls))
    stack = await start_stack(["prefill", "decode"], profiles=FleetProfiles(check))
    state = await stack.state()
    assert state["profiles"]["max_num_seqs"] == {"d1": 128, "p0": None}


async def test_tokenize_fallback_uses_the_profiled_chars_per_token(
    start_stack: StartStack,
) -> None:
    # The sweep measured 4.5 chars/token on this dialect; engine.chars_per_token (3.8)
    # is only a guess, so the fallback count of a 450-char prompt is 100, not 119.
    urls = {"p0": "http://127.0.0.1:9", "d1": "http://127.0.0.1:9"}
    check = ProfileCheck(
        store=store_for(urls), usable=frozenset(urls), messages=(), configured=tuple(urls)
    )
    stack = await start_stack(
        ["prefill", "decode"], engine={"tokenize": False}, profiles=FleetProfiles(check)
    )
    state = await stack.state()
    assert state["requests"]["fallback_chars_per_token"] == {"value": 4.5, "source": "profile"}
    assert state["profiles"]["max_num_seqs"] == {"p0": None, "d1": None}
    seen: list[int] = []

    async def send() -> None:
        async with httpx.AsyncClient(timeout=10) as client:
            await client.post(
                f"{stack.url}/v1/completions",
                json={"model": MODEL, "prompt": "x" * 450, "max_tokens": 200},
            )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)

        def counted() -> bool:
            seen.extend(
                r.prompt_tokens for r in stack.ctx.records.values() if r.prompt_tokens is not None
            )
            return bool(seen)

        await wait_for(counted)
    assert seen[0] == 100


async def test_tokenize_fallback_without_a_profile_uses_the_config(
    start_stack: StartStack,
) -> None:
    stack = await start_stack(["prefill", "decode"], engine={"tokenize": False})
    state = await stack.state()
    assert state["requests"]["fallback_chars_per_token"] == {
        "value": 3.8,
        "source": "engine.chars_per_token",
    }
