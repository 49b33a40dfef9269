"""The simulated engine's prefix cache: hits, LRU eviction, pricing, and its events."""

from __future__ import annotations

import attrs
import pytest

from narwhal.prefix import BlockRemoved, BlockStored, block_hashes, external_hash
from narwhal.sim import CoreRequest, KvEventsConfig, SchedulerCore, SimEngineSpec, SimTiming

BS = 16
QUIET = SimTiming(noise_sigma=0.0, block_size=BS)


def ids(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def run_to_first_token(core: SchedulerCore, req: CoreRequest) -> float:
    """Add `req` to an idle core and step until it samples; the model seconds it took."""
    core.add(req)
    elapsed = 0.0
    while not req.generated:
        plan = core.schedule()
        elapsed += plan.duration_s
        core.complete(plan)
    return elapsed


def finish(core: SchedulerCore) -> None:
    while core.has_work():
        core.complete(core.schedule())


def caching_core(timing: SimTiming = QUIET, *, events: bool = False) -> SchedulerCore:
    return SchedulerCore(timing, prefix_caching=True, kv_events=events)


def test_a_repeated_prompt_skips_its_cached_blocks() -> None:
    core = caching_core()
    prompt = ids(1000)
    first = CoreRequest(rid="a", prompt_tokens=1000, max_tokens=1, token_ids=prompt)
    cold = run_to_first_token(core, first)
    second = CoreRequest(rid="b", prompt_tokens=1000, max_tokens=1, token_ids=prompt)
    warm = run_to_first_token(core, second)
    assert first.cached_tokens == 0
    # Every full block but the one holding the last token (vLLM recomputes it).
    assert second.cached_tokens == (999 // BS) * BS == 992
    # Priced on the uncached tokens only: one chunk [992, 1000) over the cached prefix.
    assert warm == pytest.approx(QUIET.step_s(QUIET.chunk_cost_s(992, 1000), 0, 0))
    assert cold == pytest.approx(QUIET.prefill_s(1000))
    assert core.pool.hits == 992
    assert core.pool.queries == 2000


def test_a_prompt_that_extends_a_cached_one_hits_its_prefix() -> None:
    core = caching_core()
    turn1 = ids(300)
    run_to_first_token(core, CoreRequest(rid="a", prompt_tokens=300, max_tokens=1, token_ids=turn1))
    turn2 = turn1 + ids(200, start=50_000)
    req = CoreRequest(rid="b", prompt_tokens=500, max_tokens=1, token_ids=turn2)
    run_to_first_token(core, req)
    assert req.cached_tokens == (300 // BS) * BS
    # A prompt that differs in its first block shares nothing.
    other = CoreRequest(rid="c", prompt_tokens=300, max_tokens=1, token_ids=[7, *turn1[1:]])
    run_to_first_token(core, other)
    assert other.cached_tokens == 0


def test_without_caching_nothing_is_shared() -> None:
    core = SchedulerCore(QUIET)
    prompt = ids(1000)
    run_to_first_token(
        core, CoreRequest(rid="a", prompt_tokens=1000, max_tokens=1, token_ids=prompt)
    )
    req = CoreRequest(rid="b", prompt_tokens=1000, max_tokens=1, token_ids=prompt)
    assert run_to_first_token(core, req) == pytest.approx(QUIET.prefill_s(1000))
    assert req.cached_tokens == 0


def test_eviction_is_lru_within_the_kv_capacity() -> None:
    # Room for 20 blocks: three 7-block prompts cannot all stay cached.
    timing = attrs.evolve(QUIET, kv_capacity_tokens=20 * BS)
    core = caching_core(timing)
    a, b, c = ids(7 * BS, 1), ids(7 * BS, 10_000), ids(7 * BS, 20_000)
    for rid, prompt in (("a", a), ("b", b)):
        core.add(CoreRequest(rid=rid, prompt_tokens=len(prompt), max_tokens=1, token_ids=prompt))
        finish(core)
    # Touch a again: b is now the least recently used.
    again = CoreRequest(rid="a2", prompt_tokens=len(a), max_tokens=1, token_ids=a)
    core.add(again)
    finish(core)
    assert again.cached_tokens == 6 * BS
    core.add(CoreRequest(rid="c", prompt_tokens=len(c), max_tokens=1, token_ids=c))
    finish(core)
    assert core.pool.cached_blocks <= timing.total_blocks
    hit_a = CoreRequest(rid="a3", prompt_tokens=len(a), max_tokens=1, token_ids=a)
    core.add(hit_a)
    finish(core)
    hit_b = CoreRequest(rid="b2", prompt_tokens=len(b), max_tokens=1, token_ids=b)
    core.add(hit_b)
    finish(core)
    assert hit_a.cached_tokens == 6 * BS
    assert (hit_b.cached_tokens or 0) < 6 * BS


def test_blocks_in_use_are_never_evicted() -> None:
    timing = attrs.evolve(QUIET, kv_capacity_tokens=10 * BS)
    core = caching_core(timing)
    held = CoreRequest(
        rid="p", prompt_tokens=8 * BS, max_tokens=1, token_ids=ids(8 * BS), hold_kv=True
    )
    core.add(held)
    finish(core)
    # The held (leased) blocks stay; a prompt too big for what is left waits.
    waiting = CoreRequest(rid="x", prompt_tokens=4 * BS, max_tokens=1, token_ids=ids(4 * BS, 9000))
    core.add(waiting)
    assert core.schedule().empty
    core.release_held(held.blocks, held.computed)
    finish(core)
    assert waiting.finished


def test_cache_changes_are_vllm_events() -> None:
    timing = attrs.evolve(QUIET, kv_capacity_tokens=6 * BS)
    core = caching_core(timing, events=True)
    first = ids(3 * BS + 5)
    core.add(CoreRequest(rid="a", prompt_tokens=len(first), max_tokens=1, token_ids=first))
    finish(core)
    hashes = block_hashes(first, BS)
    assert core.pool.take_events() == [
        BlockStored(
            block_hashes=[external_hash(h) for h in hashes],
            parent_block_hash=None,
            token_ids=first[: 3 * BS],
            block_size=BS,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            group_idx=0,
        )
    ]
    # A second prompt needing every block evicts the first's, tail block first.
    second = ids(6 * BS, 40_000)
    core.add(CoreRequest(rid="b", prompt_tokens=len(second), max_tokens=1, token_ids=second))
    finish(core)
    events = core.pool.take_events()
    removed = [e.block_hashes[0] for e in events if isinstance(e, BlockRemoved)]
    assert removed == [external_hash(h) for h in reversed(hashes)]


def test_events_and_caching_are_vllm_only_and_need_each_other() -> None:
    with pytest.raises(ValueError, match=r"^kv_events needs prefix_caching"):
        SimEngineSpec(kv_events=KvEventsConfig())
    with pytest.raises(ValueError, match=r"vllm engines only"):
        SimEngineSpec(dialect="sglang", prefix_caching=True)
