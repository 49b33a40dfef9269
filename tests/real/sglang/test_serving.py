"""Serving through Narwhal (`dialect: sglang`) to real SGLang: the client gets what the engine
made, on the aggregate engine and through the Mooncake pair.

The reference is the same request sent straight to `agg` without Narwhal: with greedy
sampling the tiny model's output is the same on every engine and across a handoff (the
decode server cannot compute a prompt itself, so equal text means the KV moved).
`ignore_eos` keeps the random-weight model from stopping early.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import attrs
import httpx
import pytest

from ...support import post_stream
from ..client import finish_reasons, post_json, sse_events, streamed_text, unique_text
from ..conftest import MODEL, RealStack, narwhal_in_front
from ..engines import Engine
from ..sglang_engines import SGLangFleet
from .conftest import aggregate_config, pair_config, total

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@attrs.frozen
class Front:
    kind: str
    stack: RealStack
    fleet: SGLangFleet

    @property
    def url(self) -> str:
        return self.stack.url

    @property
    def reference(self) -> Engine:
        return self.fleet["agg"]


@pytest.fixture(params=["aggregate", "pair"])
async def front(request: pytest.FixtureRequest, sglang: SGLangFleet) -> AsyncIterator[Front]:
    config = aggregate_config(sglang) if request.param == "aggregate" else pair_config(sglang)
    async with narwhal_in_front(config) as stack:
        yield Front(request.param, stack, sglang)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=120.0) as c:
        yield c


async def direct(client: httpx.AsyncClient, engine: Engine, path: str, body: dict[str, Any]) -> Any:
    return await post_json(client, f"{engine.url}{path}", {**body, "stream": False})


def counts(usage: dict[str, Any]) -> dict[str, int]:
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


async def pair_counters(fleet: SGLangFleet) -> tuple[float, float]:
    """The prefill server's prompt tokens and the decode server's generated tokens."""
    prefill, decode = fleet.pair
    return (
        await total(prefill, "sglang:prompt_tokens_total"),
        await total(decode, "sglang:generation_tokens_total"),
    )


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_completion_is_the_engines_answer(
    front: Front, client: httpx.AsyncClient, stream: bool
) -> None:
    body: dict[str, Any] = {"model": MODEL, "prompt": unique_text(30), "max_tokens": 8, **GREEDY}
    want = await direct(client, front.reference, "/v1/completions", body)
    before = await pair_counters(front.fleet)

    if not stream:
        got = await post_json(client, f"{front.url}/v1/completions", body)
        assert got["object"] == "text_completion"
        assert counts(got["usage"]) == counts(want["usage"])
        [choice] = got["choices"]
        assert choice["text"] == want["choices"][0]["text"]
        assert choice["finish_reason"] == "length"
    else:
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        status, headers, raw = await post_stream(client, f"{front.url}/v1/completions", streamed)
        assert status == 200, raw
        assert headers["content-type"].startswith("text/event-stream")
        events = sse_events(raw)
        assert {e["id"] for e in events} == {events[0]["id"]}
        assert streamed_text(events) == want["choices"][0]["text"]
        assert finish_reasons(events) == ["length"]
        assert events[-1]["choices"] == []
        assert counts(events[-1]["usage"]) == counts(want["usage"])

    prompt, generated = await pair_counters(front.fleet)
    if front.kind == "pair":
        # The prefill server prefilled the prompt, the decode server made the tokens.
        assert prompt - before[0] == want["usage"]["prompt_tokens"]
        assert generated - before[1] == 8
    else:
        assert (prompt, generated) == before


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_chat_is_the_engines_answer(
    front: Front, client: httpx.AsyncClient, stream: bool
) -> None:
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": unique_text(20)},
    ]
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 6, **GREEDY}
    want = await direct(client, front.reference, "/v1/chat/completions", body)
    [expected] = want["choices"]

    if not stream:
        got = await post_json(client, f"{front.url}/v1/chat/completions", body)
        assert got["object"] == "chat.completion"
        assert counts(got["usage"]) == counts(want["usage"])
        [choice] = got["choices"]
        assert choice["message"]["role"] == "assistant"
        assert choice["message"]["content"] == expected["message"]["content"]
        assert choice["finish_reason"] == "length"
    else:
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        status, _, raw = await post_stream(client, f"{front.url}/v1/chat/completions", streamed)
        assert status == 200, raw
        events = sse_events(raw)
        assert all(e["object"] == "chat.completion.chunk" for e in events)
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert streamed_text(events, chat=True) == expected["message"]["content"]
        # SGLang 0.5.23 ends a chat stream's choices with a chunk of its own for the
        # finish reason, and every delta carries `reasoning_content: null`.
        assert finish_reasons(events) == ["length"]
        deltas = [c["delta"] for e in events for c in e["choices"]]
        assert all("reasoning_content" in d for d in deltas), deltas
        assert events[-1]["choices"] == []
        assert counts(events[-1]["usage"]) == counts(want["usage"])
