"""Each engine fault and each deadline gives the manual's outcome (4.2, 4.3, 6).

Timings here are behaviour, not performance: a deadline must fire near its configured
value. The bounds are generous (the box is shared) but would catch a timer that is not
armed or armed at the wrong place.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from narwhal._errors import EngineFailed
from narwhal.engines import ConnectError
from narwhal.fleet import EngineState

from ..support import wait_for
from .conftest import MODEL, Stack, StartStack

PROMPT = "the quick brown fox jumps over the lazy dog"


async def post(stack: Stack, body: dict[str, Any], **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(
            f"{stack.url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, **body}, **kw
        )


def sse_events(response: httpx.Response) -> list[str]:
    text = response.text
    assert text.endswith("\n\n"), text[-200:]
    return [block.removeprefix("data: ") for block in text[:-2].split("\n\n")]


def terminal_error(response: httpx.Response) -> dict[str, Any]:
    """A failed stream: 200, then an error event as the last event, and no [DONE]."""
    assert response.status_code == 200
    events = sse_events(response)
    assert "[DONE]" not in events
    last = json.loads(events[-1])
    assert set(last) == {"error"}
    error: dict[str, Any] = last["error"]
    return error


def phases(stack: Stack, index: int, outcome: str) -> list[str]:
    return [o["phase"] for o in stack.fleet[index].state()["outcomes"] if o["outcome"] == outcome]


async def settled(stack: Stack) -> dict[str, Any]:
    """Router state once every request has left (nothing retained, nothing leaked)."""
    await wait_for(lambda: stack.ctx.retained == 0)
    state = await stack.state()
    assert state["admission"]["admitted"] == 0
    for engine in state["engines"]:
        assert engine["prefill"]["inflight"] == 0, engine
        assert engine["decode"]["active"] == 0, engine
        assert engine["decode"]["pending"] == engine["decode"]["pending_tokens"] == 0, engine
        assert engine["prefill"]["queued_tokens"] == 0, engine
        assert engine["handoffs_pending"] == 0, engine
        assert engine["pools"]["serving"]["in_use"] == 0, engine
    return state


@pytest.mark.parametrize(
    ("status", "client_status", "code"),
    [(503, 503, "engine_http_503"), (429, 429, "engine_http_429"), (500, 502, "engine_http_500")],
)
async def test_prefill_engine_errors_are_mapped_not_passed_through(
    start_stack: StartStack, status: int, client_status: int, code: str
) -> None:
    stack = await start_stack()
    stack.fleet[0].set_faults(error_status=status, leg="prefill")
    response = await post(stack, {"max_tokens": 3, "stream": True})
    assert response.status_code == client_status
    error = response.json()["error"]
    assert error["code"] == code
    assert error["message"].startswith(f"prefill engine p0 returned HTTP {status}: ")
    assert stack.fleet[1].state()["counters"]["requests"]["decode"] == 0
    await settled(stack)


@pytest.mark.parametrize("timeout_s", [None, 1.5])
async def test_a_connect_failure_reaches_recovery_with_its_deadline(
    start_stack: StartStack, monkeypatch: pytest.MonkeyPatch, timeout_s: float | None
) -> None:
    # A connect that ran out engine.connect_timeout_s carries the deadline, so recovery
    # can set it aside when the router's own loop lag explains it; a refusal carries none.
    stack = await start_stack()
    prefill = stack.ctx.fleet.get("p0")
    assert prefill is not None

    async def cannot_connect() -> object:
        raise ConnectError("connect to 127.0.0.1:9 did not work", timeout_s=timeout_s)

    monkeypatch.setattr(prefill.serving_pool, "_checkout", cannot_connect)
    seen: list[EngineFailed] = []
    observer = stack.ctx.leg_observer
    original = observer.leg_failed

    def leg_failed(engine: EngineState, phase: str, failure: EngineFailed) -> None:
        seen.append(failure)
        original(engine, phase, failure)

    monkeypatch.setattr(observer, "leg_failed", leg_failed)
    response = await post(stack, {"max_tokens": 3})
    assert response.json()["error"]["code"] == "engine_unreachable"
    assert [(f.engine_id, f.code, f.deadline_s) for f in seen] == [
        ("p0", "engine_unreachable", timeout_s)
    ]


async def test_client_errors_from_the_engine_keep_their_status(start_stack: StartStack) -> None:
    # Without /tokenize's context length the engine is the one to say it.
    stack = await start_stack(engine={"tokenize": False})
    response = await post(stack, {"max_tokens": 10_000})  # beyond the sim's max_model_len
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "engine_rejected_request"
    assert "cannot be greater than max_model_len=8192" in error["message"]


@pytest.mark.parametrize("stream", [True, False])
async def test_output_past_the_context_is_refused_before_any_leg(
    start_stack: StartStack, stream: bool
) -> None:
    # The prefill leg asks for one token, so only the decode engine would see the overflow:
    # after the prefill's work, and for a stream after the 200, as an error event.
    stack = await start_stack()
    response = await post(stack, {"max_tokens": 8190, "stream": stream})  # 8192 in the sim
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "max_tokens"
    count = (await tokenize(stack))["count"]
    assert error["message"] == (
        f"'max_tokens' is too large: 8190. This model's maximum context length is 8192 "
        f"tokens and your request has {count} input tokens (8190 > 8192 - {count})."
    )
    for engine in stack.fleet:
        assert sum(engine.state()["counters"]["requests"].values()) == 0
    state = await settled(stack)
    assert state["slo"]["counts"] == {"met": 0, "missed": 0, "refused": 0, "unmeasured": 0}
    fits = await post(stack, {"max_tokens": 8192 - count, "stream": stream})
    assert fits.status_code == 200


async def test_a_chat_prompt_past_the_context_is_refused_with_the_field_it_used(
    start_stack: StartStack,
) -> None:
    stack = await start_stack()
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(
            f"{stack.url}/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": PROMPT}],
                "max_completion_tokens": 9000,
            },
        )
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["code"], error["param"]) == (
            "context_length_exceeded",
            "max_completion_tokens",
        )
        # A null max_completion_tokens bounds nothing: the field that does is max_tokens.
        response = await client.post(
            f"{stack.url}/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": PROMPT}],
                "max_completion_tokens": None,
                "max_tokens": 9000,
            },
        )
        assert response.json()["error"]["param"] == "max_tokens"
        long_text = {"model": MODEL, "prompt": "fox " * 10_000, "max_tokens": 1}
        response = await client.post(f"{stack.url}/v1/completions", json=long_text)
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", "input_tokens")
        assert error["message"].startswith("This model's maximum context length is 8192 tokens.")
    await settled(stack)


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("batch", [False, True])
async def test_a_token_id_prompt_past_the_context_is_refused_before_any_leg(
    start_stack: StartStack, stream: bool, batch: bool
) -> None:
    # Token ids are counted as sent, without /tokenize: the check needs the context length
    # from the engines' /v1/models cards. Without it the decode engine said it, after the
    # prefill's work and, for a stream, after the 200.
    stack = await start_stack()

    def ids(count: int) -> list[int] | list[list[int]]:
        return [[5] * count] if batch else [5] * count

    response = await post(stack, {"prompt": ids(8000), "max_tokens": 500, "stream": stream})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "max_tokens")
    assert error["message"] == (
        "'max_tokens' is too large: 500. This model's maximum context length is 8192 tokens "
        "and your request has 8000 input tokens (500 > 8192 - 8000)."
    )
    response = await post(stack, {"prompt": ids(8192), "max_tokens": 1, "stream": stream})
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "input_tokens")
    for engine in stack.fleet:
        assert sum(engine.state()["counters"]["requests"].values()) == 0
    state = await settled(stack)
    assert state["slo"]["counts"] == {"met": 0, "missed": 0, "refused": 0, "unmeasured": 0}
    assert state["requests"]["context_checks"] == {"refused": 2}
    assert [e["context"] for e in state["engines"]] == [
        {"length": 8192, "note": "GET /v1/models max_model_len"}
    ] * 2
    fits = await post(stack, {"prompt": ids(8000), "max_tokens": 192, "stream": stream})
    assert fits.status_code == 200


@pytest.mark.parametrize("stream", [True, False])
async def test_a_completion_without_max_tokens_is_checked_with_the_engines_default(
    start_stack: StartStack, stream: bool
) -> None:
    # The engines generate at most 16 tokens for it, and check prompt plus 16 against the
    # context. Taken as unbounded, it went to the prefill engine and the decode engine
    # refused it: a 400 after the prefill's work or, for a stream, an error event after
    # the 200.
    stack = await start_stack()
    response = await post(stack, {"prompt": [5] * 8177, "stream": stream})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "max_tokens")
    assert error["message"] == (
        "'max_tokens' is too large: 16. This model's maximum context length is 8192 tokens "
        "and your request has 8177 input tokens (16 > 8192 - 8177)."
    )
    for engine in stack.fleet:
        assert sum(engine.state()["counters"]["requests"].values()) == 0
    fits = await post(stack, {"prompt": [5] * 8176, "stream": stream})
    assert fits.status_code == 200
    state = await settled(stack)
    assert state["requests"]["context_checks"] == {"passed": 1, "refused": 1}


@pytest.mark.parametrize("stream", [True, False])
async def test_a_prompt_vllm_truncates_is_checked_at_the_length_it_runs(
    start_stack: StartStack, stream: bool
) -> None:
    # vLLM keeps the last truncate_prompt_tokens tokens before its own checks. Counted
    # whole, these prompts were refused with 400 context_length_exceeded (and priced at
    # a length the engine never runs).
    stack = await start_stack()
    usage = {"stream_options": {"include_usage": True}} if stream else {}
    for prompt in ([5] * 9000, "fox " * 10_000):
        body = {"prompt": prompt, "truncate_prompt_tokens": 1000, "max_tokens": 8, **usage}
        response = await post(stack, {**body, "stream": stream})
        assert response.status_code == 200, response.text
        answer = json.loads(sse_events(response)[-2]) if stream else response.json()
        assert answer["usage"]["prompt_tokens"] == 1000
    # -1 keeps max_model_len tokens, which leaves no room for output: refused up front.
    response = await post(stack, {"prompt": [5] * 9000, "truncate_prompt_tokens": -1})
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "input_tokens")
    assert "your request has 8192 input tokens" in error["message"]
    state = await settled(stack)
    assert state["requests"]["context_checks"] == {"passed": 2, "refused": 1}


async def test_without_a_context_length_the_engine_refuses_as_before(
    start_stack: StartStack,
) -> None:
    # Pinned to vLLM 0.29, which refuses prompt + max_tokens over the context (0.32
    # serves it with the output capped).
    stack = await start_stack(sim={"vllm_version": "0.29.0"})
    for engine in stack.ctx.fleet:
        # As recovery records an engine whose /v1/models card has no max_model_len.
        engine.set_context(None, "its /v1/models card for 'm' has no positive max_model_len")
    response = await post(stack, {"prompt": [5] * 8000, "max_tokens": 500})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "engine_rejected_request"
    state = await settled(stack)
    assert state["requests"]["context_checks"] == {"unknown": 1}


async def tokenize(stack: Stack) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(
            f"{stack.fleet[0].url}/tokenize", json={"model": MODEL, "prompt": PROMPT}
        )
    answer: dict[str, Any] = response.json()
    return answer


async def test_decode_failure_after_commit_is_a_terminal_error_event(
    start_stack: StartStack,
) -> None:
    stack = await start_stack()
    stack.fleet[1].set_faults(error_status=500, leg="decode")
    response = await post(stack, {"max_tokens": 3, "stream": True})
    error = terminal_error(response)
    assert error["code"] == "engine_http_500"
    assert sse_events(response) == [sse_events(response)[-1]]  # nothing but the error
    await settled(stack)


async def test_non_streaming_decode_failure_is_an_http_error(start_stack: StartStack) -> None:
    stack = await start_stack()
    stack.fleet[1].set_faults(error_status=503, leg="decode")
    response = await post(stack, {"max_tokens": 3})
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "engine_http_503"


async def test_crash_mid_stream(start_stack: StartStack) -> None:
    stack = await start_stack()
    stack.fleet[1].set_faults(crash_after_tokens=3, leg="decode")
    response = await post(stack, {"max_tokens": 20, "stream": True})
    error = terminal_error(response)
    assert error["code"] == "engine_connection_lost"
    assert len(sse_events(response)) >= 2  # tokens were relayed before the crash
    await settled(stack)


async def test_engine_error_event_inside_the_stream_ends_it(start_stack: StartStack) -> None:
    stack = await start_stack()
    stack.fleet[1].set_faults(sse_error_after_tokens=2, leg="decode")
    response = await post(stack, {"max_tokens": 20, "stream": True})
    error = terminal_error(response)
    assert error["code"] == "engine_stream_error"
    assert "mid-stream" in error["message"]
    # The engine's own error event and its [DONE] are not relayed.
    assert sum('"error"' in event for event in sse_events(response)) == 1


async def test_prefill_engine_down(start_stack: StartStack) -> None:
    stack = await start_stack()
    await stack.fleet[0].go_down()
    response = await post(stack, {"max_tokens": 3})
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "engine_unreachable"
    assert "connection refused" in error["message"]


async def test_expired_kv_lease_fails_the_decode(start_stack: StartStack) -> None:
    stack = await start_stack(sim={"lease_s": 0.0001}, speed=1.0)
    response = await post(stack, {"max_tokens": 3})
    assert response.status_code == 502
    # The non-streaming request's decode leg streams: vLLM reports the KV load failure
    # as an error event.
    assert response.json()["error"]["code"] == "engine_stream_error"
    assert stack.fleet[0].state()["counters"]["kv_expired"] >= 1


async def test_request_deadline_mid_stream_emits_expired(start_stack: StartStack) -> None:
    stack = await start_stack(serving={"request_timeout_s": 0.5})
    stack.fleet[1].set_faults(stall_after_tokens=2, leg="decode")
    started = trio.current_time()
    response = await post(stack, {"max_tokens": 20, "stream": True})
    elapsed = trio.current_time() - started
    error = terminal_error(response)
    assert error["code"] == "expired"
    assert error["type"] == "timeout_error"
    assert 0.5 <= elapsed < 1.5
    await wait_for(lambda: phases(stack, 1, "aborted") == ["decode"])
    await settled(stack)


async def test_request_deadline_before_output_is_504(start_stack: StartStack) -> None:
    stack = await start_stack(serving={"request_timeout_s": 0.4})
    stack.fleet[0].set_faults(stall_before_first_token_s=5, leg="prefill")
    started = trio.current_time()
    response = await post(stack, {"max_tokens": 3})
    elapsed = trio.current_time() - started
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "expired"
    assert 0.4 <= elapsed < 1.4
    await wait_for(lambda: phases(stack, 0, "aborted") == ["prefill"])


class Deadlines:
    """Records which deadline each failed leg tells recovery about (`deadline_s`: recovery
    sets a deadline aside when the router's own event loop lag explains it)."""

    def __init__(self, stack: Stack) -> None:
        ctx = stack.supervisor.ctx
        assert ctx is not None
        self.inner = ctx.leg_observer
        self.seen: list[tuple[str | None, float | None]] = []
        ctx.leg_observer = self

    def leg_ok(self, engine: EngineState, phase: str, duration_s: float, **kw: Any) -> None:
        self.inner.leg_ok(engine, phase, duration_s, **kw)

    def leg_failed(self, engine: EngineState, phase: str, failure: EngineFailed) -> None:
        self.seen.append((failure.code, failure.deadline_s))
        self.inner.leg_failed(engine, phase, failure)


async def test_prefill_timeout(start_stack: StartStack) -> None:
    stack = await start_stack(serving={"prefill_timeout_s": 0.3})
    stack.fleet[0].set_faults(stall_before_first_token_s=5, leg="prefill")
    deadlines = Deadlines(stack)
    started = trio.current_time()
    response = await post(stack, {"max_tokens": 3, "stream": True})
    elapsed = trio.current_time() - started
    assert response.status_code == 504
    error = response.json()["error"]
    assert error["code"] == "prefill_timeout"
    assert "serving.prefill_timeout_s=0.3" in error["message"]
    assert 0.3 <= elapsed < 1.3
    assert ("prefill_timeout", 0.3) in deadlines.seen
    await wait_for(lambda: phases(stack, 0, "aborted") == ["prefill"])


async def test_first_token_timeout(start_stack: StartStack) -> None:
    stack = await start_stack(engine={"first_token_timeout_s": 0.3})
    stack.fleet[1].set_faults(stall_before_first_token_s=5, leg="decode")
    deadlines = Deadlines(stack)
    started = trio.current_time()
    response = await post(stack, {"max_tokens": 3, "stream": True})
    elapsed = trio.current_time() - started
    error = terminal_error(response)
    assert error["code"] == "first_token_timeout"
    assert "engine.first_token_timeout_s=0.3" in error["message"]
    assert 0.3 <= elapsed < 1.3
    # What the decode leg waited for its first token: the whole budget, give or take.
    ((code, waited),) = deadlines.seen
    assert code == "first_token_timeout"
    assert waited is not None
    assert 0.3 <= waited < 1.3
    await wait_for(lambda: phases(stack, 1, "aborted") == ["decode"])
    await settled(stack)


async def test_decode_gap_timeout(start_stack: StartStack) -> None:
    stack = await start_stack(engine={"decode_read_timeout_s": 0.3})
    stack.fleet[1].set_faults(stall_after_tokens=2, leg="decode")
    deadlines = Deadlines(stack)
    response = await post(stack, {"max_tokens": 20, "stream": True})
    error = terminal_error(response)
    assert error["code"] == "decode_stalled"
    assert len(sse_events(response)) >= 2
    assert deadlines.seen == [("decode_stalled", 0.3)]


async def test_zero_gap_timeout_leaves_the_request_deadline_in_charge(
    start_stack: StartStack,
) -> None:
    stack = await start_stack(
        engine={"decode_read_timeout_s": 0}, serving={"request_timeout_s": 0.6}
    )
    stack.fleet[1].set_faults(stall_after_tokens=2, leg="decode")
    response = await post(stack, {"max_tokens": 20, "stream": True})
    assert terminal_error(response)["code"] == "expired"
