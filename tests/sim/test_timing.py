"""The pure timing core: the latency law without sockets."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from narwhal.sim import CoreRequest, ReqState, SchedulerCore, SimTiming, idle_prefill_s

QUIET = SimTiming(noise_sigma=0.0)


def decode_step(core: SchedulerCore) -> float:
    plan = core.schedule()
    assert plan.decodes
    assert not plan.chunks
    core.complete(plan)
    return plan.duration_s


def state_of(r: CoreRequest) -> ReqState:
    # A call, so mypy does not narrow `r.state` across scheduler steps.
    return r.state


def warm_core(active: int, prompt: int = 512) -> SchedulerCore:
    """A core whose `active` requests all finished prefill and are decoding."""
    core = SchedulerCore(QUIET)
    for i in range(active):
        core.add(CoreRequest(rid=str(i), prompt_tokens=prompt, max_tokens=1000))
    for _ in range(active * prompt // QUIET.chunk_tokens + 2):
        plan = core.schedule()
        core.complete(plan)
        if not plan.chunks:
            break
    assert all(r.computed >= prompt for r in core.running)
    return core


def test_defaults_match_the_notes() -> None:
    t = SimTiming()
    assert t.prefill_law_s(2048) == pytest.approx(0.049, rel=0.02)  # "2k -> 49 ms"
    assert t.prefill_law_s(8000) == pytest.approx(0.210, rel=0.01)  # "8k -> 210 ms"
    assert t.decode_step_s(100_000, 0) - t.decode_step_s(0, 0) == pytest.approx(0.0044)
    assert t.kv_transfer_s(8192) == pytest.approx(0.0005 + 8192 * 131072 / 50e9)
    assert t.total_blocks == 450_000 // 16


def test_decode_step_grows_with_batch_and_kv() -> None:
    one = decode_step(warm_core(1))
    many = decode_step(warm_core(64))
    assert many > one
    # The step is exactly t0 + alpha*K + beta*B.
    core = warm_core(64)
    kv = sum(r.computed for r in core.running)
    assert decode_step(core) == pytest.approx(QUIET.decode_step_s(kv, 64))


def test_prefill_is_quadratic_through_chunked_steps() -> None:
    sizes = np.array([256, 512, 1024, 2048, 3072, 4096, 6144, 8000])
    times = np.array([idle_prefill_s(QUIET, int(n)) for n in sizes])
    for n, t in zip(sizes, times, strict=True):
        assert t == pytest.approx(QUIET.prefill_s(int(n)))
        if n <= QUIET.chunk_tokens:
            assert t == pytest.approx(QUIET.prefill_law_s(int(n)))
    c, b, _a = np.polyfit(sizes, times, 2)
    assert c == pytest.approx(QUIET.prefill_quad_s, rel=0.35)
    assert b == pytest.approx(QUIET.prefill_token_s, rel=0.35)
    # Doubling the prompt more than doubles the time once the quadratic term matters.
    assert idle_prefill_s(QUIET, 8000) > 2 * idle_prefill_s(QUIET, 4000)


def test_long_prompt_is_chunked_and_interleaves_with_decodes() -> None:
    core = warm_core(8)
    long = CoreRequest(rid="long", prompt_tokens=5000, max_tokens=4)
    core.add(long)
    steps = 0
    while long.generated == 0:
        plan = core.schedule()
        # Running decodes keep going while the long prompt is chunked beside them.
        assert len(plan.decodes) == 8
        assert plan.prefill_tokens <= QUIET.chunk_tokens
        core.complete(plan)
        steps += 1
    assert steps == 3  # 5000 tokens with a 2048 budget shared with 8 decodes


def test_prefill_slows_the_decode_steps_it_shares() -> None:
    core = warm_core(8)
    alone = decode_step(core)
    core.add(CoreRequest(rid="p", prompt_tokens=2000, max_tokens=1))
    plan = core.schedule()
    assert plan.chunks
    assert plan.decodes
    assert plan.duration_s > alone + QUIET.chunk_cost_s(0, 2000) * 0.99


def test_requests_wait_when_kv_is_full() -> None:
    timing = attrs.evolve(QUIET, kv_capacity_tokens=1024)
    core = SchedulerCore(timing)
    a = CoreRequest(rid="a", prompt_tokens=800, max_tokens=2)
    b = CoreRequest(rid="b", prompt_tokens=800, max_tokens=2)
    core.add(a)
    core.add(b)
    plan = core.schedule()
    assert [r for r, _, _ in plan.chunks] == [a]
    assert state_of(b) is ReqState.WAITING
    for _ in range(10):
        core.complete(plan)
        plan = core.schedule()
        if state_of(b) is not ReqState.WAITING:
            break
    assert a.state is ReqState.FINISHED
    assert b.state is ReqState.RUNNING
    assert core.used_blocks == 50


def test_decode_growth_preempts_the_newest_request() -> None:
    timing = attrs.evolve(QUIET, kv_capacity_tokens=64, block_size=16)
    core = SchedulerCore(timing)
    a = CoreRequest(rid="a", prompt_tokens=31, max_tokens=10)
    b = CoreRequest(rid="b", prompt_tokens=31, max_tokens=10)
    core.add(a)
    core.add(b)
    for _ in range(6):
        core.complete(core.schedule())
    assert core.preemptions >= 1
    assert b.preemptions >= 1
    assert a.preemptions == 0
    for _ in range(200):
        if a.finished and b.finished:
            break
        core.complete(core.schedule())
    assert a.generated == 10
    assert b.generated == 10
    assert core.used_blocks == 0


def test_max_num_seqs_bounds_the_batch() -> None:
    core = SchedulerCore(attrs.evolve(QUIET, max_num_seqs=4))
    for i in range(10):
        core.add(CoreRequest(rid=str(i), prompt_tokens=10, max_tokens=5))
    core.complete(core.schedule())
    assert len(core.running) == 4
    assert len(core.waiting) == 6


def test_abort_frees_kv_at_once() -> None:
    core = SchedulerCore(QUIET)
    r = CoreRequest(rid="r", prompt_tokens=1000, max_tokens=10)
    core.add(r)
    plan = core.schedule()
    assert core.used_blocks == 63
    core.abort(r)
    assert core.used_blocks == 0
    core.complete(plan)  # the in-flight step must ignore the aborted request
    assert r.state is ReqState.ABORTED
    assert r.generated == 0


def test_remote_kv_waits_for_pull_then_samples_next_step() -> None:
    core = SchedulerCore(QUIET)
    r = CoreRequest(rid="d", prompt_tokens=300, max_tokens=3, remote_kv=True)
    core.add(r)
    plan = core.schedule()
    assert plan.empty
    assert plan.pulls == [r]
    assert r.state is ReqState.PULLING
    assert core.used_blocks == 19
    core.pull_done(r)
    plan = core.schedule()
    assert plan.decodes == [r]
    assert not plan.chunks
    core.complete(plan)
    assert r.generated == 1


def test_held_kv_outlives_the_prefill_request() -> None:
    core = SchedulerCore(QUIET)
    r = CoreRequest(rid="p", prompt_tokens=100, max_tokens=1, hold_kv=True)
    core.add(r)
    result = core.complete(core.schedule())
    assert result.finished == [r]
    assert core.used_blocks == 7
    assert core.held_tokens == 100
    core.release_held(r.blocks, r.computed)
    assert core.used_blocks == 0
    assert core.held_tokens == 0


def test_zero_law_never_takes_zero_time() -> None:
    zero = SimTiming.zero()
    core = SchedulerCore(zero)
    core.add(CoreRequest(rid="z", prompt_tokens=4000, max_tokens=3))
    plan = core.schedule()
    assert plan.duration_s == zero.min_step_s > 0
    assert zero.kv_transfer_s(8000) == 0.0


def test_noise_is_seeded_and_unbiased() -> None:
    def durations(seed: int) -> list[float]:
        core = SchedulerCore(SimTiming(), seed=seed)
        core.add(CoreRequest(rid="n", prompt_tokens=16, max_tokens=2001))
        out = []
        for _ in range(2000):
            plan = core.schedule()
            out.append(plan.duration_s)
            core.complete(plan)
        return out

    a, b = durations(1), durations(1)
    assert a == b
    ratios = np.array(a[1:]) / np.array([QUIET.decode_step_s(16 + i, 1) for i in range(1999)])
    assert ratios.mean() == pytest.approx(1.0, abs=0.01)
    assert ratios.std() == pytest.approx(0.05, rel=0.2)
