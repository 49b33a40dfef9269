"""Serving through Narwhal to real vLLM: what the client gets is what the engine made.

Each test runs on the aggregate fleet (`agg0`, `agg1`) and on the NixlConnector pair. The
reference is the same request sent straight to `agg0` without Narwhal: with greedy
sampling (`temperature: 0`) the tiny model's output is deterministic across engines and
across a handoff, so text, token counts and logprobs must agree exactly (logprobs within
float noise). `ignore_eos` keeps the random-weight model from stopping early, so every
request makes exactly its `max_tokens`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import attrs
import httpx
import pytest

from ..support import post_stream
from .client import (
    chat_of,
    counter,
    finish_reasons,
    post_json,
    prompt_of,
    sse_events,
    streamed_text,
    token_count,
    unique_text,
)
from .conftest import MODEL, RealStack, aggregate_config, narwhal_in_front, pair_config
from .engines import CONTEXT, Engine, RealFleet

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@attrs.frozen
class Front:
    kind: str
    stack: RealStack
    fleet: RealFleet

    @property
    def url(self) -> str:
        return self.stack.url

    @property
    def reference(self) -> Engine:
        """The engine the same request is sent to directly, for the expected answer."""
        return self.fleet["agg0"]


@pytest.fixture(params=["aggregate", "pair"])
async def front(request: pytest.FixtureRequest, vllm: RealFleet) -> AsyncIterator[Front]:
    config = aggregate_config(vllm) if request.param == "aggregate" else pair_config(vllm)
    async with narwhal_in_front(config) as stack:
        yield Front(request.param, stack, vllm)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=120.0) as c:
        yield c


async def direct(client: httpx.AsyncClient, engine: Engine, path: str, body: dict[str, Any]) -> Any:
    return await post_json(client, f"{engine.url}{path}", {**body, "stream": False})


def counts(usage: dict[str, Any]) -> dict[str, int]:
    """A usage record's token counts (its `*_details` fields are another test's business:
    the non-streaming answer's fields, issue 28 §3)."""
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def assert_same_logprobs(got: list[float], want: list[float]) -> None:
    assert got == pytest.approx(want, abs=1e-3)


async def test_a_completion_is_the_engines_answer(front: Front, client: httpx.AsyncClient) -> None:
    prompt = await prompt_of(front.reference, 40)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "logprobs": 2, **GREEDY}
    want = await direct(client, front.reference, "/v1/completions", body)

    answer = await client.post(f"{front.url}/v1/completions", json=body)

    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("application/json")
    got = answer.json()
    assert got["object"] == "text_completion"
    assert got["model"] == MODEL
    assert counts(got["usage"]) == counts(want["usage"])
    assert got["usage"]["prompt_tokens"] == 40
    assert got["usage"]["completion_tokens"] == 8
    [choice] = got["choices"]
    [expected] = want["choices"]
    assert choice["text"] == expected["text"]
    assert choice["finish_reason"] == expected["finish_reason"] == "length"
    logprobs, expected_logprobs = choice["logprobs"], expected["logprobs"]
    assert logprobs["tokens"] == expected_logprobs["tokens"]
    assert len(logprobs["tokens"]) == 8
    assert logprobs["text_offset"] == expected_logprobs["text_offset"]
    assert_same_logprobs(logprobs["token_logprobs"], expected_logprobs["token_logprobs"])
    for top, expected_top in zip(
        logprobs["top_logprobs"], expected_logprobs["top_logprobs"], strict=True
    ):
        assert top.keys() == expected_top.keys()
        # The top 2, and the sampled token when it is not among them; keyed by text, so
        # two tokens that decode alike (the random-weight model makes such) are one key.
        assert 1 <= len(top) <= 3


