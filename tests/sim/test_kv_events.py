"""A caching simulated vLLM engine over HTTP: cached_tokens in usage, and its KV events
read off ZMQ by a subscriber, as a router would read a real engine's."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import httpx
import pytest
import trio
import zmq

from narwhal.prefix import (
    END_SEQ,
    AllBlocksCleared,
    BlockStored,
    EventBatch,
    block_hashes,
    decode_batch,
    decode_seq,
    encode_seq,
    external_hash,
)
from narwhal.sim import Fleet, KvEventsConfig, SimEngineSpec, SimTiming

from ..support import StartFleet

BS = 16
TIMING = SimTiming(block_size=BS, noise_sigma=0.0)
PROMPT = " ".join(f"word{i}" for i in range(200))  # ~400 tokens: many full blocks
Frames = list[bytes]


@contextmanager
def zmq_socket(kind: int) -> Iterator[zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        yield sock
    finally:
        trio.lowlevel.notify_closing(int(sock.getsockopt(zmq.FD)))
        sock.close(linger=0)
        ctx.term()


@contextmanager
def subscriber() -> Iterator[tuple[zmq.Socket[bytes], int]]:
    """A SUB socket bound to a free local port, which the engine's PUB connects to."""
    with zmq_socket(zmq.SUB) as sub:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        yield sub, sub.bind_to_random_port("tcp://127.0.0.1")


async def recv(sock: zmq.Socket[bytes], timeout_s: float = 10.0) -> Frames:
    with trio.fail_after(timeout_s):
        while not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            await trio.lowlevel.wait_readable(int(sock.getsockopt(zmq.FD)))
        return sock.recv_multipart(zmq.NOBLOCK)


async def complete(client: httpx.AsyncClient, url: str, prompt: str) -> dict[str, Any]:
    r = await client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def subscribed(client: httpx.AsyncClient, url: str, sub: zmq.Socket[bytes]) -> None:
    """Publish until the subscriber hears a batch: a PUB drops what it sends before the
    subscription reaches it (ZMQ's slow joiner), a real engine's as much as this one's."""
    for i in range(100):
        await complete(client, url, f"warm up {i} " + "x " * 40)
        with trio.move_on_after(0.2):
            await recv(sub)
            return
    raise AssertionError("the subscriber never heard the engine")


async def replay(endpoint: str, first: int) -> list[tuple[int, bytes]]:
    with zmq_socket(zmq.DEALER) as dealer:
        dealer.connect(endpoint)
        dealer.send_multipart((b"", encode_seq(first)))
        out: list[tuple[int, bytes]] = []
        while True:
            _, _topic, seq, payload = await recv(dealer)
            if seq == END_SEQ:
                return out
            out.append((decode_seq(seq), payload))


async def caching_fleet(start_fleet: StartFleet, sub_port: int, **spec: Any) -> Fleet:
    events = KvEventsConfig(
        endpoint=f"tcp://127.0.0.1:{sub_port}", replay_endpoint="tcp://127.0.0.1:0", topic="kv"
    )
    return await start_fleet(
        engines=1,
        speed=50.0,
        spec=SimEngineSpec(timing=TIMING, prefix_caching=True, kv_events=events, **spec),
    )


