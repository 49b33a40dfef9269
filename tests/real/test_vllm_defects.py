"""Defects real vLLM 0.32 exposed in Narwhal (issue 28, section 3), each checked on the
real engines: client errors inside a stream, requests only the decode engine refuses,
`n`/`best_of`, assembled non-streaming answers, status-line reason phrases, and
`max_model_len` on Narwhal's `/v1/models`.

The engines are shared by the whole tier, so what a test reads from an engine's
/metrics is a difference taken around its own requests."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest
import trio

from ..support import sse_payloads
from .client import counter, sse_events
from .conftest import (
    MODEL,
    RealStack,
    RequestLog,
    aggregate_config,
    engine_entry,
    narwhal_in_front,
    pair_config,
    real_config,
)
from .engines import CONTEXT, RealFleet

PROMPT = "def main():\n    import os\n    return os.getcwd()\n"


async def narwhal_metric(client: httpx.AsyncClient, stack: RealStack, name: str) -> float:
    """The sum of Narwhal's own samples of `name` on its /metrics."""
    text = (await client.get(f"{stack.admin_url}/metrics")).text
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
    return sum(float(match[2]) for match in pattern.finditer(text))


def engine_refusal(answer: httpx.Response) -> str:
    """The message of an engine's refusal: its HTTP error's, or its stream's error event's."""
    if answer.status_code == 200:
        events = sse_payloads(answer.content)
        assert events[-1] == "[DONE]", events
        error = json.loads(events[0])["error"]
        assert error["code"] == 400, error
    else:
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
    message: str = error["message"]
    return message


def error_of(answer: httpx.Response) -> dict[str, Any]:
    """The envelope of an HTTP error answer (not a stream)."""
    assert answer.headers["content-type"] == "application/json", answer.text
    error: dict[str, Any] = answer.json()["error"]
    return error


# ---------------------------------------------------------------------- 1. stream errors

# Requests every vLLM engine refuses, streamed or not. Streamed, vLLM 0.32 answers 200,
# then `data: {"error": {..., "code": 400}}` and `data: [DONE]`.
BAD_REQUESTS: list[tuple[str, dict[str, Any], str]] = [
    ("completions", {"prompt": PROMPT, "max_tokens": 4, "logprobs": 21}, "logprobs of 21"),
    ("completions", {"prompt": [1, 2, 999_999], "max_tokens": 4}, "out of vocabulary"),
    (
        "completions",
        {"prompt": PROMPT, "max_tokens": 4, "allowed_token_ids": [999_999]},
        "allowed_token_ids",
    ),
    (
        "chat",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "logprobs": True,
            "top_logprobs": 21,
        },
        "logprobs of 21",
    ),
]
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


async def test_a_client_error_in_an_engine_stream_is_the_clients_not_the_engines(
    vllm: RealFleet,
) -> None:
    # The engines' own answer, streamed: 200, an error event with code 400, [DONE].
    agg0 = vllm["agg0"]
    async with httpx.AsyncClient(timeout=60) as direct:
        raw = await direct.post(
            f"{agg0.url}/v1/completions",
            json={"model": MODEL, **BAD_REQUESTS[0][1], "stream": True},
        )
    assert raw.status_code == 200
    events = sse_payloads(raw.content)
    assert events[-1] == "[DONE]"
    assert json.loads(events[0])["error"]["code"] == 400

    # Retries allowed, so a retried client error would show.
    config = aggregate_config(vllm, serving={"max_attempts": 3, "handoff_timeout_s": 5.0})
    sent = [
        (kind, body, words, stream)
        for kind, body, words in BAD_REQUESTS
        for stream in (True, False)
    ]
    answers: list[httpx.Response] = []
    async with narwhal_in_front(config) as stack, httpx.AsyncClient(timeout=60) as client:
        # Bounded: three rounds of the four bad requests, streamed and not (24 requests;
        # each engine's breaker opens at 5 counted failures in 30 s).
        for _ in range(3):
            for kind, body, _, stream in sent:
                answers.append(
                    await client.post(
                        f"{stack.url}{PATHS[kind]}", json={"model": MODEL, **body, "stream": stream}
                    )
                )
        good = await client.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4},
        )
        refused = await narwhal_metric(client, stack, "narwhal_engine_failures_total")
        counted = await narwhal_metric(client, stack, "narwhal_counted_failures_total")
        retries = await narwhal_metric(client, stack, "narwhal_retries_total")
        state = await stack.state()
    # Before the fix the bad requests opened both engines' breakers, and this was a 503.
    assert good.status_code == 200, good.text
    for answer, (kind, _, words, stream) in zip(answers, sent * 3, strict=True):
        assert answer.status_code == 400, (kind, stream, answer.text)
        error = error_of(answer)
        assert error["type"] == "invalid_request_error"
        assert error["code"] == "engine_rejected_request"
        assert words in error["message"], error
    # Each a failed leg, refused for the client's fault: none counted against an engine.
    assert (refused, counted, retries) == (len(answers), 0, 0)
    for engine in ("agg0", "agg1"):
        breakers = state["recovery"]["engines"][engine]["breakers"]
        assert [b["failures_in_window"] for b in breakers.values()] == [0, 0], breakers


