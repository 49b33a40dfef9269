"""The context check follows the rule of the engine build it talks to, never refuses what
an available engine would serve, and never names a field the client did not send.

The rules themselves are checked against real vLLM 0.32 in tests/real/test_vllm_context.py;
here they are pure functions, and the stack tests pin the older rule (see `OLDER_VLLM`).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from narwhal.config import Config, EngineSpec
from narwhal.engines import SGLANG, VLLM, Dialect
from narwhal.fleet import EngineState
from narwhal.serving import context_rule, output_bound
from narwhal.serving._context_check import check_context, context_refusal

from ..support import wait_for
from .conftest import MODEL, Stack, StartStack
from .test_failures import PROMPT, post, settled, sse_events, tokenize
from .test_request_parsing import chat_request, request

# The build the stack tests below ask the simulator to play: it reports vLLM 0.29.0 on
# /version and refuses prompt + max_tokens over its context as vLLM did before 0.32.
OLDER_VLLM = "0.29.0"


@pytest.mark.parametrize(
    ("dialect", "version", "rule"),
    [
        (VLLM, "0.32.0", "prompt"),
        (VLLM, "0.32.1rc1.dev93+g8e2a469b3", "prompt"),
        (VLLM, "1.0.0", "prompt"),
        (VLLM, "0.31.2", "total"),
        (VLLM, "0.29.0", "total"),
        (VLLM, "0.9.2", "total"),
        # Not known: the rule that refuses less; the engine refuses what it must itself.
        (VLLM, None, "prompt"),
        (VLLM, "main", "prompt"),
        (SGLANG, "0.5.9", "total"),
        (SGLANG, None, "total"),
    ],
)
def test_the_rule_is_the_builds(dialect: Dialect, version: str | None, rule: str) -> None:
    assert context_rule(dialect, version) == rule


def test_vllm_0_32_serves_output_past_the_context_capped() -> None:
    for served in (request(max_tokens=500), request(), request(max_tokens=None)):
        assert context_refusal(served, 8000, 8192, VLLM, "prompt") is None
        assert context_refusal(served, 8191, 8192, VLLM, "prompt") is None
    assert context_refusal(request(max_tokens=8192), 10, 8192, VLLM, "prompt") is None
    assert context_refusal(chat_request(max_tokens=8000), 8000, 8192, VLLM, "prompt") is None


def test_vllm_0_32_refuses_in_its_words_and_order() -> None:
    # Its output bound above the context (checked before the prompt, as vLLM does).
    for key, req in (
        ("max_tokens", request(max_tokens=8193)),
        ("max_completion_tokens", chat_request(max_completion_tokens=8193, max_tokens=10)),
        ("max_tokens", chat_request(max_completion_tokens=None, max_tokens=8193)),
    ):
        refusal = context_refusal(req, 9000, 8192, VLLM, "prompt")
        assert refusal is not None
        assert (refusal.status, refusal.code, refusal.param) == (
            400,
            "context_length_exceeded",
            key,
        )
        assert refusal.message == (
            f"{key}=8193 cannot be greater than max_model_len=8192. Please request fewer "
            f"output tokens. (parameter={key}, value=8193)"
        )
    long = context_refusal(request(max_tokens=1), 9000, 8192, VLLM, "prompt")
    assert long is not None
    assert (long.code, long.param) == ("context_length_exceeded", "input_tokens")
    assert long.message == (
        "This model's maximum context length is 8192 tokens. However, your prompt contains "
        "9000 input tokens, which exceeds this limit even without any output tokens. Please "
        "reduce the length of the input prompt. (parameter=input_tokens, value=9000)"
    )


def test_a_refusal_never_names_a_field_the_client_did_not_send() -> None:
    # A prompt that fills the context leaves no room for a token: vLLM 0.32 answers
    # "max_tokens must be at least 1, got 0" naming max_tokens, sent or not.
    for req in (request(), request(max_tokens=5), chat_request()):
        full = context_refusal(req, 8192, 8192, VLLM, "prompt")
        assert full is not None
        assert full.param == "input_tokens"
        assert "which leaves no room for an output token" in full.message
    # A completion's default of 16 over a tiny context: the engine's to refuse.
    assert context_refusal(request(), 2, 8, VLLM, "prompt") is None
    # The older rule counts that default, and names the prompt, not the unsent field.
    for dialect in (VLLM, SGLANG):
        refusal = context_refusal(request(), 8177, 8192, dialect, "total")
        assert refusal is not None
        assert (refusal.code, refusal.param) == ("context_length_exceeded", "input_tokens")
    refusal = context_refusal(request(), 8177, 8192, VLLM, "total")
    assert refusal is not None
    assert refusal.message == (
        "This model's maximum context length is 8192 tokens. However, your request has 8177 "
        "input tokens and a completion's default of 16 output tokens (8177 + 16 > 8192). "
        "Please reduce the length of the input prompt, or set max_tokens to at most 15."
    )


@pytest.mark.parametrize("dialect", [VLLM, SGLANG])
def test_the_older_rule_refuses_the_total(dialect: Dialect) -> None:
    # A prompt that fills the context, or output past it; a total equal to it passes
    # (older SGLang builds refused that too: the engine says so itself).
    assert context_refusal(request(max_tokens=100), 8092, 8192, dialect, "total") is None
    assert context_refusal(request(max_tokens=None), 8191, 8192, dialect, "total") is None
    assert context_refusal(request(), 8176, 8192, dialect, "total") is None
    output = context_refusal(request(max_tokens=101), 8092, 8192, dialect, "total")
    assert output is not None
    assert (output.status, output.code, output.param) == (
        400,
        "context_length_exceeded",
        "max_tokens",
    )
    prompt = context_refusal(request(max_tokens=1), 8192, 8192, dialect, "total")
    assert prompt is not None
    assert (prompt.code, prompt.param) == ("context_length_exceeded", "input_tokens")


def test_the_older_rule_speaks_each_engines_words() -> None:
    chat = chat_request(max_completion_tokens=200)
    vllm, sglang = (context_refusal(chat, 8000, 8192, d, "total") for d in (VLLM, SGLANG))
    assert vllm is not None
    assert sglang is not None
    assert vllm.param == sglang.param == "max_completion_tokens"
    assert vllm.message == (
        "'max_completion_tokens' is too large: 200. This model's maximum context length is "
        "8192 tokens and your request has 8000 input tokens (200 > 8192 - 8000)."
    )
    assert sglang.message == (
        "Requested token count exceeds the model's maximum context length of 8192 tokens. "
        "You requested a total of 8200 tokens: 8000 tokens from the input messages and 200 "
        "tokens for the completion. Please reduce the number of tokens in the input messages "
        "or the completion to fit within the limit."
    )
    long = (context_refusal(chat, 9000, 8192, d, "total") for d in (VLLM, SGLANG))
    assert [e.message for e in long if e is not None] == [
        "This model's maximum context length is 8192 tokens. However, your request has 9000 "
        "input tokens. Please reduce the length of the input messages.",
        "The input (9000 tokens) is longer than the model's context length (8192 tokens).",
    ]
    # A completion's max_completion_tokens bounds nothing (`_max_tokens`).
    both = request(max_completion_tokens=500, max_tokens=10)
    assert context_refusal(both, 8000, 8192, VLLM, "total") is None


def engine(engine_id: str, version: str | None, context: int | None) -> EngineState:
    spec = EngineSpec(id=engine_id, url="http://127.0.0.1:9", role="both")
    state = EngineState(spec, Config(engines=(spec,)))
    state.version = version
    state.set_context(context, "test")
    return state


async def test_the_fleet_refuses_only_what_no_available_engine_would_serve() -> None:
    old, new = engine("old", "0.29.0", 8192), engine("new", "0.32.0", 8192)
    unknown = engine("unknown", None, 8192)
    over = request(max_tokens=500)  # 8000 + 500 > 8192
    result, refusal = check_context(over, 8000, [old])
    assert result == "refused"
    assert refusal is not None
    assert refusal.param == "max_tokens"
    # A mixed fleet: the 0.32 engine serves it, so it is not refused.
    assert check_context(over, 8000, [old, new]) == ("passed", None)
    assert check_context(over, 8000, [unknown]) == ("passed", None)
    # A wider engine of the older build serves it too.
    wider = engine("wider", "0.29.0", 16384)
    assert check_context(over, 8000, [old, wider]) == ("passed", None)
    # Every engine refuses: the widest one's words, the more lenient rule first.
    result, refusal = check_context(request(max_tokens=1), 9000, [old, new])
    assert result == "refused"
    assert refusal is not None
    assert "which exceeds this limit even without any output tokens" in refusal.message
    wide = engine("wide", "0.29", 16384)
    result, refusal = check_context(request(max_tokens=1), 20000, [new, wide])
    assert refusal is not None
    assert "maximum context length is 16384 tokens" in refusal.message
    # Nothing to check against: the engine refuses itself.
    blind = engine("blind", "0.32.0", None)
    assert check_context(over, 9000, [blind]) == ("unknown", None)
    for state in (old, new, unknown, wide, wider, blind):
        await state.aclose()


def test_pricing_bounds_the_output_by_the_room_the_prompt_leaves() -> None:
    assert output_bound(500, 8000, 8192) == 192
    assert output_bound(100, 8000, 8192) == 100
    assert output_bound(500, 9000, 8192) == 0
    # No bound set stays unbounded (the context bounds it; demand prices its expectation).
    assert output_bound(None, 8000, 8192) is None
    # Without a context or an exact count, the request's own bound.
    assert output_bound(500, 8000, None) == 500
    assert output_bound(500, None, 8192) == 500


# -- through the router, on the simulator as an older vLLM build ------------------------


async def older_build(stack: Stack) -> Stack:
    """`stack` once its engines' versions are known, which must be `OLDER_VLLM`."""
    await wait_for(lambda: all(e.version is not None for e in stack.ctx.fleet))
    versions = {e.version for e in stack.ctx.fleet}
    assert versions == {OLDER_VLLM}, f"these tests assume a vLLM {OLDER_VLLM} simulator"
    return stack


