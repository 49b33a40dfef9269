from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from benchkit import workload as gw

from narwhal.sim import SimTiming


def _trace(name: str, n: int, rate: float, prompt: int, output: int, seed: int) -> gw.Trace:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, n)
    gaps[0] = 0.0
    t = np.cumsum(gaps)
    # Lognormal lengths (mean `prompt` / `output`): a long tail, as in the real traces.
    sigma = 0.8
    mu_p = np.log(prompt) - sigma * sigma / 2
    mu_o = np.log(output) - sigma * sigma / 2
    return gw.Trace(
        name,
        t - t[0],
        np.maximum(1, rng.lognormal(mu_p, sigma, n)).astype(np.int64),
        np.maximum(1, rng.lognormal(mu_o, sigma, n)).astype(np.int64),
    )


@pytest.fixture
def traces() -> dict[gw.Source, gw.Trace]:
    return {
        "conv": _trace("conv", 20_000, 5.5, 1150, 210, 1),
        "code": _trace("code", 9_000, 2.6, 2050, 28, 2),
    }


def test_load_trace_parses_and_sorts(tmp_path: Path) -> None:
    (tmp_path / "AzureLLMInferenceTrace_code.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:04.0319600,3180,8\n"
        "2023-11-16 18:17:03.9799600,4808,10\n"
        "2023-11-16 18:18:04.5000000,110,27\n"
    )
    trace = gw.load_trace(tmp_path, "code")
    assert trace.prompt.tolist() == [4808, 3180, 110]
    assert trace.output.tolist() == [10, 8, 27]
    assert trace.t[0] == 0.0
    assert trace.t[1] == pytest.approx(0.052, abs=1e-6)
    assert trace.t[2] == pytest.approx(60.52004, abs=1e-6)


def test_load_trace_missing_directory_names_the_option(tmp_path: Path) -> None:
    with pytest.raises(gw.TraceError, match=r"--traces DIR"):
        gw.load_trace(tmp_path / "absent", "conv")


def test_load_trace_bad_row(tmp_path: Path) -> None:
    (tmp_path / "AzureLLMInferenceTrace_conv.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:04.0,x,8\n"
    )
    with pytest.raises(gw.TraceError, match=r"unreadable row"):
        gw.load_trace(tmp_path, "conv")


def test_clip_lengths_fit_the_context() -> None:
    limits = gw.Limits(max_model_len=8192, max_output=1024)
    inp, out = gw.clip_lengths(np.array([14050, 8000, 0, 100]), np.array([10, 1899, 0, 5]), limits)
    assert out.tolist() == [10, 1024, 1, 5]
    assert (inp + out <= 8191).all()
    assert inp.tolist() == [8181, 7167, 1, 100]


def test_pool_capacity_respects_tpot_and_batch_limits() -> None:
    timing = SimTiming()
    slo = gw.Slo(0.5, 0.05)
    cap = gw.pool_capacity(timing, np.array([1000] * 10), np.array([200] * 10), slo)
    assert 1 <= cap.decode_batch <= timing.max_num_seqs
    assert cap.decode_step_s <= 0.8 * slo.tpot_s
    expected = cap.decode_batch / (200 * cap.decode_step_s)
    assert cap.decode_per_engine == pytest.approx(expected)
    work = timing.prefill_token_s * 1000 + timing.prefill_quad_s * 1e6
    work += timing.step_base_s * 1000 / timing.chunk_tokens
    assert cap.prefill_per_engine == pytest.approx(1.0 / work)
    # A tighter TPOT SLO can only shrink the decode batch.
    tight = gw.pool_capacity(timing, np.array([1000] * 10), np.array([200] * 10), gw.Slo(0.5, 0.01))
    assert tight.decode_batch < cap.decode_batch


def test_best_split_follows_the_mix() -> None:
    timing = SimTiming()
    slo = gw.Slo()
    # Code-like: long prompts, ~28 tokens out -> prefill-bound, the most prefill engines.
    code = gw.pool_capacity(timing, np.array([2048] * 50), np.array([28] * 50), slo)
    # Chat-like with long answers -> decode matters, fewer prefill engines.
    chat = gw.pool_capacity(timing, np.array([600] * 50), np.array([600] * 50), slo)
    p_code, c_code = gw.best_split(code, 8)
    p_chat, _ = gw.best_split(chat, 8)
    assert p_code == 7
    assert p_chat < p_code
    assert c_code == gw.split_capacity(code, 7, 1)
    assert gw.split_capacity(code, 7, 1) == min(7 * code.prefill_per_engine, code.decode_per_engine)


def test_tile_repeats_the_trace_after_its_end() -> None:
    trace = gw.Trace("x", np.array([0.0, 1.0, 3.0]), np.array([1, 2, 3]), np.array([4, 5, 6]))
    tiled = gw.tile(trace, 2)
    # One mean gap (1.5 s) between the copies.
    assert tiled.t.tolist() == [0.0, 1.0, 3.0, 4.5, 5.5, 7.5]
    assert tiled.prompt.tolist() == [1, 2, 3, 1, 2, 3]


