"""Role changes on a real NixlConnector pair: what they need from the engines.

vLLM 0.32 deprecates `kv_role: kv_both` for NixlConnector (vllm#43807) in favour of
explicit `kv_producer` / `kv_consumer` roles, but each request's `kv_transfer_params` still
decides which side an engine plays. The tier's pair is launched `kv_both`, the launch a
fleet needs when Narwhal's controller may flip its engines' roles.
"""

from __future__ import annotations

import re
import urllib.request

import httpx
import pytest

from narwhal.ctl import CtlError, CtlRequest
from narwhal.supervisor._operations import Operations

from .conftest import MODEL, RealStack, narwhal_in_front, pair_config
from .engines import Engine, RealFleet

_SOURCE = re.compile(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="([a-z_]+)"[^}]*\} (\S+)$')


def prompt_tokens_by_source(engine: Engine) -> dict[str, float]:
    with urllib.request.urlopen(engine.url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = {}
    for line in text.splitlines():
        if match := _SOURCE.match(line):
            found[match[1]] = float(match[2])
    assert found, "vllm:prompt_tokens_by_source_total missing from /metrics"
    return found


async def complete(stack: RealStack, prompt: str) -> int:
    async with httpx.AsyncClient(timeout=60) as client:
        answer = await client.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 4},
        )
    assert answer.status_code == 200, answer.text
    prompt_tokens: int = answer.json()["usage"]["prompt_tokens"]
    return prompt_tokens


async def test_a_kv_both_pair_serves_handoffs_in_either_direction(vllm: RealFleet) -> None:
    prefill, decode = vllm.pair
    async with narwhal_in_front(pair_config(vllm)) as stack:
        operations = Operations(stack.supervisor)
        # A distinct prompt per direction, so prefix caching cannot stand in for the
        # transfer on the receiving engine.
        before = prompt_tokens_by_source(decode)
        tokens = await complete(stack, "def forward(self, x):\n    return x\n" * 6)
        after = prompt_tokens_by_source(decode)
        assert after["external_kv_transfer"] - before["external_kv_transfer"] == tokens
        assert after["local_compute"] == before["local_compute"]

        await operations(CtlRequest("pin", prefill.name, "decode"))
        await operations(CtlRequest("pin", decode.name, "prefill"))
        try:
            before = prompt_tokens_by_source(prefill)
            tokens = await complete(stack, "class Reader(io.RawIOBase):\n    pass\n" * 6)
            after = prompt_tokens_by_source(prefill)
        finally:
            await operations(CtlRequest("pin", prefill.name, "prefill"))
            await operations(CtlRequest("pin", decode.name, "decode"))
        # The engine launched as the pair's producer now decoded from transferred KV.
        assert after["external_kv_transfer"] - before["external_kv_transfer"] == tokens
        assert after["local_compute"] == before["local_compute"]


async def test_explicit_kv_roles_fix_the_engines_roles(vllm: RealFleet) -> None:
    document = pair_config(vllm)
    document["engines"][0]["kv_role"] = "kv_producer"
    document["engines"][1]["kv_role"] = "kv_consumer"
    async with narwhal_in_front(document) as stack:
        prefill = stack.ctx.fleet.get(vllm.pair[0].name)
        assert prefill is not None
        assert prefill.fixed_role is not None
        with pytest.raises(CtlError) as refused:
            await Operations(stack.supervisor)(CtlRequest("pin", prefill.id, "decode"))
        assert refused.value.code == "role_fixed"
        assert "kv_role 'kv_producer'" in refused.value.message
        assert prefill.role == "prefill"
        # Requests still flow as configured.
        await complete(stack, "for line in sys.stdin:\n    print(line)\n" * 4)
