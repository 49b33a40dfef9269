"""n choices, stop strings and logprobs, as vLLM serves them (both simulated builds)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from ..support import StartFleet, post_stream, sse_json

FAST = {"speed": 100.0}
CHAT = [{"role": "user", "content": "Name a river."}]


def streamed_texts(raw: bytes, *, chat: bool) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in sse_json(raw):
        for choice in chunk["choices"]:
            piece = choice["delta"].get("content", "") if chat else choice["text"]
            texts[choice["index"]] = texts.get(choice["index"], "") + piece
    return texts


@pytest.mark.parametrize("vllm_version", ["0.32.0", "0.29.0"])
async def test_n_choices_are_served(
    start_fleet: StartFleet, client: httpx.AsyncClient, vllm_version: str
) -> None:
    fleet = await start_fleet(engines=1, vllm_version=vllm_version, **FAST)
    url = fleet[0].url
    r = await client.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 4, "n": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in body["choices"]]
    assert len(set(texts)) == 3
    assert all(len(t.split()) == 4 for t in texts)
    assert body["usage"]["completion_tokens"] == 12
    stream = {"prompt": "x", "max_tokens": 4, "n": 3, "stream": True}
    _, _, raw = await post_stream(client, f"{url}/v1/completions", stream)
    assert streamed_texts(raw, chat=False) == dict(enumerate(texts))
    chat = {"messages": CHAT, "max_tokens": 2, "n": 2, "stream": True}
    _, _, raw = await post_stream(client, f"{url}/v1/chat/completions", chat)
    roles = [c["choices"][0]["index"] for c in sse_json(raw) if "role" in c["choices"][0]["delta"]]
    assert roles == [0, 1]
    assert [len(t.split()) for t in streamed_texts(raw, chat=True).values()] == [2, 2]


@pytest.mark.parametrize("include", [False, True])
async def test_a_stop_string_ends_a_choice_where_it_completes(
    start_fleet: StartFleet, client: httpx.AsyncClient, include: bool
) -> None:
    fleet = await start_fleet(engines=1, **FAST)
    url = fleet[0].url
    free = await client.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 40})
    words = free.json()["choices"][0]["text"]
    # A stop string spanning two tokens, found after the first.
    at = words.index(" ", words.index(" ", 1) + 1)
    stop = words[at - 2 : at + 3]
    body: dict[str, Any] = {
        "prompt": "x",
        "max_tokens": 40,
        "stop": ["never-there", stop],
        "include_stop_str_in_output": include,
    }
    r = await client.post(f"{url}/v1/completions", json=body)
    (choice,) = r.json()["choices"]
    expected = words[: at + 3] if include else words[: at - 2]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
        expected,
        "stop",
        stop,
    )
    tokens = words[: at + 3].count(" ")
    assert r.json()["usage"]["completion_tokens"] == tokens
    # Streamed, the text before a possible stop string is held back: never half sent.
    _, _, raw = await post_stream(client, f"{url}/v1/completions", {**body, "stream": True})
    assert streamed_texts(raw, chat=False) == {0: expected}
    last = sse_json(raw)[-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop)
    # Not before min_tokens.
    later = await client.post(f"{url}/v1/completions", json={**body, "min_tokens": tokens})
    assert later.json()["usage"]["completion_tokens"] > tokens


async def test_logprobs_describe_the_tokens_sent(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=1, **FAST)
    url = fleet[0].url
    body = {"prompt": "x", "max_tokens": 5, "logprobs": 3}
    choice = (await client.post(f"{url}/v1/completions", json=body)).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"]
    offsets = [len("".join(logprobs["tokens"][:i])) for i in range(5)]
    assert logprobs["text_offset"] == offsets
    assert all(lp < 0 for lp in logprobs["token_logprobs"])
    # The sampled token and 3 others at each position.
    assert [len(top) for top in logprobs["top_logprobs"]] == [4] * 5
    assert all(
        t in top for t, top in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True)
    )
    _, _, raw = await post_stream(client, f"{url}/v1/completions", {**body, "stream": True})
    streamed = [c["choices"][0]["logprobs"] for c in sse_json(raw)]
    assert [o for lp in streamed for o in lp["text_offset"]] == offsets
    chat = {"messages": CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
    choice = (await client.post(f"{url}/v1/chat/completions", json=chat)).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == choice["message"]["content"]
    assert all(bytes(c["bytes"]).decode() == c["token"] for c in content)
    assert [len(c["top_logprobs"]) for c in content] == [2, 2, 2]
    assert all(c["top_logprobs"][0]["token"] == c["token"] for c in content)
    plain = {"messages": CHAT, "max_tokens": 3, "logprobs": False}
    r = await client.post(f"{url}/v1/chat/completions", json=plain)
    assert r.json()["choices"][0]["logprobs"] is None