async def test_block_stored_carries_vllms_hashes_of_the_prompt(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    with subscriber() as (sub, port):
        fleet = await caching_fleet(start_fleet, port)
        url = fleet[0].url
        await subscribed(client, url, sub)
        tokens = (await client.post(f"{url}/tokenize", json={"prompt": PROMPT})).json()["tokens"]
        await complete(client, url, PROMPT)
        want = [external_hash(h) for h in block_hashes(tokens, BS)]
        stored: list[BlockStored] = []
        seqs: list[int] = []
        while sum(len(e.block_hashes) for e in stored) < len(want):
            topic, seq, payload = await recv(sub)
            assert topic == b"kv"
            seqs.append(decode_seq(seq))
            batch = decode_batch(payload)
            assert batch.data_parallel_rank == 0
            stored += [e for e in batch.events if isinstance(e, BlockStored)]
        # Chunks of one prompt chain on: each event's parent is the last block before it.
        assert [h for e in stored for h in e.block_hashes] == want
        assert stored[0].parent_block_hash is None
        assert [e.parent_block_hash for e in stored[1:]] == [
            e.block_hashes[-1] for e in stored[:-1]
        ]
        assert [t for e in stored for t in e.token_ids] == tokens[: len(want) * BS]
        assert {e.block_size for e in stored} == {BS}
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        # The replay socket resends every batch from the one asked for.
        replayed = await replay(fleet[0].state()["kv_events"]["replay_endpoint"], 0)
        assert [seq for seq, _ in replayed] == list(range(seqs[-1] + 1))
        assert all(isinstance(decode_batch(p), EventBatch) for _, p in replayed)


async def test_restart_empties_the_cache_and_counts_again_from_zero(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    with subscriber() as (_sub, port):
        fleet = await caching_fleet(start_fleet, port, prompt_tokens_details=True)
        engine = fleet[0]
        first = await complete(client, engine.url, PROMPT)
        again = await complete(client, engine.url, PROMPT)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        hit = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert hit == (first["usage"]["prompt_tokens"] - 1) // BS * BS
        endpoint = engine.state()["kv_events"]["replay_endpoint"]
        assert [seq for seq, _ in await replay(endpoint, 0)] == [0]
        await engine.restart()
        # A new instance: nothing cached, and its batches count from 0 on the same sockets.
        assert engine.state()["kv_events"]["replay_endpoint"] == endpoint
        cold = await complete(client, engine.url, PROMPT)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert [seq for seq, _ in await replay(endpoint, 0)] == [0]


async def test_reset_prefix_cache_clears_all_blocks(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    with subscriber() as (sub, port):
        fleet = await caching_fleet(start_fleet, port)
        url = fleet[0].url
        await subscribed(client, url, sub)
        r = await client.post(f"{url}/reset_prefix_cache")
        assert r.json() == {"success": True}
        while True:
            _, _, payload = await recv(sub)
            if decode_batch(payload).events == [AllBlocksCleared()]:
                break
        assert fleet[0].state()["prefix_cache"]["cached_blocks"] == 0


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [False, True])
async def test_cached_tokens_only_with_prompt_tokens_details(
    start_fleet: StartFleet, client: httpx.AsyncClient, chat: bool, stream: bool
) -> None:
    fleet = await start_fleet(
        engines=2,
        speed=50.0,
        spec=SimEngineSpec(timing=TIMING, prefix_caching=True),
    )
    # Engine 1 reports details; engine 0 is the same engine without the flag.
    plain, detailed = fleet[0], fleet[1]
    detailed.engine.spec = attrs.evolve(detailed.engine.spec, prompt_tokens_details=True)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"max_tokens": 2, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    if stream:
        body["stream_options"] = {"include_usage": True}

    async def usage(url: str) -> dict[str, Any]:
        r = await client.post(f"{url}{path}", json=body)
        assert r.status_code == 200
        if not stream:
            found: dict[str, Any] = r.json()["usage"]
            return found
        chunks = [line[6:] for line in r.text.splitlines() if line.startswith("data: {")]
        last: dict[str, Any] = httpx.Response(200, content=chunks[-1]).json()["usage"]
        return last

    for engine in (plain, detailed):
        await usage(engine.url)
    off = await usage(plain.url)
    on = await usage(detailed.url)
    assert off.get("prompt_tokens_details") is None
    cached = (on["prompt_tokens"] - 1) // BS * BS
    if chat:
        want = {"cached_tokens": cached, "created_cache_tokens": 0, "multimodal_tokens": None}
    elif stream:
        want = {"cached_tokens": cached}
    else:
        want = {"cached_tokens": cached, "created_cache_tokens": None, "multimodal_tokens": None}
    assert on["prompt_tokens_details"] == want


async def test_metrics_count_prefix_cache_queries_and_hits(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(
        engines=1, speed=50.0, spec=SimEngineSpec(timing=TIMING, prefix_caching=True)
    )
    url = fleet[0].url
    first = await complete(client, url, PROMPT)
    await complete(client, url, PROMPT)
    n = first["usage"]["prompt_tokens"]
    text = (await client.get(f"{url}/metrics")).text
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prefix_cache_")
    }
    assert values == {
        "vllm:prefix_cache_queries_total": 2 * n,
        "vllm:prefix_cache_hits_total": (n - 1) // BS * BS,
    }
    assert 'enable_prefix_caching="True"' in text
