"""Narwhal's cache index against real vLLM on CPU: agg1 publishes its KV cache events on
an endpoint it binds (`tcp://*:PORT`, vLLM's default form), so Narwhal connects to it
at agg1's host; after a request through Narwhal, /narwhal/state shows agg1 holding the
prompt's blocks, and `match` on the prompt's chain (computed by `narwhal.prefix` from
/tokenize's ids) finds all of its full blocks."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
import trio

from narwhal.caches import EngineCaches
from narwhal.prefix import block_hashes, external_hash, prompt_key

from .conftest import MODEL, engine_entry, narwhal_in_front, real_config
from .engines import RealFleet, kv_events_config

# Longer than two of vLLM CPU's 128-token blocks in the tier's tokenizer.
PROMPT = "".join(f"def cached_{i}(request):\n    return answer(request, {i})\n" for i in range(40))


async def test_narwhal_indexes_the_blocks_agg1_reports_for_a_routed_prompt(
    vllm: RealFleet,
) -> None:
    engine = vllm["agg1"]
    events = kv_events_config(engine)
    assert events is not None
    # The engine binds its PUB: Narwhal connects to it.
    assert events["endpoint"].startswith("tcp://*:")
    entry = engine_entry(
        engine,
        "both",
        kv_events={k: events[k] for k in ("endpoint", "replay_endpoint", "topic")},
    )
    document = real_config([entry], profiles={"path": str(vllm.directory / "no-profiles.json")})
    ids = await client_ids(engine.url, PROMPT)
    info = re.search(r'vllm:cache_config_info\{[^}]*block_size="(\d+)"', engine.metrics())
    assert info is not None
    block_size = int(info.group(1))
    chain = [external_hash(h) for h in block_hashes(ids, block_size)]
    assert len(chain) >= 2
    async with narwhal_in_front(document) as stack, stack.client() as client:
        caches = stack.supervisor.caches
        assert caches is not None
        client.timeout = httpx.Timeout(120)
        body: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
        answer = await client.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        await until_agg1_holds(caches, client, chain)
        state = (await stack.state())["caches"]["engines"]["agg1"]
        assert state["source"] == "events"
        assert state["binds"] is False
        assert state["blocks"] >= len(chain)
        assert state["problem"] is None


async def test_a_prompt_extending_one_agg1_cached_is_placed_there_by_its_events(
    vllm: RealFleet, caplog: pytest.LogCaptureFixture
) -> None:
    # Exact pricing: the router has the prompt's token ids (engine.tokenizer_path), agg1's
    # events say which of its blocks it holds, and agg0 (no events) has seen nothing.
    caplog.set_level(logging.INFO, logger="narwhal.request")
    agg0, agg1 = vllm["agg0"], vllm["agg1"]
    events = kv_events_config(agg1)
    assert events is not None
    entries = [
        engine_entry(agg0, "both"),
        engine_entry(
            agg1, "both", kv_events={k: events[k] for k in ("endpoint", "replay_endpoint", "topic")}
        ),
    ]
    document = real_config(
        entries,
        engine={"tokenizer_path": str(vllm.model)},
        profiles={"path": str(vllm.directory / "no-profiles.json")},
    )
    prompt = "".join(
        f"def placed_{i}(request):\n    return answer(request, {i})\n" for i in range(40)
    )
    async with narwhal_in_front(document) as stack, stack.client() as client:
        caches = stack.supervisor.caches
        assert caches is not None
        client.timeout = httpx.Timeout(120)
        first = stack.ctx.fleet.get("agg0")
        assert first is not None
        first.operator_drain()
        body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        chain = prompt_key(prompt, 0, await client_ids(agg1.url, prompt)).block_chain(128)
        await until_agg1_holds(caches, client, chain)
        first.operator_undrain()
        # Both idle: by load the tie would go to agg0; agg1's cached blocks win.
        longer = {**body, "prompt": prompt + "def tail():\n    pass\n"}
        answer = await client.post("/v1/completions", json=longer)
        assert answer.status_code == 200, answer.text
        metrics = stack.ctx.metrics.registry
        cached = metrics.get_sample_value("narwhal_cached_prompt_tokens_total", {"engine": "agg1"})
        records = (await stack.state())["caches"]["engines"]
    assert cached is not None, "agg1 did not run the prefill"
    assert cached >= 128
    assert records["agg1"]["source"] == "events"
    assert records["agg0"]["source"] == "approximate"
    # agg1 found in its cache exactly the blocks its events told Narwhal it held.
    line = [r.__dict__ for r in caplog.records if r.__dict__.get("event") == "request"][-1]
    assert line["decode_engine"] == "agg1"
    assert line["engine_cached_tokens"] == line["cached_tokens"] == cached


async def client_ids(url: str, prompt: str) -> list[int]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as direct:
        answer = await direct.post("/tokenize", json={"model": MODEL, "prompt": prompt})
    ids: list[int] = answer.json()["tokens"]
    return ids


async def until_agg1_holds(
    caches: EngineCaches, client: httpx.AsyncClient, chain: Sequence[int]
) -> None:
    """Until agg1's index holds every block of `chain`. A SUB hears only what is
    published after it connected: a batch heard after that (a request's) brings the
    earlier ones by the replay socket. vLLM publishes a batch only when a block fills,
    so each warm-up prompt is new and longer than a block (a short one, as in CI once,
    publishes nothing and the first batch, lost to a slow subscription, never comes)."""
    assert chain
    with trio.fail_after(60):
        for i in range(60):
            if caches.match("agg1", chain) == len(chain):
                break
            lines = "".join(f"warm up {i}, line {j}: nothing cached yet\n" for j in range(40))
            warm = {"model": MODEL, "prompt": lines, "max_tokens": 1}
            assert (await client.post("/v1/completions", json=warm)).status_code == 200
            with trio.move_on_after(1.0):
                await caches.wait_seq("agg1", 0)
    assert caches.match("agg1", chain) == len(chain)
