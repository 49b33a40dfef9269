"""The cached-prefill law on real vLLM (CPU): narwhal-profile sees its prefix cache (on by
default, 128-token blocks) and records how far the law that cache-aware pricing uses is
from its prefills of prompts whose leading blocks it holds."""

from __future__ import annotations

from pathlib import Path

import attrs
import httpx
import trio

from narwhal.config import load_config
from narwhal.probe import CheckPlan, SweepPlan, cached_law_warning, profile_fleet, run_check
from narwhal.probe._texts import TextMaker
from narwhal.profiles import POOR_FIT_RESIDUAL_P90, save_profiles

from .conftest import MODEL, engine_entry, real_config
from .engines import CONTEXT, RealFleet

# Sizes up to most of the context, so the cached points (a half and nearly all of a
# mid-size and of the largest measured prompt) span several 128-token blocks.
PLAN = attrs.evolve(
    SweepPlan.fast(),
    prefill_sizes=(16, 256, 512, 1024, 1800),
    decode_active=(1,),
    decode_contexts=(128,),
    budget_s=240.0,
)


async def test_the_law_is_measured_and_holds_on_vllm(vllm: RealFleet, tmp_path: Path) -> None:
    engine = vllm["agg0"]
    path = tmp_path / "profiles.json"
    config = load_config(real_config([engine_entry(engine, "both")], profiles={"path": str(path)}))
    with trio.fail_after(300):
        store = await profile_fleet(config, PLAN)
    profile = store.engines["agg0"]
    cached = profile.cached
    assert cached is not None
    assert cached.seen, cached
    assert cached.block_size == 128
    assert len(cached.points) == 4
    for point in cached.points:
        assert point.cached % 128 == 0
        assert 0 < point.cached < point.tokens <= CONTEXT
    mostly = [p for p in cached.points if p.cached >= 0.8 * p.tokens]
    assert mostly
    # What pricing relies on: a mostly cached prompt costs less than the same prompt
    # cold. Timed here in interleaved pairs of one size, not against the sweep's cold
    # fit: on this box that fit moves 30-50 % between runs, and one CI run's cached
    # point (1,408 of 1,702 tokens, 138 ms) stood above a cold fit of 87 ms measured a
    # minute before it. Each side's fastest: a busy spell of the box only adds time,
    # and one CI run's first three pairs were that slow (cached 204, 122, 97 ms then
    # 42, 37; cold 103, 181, 273 then 84, 84), putting the medians at 97 against 102.
    cpt = store.chars_per_token.get("vllm", 4.0)
    cached_s, cold_s = await _paired(engine.url, chars=round(1600 * cpt), cached_share=0.85)
    assert min(cached_s) < 0.85 * min(cold_s), (cached_s, cold_s)
    # How close the law comes depends on the box: on this one, 2 cores under four CPU
    # engines, the cold fit itself moves 30-50 % between runs at 1700 tokens, and the law
    # was 54-93 % off at p90 in three runs, over-pricing the mostly cached prompts (the
    # store keeps it; the check warns).
    warning = cached_law_warning("agg0", cached)
    assert (warning is None) == (cached.residual_p90 <= POOR_FIT_RESIDUAL_P90)

    save_profiles(store, path)
    with trio.fail_after(300):
        report = await run_check(config, CheckPlan(handoff_samples=1, measure_lease=False))
    (row,) = [r for r in report.rows if r.check == "cached-prefill"]
    assert row.target == "agg0"
    assert row.status == ("pass" if warning is None else "warn"), row


async def _paired(
    url: str, *, chars: int, cached_share: float, pairs: int = 7
) -> tuple[list[float], list[float]]:
    """Seconds of `pairs` prompts of `chars` characters whose first `cached_share` the
    engine holds (a shared prefix, sent once first), and of as many that share nothing
    (each starts with its own serial), interleaved so a busy spell of the box slows both."""
    texts = TextMaker("paired")
    prefix = texts.text(round(chars * cached_share))
    rest = chars - len(prefix)
    cached: list[float] = []
    cold: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def timed(prompt: str) -> float:
            started = trio.current_time()
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return trio.current_time() - started

        await timed(prefix + " " + texts.text(rest))  # the prefix is cached from here
        for _ in range(pairs):
            cached.append(await timed(prefix + " " + texts.text(rest)))
            cold.append(await timed(texts.text(chars)))
    return cached, cold