@pytest.mark.parametrize("stream", [True, False])
async def test_output_past_the_context_is_refused_before_any_leg(
    start_stack: StartStack, stream: bool
) -> None:
    # The prefill leg asks for one token, so only the decode engine would see the overflow:
    # after the prefill's work, and for a stream after the 200, as an error event.
    stack = await older_build(await start_stack(sim={"vllm_version": OLDER_VLLM}))
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
    for handle in stack.fleet:
        assert sum(handle.state()["counters"]["requests"].values()) == 0
    state = await settled(stack)
    assert state["slo"]["counts"] == {"met": 0, "missed": 0, "refused": 0, "unmeasured": 0}
    fits = await post(stack, {"max_tokens": 8192 - count, "stream": stream})
    assert fits.status_code == 200


async def test_a_chat_prompt_past_the_context_is_refused_with_the_field_it_used(
    start_stack: StartStack,
) -> None:
    stack = await older_build(await start_stack(sim={"vllm_version": OLDER_VLLM}))
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
    stack = await older_build(await start_stack(sim={"vllm_version": OLDER_VLLM}))

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
    for handle in stack.fleet:
        assert sum(handle.state()["counters"]["requests"].values()) == 0
    state = await settled(stack)
    assert state["slo"]["counts"] == {"met": 0, "missed": 0, "refused": 0, "unmeasured": 0}
    assert state["requests"]["context_checks"] == {"refused": 2}
    context: dict[str, Any] = {
        "length": 8192,
        "note": "GET /v1/models max_model_len",
        "rule": "total",
        "version": OLDER_VLLM,
    }
    assert [e["context"] for e in state["engines"]] == [context] * 2
    fits = await post(stack, {"prompt": ids(8000), "max_tokens": 192, "stream": stream})
    assert fits.status_code == 200


