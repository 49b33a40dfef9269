"""The cached-prefill law on real vLLM (CPU): narwhal-profile sees its prefix cache (on by
default, 128-token blocks) and records how far the law that cache-aware pricing uses is
from its prefills of prompts whose leading blocks it holds."""

from __future__ import annotations

from pathlib import Path

import attrs
import trio

from narwhal.config import load_config
from narwhal.probe import CheckPlan, SweepPlan, cached_law_warning, profile_fleet, run_check
from narwhal.profiles import POOR_FIT_RESIDUAL_P90, save_profiles

from .conftest import engine_entry, real_config
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
    # What pricing relies on: a mostly cached prompt costs less than its cold price (at
    # 75 % of an 853-token prompt the fixed cost dominates: 18 ms against 22 ms cold).
    # Typically about half; one CI run measured 0.81x (1,408 of 1,702 tokens cached:
    # 44 ms against a 55 ms cold fit) while the cold fit itself moves 30-50 % from run
    # to run on this box, so the bar is 0.9x.
    mostly = [p for p in cached.points if p.cached >= 0.8 * p.tokens]
    assert mostly
    for point in mostly:
        assert point.seconds < 0.9 * profile.prefill.prefill_s(point.tokens), point
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