def test_standard_phases_scale_and_names() -> None:
    full = gw.standard_phases()
    quick = gw.standard_phases(scale=0.05)
    assert [p.name for p in full] == [
        "decode_heavy",
        "prefill_heavy",
        "overload",
        "drift",
        "stationary",
    ]
    assert [p.duration_s * 0.05 for p in full] == pytest.approx([p.duration_s for p in quick])
    assert 1.5 <= full[2].load <= 2.0
    assert gw.phase_bounds(quick)[-1][2] == pytest.approx(sum(p.duration_s for p in quick))


def _build(
    traces: dict[gw.Source, gw.Trace], seed: int, phases: list[gw.Phase]
) -> tuple[list[gw.Request], list[gw.MixCapacity]]:
    return gw.build(phases, traces, timing=SimTiming(), seed=seed)


def test_build_is_deterministic_under_a_seed(traces: dict[gw.Source, gw.Trace]) -> None:
    phases = gw.standard_phases(scale=0.02)
    a, caps_a = _build(traces, 3, phases)
    b, caps_b = _build(traces, 3, phases)
    c, _ = _build(traces, 4, phases)
    assert a == b
    assert caps_a == caps_b
    assert a != c


def test_build_rates_follow_capacity_and_phases(traces: dict[gw.Source, gw.Trace]) -> None:
    phases = gw.standard_phases(scale=0.05)
    requests, caps = _build(traces, 1, phases)
    assert [r.t for r in requests] == sorted(r.t for r in requests)
    for (name, start, end), phase, cap in zip(gw.phase_bounds(phases), phases, caps, strict=True):
        mine = [r for r in requests if r.phase == name]
        assert all(start <= r.t < end for r in mine)
        assert all(r.prompt + r.output < 8192 and r.output >= 1 for r in mine)
        if phase.mix_end is None and not phase.swing:
            expected = phase.load * cap.capacity * phase.duration_s
            assert len(mine) == pytest.approx(expected, rel=0.02)
    by_name = {c.phase: c for c in caps}
    assert by_name["stationary"].best_prefill > by_name["decode_heavy"].best_prefill
    assert {r.source for r in requests if r.phase == "prefill_heavy"} == {"code", "conv_long"}
    assert all(r.prompt >= gw.LONG_PROMPT for r in requests if r.source == "conv_long")
    # The decode-heavy phase is conversations with long answers only.
    decode_heavy = [r for r in requests if r.phase == "decode_heavy"]
    assert {r.source for r in decode_heavy} == {"conv_long_output"}
    assert all(r.output >= gw.LONG_OUTPUT for r in decode_heavy)


def test_drift_moves_from_conv_to_code(traces: dict[gw.Source, gw.Trace]) -> None:
    phase = gw.Phase(
        "drift",
        60.0,
        0.5,
        (("conv", 1.0), ("code", 0.0)),
        mix_end=(("conv", 0.0), ("code", 1.0)),
    )
    requests, caps = _build(traces, 1, [phase])
    first = [r.source for r in requests if r.t < 20]
    last = [r.source for r in requests if r.t >= 40]
    assert first.count("conv") > 3 * first.count("code")
    assert last.count("code") > 3 * last.count("conv")
    assert caps[0].capacity != caps[0].capacity_end


def test_swing_modulates_the_rate(traces: dict[gw.Source, gw.Trace]) -> None:
    phase = gw.Phase("wave", 40.0, 0.5, (("conv", 1.0),), swing=0.5, period_s=40.0)
    requests, _ = _build(traces, 1, [phase])
    # sin > 0 in the first half period, < 0 in the second.
    high = sum(1 for r in requests if r.t < 20)
    low = sum(1 for r in requests if r.t >= 20)
    assert high > 1.5 * low


def test_warp_keeps_the_trace_shape_at_a_constant_rate() -> None:
    trace_t = np.array([0.0, 1.0, 1.1, 5.0, 9.0])
    out = gw._warp(trace_t, trace_rate=0.5, rate=np.full(1000, 2.0), dt_s=0.01)
    # Four times the trace's rate: every gap shrinks by 4, order kept.
    assert out == pytest.approx(trace_t / 4.0, abs=0.011)


def test_streams_superpose_independent_runs(traces: dict[gw.Source, gw.Trace]) -> None:
    phase = gw.Phase("p", 30.0, 0.5, (("code", 1.0),))
    one, caps = _build(traces, 1, [phase])
    many, _ = gw.build([phase], traces, timing=SimTiming(), seed=1, streams=4)
    expected = 0.5 * caps[0].capacity * 30.0
    assert len(one) == pytest.approx(expected, rel=0.02)
    assert len(many) == pytest.approx(expected, rel=0.02)
    assert one != many
    with pytest.raises(ValueError, match=r"^streams is 0; must be >= 1$"):
        gw.build([phase], traces, timing=SimTiming(), streams=0)
