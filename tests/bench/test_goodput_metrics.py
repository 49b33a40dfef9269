from __future__ import annotations

import pytest
from benchkit import attainment as gm, summarize


def _s(
    outcome: str = "ok",
    ttft: float | None = 0.1,
    tpot: float | None = 0.01,
    t: float = 0.0,
    phase: str = "a",
) -> gm.Sample:
    return gm.Sample(t, phase, "conv", outcome, ttft, tpot, 10)


def test_passes_needs_both_slos_and_a_finished_stream() -> None:
    assert gm.passes(_s(), 0.5, 0.05)
    assert not gm.passes(_s(ttft=0.6), 0.5, 0.05)
    assert not gm.passes(_s(tpot=0.06), 0.5, 0.05)
    assert not gm.passes(_s("truncated"), 0.5, 0.05)
    assert not gm.passes(_s("refused", None, None), 0.5, 0.05)
    assert not gm.passes(_s("timeout", None, None), 0.5, 0.05)
    # One output token has no TPOT: the TTFT alone decides.
    assert gm.passes(_s(tpot=None), 0.5, 0.05)


def test_samples_from_scales_wall_to_model_time_and_marks_missing() -> None:
    requests = [(0.0, "a", "conv"), (1.0, "a", "code"), (2.0, "b", "conv")]
    rows = [
        [0, 0.001, 200, "ok", 0.8, 0.04, 5, 3.0],
        [2, 0.0, 429, "refused", None, None, 0, 2.1],
    ]
    samples = gm.samples_from(requests, rows, speed=0.25)
    assert samples[0].ttft == pytest.approx(0.2)
    assert samples[0].tpot == pytest.approx(0.01)
    assert samples[1].outcome == "missing"
    assert samples[2].refused


def test_group_stats_counts_refusals_against_offered() -> None:
    samples = [_s(), _s(), _s(ttft=0.9), _s("refused", None, None)]
    stats = gm.group_stats(samples, duration_s=2.0, ttft_slo=0.5, tpot_slo=0.05)
    assert stats["offered"] == 4
    assert stats["passing"] == 2
    assert stats["attainment"] == 0.5
    assert stats["goodput_per_s"] == 1.0
    assert stats["admitted"] == 3
    assert stats["admitted_attainment"] == pytest.approx(0.6667)
    assert stats["ttft_attainment"] == 0.5
    assert stats["admitted_ttft_attainment"] == pytest.approx(0.6667)
    assert stats["outcomes"] == {"ok": 3, "refused": 1}
    assert stats["ttft_ms"]["n"] == 3
    assert stats["ttft_ms"]["max"] == 900.0


def test_group_stats_of_nothing() -> None:
    stats = gm.group_stats([], duration_s=5.0, ttft_slo=0.5, tpot_slo=0.05)
    assert stats["attainment"] is None
    assert stats["goodput_per_s"] == 0.0
    assert stats["ttft_ms"] == {"n": 0}


def test_phase_table_groups_by_offered_phase() -> None:
    samples = [_s(phase="a", t=0.5), _s(phase="b", t=1.5, ttft=2.0), _s(phase="b", t=1.7)]
    table = gm.phase_table(samples, [("a", 0.0, 1.0), ("b", 1.0, 3.0)], 0.5, 0.05)
    assert table["a"]["attainment"] == 1.0
    assert table["b"]["attainment"] == 0.5
    assert table["b"]["goodput_per_s"] == 0.5
    assert table["all"]["offered"] == 3
    assert table["all"]["goodput_per_s"] == pytest.approx(2 / 3, abs=0.01)


def test_windows_bin_by_offered_time() -> None:
    samples = [_s(t=0.1), _s(t=0.9, ttft=1.0), _s(t=2.5), _s(t=9.0)]
    w = gm.windows(samples, total_s=3.0, window_s=1.0, ttft_slo=0.5, tpot_slo=0.05)
    assert w["t"] == [0.0, 1.0, 2.0]
    assert w["offered"] == [2, 0, 2]  # the late straggler is clamped into the last window
    assert w["attainment"] == [0.5, None, 1.0]


def test_latency_summaries_keep_statistics_not_samples() -> None:
    s = summarize([0.1, 0.2, 0.3, 0.4], scale=1000.0, digits=1, with_max=True)
    assert s == {"n": 4, "p50": 250.0, "p90": 370.0, "p99": 397.0, "mean": 250.0, "max": 400.0}
    assert summarize([], with_max=True) == {"n": 0}


def test_hindsight_best_prefers_goodput_then_attainment() -> None:
    results = {
        "x": {"all": {"goodput_per_s": 10.0, "attainment": 0.8}},
        "y": {"all": {"goodput_per_s": 12.0, "attainment": 0.7}},
        "z": {"all": {"goodput_per_s": 12.0, "attainment": 0.9}},
    }
    assert gm.hindsight_best(results, ["x", "y", "z"]) == "z"
    assert gm.hindsight_best(results, ["x"]) == "x"
    assert gm.hindsight_best(results, ["nope"]) is None