@pytest.mark.parametrize("stream", [True, False])
async def test_a_completion_without_max_tokens_is_checked_with_the_engines_default(
    start_stack: StartStack, stream: bool
) -> None:
    # The older builds generate at most 16 tokens for it, and check prompt plus 16 against
    # the context. Taken as unbounded, it went to the prefill engine and the decode engine
    # refused it: a 400 after the prefill's work or, for a stream, an error event after
    # the 200. The refusal names the prompt: the client sent no max_tokens.
    stack = await older_build(await start_stack(sim={"vllm_version": OLDER_VLLM}))
    response = await post(stack, {"prompt": [5] * 8177, "stream": stream})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "input_tokens")
    assert error["message"] == (
        "This model's maximum context length is 8192 tokens. However, your request has 8177 "
        "input tokens and a completion's default of 16 output tokens (8177 + 16 > 8192). "
        "Please reduce the length of the input prompt, or set max_tokens to at most 15."
    )
    for handle in stack.fleet:
        assert sum(handle.state()["counters"]["requests"].values()) == 0
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
    stack = await older_build(await start_stack(sim={"vllm_version": OLDER_VLLM}))
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
    stack = await older_build(await start_stack(sim={"vllm_version": OLDER_VLLM}))
    for state in stack.ctx.fleet:
        # As recovery records an engine whose /v1/models card has no max_model_len.
        state.set_context(None, "its /v1/models card for 'm' has no positive max_model_len")
    response = await post(stack, {"prompt": [5] * 8000, "max_tokens": 500})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "engine_rejected_request"
    result = await settled(stack)
    assert result["requests"]["context_checks"] == {"unknown": 1}