@pytest.mark.parametrize("include_usage", [True, False], ids=["usage", "no-usage"])
async def test_a_streamed_completion_is_the_engines_stream(
    front: Front, client: httpx.AsyncClient, include_usage: bool
) -> None:
    prompt = await prompt_of(front.reference, 30)
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "logprobs": 1}
    body.update(GREEDY)
    want = await direct(client, front.reference, "/v1/completions", body)
    streamed = {**body, "stream": True}
    if include_usage:
        streamed["stream_options"] = {"include_usage": True}

    status, headers, raw = await post_stream(client, f"{front.url}/v1/completions", streamed)

    assert status == 200, raw
    assert headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert {e["id"] for e in events} == {events[0]["id"]}
    assert all(e["object"] == "text_completion" and e["model"] == MODEL for e in events)
    assert streamed_text(events) == want["choices"][0]["text"]
    assert finish_reasons(events) == ["length"]
    tokens = [t for e in events for c in e["choices"] for t in c["logprobs"]["tokens"]]
    assert tokens == want["choices"][0]["logprobs"]["tokens"]
    # Narwhal always asks the engine for its usage chunk; the client gets it only if asked.
    usages = [e for e in events if e.get("usage")]
    if include_usage:
        assert usages == [events[-1]]
        assert events[-1]["choices"] == []
        assert counts(events[-1]["usage"]) == counts(want["usage"])
    else:
        assert usages == []


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_chat_is_the_engines_answer(
    front: Front, client: httpx.AsyncClient, stream: bool
) -> None:
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": unique_text(20)},
    ]
    prompt_tokens = await token_count(front.reference, messages=messages)
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 6,
        "logprobs": True,
        "top_logprobs": 2,
        **GREEDY,
    }
    want = await direct(client, front.reference, "/v1/chat/completions", body)
    [expected] = want["choices"]
    assert want["usage"]["prompt_tokens"] == prompt_tokens

    if not stream:
        got = await post_json(client, f"{front.url}/v1/chat/completions", body)
        assert got["object"] == "chat.completion"
        assert counts(got["usage"]) == counts(want["usage"])
        [choice] = got["choices"]
        assert choice["message"]["role"] == "assistant"
        assert choice["message"]["content"] == expected["message"]["content"]
        assert choice["finish_reason"] == "length"
        content = choice["logprobs"]["content"]
    else:
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        status, _, raw = await post_stream(client, f"{front.url}/v1/chat/completions", streamed)
        assert status == 200, raw
        events = sse_events(raw)
        assert all(e["object"] == "chat.completion.chunk" for e in events)
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert streamed_text(events, chat=True) == expected["message"]["content"]
        assert finish_reasons(events) == ["length"]
        assert events[-1]["choices"] == []
        assert counts(events[-1]["usage"]) == counts(want["usage"])
        content = [
            item
            for e in events
            for c in e["choices"]
            for item in (c["logprobs"] or {}).get("content") or []
        ]
    assert [c["token"] for c in content] == [c["token"] for c in expected["logprobs"]["content"]]
    assert_same_logprobs(
        [c["logprob"] for c in content], [c["logprob"] for c in expected["logprobs"]["content"]]
    )
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    assert want["usage"]["completion_tokens"] == len(content) == 6


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_completion_without_max_tokens_makes_sixteen(
    front: Front, client: httpx.AsyncClient, stream: bool
) -> None:
    # vLLM's default for completions; Narwhal prices and checks with the same 16.
    body: dict[str, Any] = {"model": MODEL, "prompt": unique_text(10), **GREEDY}
    if not stream:
        got = await post_json(client, f"{front.url}/v1/completions", body)
        usage, reasons = got["usage"], [got["choices"][0]["finish_reason"]]
    else:
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        status, _, raw = await post_stream(client, f"{front.url}/v1/completions", streamed)
        assert status == 200, raw
        events = sse_events(raw)
        usage, reasons = events[-1]["usage"], finish_reasons(events)
    assert usage["completion_tokens"] == 16
    assert reasons == ["length"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_chat_without_max_tokens_runs_to_the_end_of_the_context(
    front: Front, client: httpx.AsyncClient, stream: bool
) -> None:
    # A chat without a bound decodes until the context is full: 8 tokens after 2040.
    messages = await chat_of(front.reference, CONTEXT - 8)
    body: dict[str, Any] = {"model": MODEL, "messages": messages, **GREEDY}
    if not stream:
        got = await post_json(client, f"{front.url}/v1/chat/completions", body)
        usage, reasons = got["usage"], [got["choices"][0]["finish_reason"]]
    else:
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        status, _, raw = await post_stream(client, f"{front.url}/v1/chat/completions", streamed)
        assert status == 200, raw
        events = sse_events(raw)
        usage, reasons = events[-1]["usage"], finish_reasons(events)
    assert usage["prompt_tokens"] == CONTEXT - 8
    assert usage["completion_tokens"] == 8
    assert reasons == ["length"]


async def test_a_completion_that_fills_the_context_exactly_is_served(
    front: Front, client: httpx.AsyncClient
) -> None:
    prompt = await prompt_of(front.reference, CONTEXT - 6)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, **GREEDY}
    got = await post_json(client, f"{front.url}/v1/completions", body)
    assert got["usage"]["prompt_tokens"] == CONTEXT - 6
    assert got["usage"]["completion_tokens"] == 6
    assert got["choices"][0]["finish_reason"] == "length"


async def test_a_completion_whose_max_tokens_passes_the_context_is_served_capped(
    front: Front, client: httpx.AsyncClient
) -> None:
    prompt = await prompt_of(front.reference, CONTEXT - 6)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, **GREEDY}
    want = await direct(client, front.reference, "/v1/completions", body)
    assert want["usage"]["completion_tokens"] == 6  # the engine serves it, capped

    answer = await client.post(f"{front.url}/v1/completions", json=body)

    assert answer.status_code == 200, answer.text
    assert counts(answer.json()["usage"]) == counts(want["usage"])
    assert answer.json()["choices"][0]["finish_reason"] == "length"


async def test_a_handoff_moves_the_whole_prompt_to_the_decode_engine(
    vllm: RealFleet, client: httpx.AsyncClient
) -> None:
    prefill, decode = vllm.pair
    prompt_tokens = 300  # three KV blocks of 128, the last one partial
    prompt = await prompt_of(prefill, prompt_tokens)
    sources = ("local_compute", "local_cache_hit", "external_kv_transfer")

    async def by_source(engine: Engine) -> dict[str, float]:
        return {
            s: await counter(engine, "vllm:prompt_tokens_by_source_total", source=s)
            for s in sources
        }

    before = {"prefill": await by_source(prefill), "decode": await by_source(decode)}
    transfers = await counter(decode, "vllm:nixl_xfer_time_seconds_count")
    async with narwhal_in_front(pair_config(vllm)) as stack:
        got = await post_json(
            client,
            f"{stack.url}/v1/completions",
            {"model": MODEL, "prompt": prompt, "max_tokens": 4, **GREEDY},
        )
    assert got["usage"]["prompt_tokens"] == prompt_tokens
    after = {"prefill": await by_source(prefill), "decode": await by_source(decode)}
    rise = {engine: {s: after[engine][s] - before[engine][s] for s in sources} for engine in before}
    # The prefill engine computed the prompt; the decode engine received all of it.
    assert rise["prefill"] == {
        "local_compute": prompt_tokens,
        "local_cache_hit": 0,
        "external_kv_transfer": 0,
    }
    assert rise["decode"] == {
        "local_compute": 0,
        "local_cache_hit": 0,
        "external_kv_transfer": prompt_tokens,
    }
    assert await counter(decode, "vllm:nixl_xfer_time_seconds_count") == transfers + 1
