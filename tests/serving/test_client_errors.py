"""An engine refusing a request inside its stream is the client's error, not the engine's.

vLLM 0.32 answers a streamed request's validation error with 200, then
`data: {"error": {..., "code": 400}}` and `data: [DONE]`; the engines here answer so for a
request with `logprobs` above 20, as the real one does (tests/real/test_vllm_defects.py
checks it against vLLM itself).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import trio

from ..support import open_sse, sse_payloads
from .conftest import MODEL, Stack, StartStack

REFUSAL = {
    "message": "Requested sample logprobs of 21, which is greater than max allowed: 20 "
    "(parameter=logprobs, value=21)",
    "type": "BadRequestError",
    "param": "logprobs",
    "code": 400,
}
RETRYING = {"max_attempts": 3, "handoff_timeout_s": 5.0}
TOKEN = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 1,
    "model": MODEL,
    "choices": [{"index": 0, "text": " a", "logprobs": None, "finish_reason": None}],
}


def event(document: object) -> bytes:
    return b"data: " + json.dumps(document).encode() + b"\n\n"


def refusing(stack: Stack, *, after_tokens: int = 0, seen: trio.Event | None = None) -> None:
    """Every engine answers a streamed request with `logprobs: 21` as vLLM 0.32 does:
    200, (`after_tokens` token events, and once `seen` is set,) an error event with code
    400, [DONE]."""
    for handle in stack.fleet:
        routes = handle.engine._routes
        serve = routes[("POST", "/v1/completions")]

        async def completions(req: Any, resp: Any, serve: Any = serve) -> None:
            body = req.json()
            if body.get("logprobs") != 21 or not body.get("stream"):
                await serve(req, resp)
                return
            await resp.start_stream(200)
            for _ in range(after_tokens):
                await resp.send_chunk(event(TOKEN))
            if seen is not None:
                await seen.wait()
            await resp.send_chunk(event({"error": REFUSAL}))
            await resp.end_stream(b"data: [DONE]\n\n")

        routes[("POST", "/v1/completions")] = completions


async def post(client: httpx.AsyncClient, stack: Stack, **body: Any) -> httpx.Response:
    return await client.post(
        f"{stack.url}/v1/completions",
        json={"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 3, **body},
    )


def counted(stack: Stack) -> float:
    samples = stack.ctx.metrics.registry.get_sample_value
    return sum(
        samples("narwhal_counted_failures_total", {"engine": e, "phase": phase}) or 0.0
        for e in ("b0", "b1")
        for phase in ("prefill", "decode")
    )


async def test_a_refusal_in_the_stream_is_an_http_error_never_retried_nor_counted(
    start_stack: StartStack,
) -> None:
    stack = await start_stack(["both", "both"], serving=RETRYING)
    refusing(stack)
    async with httpx.AsyncClient(timeout=30) as client:
        # Enough to open both engines' breakers (5 counted failures each in 30 s).
        answers = [await post(client, stack, logprobs=21, stream=i % 2 == 0) for i in range(16)]
        good = await post(client, stack)
        state = await stack.state()
    assert good.status_code == 200, good.text
    for answer in answers:
        assert answer.status_code == 400
        assert answer.headers["content-type"] == "application/json"
        # In the engine's words, without naming the engine (serving.expose_engine_details).
        assert answer.json()["error"] == {
            "message": f"aggregate engine returned 400 in its stream: {REFUSAL['message']}",
            "type": "invalid_request_error",
            "param": "logprobs",
            "code": "engine_rejected_request",
        }
    # One leg each, nothing counted against an engine.
    assert stack.ctx.metrics.retries.labels("engine_rejected_request")._value.get() == 0
    assert counted(stack) == 0
    for engine in ("b0", "b1"):
        breakers = state["recovery"]["engines"][engine]["breakers"]
        assert {b["state"] for b in breakers.values()} == {"closed"}
        assert {b["failures_in_window"] for b in breakers.values()} == {0}


async def test_a_refusal_after_output_ends_the_stream_with_its_status(
    start_stack: StartStack,
) -> None:
    stack = await start_stack(["both"], serving=RETRYING)
    seen = trio.Event()
    refusing(stack, after_tokens=2, seen=seen)
    body = {"model": MODEL, "prompt": "the quick brown fox", "logprobs": 21, "stream": True}
    async with open_sse(stack.url, "/v1/completions", body) as reader:
        events = [await reader.event(), await reader.event()]
        seen.set()  # the client has the tokens: now the engine refuses
        while (payload := await reader.event()) is not None:
            events.append(payload)
        assert reader.status == 200
    assert [json.loads(e) for e in events[:2] if e is not None] == [TOKEN, TOKEN]
    assert "[DONE]" not in events
    assert len(events) == 3
    assert events[-1] is not None
    assert json.loads(events[-1]) == {
        "error": {
            "message": f"aggregate engine returned 400 in its stream: {REFUSAL['message']}",
            "type": "invalid_request_error",
            "param": "logprobs",
            "code": "engine_rejected_request",
            "status": 400,
        }
    }
    assert counted(stack) == 0


async def test_an_engine_failure_before_output_is_still_a_terminal_event(
    start_stack: StartStack,
) -> None:
    # Only a client's error replaces a committed stream's 200; an engine's own failure
    # (its 500 inside the stream) is the terminal event it was, carrying its status.
    stack = await start_stack(["both"])
    stack.fleet[0].set_faults(sse_error_after_tokens=0)
    async with httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, stack, stream=True)
    assert answer.status_code == 200
    (error,) = [json.loads(e)["error"] for e in sse_payloads(answer.content)]
    assert (error["code"], error["status"]) == ("engine_stream_error", 502)
