"""What real vLLM on CPU says about its prefix cache, which cache-aware serving builds on:
its KV cache events carry the block hashes `narwhal.prefix` computes from the prompt's
token ids, at the block size it reports, and a repeated prompt is served from the cache
(its hits counted in /metrics)."""

from __future__ import annotations

import re

import httpx
import zmq

from narwhal.prefix import END_SEQ, BlockStored, block_hashes, decode_batch, external_hash

from .conftest import MODEL
from .engines import RealFleet, kv_events_config, sample

# Longer than two of vLLM CPU's 128-token blocks in the tier's tokenizer.
PROMPT = "".join(
    f"def handler_{i}(request):\n    return respond(request, {i})\n" for i in range(40)
)


def replayed(endpoint: str) -> list[BlockStored]:
    """Every BlockStored the engine still buffers, through its replay socket."""
    socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    stored: list[BlockStored] = []
    try:
        socket.send_multipart([b"", (0).to_bytes(8, "big")])
        for _ in range(10_000):  # bounded: the engine ends the replay with END_SEQ
            assert socket.poll(10_000), "the engine's replay socket did not answer in 10 s"
            frames = socket.recv_multipart()
            if frames[-2] == END_SEQ:
                return stored
            batch = decode_batch(frames[-1])
            stored += [event for event in batch.events if isinstance(event, BlockStored)]
        raise AssertionError("the replay did not end")
    finally:
        socket.close()


def test_kv_events_carry_narwhals_block_hashes_and_a_repeat_hits_the_cache(
    vllm: RealFleet,
) -> None:
    engine = vllm["agg1"]
    events = kv_events_config(engine)
    assert events is not None
    with httpx.Client(base_url=engine.url, timeout=120) as client:
        ids = client.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()["tokens"]
        info = re.search(r'vllm:cache_config_info\{[^}]*block_size="(\d+)"', engine.metrics())
        assert info is not None
        block_size = int(info.group(1))
        assert len(ids) > 2 * block_size
        hits_before = sample(engine.metrics(), "vllm:prefix_cache_hits_total")
        for _ in range(2):
            answer = client.post(
                "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
            )
            assert answer.status_code == 200, answer.text
    full = len(ids) // block_size * block_size
    # The second request's full blocks all came from the cache.
    assert sample(engine.metrics(), "vllm:prefix_cache_hits_total") - hits_before >= full
    ours = [event for event in replayed(events["replay_endpoint"]) if event.token_ids == ids[:full]]
    assert ours, "no BlockStored event for the prompt's blocks"
    event = ours[-1]
    assert event.block_size == block_size
    assert event.parent_block_hash is None  # the prompt's first block starts the chain
    assert event.block_hashes == [external_hash(h) for h in block_hashes(ids, block_size)]
