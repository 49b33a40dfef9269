"""A caching narwhal-sim engine publishing KV events, Narwhal in front: after a request
through Narwhal, /narwhal/state shows the engine holding the prompt's blocks, and a
restarted engine's index starts again."""

from __future__ import annotations

from functools import partial
from typing import Any

import httpx
import trio

from narwhal.config import load_config
from narwhal.prefix import block_hashes, external_hash
from narwhal.sim import Fleet, KvEventsConfig, SimEngineSpec, SimTiming, serve_fleet
from narwhal.supervisor import Supervisor

from ..serving.conftest import MODEL, Stack, fleet_config
from ..support import FakeFileLimit, free_port, wait_for

BS = 16
PROMPT = " ".join(f"word{i}" for i in range(200))
OTHER = " ".join(f"other{i}" for i in range(200))


async def caching_stack(nursery: trio.Nursery) -> Stack:
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # the engine connects: Narwhal binds
    events = KvEventsConfig(endpoint=endpoint, replay_endpoint="tcp://127.0.0.1:0", topic="kv")
    spec = SimEngineSpec(
        timing=SimTiming(block_size=BS, noise_sigma=0.0), prefix_caching=True, kv_events=events
    )
    fleet: Fleet = await nursery.start(
        partial(serve_fleet, engines=1, speed=50.0, model=MODEL, spec=spec)
    )
    document = fleet_config(fleet, ["both"])
    replay = fleet[0].state()["kv_events"]["replay_endpoint"]
    document["engines"][0]["kv_events"] = {
        "endpoint": endpoint,
        "replay_endpoint": replay,
        "topic": "kv",
    }
    config = load_config(document)
    supervisor: Supervisor = await nursery.start(
        Supervisor(config, open_files=FakeFileLimit().limit()).run
    )
    return Stack(fleet, supervisor, config)


async def complete(client: httpx.AsyncClient, prompt: str) -> None:
    r = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}
    )
    assert r.status_code == 200, r.text


async def heard(stack: Stack, client: httpx.AsyncClient) -> None:
    """Request until Narwhal hears the engine: a PUB drops what it sends before its
    connection is up (ZMQ's slow joiner), and a batch heard brings the earlier ones by
    the replay."""
    caches = stack.supervisor.caches
    assert caches is not None
    for i in range(100):
        await complete(client, f"warm up {i} " + "x " * 40)
        with trio.move_on_after(0.2):
            await caches.wait_seq("b0", 0)
            return
    raise AssertionError("narwhal never heard the engine")


async def chain(stack: Stack, prompt: str) -> list[int]:
    async with httpx.AsyncClient(base_url=stack.fleet[0].url) as client:
        tokens = (await client.post("/tokenize", json={"prompt": prompt})).json()["tokens"]
    return [external_hash(h) for h in block_hashes(tokens, BS)]


async def test_the_state_shows_the_engine_holding_a_routed_prompts_blocks(
    nursery: trio.Nursery,
) -> None:
    stack = await caching_stack(nursery)
    supervisor = stack.supervisor
    caches = supervisor.caches
    assert caches is not None
    want = await chain(stack, PROMPT)
    async with stack.client() as client:
        await complete(client, PROMPT)
        await heard(stack, client)
        await wait_for(lambda: caches.match("b0", want) == len(want), within_s=10)
        state: dict[str, Any] = (await stack.state())["caches"]
        engine = state["engines"]["b0"]
        assert engine["source"] == "events"
        assert engine["binds"] is True
        assert engine["blocks"] >= len(want)
        assert engine["resets"] == {}
        assert state["max_blocks_per_engine"] == 262_144
        metrics = await stack.metrics()
        assert f'narwhal_cache_blocks{{engine="b0"}} {float(engine["blocks"])}' in metrics

        await stack.fleet[0].restart()
        other = await chain(stack, OTHER)
        await complete(client, OTHER)
        await wait_for(lambda: caches.match("b0", other) == len(other), within_s=10)
        assert caches.match("b0", want) == 0
        resets = (await stack.state())["caches"]["engines"]["b0"]["resets"]
        # The new process's seq starts again at 0, or recovery saw the restart first.
        assert resets, resets
        assert set(resets) <= {"seq_back", "restart"}
