"""Requests a vLLM pair cannot serve as asked: refused before any leg, or run on one engine.

- What the decode engine refuses though the prefill engine does not (the prefill leg
  drops `stream_options`, sets `stream: false` and `max_tokens: 1`): refused up front in
  vLLM's words, with no leg at all.
- `n > 1` runs on an aggregate engine; a fleet of pairs alone refuses it.
- `best_of` above n is refused (vLLM's V1 engine ignores it).
- `prompt_logprobs` run on one engine: an aggregate one, else the pair's decode engine
  alone, which computes the prompt either way.

The real engines' side of each is in tests/real/test_vllm_defects.py.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest

from .conftest import MODEL, Stack, StartStack

PROMPT = "the quick brown fox jumps over the lazy dog"
CHAT = {"messages": [{"role": "user", "content": PROMPT}]}


async def post(stack: Stack, body: dict[str, Any], path: str = "/v1/completions") -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(f"{stack.url}{path}", json={"model": MODEL, **body})


def legs(stack: Stack) -> list[int]:
    """Each engine's leg count, in config order."""
    return [sum(engine.state()["counters"]["requests"].values()) for engine in stack.fleet]


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        (
            "/v1/completions",
            {"prompt": PROMPT, "stream_options": {"include_usage": True}},
            "stream_options",
            "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "stream": False, "stream_options": {"include_usage": False}},
            "stream_options",
            "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
        ),
        (
            "/v1/completions",
            {"prompt": PROMPT, "max_tokens": 4, "min_tokens": 5, "stream": True},
            "min_tokens",
            "min_tokens must be less than or equal to max_tokens=4, got 5.",
        ),
        (
            # A completion's default bound of 16.
            "/v1/completions",
            {"prompt": PROMPT, "min_tokens": 17},
            "min_tokens",
            "min_tokens must be less than or equal to max_tokens=16, got 17.",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "max_completion_tokens": 2, "max_tokens": 9, "min_tokens": 3},
            "min_tokens",
            "min_tokens must be less than or equal to max_tokens=2, got 3.",
        ),
        (
            "/v1/completions",
            {"prompt": PROMPT, "prompt_logprobs": -1, "stream": True},
            "prompt_logprobs",
            "`prompt_logprobs` are not available when `stream=True`. (parameter=prompt_logprobs)",
        ),
    ],
)
async def test_what_the_decode_engine_would_refuse_is_refused_before_any_leg(
    start_stack: StartStack, path: str, body: dict[str, Any], param: str, message: str
) -> None:
    stack = await start_stack()
    response = await post(stack, body, path)
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": message,
        "type": "invalid_request_error",
        "param": param,
        "code": "invalid_request",
    }
    assert legs(stack) == [0, 0]


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": PROMPT, "stream_options": {"include_usage": True}, "stream": True},
        {"prompt": PROMPT, "max_tokens": 4, "min_tokens": 4},
    ],
)
async def test_what_both_legs_take_goes_on(start_stack: StartStack, body: dict[str, Any]) -> None:
    stack = await start_stack()
    response = await post(stack, body)
    assert response.status_code == 200, response.text
    assert legs(stack) == [1, 1]


def placed(caplog: pytest.LogCaptureFixture) -> list[tuple[str | None, str | None]]:
    """(prefill engine, decode engine) of each finished request."""
    return [
        (getattr(r, "prefill_engine", None), getattr(r, "decode_engine", None))
        for r in caplog.records
        if getattr(r, "event", None) == "request"
    ]


async def test_n_runs_on_an_aggregate_engine(
    start_stack: StartStack, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal")
    stack = await start_stack(["prefill", "decode", "both"])
    # (Whether the engine serves n is the engine's; this simulator build may not.)
    await post(stack, {"prompt": PROMPT, "max_tokens": 3, "n": 2})
    assert (await post(stack, {"prompt": PROMPT, "max_tokens": 3})).status_code == 200
    assert placed(caplog) == [(None, "b2"), ("p0", "d1")]


async def test_n_on_a_fleet_of_pairs_is_refused_before_any_leg(start_stack: StartStack) -> None:
    stack = await start_stack()
    response = await post(stack, {"prompt": PROMPT, "n": 3, "stream": True})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "n=3 is served only by an aggregate engine (role `both`), and the fleet "
        "has none: a prefill/decode pair hands over the KV of one sequence, not n",
        "type": "invalid_request_error",
        "param": "n",
        "code": "invalid_request",
    }
    assert legs(stack) == [0, 0]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"best_of": 1000},
            "'best_of' is not supported: best_of=1000 asks for the best 1 of 1000 sequences, "
            "and vLLM's V1 engine ignores best_of (it would return 1 sequence(s) and choose "
            "among none); ask for n=1000 and choose among them",
        ),
        ({"best_of": 0}, "'best_of' must be a positive integer, not 0"),
        ({"best_of": "2"}, "'best_of' must be a positive integer, not '2'"),
    ],
)
async def test_best_of_above_n_is_refused(
    start_stack: StartStack, body: dict[str, Any], message: str
) -> None:
    stack = await start_stack()
    response = await post(stack, {"prompt": PROMPT, **body})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "best_of"
    assert response.json()["error"]["message"] == message
    assert legs(stack) == [0, 0]
    # One that asks for no more than n goes on as sent.
    assert (await post(stack, {"prompt": PROMPT, "best_of": 1})).status_code == 200


@pytest.mark.parametrize("n", [0, -1, 1.5, "2", True])
async def test_n_must_be_a_positive_integer(start_stack: StartStack, n: object) -> None:
    stack = await start_stack()
    response = await post(stack, {"prompt": PROMPT, "n": n})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "n"
    assert response.json()["error"]["message"] == f"'n' must be a positive integer, not {n!r}"


async def test_prompt_logprobs_run_on_one_engine(
    start_stack: StartStack, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal")
    body = {"prompt": PROMPT, "max_tokens": 3, "prompt_logprobs": 1}
    pair = await start_stack()
    response = await post(pair, body)
    assert response.status_code == 200, response.text
    # The decode engine alone: it computes the prompt itself.
    assert legs(pair) == [0, 1]
    mixed = await start_stack(["prefill", "decode", "both"])
    assert (await post(mixed, body)).status_code == 200
    assert legs(mixed) == [0, 0, 1]
    assert placed(caplog) == [(None, "d1"), (None, "b2")]