# ------------------------------------------------------- 2. refused before any prefill


async def test_requests_the_decode_engine_would_refuse_are_refused_before_any_prefill(
    vllm: RealFleet,
) -> None:
    prefill, decode = vllm.pair
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    stream_options = "Stream options can only be defined when `stream=True`."
    cases: list[tuple[str, dict[str, Any], str, str]] = [
        (
            "completions",
            {"prompt": PROMPT, "max_tokens": 4, "stream_options": {"include_usage": True}},
            "stream_options",
            f"{stream_options} (parameter=stream_options)",
        ),
        (
            "chat",
            {**chat, "stream": False, "stream_options": {"include_usage": True}},
            "stream_options",
            f"{stream_options} (parameter=stream_options)",
        ),
        (
            "completions",
            {"prompt": PROMPT, "max_tokens": 4, "min_tokens": 8, "stream": True},
            "min_tokens",
            "min_tokens must be less than or equal to max_tokens=4, got 8.",
        ),
        (
            "completions",
            {"prompt": PROMPT, "max_tokens": 4, "min_tokens": 8},
            "min_tokens",
            "min_tokens must be less than or equal to max_tokens=4, got 8.",
        ),
        (
            # No max_tokens: vLLM's completion default of 16.
            "completions",
            {"prompt": PROMPT, "min_tokens": 17, "stream": True},
            "min_tokens",
            "min_tokens must be less than or equal to max_tokens=16, got 17.",
        ),
        (
            "chat",
            {**chat, "max_completion_tokens": 2, "min_tokens": 3, "stream": True},
            "min_tokens",
            "min_tokens must be less than or equal to max_tokens=2, got 3.",
        ),
        (
            "completions",
            {"prompt": PROMPT, "max_tokens": 4, "prompt_logprobs": 1, "stream": True},
            "prompt_logprobs",
            "`prompt_logprobs` are not available when `stream=True`. (parameter=prompt_logprobs)",
        ),
    ]
    # What the decode engine itself answers each: its words, as an HTTP error or, for a
    # stream it refuses once started, in the error event.
    async with httpx.AsyncClient(timeout=60) as direct:
        for kind, body, _, message in cases:
            own = await direct.post(f"{decode.url}{PATHS[kind]}", json={"model": MODEL, **body})
            assert engine_refusal(own) == message
    prompt_tokens = await counter(prefill, "vllm:prompt_tokens_total")
    ended = await counter(prefill, "vllm:request_success_total")
    answers = []
    async with (
        narwhal_in_front(pair_config(vllm)) as stack,
        httpx.AsyncClient(timeout=60) as client,
    ):
        for kind, body, _, _ in cases:
            answers.append(
                await client.post(f"{stack.url}{PATHS[kind]}", json={"model": MODEL, **body})
            )
        producer = stack.ctx.fleet.get("prefill")
        assert producer is not None
        legs = producer.load.legs_started
    # No request reached the prefill engine, so no producer holds KV for a decode that never
    # comes: a producer holds KV only for a request it ran to the end, which these counters
    # would show (an aborted one too). Waiting out its 30 s lease for
    # `vllm:nixl_num_kv_expired_reqs` would show nothing more. (The engine's counters are the
    # whole engine's: the tier runs one test at a time.)
    assert legs == 0
    assert await counter(prefill, "vllm:prompt_tokens_total") == prompt_tokens
    assert await counter(prefill, "vllm:request_success_total") == ended
    assert [a.status_code for a in answers] == [400] * len(cases), [a.text for a in answers]
    for answer, (kind, body, param, message) in zip(answers, cases, strict=True):
        error = error_of(answer)
        assert (error["param"], error["message"]) == (param, message), (kind, body)
        assert error["type"] == "invalid_request_error"


# --------------------------------------------------------------- 3. n > 1 and best_of


def finished(log: RequestLog) -> list[tuple[str | None, str | None]]:
    """(prefill engine, decode engine) of each finished request, in order."""
    return [(line.get("prefill_engine"), line.get("decode_engine")) for line in log.lines()]


