"""The tier's first question: does a request through Narwhal reach real vLLM and come back?"""

from __future__ import annotations

import httpx

from .conftest import MODEL, aggregate_config, narwhal_in_front, pair_config
from .engines import RealFleet


async def test_completion_through_an_aggregate_fleet(vllm: RealFleet) -> None:
    async with (
        narwhal_in_front(aggregate_config(vllm)) as stack,
        httpx.AsyncClient(timeout=60) as client,
    ):
        answer = await client.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": "def main():", "max_tokens": 8},
        )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["usage"]["completion_tokens"] == 8
    assert body["choices"][0]["finish_reason"] == "length"


async def test_completion_through_a_nixl_pair(vllm: RealFleet) -> None:
    async with (
        narwhal_in_front(pair_config(vllm)) as stack,
        httpx.AsyncClient(timeout=60) as client,
    ):
        answer = await client.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": "import os\nimport sys\n", "max_tokens": 4},
        )
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 4
