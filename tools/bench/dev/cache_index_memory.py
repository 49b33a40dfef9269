"""The memory and the cost of the per-engine cache indexes, at the sizes the bound allows.

    .venv/bin/python tools/bench/dev/cache_index_memory.py [--sizes 100000,262144,1000000]

For each size N (262144: cache.max_blocks_per_engine's default): the bytes
tracemalloc sees retained by a `BlockIndex` (the exact index, fed by KV events)
holding N blocks, and by a `PromptIndex` (the approximate one, learnt from routed
prompts) holding N text blocks; each filled to N, then again after N more blocks went
through the bound (what a long-running index holds: the dict keeps room
for what it dropped). Then, untraced, the cost of `match` on a 64-block prompt every
block of which is held (the longest walk), of `PromptIndex.learn` of such a prompt, of
`prompt_key` on a 32k-char prompt, and of its `block_chain` (vLLM's sha256 chain) at 16
and 128 tokens per block. No sockets. Writes runs/bench/cache-index-memory.json.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
import tracemalloc
from collections.abc import Callable, Sized
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchkit, one folder up
from benchkit import RUNS, Json, write_json
from benchkit._facts import git_revision, load_average, machine

from narwhal.prefix import (
    TEXT_BLOCK_CHARS,
    BlockIndex,
    BlockStored,
    PromptIndex,
    PromptKey,
    prompt_key,
)

CHAIN = 64  # blocks per prompt: 8k tokens at vLLM's 128, 16k chars of text blocks
PER_EVENT = 64  # hashes per BlockStored, as a prefill of CHAIN blocks stores them


def stored(hashes: list[int]) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=[],
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def text_key(chain: tuple[int, ...]) -> PromptKey:
    """A key with a given text chain, as `prompt_key` makes one from CHAIN blocks of text."""
    chars = len(chain) * TEXT_BLOCK_CHARS
    return PromptKey(chars=chars, tokens=chars // 4, text_chain=chain, token_ids=None)


def hashes(rng: random.Random, n: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(n)]


def fill_blocks(index: BlockIndex, rng: random.Random, n: int, seq: int) -> int:
    for _ in range(0, n, PER_EVENT):
        index.apply(seq, [stored(hashes(rng, PER_EVENT))])
        seq += 1
    return seq


def fill_prompts(index: PromptIndex, rng: random.Random, n: int, now: float) -> float:
    for _ in range(0, n, CHAIN):
        index.learn(text_key(tuple(hashes(rng, CHAIN))), now)
        now += 0.001
    return now


def traced(build: Callable[[], Sized], n: int) -> int:
    """The bytes still allocated for what `build` returns (holding `n` blocks)."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    built = build()
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert len(built) == n, (len(built), n)
    return held


def footprint(build: Callable[[int], Sized], n: int) -> dict[str, Json]:
    """`build(through)` makes an index bounded at n and feeds it `through` blocks."""
    filled = traced(lambda: build(n), n)
    churned = traced(lambda: build(2 * n), n)
    return {
        "blocks": n,
        "filled_bytes": filled,
        "filled_bytes_per_block": round(filled / n, 1),
        "churned_bytes": churned,
        "churned_bytes_per_block": round(churned / n, 1),
    }


def memory(n: int) -> dict[str, Json]:
    rng = random.Random(n)

    def blocks(through: int) -> BlockIndex:
        index = BlockIndex(n)
        fill_blocks(index, rng, through, 0)
        return index

    def prompts(through: int) -> PromptIndex:
        index = PromptIndex(n, 300.0)
        fill_prompts(index, rng, through, 0.0)
        return index

    return {"block_index": footprint(blocks, n), "prompt_index": footprint(prompts, n)}


def per_call_us(call: Callable[[], object], reps: int) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            call()
        best = min(best, (time.perf_counter() - start) / reps)
    return round(best * 1e6, 2)


def costs(n: int) -> dict[str, Json]:
    rng = random.Random(7)
    block_index = BlockIndex(n)
    fill_blocks(block_index, rng, n - CHAIN, 0)
    chain = hashes(rng, CHAIN)
    block_index.apply(n, [stored(chain)])
    assert block_index.match(chain) == CHAIN
    prompt_index = PromptIndex(n, 300.0)
    now = fill_prompts(prompt_index, rng, n - CHAIN, 0.0)
    key = text_key(tuple(hashes(rng, CHAIN)))
    prompt_index.learn(key, now)
    assert prompt_index.match(key, now) == CHAIN * TEXT_BLOCK_CHARS

    # 32k chars of text and the ~8k token ids a tokenizer would make of them.
    text = " ".join(f"w{rng.getrandbits(20)}" for _ in range(4000))[:32_768]
    ids = [rng.getrandbits(15) for _ in range(8192)]

    def fresh_chain(size: int) -> Callable[[], object]:
        return lambda: prompt_key(text, len(ids), ids).block_chain(size)

    learn_now = [now]

    def learn() -> None:
        learn_now[0] += 0.001
        prompt_index.learn(key, learn_now[0])

    return {
        "index_blocks": n,
        "chain_blocks": CHAIN,
        "block_index_match_us": per_call_us(lambda: block_index.match(chain), 2000),
        "prompt_index_match_us": per_call_us(lambda: prompt_index.match(key, now), 2000),
        "prompt_index_learn_us": per_call_us(learn, 2000),
        "prompt_key_32k_chars_us": per_call_us(lambda: prompt_key(text, len(ids)), 500),
        "prompt_key_32k_chars_8k_ids_us": per_call_us(lambda: prompt_key(text, len(ids), ids), 200),
        "block_chain_8k_ids_size_16_us": per_call_us(fresh_chain(16), 5),
        "block_chain_8k_ids_size_128_us": per_call_us(fresh_chain(128), 20),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="100000,262144,1000000", help="index sizes in blocks")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict[str, Json] = {}
    for n in sizes:
        results[str(n)] = {"memory": memory(n), "cost": costs(n)}
        print(n, results[str(n)], flush=True)
    out = RUNS / "cache-index-memory.json"
    write_json(
        out,
        {
            "benchmark": "cache-index-memory",
            "machine": machine(),
            "git": git_revision(),
            "load_average": load_average(),
            "config": {"sizes": sizes, "chain_blocks": CHAIN, "hashes_per_event": PER_EVENT},
            "results": results,
        },
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
