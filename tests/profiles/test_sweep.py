"""narwhal-profile's sweep against the simulator: the fits recover the configured law."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import trio

from narwhal.probe import (
    EngineClient,
    Gauges,
    SweepFailed,
    SweepPlan,
    TextMaker,
    carry_facts,
    measure_decode_point,
    profile_fleet,
)
from narwhal.profiles import MeasuredFacts, load_profiles, save_profiles, verify_builds
from narwhal.sim import SimTiming, idle_prefill_s

from ..support import StartFleet
from .helpers import BUILD, config_for, store_for

# The default law's per-token and per-request decode terms are tiny next to the step base
# (44 ns/token, 30 us/request against 6 ms); scaled up they are identifiable with the small
# sweep a test can afford. Prefill keeps the default law.
LAW = SimTiming(decode_kv_token_s=2e-7, decode_seq_s=2e-4)
PLAN = attrs.evolve(
    SweepPlan.fast(), decode_gaps=24, decode_contexts=(128, 2048), handoff_repeats=3
)
# What a client observes on top of the engine's own time: the HTTP exchange and the
# simulator's tokenisation, in this one process, on a machine that may be busy with other
# work. Measured: 2-4 ms on a quiet machine, up to ~9 ms when the cores are contended.
OVERHEAD_S = 0.010


async def test_profile_recovers_the_sim_law(start_fleet: StartFleet, tmp_path: Path) -> None:
    fleet = await start_fleet(engines=2, speed=1.0, timing=LAW)
    urls = {"e0": fleet[0].url, "e1": fleet[1].url}
    config = config_for(urls, profiles=str(tmp_path / "profiles.json"))
    lines: list[str] = []
    store = await profile_fleet(config, PLAN, progress=lines.append)
    assert any("prefill fit" in line for line in lines)
    assert lines[-1].endswith(f"done in {store.sweep['duration_s']:.1f} s")

    for engine_id, profile in store.engines.items():
        assert profile.url == urls[engine_id]
        assert profile.build == (
            f"vllm {fleet[0].engine.spec.vllm_version} [{fleet[0].engine.spec.build}] "
            "model=sim-llama-3-8b max_model_len=8192"
        )
        assert profile.max_model_len == 8192
        assert profile.kv_capacity_tokens == LAW.kv_capacity_tokens
        assert profile.kv_capacity_source.startswith("vllm:cache_config_info")
        # vLLM does not publish max_num_seqs and no point reached the engine's.
        assert (profile.max_num_seqs, profile.max_num_seqs_source) == (0, "")
        assert 4.0 < profile.chars_per_token < 5.5

        pre = profile.prefill
        assert pre.min_tokens <= 4
        assert pre.max_tokens > 7000
        for n in (pre.min_tokens, 64, 512, 1024, 2048, 4096, pre.max_tokens):
            law = idle_prefill_s(LAW, n)
            assert pre.in_domain(n)
            # The quadratic follows the chunked law within 10 %, plus the client overhead.
            assert abs(pre.prefill_s(n) - law) <= 0.10 * law + OVERHEAD_S, (engine_id, n)
        # Over the whole range the growth (which carries no constant overhead) follows the
        # law's within 10 %.
        grown = pre.prefill_s(pre.max_tokens) - pre.prefill_s(pre.min_tokens)
        law_grown = idle_prefill_s(LAW, pre.max_tokens) - idle_prefill_s(LAW, pre.min_tokens)
        assert grown == pytest.approx(law_grown, rel=0.10), engine_id
        assert 0.8 * LAW.step_base_s <= pre.a_s <= LAW.step_base_s + OVERHEAD_S
        assert pre.b_s_per_token == pytest.approx(LAW.prefill_token_s, rel=0.25)

        dec = profile.decode
        assert (dec.min_active, dec.max_active) == (1, 12)
        assert 12 * 2048 < dec.max_kv_tokens < 12 * 2300
        for active, kv in ((1, 200), (4, 4000), (12, 12000), (8, 9000), (12, 24000)):
            assert dec.in_domain(active, kv)
            law = LAW.decode_step_s(kv, active)
            assert dec.interval_s(active, kv) == pytest.approx(law, rel=0.12), (active, kv)
        assert dec.t0_s == pytest.approx(LAW.step_base_s, rel=0.12)
        assert dec.idle_floor_s == pytest.approx(LAW.decode_step_s(dec.min_kv_tokens, 1), rel=0.12)
        # Both inputs are seen, separately: neither term collapses into the other. (With
        # five points and noisy medians the two slopes trade off against each other; the
        # predictions above are what is accurate.)
        assert 0.5 < dec.kv_s_per_token / LAW.decode_kv_token_s < 2.0
        assert 0.5 < dec.active_s_per_request / LAW.decode_seq_s < 2.0

    assert set(store.handoffs) == {("e0", "e1"), ("e1", "e0")}
    for handoff in store.handoffs.values():
        small, large = handoff.buckets
        assert small.tokens == pytest.approx(64, rel=0.25)
        assert large.tokens == pytest.approx(1024, rel=0.25)
        assert large.samples == PLAN.handoff_repeats
        # KV transfer of the prompt, then one decode step on the decoder; on top, the
        # decode request and the simulator's engine-to-engine pull (both HTTP).
        law = LAW.kv_transfer_s(large.tokens) + LAW.decode_step_s(large.tokens, 1)
        assert 0.9 * law <= large.p50_s <= law + 3 * OVERHEAD_S
        assert large.p99_s >= large.p50_s
        # vLLM's decode leg opens right after the prefill answer: the first-token span is
        # the handoff less the instant between the two.
        assert large.first_token_p99_s <= large.p99_s
        assert large.first_token_p50_s <= large.p50_s
    assert store.chars_per_token.keys() == {"vllm"}

    path = Path(config.profiles.path)
    save_profiles(store, path)
    check = load_profiles(path, config)
    assert check.ok, check.messages
    document = json.loads(await trio.Path(path).read_text())
    assert document["sweep"]["handoff_repeats"] == PLAN.handoff_repeats


async def test_changed_build_is_detected(start_fleet: StartFleet) -> None:
    before = await start_fleet(engines=1, speed=50.0, build="build-1")
    after = await start_fleet(engines=1, speed=50.0, build="build-2")
    config = config_for({"e0": before[0].url})
    client = EngineClient(config.engines[0], config.engine)
    old = (await client.identity()).build_identity
    await client.aclose()
    config2 = config_for({"e0": after[0].url})
    client = EngineClient(config2.engines[0], config2.engine)
    new = (await client.identity()).build_identity
    await client.aclose()
    assert "build-1" in old
    assert "build-2" in new
    store = store_for({"e0": before[0].url}, build=old)
    assert verify_builds(store, {"e0": old}) == []
    (problem,) = verify_builds(store, {"e0": new})
    assert problem.startswith(f"engine 'e0': build is {new!r} but the profile was measured on")


async def test_recorded_facts_survive_only_unchanged_builds() -> None:
    facts = MeasuredFacts(measured_at="t", lease_s=30.0, builds={"e0": BUILD})
    old = attrs.evolve(store_for({"e0": "http://127.0.0.1:1"}), facts=facts)
    kept, note = carry_facts(store_for({"e0": "http://127.0.0.1:1"}), old)
    assert kept.facts == facts
    assert note is None
    fresh = store_for({"e0": "http://127.0.0.1:1"}, build="other")
    dropped, note = carry_facts(fresh, old)
    assert dropped.facts is None
    assert note == (
        "dropped the recorded narwhal-check facts: measured on other builds of e0; "
        "run narwhal-check --record again"
    )
    assert carry_facts(fresh, None) == (fresh, None)


async def test_sweep_failures_name_the_engine(start_fleet: StartFleet) -> None:
    fleet = await start_fleet(engines=2, speed=50.0)
    await fleet[1].go_down()
    config = config_for({"e0": fleet[0].url, "e1": fleet[1].url})
    with pytest.raises(SweepFailed, match=r"^engine 'e1' GET /version: connect to .* refused"):
        await profile_fleet(config, PLAN)
    wrong = config_for({"e0": fleet[0].url})
    wrong = attrs.evolve(wrong, engines=(attrs.evolve(wrong.engines[0], model="another-model"),))
    with pytest.raises(
        SweepFailed,
        match=r"^engine 'e0' does not serve model 'another-model' .*lists: sim-llama-3-8b$",
    ):
        await profile_fleet(wrong, PLAN)


async def test_sweep_is_bounded_by_its_budget(start_fleet: StartFleet) -> None:
    fleet = await start_fleet(engines=1, speed=1.0)
    config = config_for({"e0": fleet[0].url})
    start = trio.current_time()
    with pytest.raises(SweepFailed, match=r"^the sweep exceeded its time budget of 0\.3 s"):
        await profile_fleet(config, attrs.evolve(PLAN, budget_s=0.3))
    assert trio.current_time() - start < 1.0


async def test_decode_points_beyond_the_engines_batch_cap_are_skipped(
    start_fleet: StartFleet,
) -> None:
    # The engine runs at most 6 requests at once: a point of 12 would leave its probe
    # queued behind loads that decode for a long while. The sweep sees the running count
    # settle below the loads, skips that point and every larger one, and fits the rest;
    # the profile's domain stops where it measured. Slow steps (20 ms of wall time) make
    # the loads outlast the stall window 4x over.
    law = SimTiming(max_num_seqs=6, step_base_s=0.1)
    fleet = await start_fleet(engines=1, speed=5.0, timing=law)
    config = config_for({"e0": fleet[0].url})
    plan = attrs.evolve(
        PLAN,
        decode_active=(1, 4, 12, 16),
        decode_contexts=(128,),
        decode_gaps=8,
        decode_cap_stall_s=0.3,
        handoff_sizes=(64,),
    )
    lines: list[str] = []
    store = await profile_fleet(config, plan, progress=lines.append)
    skipped = [line for line in lines if "skipped" in line]
    assert len(skipped) == 2, lines
    first = "e0: decode point 12 x 128 tokens skipped: engine 'e0' runs 6 of the point's 11"
    assert first in skipped[0]
    assert "e0: decode point 16 x 128 tokens skipped: the engine ran only 6" in skipped[1]
    assert store.engines["e0"].decode.max_active == 4
    # vLLM does not publish max_num_seqs; what the sweep saw is recorded in its place.
    assert store.engines["e0"].max_num_seqs == 6
    assert store.engines["e0"].max_num_seqs_source.startswith("observed")


async def test_a_decode_point_counts_its_own_requests_when_the_engine_reads_none(
    start_fleet: StartFleet,
) -> None:
    # vLLM 0.32's vllm:num_requests_running reads 0 for a second or more while requests
    # run. A point of 4 streams is still a point of 4, not of the 1 that 0 + the probe makes.
    fleet = await start_fleet(engines=1, speed=5.0)
    config = config_for({"e0": fleet[0].url})
    client = EngineClient(config.engines[0], config.engine)
    engine_gauges = client.gauges

    async def none_running() -> Gauges:
        return attrs.evolve(await engine_gauges(), running=0.0)

    client.gauges = none_running  # type: ignore[method-assign]
    try:
        identity = await client.identity()
        plan = attrs.evolve(PLAN, decode_gaps=8)
        point, _ = await measure_decode_point(client, TextMaker("t"), 4.5, identity, 4, 128, plan)
    finally:
        await client.aclose()
    assert point.active == 4
