"""Requests a vLLM pair cannot serve as asked: refused before any leg.

- What the decode engine refuses though the prefill engine does not (the prefill leg
  drops `stream_options`, sets `stream: false` and `max_tokens: 1`): refused up front in
  vLLM's words, with no leg at all.

The real engines' side of each is in tests/real/test_vllm_defects.py.
"""

from __future__ import annotations

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
