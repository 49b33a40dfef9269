"""The context check follows vLLM 0.32: what the engine serves goes through, what it
refuses is refused up front, and a refusal names only a field the client sent.

vLLM 0.32 serves prompt + max_tokens over the context with the output capped at the room
left (finish_reason "length"). It refuses a max_tokens above max_model_len, and a prompt
past it; a prompt that fills it gets "max_tokens must be at least 1, got 0" (naming
max_tokens, sent or not). Narwhal refused prompt + max_tokens over the context, as older
builds did, and a completion without max_tokens was refused naming max_tokens (16 by
default).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from .conftest import MODEL, RealStack, aggregate_config, narwhal_in_front, pair_config
from .engines import CONTEXT, RealFleet


def ids(count: int) -> list[int]:
    """A prompt of exactly `count` tokens (ids inside the tiny model's vocabulary)."""
    return [100 + i % 500 for i in range(count)]


async def complete(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> httpx.Response:
    with trio.fail_after(120):
        return await client.post(f"{url}/v1/completions", json={"model": MODEL, **body})


def streamed(response: httpx.Response) -> tuple[str | None, int]:
    """(the last finish_reason, usage.completion_tokens) of a streamed answer."""
    assert response.status_code == 200, response.text
    events = [block.removeprefix("data: ") for block in response.text.strip().split("\n\n")]
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], chunks[-2:]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    return reasons[-1], usage[-1]["completion_tokens"]


def answered(response: httpx.Response, stream: bool) -> tuple[str | None, int]:
    if stream:
        return streamed(response)
    assert response.status_code == 200, response.text
    body = response.json()
    return body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]


async def context_checks(stack: RealStack) -> dict[str, int]:
    state = await stack.state()
    checks: dict[str, int] = state["requests"]["context_checks"]
    return checks


@pytest.mark.parametrize("stream", [False, True])
async def test_output_past_the_context_is_served_capped(vllm: RealFleet, stream: bool) -> None:
    usage = {"stream_options": {"include_usage": True}} if stream else {}
    async with (
        narwhal_in_front(aggregate_config(vllm)) as stack,
        httpx.AsyncClient(timeout=120.0) as client,
    ):
        over = {"prompt": ids(CONTEXT - 48), "max_tokens": 100, "stream": stream, **usage}
        response = await complete(client, stack.url, over)
        assert answered(response, stream) == ("length", 48)
        # No max_tokens: the engine's default of 16, capped at the 8 left.
        near = {"prompt": ids(CONTEXT - 8), "stream": stream, **usage}
        response = await complete(client, stack.url, near)
        assert answered(response, stream) == ("length", 8)
        assert await context_checks(stack) == {"passed": 2}


async def test_output_past_the_context_is_served_capped_through_a_nixl_pair(
    vllm: RealFleet,
) -> None:
    # The decode leg is the one that sees the whole max_tokens; the prefill leg asks for one.
    # A NIXL pull of 2000 tokens on a busy 2-core box can take seconds (the tier's
    # first-token timeout allows for it).
    config = pair_config(vllm)
    async with narwhal_in_front(config) as stack, httpx.AsyncClient(timeout=120.0) as client:
        body = {
            "prompt": ids(CONTEXT - 30),
            "max_tokens": 200,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        response = await complete(client, stack.url, body)
        assert streamed(response) == ("length", 30)


async def test_what_the_engine_refuses_is_refused_up_front_naming_only_what_was_sent(
    vllm: RealFleet,
) -> None:
    engine = vllm.aggregate[0]
    async with (
        narwhal_in_front(aggregate_config(vllm)) as stack,
        httpx.AsyncClient(timeout=120.0) as client,
    ):
        # max_tokens above the context, and a prompt past it: the engine's own words.
        for body in (
            {"prompt": ids(10), "max_tokens": CONTEXT + 1},
            {"prompt": ids(CONTEXT + 52), "max_tokens": 1},
        ):
            own = (await complete(client, engine.url, body)).json()["error"]
            for stream in (False, True):
                response = await complete(client, stack.url, {**body, "stream": stream})
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["code"] == "context_length_exceeded"
                assert (error["param"], error["message"]) == (own["param"], own["message"])
        # A chat names the field it used.
        chat = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello"}],
            "max_completion_tokens": CONTEXT + 1,
        }
        with trio.fail_after(60):
            response = await client.post(f"{stack.url}/v1/chat/completions", json=chat)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "max_completion_tokens"
        # A prompt that fills the context: vLLM names max_tokens, which this client did not
        # send; Narwhal names the prompt.
        full = {"prompt": ids(CONTEXT)}
        own = (await complete(client, engine.url, full)).json()["error"]
        assert own["param"] == "max_tokens"
        response = await complete(client, stack.url, full)
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", "input_tokens")
        assert error["message"].startswith(
            f"This model's maximum context length is {CONTEXT} tokens. However, your prompt "
            f"contains {CONTEXT} input tokens, which leaves no room for an output token."
        )
        # Refused by Narwhal itself (an engine's refusal is engine_rejected_request).
        assert await context_checks(stack) == {"refused": 6}
        state = await stack.state()
    assert {e["id"]: e["context"]["rule"] for e in state["engines"]} == {
        "agg0": "prompt",
        "agg1": "prompt",
    }
    assert {e["context"]["version"] for e in state["engines"]} == {"0.32.0"}