def mixed_config(fleet: RealFleet) -> dict[str, Any]:
    """A NIXL pair and one aggregate engine."""
    prefill, decode = fleet.pair
    return real_config(
        [
            engine_entry(prefill, "prefill"),
            engine_entry(decode, "decode"),
            engine_entry(fleet["agg0"], "both"),
        ]
    )


async def test_n_is_served_on_an_aggregate_leg_and_best_of_is_refused(
    vllm: RealFleet, request_log: RequestLog
) -> None:
    async with (
        narwhal_in_front(mixed_config(vllm)) as stack,
        httpx.AsyncClient(timeout=60) as client,
    ):
        whole = await client.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "n": 3},
        )
        streamed = await client.post(
            f"{stack.url}/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
                "n": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        plain = await client.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
        )
        best_of = await client.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "best_of": 1000},
        )
    assert whole.status_code == 200, whole.text
    document = whole.json()
    assert [c["index"] for c in document["choices"]] == [0, 1, 2]
    assert document["usage"]["completion_tokens"] == 15
    assert streamed.status_code == 200, streamed.text
    events = sse_payloads(streamed.content)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["index"] for chunk in chunks for c in chunk["choices"]} == {0, 1}
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    # n > 1 ran on the aggregate engine, n = 1 disaggregated as ever.
    assert finished(request_log)[:3] == [(None, "agg0"), (None, "agg0"), ("prefill", "decode")]
    # vLLM 0.32 ignores best_of (no V1 engine picks the best of several samples).
    assert plain.status_code == 200, plain.text
    assert best_of.status_code == 400
    error = error_of(best_of)
    assert error["param"] == "best_of"
    assert "best_of" in error["message"]


async def test_n_on_a_pair_alone_is_refused_before_any_prefill(vllm: RealFleet) -> None:
    # vLLM's NixlConnector hands over one sequence's KV: sent to the prefill engine, n > 1
    # leaves n - 1 children's blocks to expire there; sent only to the decode engine, its
    # n children all read the one producer request, which frees its blocks at the first
    # reader's notice. So a fleet of pairs refuses it.
    prefill, _ = vllm.pair
    prompt_tokens = await counter(prefill, "vllm:prompt_tokens_total")
    async with (
        narwhal_in_front(pair_config(vllm)) as stack,
        httpx.AsyncClient(timeout=60) as client,
    ):
        answer = await client.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "n": 2, "stream": True},
        )
    assert answer.status_code == 400, answer.text
    error = error_of(answer)
    assert error["param"] == "n"
    assert "role `both`" in error["message"]
    assert await counter(prefill, "vllm:prompt_tokens_total") == prompt_tokens


async def test_prompt_logprobs_run_on_one_engine(vllm: RealFleet, request_log: RequestLog) -> None:
    # The decode engine recomputes a prompt whose logprobs are asked for (vLLM skips the
    # KV it was handed): a prefill leg for it is work done twice.
    prefill, decode = vllm.pair
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "prompt_logprobs": 1}
    prompt_tokens = await counter(prefill, "vllm:prompt_tokens_total")
    local = await counter(decode, "vllm:prompt_tokens_by_source_total", source="local_compute")
    async with httpx.AsyncClient(timeout=60) as client:
        async with narwhal_in_front(pair_config(vllm)) as stack:
            alone = await client.post(f"{stack.url}/v1/completions", json=body)
        async with narwhal_in_front(mixed_config(vllm)) as stack:
            aggregate = await client.post(f"{stack.url}/v1/completions", json=body)
    for answer in (alone, aggregate):
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert choice["prompt_logprobs"][0] is None
        assert len(choice["prompt_logprobs"]) == answer.json()["usage"]["prompt_tokens"]
    # The pair's decode engine alone, then the aggregate engine; never a prefill leg.
    assert finished(request_log) == [(None, "decode"), (None, "agg0")]
    assert await counter(prefill, "vllm:prompt_tokens_total") == prompt_tokens
    computed = await counter(decode, "vllm:prompt_tokens_by_source_total", source="local_compute")
    assert computed - local == alone.json()["usage"]["prompt_tokens"]


# ------------------------------------------------------- 4. assembled non-streaming answers


