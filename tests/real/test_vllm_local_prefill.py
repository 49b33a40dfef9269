"""Local prefill on a real NixlConnector pair (docs/design.md#prefix-caching): after a
handoff the decode engine holds the prompt's KV in its prefix cache, so the next turn of
the conversation, which extends it, is sent to the decode engine alone and prefilled
there mostly from cache; the prefill engine never sees it."""

from __future__ import annotations

import uuid

from .conftest import narwhal_in_front, pair_config
from .engines import RealFleet
from .test_vllm_roles import complete, prompt_tokens_by_source


def conversation() -> str:
    tag = uuid.uuid4().hex[:8]  # a prefix no earlier test cached
    return "".join(
        f"def handler_{tag}_{i}(request):\n    return reply(request, {i})\n" for i in range(48)
    )


async def test_the_next_turn_is_prefilled_on_the_decode_engine_from_its_cache(
    vllm: RealFleet,
) -> None:
    prefill, decode = vllm.pair
    first = conversation()
    document = pair_config(vllm, cache={"local_prefill_share": 0.8})
    async with narwhal_in_front(document) as stack:
        handed = await prompt_tokens_by_source(decode)
        tokens = await complete(stack, first)
        after_handoff = await prompt_tokens_by_source(decode)
        assert after_handoff["external_kv_transfer"] - handed["external_kv_transfer"] == tokens

        before_p, before_d = (
            await prompt_tokens_by_source(prefill),
            await prompt_tokens_by_source(decode),
        )
        longer = await complete(stack, first + "def tail(request):\n    return None\n")
        after_p, after_d = (
            await prompt_tokens_by_source(prefill),
            await prompt_tokens_by_source(decode),
        )
        metrics = stack.ctx.metrics.registry
        skipped = metrics.get_sample_value("narwhal_local_prefills_total", {"engine": "decode"})
    assert skipped == 1
    assert after_p == before_p  # no prefill leg
    gained = {source: after_d[source] - before_d[source] for source in after_d}
    assert gained["external_kv_transfer"] == 0
    assert sum(gained.values()) == longer
    # Every full 128-token block of the first turn came from the decode engine's cache.
    assert gained["local_cache_hit"] >= tokens // 128 * 128 > 0, gained
