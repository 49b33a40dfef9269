"""engine.tokenizer_path against real vLLM: the router's own count of a prompt, from the
model's tokenizer.json and chat template, is what the engine charges (usage.prompt_tokens),
with no /tokenize asked."""

from __future__ import annotations

from functools import partial
from typing import Any

import httpx

from ..support import wait_for
from .conftest import MODEL, RealStack, RequestLog, aggregate_config, narwhal_in_front
from .engines import RealFleet

COMPLETIONS = [
    {"prompt": "def main():\n    print('héllo, wörld ✓')\n"},
    {"prompt": ["import os\nimport sys\n\n\nclass Tokenizer:\n"]},
    # Special-token text in a prompt is that token, as the engine's tokenizer reads it.
    {"prompt": "<|im_start|>user\nhi<|im_end|>\n", "add_special_tokens": False},
]
CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Write a function that adds two numbers."}]},
    {
        "messages": [
            {"role": "system", "content": "You answer in Python only."},
            {"role": "user", "content": "Sort a list\tof   tuples by their second item."},
            {"role": "assistant", "content": "sorted(items, key=lambda t: t[1])"},
            {"role": "user", "content": [{"type": "text", "text": "And in reverse?"}]},
        ]
    },
    {
        "messages": [{"role": "user", "content": "def f(x):\n    return x"}],
        "add_generation_prompt": False,
    },
]


async def charged(stack: RealStack, client: httpx.AsyncClient, path: str, body: Any) -> int:
    answer = await client.post(f"{stack.url}{path}", json={"model": MODEL, "max_tokens": 1, **body})
    assert answer.status_code == 200, answer.text
    prompt_tokens: int = answer.json()["usage"]["prompt_tokens"]
    return prompt_tokens


def counted(log: RequestLog) -> list[int]:
    """The prompt tokens of each request the router has logged as finished."""
    return [line["prompt_tokens"] for line in log.lines()]


def logged(log: RequestLog, requests: int) -> bool:
    return len(counted(log)) == requests


async def test_the_routers_own_count_is_what_vllm_charges(
    vllm: RealFleet, request_log: RequestLog
) -> None:
    document = aggregate_config(vllm, engine={"tokenizer_path": str(vllm.model)})
    async with narwhal_in_front(document) as stack, httpx.AsyncClient(timeout=60) as client:
        sent = 0
        for path, bodies in (("/v1/completions", COMPLETIONS), ("/v1/chat/completions", CHATS)):
            for body in bodies:
                engine_count = await charged(stack, client, path, body)
                sent += 1
                # The line is logged as the request leaves the router, just after the answer.
                await wait_for(partial(logged, request_log, sent), within_s=10)
                assert counted(request_log)[-1] == engine_count, (path, body)
        state = await stack.state()
    requests = state["requests"]
    assert requests["token_counts"] == {"local": len(COMPLETIONS) + len(CHATS)}
    assert requests["token_count_local_misses"] == {}