def without_identity(document: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in document.items() if k not in ("id", "created")}


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        ("completions", {"prompt": PROMPT, "max_tokens": 6, "logprobs": 2}),
        (
            # Greedy sampling takes n = 1 only; a seed makes the samples repeatable.
            "completions",
            {
                "prompt": PROMPT,
                "max_tokens": 4,
                "n": 2,
                "temperature": 1.0,
                "seed": 7,
                "return_token_ids": True,
            },
        ),
        ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}),
        (
            "chat",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "logprobs": True,
                "top_logprobs": 2,
                "return_token_ids": True,
            },
        ),
    ],
)
async def test_an_assembled_answer_is_the_engines_own(
    vllm: RealFleet, kind: str, body: dict[str, Any]
) -> None:
    agg0 = vllm["agg0"]
    request = {"model": MODEL, "temperature": 0, **body}
    async with httpx.AsyncClient(timeout=60) as client:
        own = await client.post(f"{agg0.url}{PATHS[kind]}", json=request)
        config = real_config([engine_entry(agg0, "both")])
        async with narwhal_in_front(config) as stack:
            assembled = await client.post(f"{stack.url}{PATHS[kind]}", json=request)
    assert own.status_code == assembled.status_code == 200, assembled.text
    # Greedy (or seeded) on the same engine: the same answer, field for field and in
    # vLLM's order.
    expected = without_identity(own.json())
    got = without_identity(assembled.json())
    assert json.dumps(got) == json.dumps(expected)


# ------------------------------------------------------------ 5. status-line reasons


async def raw_status_line(url: str, request: bytes) -> bytes:
    parts = httpx.URL(url)
    stream = await trio.open_tcp_stream(parts.host, parts.port or 80)
    async with stream:
        await stream.send_all(request)
        received = b""
        with trio.fail_after(60):
            while b"\r\n" not in received:
                chunk = await stream.receive_some(4096)
                assert chunk, received
                received += chunk
    return received.split(b"\r\n", 1)[0]


def post_request(path: str, body: dict[str, Any]) -> bytes:
    payload = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nhost: narwhal\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n"
    ).encode() + payload


async def test_status_lines_carry_a_reason_phrase(vllm: RealFleet) -> None:
    completion = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    # vLLM's own, for reference.
    assert await raw_status_line(vllm["agg0"].url, post_request("/v1/completions", completion)) == (
        b"HTTP/1.1 200 OK"
    )
    async with narwhal_in_front(aggregate_config(vllm)) as stack:
        lines = [
            await raw_status_line(stack.url, post_request("/v1/completions", completion)),
            await raw_status_line(
                stack.url, post_request("/v1/completions", {**completion, "stream": True})
            ),
            await raw_status_line(
                stack.url, post_request("/v1/completions", {**completion, "logprobs": 21})
            ),
            await raw_status_line(
                stack.url, b"GET /nowhere HTTP/1.1\r\nhost: narwhal\r\nconnection: close\r\n\r\n"
            ),
            await raw_status_line(stack.url, b"BAD REQUEST LINE\r\n\r\n"),
        ]
    assert lines == [
        b"HTTP/1.1 200 OK",
        b"HTTP/1.1 200 OK",
        b"HTTP/1.1 400 Bad Request",
        b"HTTP/1.1 404 Not Found",
        b"HTTP/1.1 400 Bad Request",
    ]


# ------------------------------------------------------------- 6. /v1/models cards


async def test_narwhals_model_card_carries_the_engines_max_model_len(vllm: RealFleet) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        own = (await client.get(f"{vllm['agg0'].url}/v1/models")).json()["data"][0]
        async with narwhal_in_front(aggregate_config(vllm)) as stack:
            with trio.fail_after(30):
                while any(e.context_length is None for e in stack.ctx.fleet):  # noqa: ASYNC110
                    await trio.sleep(0.1)
            cards = (await client.get(f"{stack.url}/v1/models")).json()["data"]
    assert own["max_model_len"] == CONTEXT
    assert [(c["id"], c["max_model_len"]) for c in cards] == [(MODEL, CONTEXT)]


async def stream_chunks(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[Any]:
    async with client.stream("POST", f"{url}/v1/completions", json=body) as answer:
        assert answer.status_code == 200
        raw = b"".join([part async for part in answer.aiter_raw()])
    return sse_events(raw)


async def test_an_empty_stream_options_relays_what_the_engine_sends(vllm: RealFleet) -> None:
    # vLLM 0.32's include_usage defaults to false: no usage chunk from the engine, so none
    # through Narwhal either, which still asks for one for its own token accounting.
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 6, "stream": True}
    body["stream_options"] = {}
    async with (
        narwhal_in_front(aggregate_config(vllm)) as stack,
        httpx.AsyncClient(timeout=60) as client,
    ):
        direct = await stream_chunks(client, vllm.aggregate[0].url, body)
        relayed = await stream_chunks(client, stack.url, body)
        asked = await stream_chunks(
            client, stack.url, {**body, "stream_options": {"include_usage": True}}
        )
    assert all(chunk["choices"] for chunk in direct)
    assert all(chunk["choices"] for chunk in relayed)
    assert asked[-1]["choices"] == []
    assert asked[-1]["usage"]["completion_tokens"] == 6
