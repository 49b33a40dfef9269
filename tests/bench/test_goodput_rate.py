"""DistServe's goodput from a rate sweep (tools/bench/goodput_rate.py): the crossing of
the attainment target, the capacity model's pick of splits, and the summary's ratio."""

from __future__ import annotations

from typing import Any

import goodput
import goodput_rate as gr
import pytest
from benchkit import workload as gw


def test_crossing_interpolates_between_the_last_pass_and_the_first_miss() -> None:
    points = [(1.0, 0.98, 60.0), (1.5, 0.94, 90.0), (2.0, 0.74, 120.0)]
    g = gr.crossing(points, 0.9)
    # 0.94 -> 0.74 falls through 0.9 a fifth of the way from 1.5 to 2.0.
    assert g == {"rate": 1.6, "per_s": 96.0, "kind": "interpolated"}
    # Order of the points does not matter.
    assert gr.crossing(list(reversed(points)), 0.9) == g


def test_crossing_says_when_it_is_only_a_bound() -> None:
    assert gr.crossing([(1.0, 0.95, 60.0), (1.5, 0.91, 90.0)], 0.9) == {
        "rate": 1.5,
        "per_s": 90.0,
        "kind": "at_least",
    }
    assert gr.crossing([(1.0, 0.5, 60.0), (1.5, 0.4, 90.0)], 0.9)["kind"] == "below"
    assert gr.crossing([], 0.9) == {"rate": None, "per_s": None, "kind": None}
    # Exactly at the target counts as meeting it.
    assert gr.crossing([(1.0, 0.9, 60.0)], 0.9)["kind"] == "at_least"


def _phase(name: str, load: float) -> gw.Phase:
    return gw.Phase(name, 10.0, load, (("conv", 1.0),))


def test_scaled_multiplies_every_load_and_keeps_the_rest() -> None:
    phases = [_phase("a", 0.5), _phase("b", 0.7)]
    out = gr.scaled(phases, 1.5)
    assert [p.load for p in out] == pytest.approx([0.75, 1.05])
    assert [p.duration_s for p in out] == [10.0, 10.0]
    assert [p.load for p in phases] == [0.5, 0.7]


def test_the_fluid_model_prefers_the_compromise_split_on_shifting_phases() -> None:
    # Phase a wants prefill (20/s per prefill engine, 60/s per decode engine), phase b
    # the opposite; the best split of each carries 120 requests/s.
    phases = [_phase("a", 0.9), _phase("b", 0.9)]
    caps = [
        gw.MixCapacity("a", 6, 120.0, 120.0, 20.0, 60.0, 100),  # 6P2D: min(120, 120)
        gw.MixCapacity("b", 2, 120.0, 120.0, 60.0, 20.0, 100),  # 2P6D: min(120, 120)
    ]
    # 4P4D carries 80/s in each phase: 80 / (0.9 x 120) = 74 % of what is offered at x1.
    assert gr.modelled_attainment(4, phases, caps, 1.0) == pytest.approx(80 / 108)
    assert gr.modelled_attainment(6, phases, caps, 1.0) == pytest.approx((108 + 40) / 216)
    # The rate where 4P4D's fluid attainment is exactly 90 %: 80 / (0.9 x 120 x r) = 0.9.
    assert gr.modelled_goodput(4, phases, caps, 0.9) == pytest.approx(80 / (0.81 * 120), rel=1e-6)
    # 3P5D and 5P3D serve 60 + 100 requests/s too once both phases saturate them; 2P6D
    # and 6P2D waste most of one phase.
    modelled = {p: gr.modelled_goodput(p, phases, caps) for p in range(1, 8)}
    assert gr.kept_splits(modelled, 0.75) == [3, 4, 5]
    assert gr.modelled_goodput(2, phases, caps, 0.9) < 0.75 * gr.modelled_goodput(4, phases, caps)
    assert gr.kept_splits(modelled, 0.0) == list(range(1, 8))


def _sweep(*points: tuple[float, float]) -> list[dict[str, Any]]:
    # One phase "p" carrying the whole run, and a phase "q" that always passes.
    return [
        {
            "rate": r,
            "status": "ran",
            "attainment": a,
            "offered_per_s": 100.0 * r,
            "phases": {
                "p": {"attainment": a, "offered_per_s": 60.0 * r},
                "q": {"attainment": 1.0, "offered_per_s": 40.0 * r},
            },
        }
        for r, a in points
    ]


def test_summary_finds_the_best_static_split_and_the_ratio() -> None:
    sweeps = {
        "narwhal-full": _sweep((1.0, 0.99), (1.5, 0.95), (2.0, 0.85)),
        "narwhal-static-4p4d": _sweep((1.0, 0.95), (1.5, 0.85)),
        "narwhal-static-3p5d": _sweep((1.0, 0.92), (1.5, 0.6)),
        "narwhal-static-5p3d": [
            {"rate": 1.0, "status": "failed", "reason": "RuntimeError: x"},
        ],
    }
    s = gr.summary(sweeps, 0.9)
    assert s["best_static"] == "narwhal-static-4p4d"
    assert s["goodput"]["narwhal-full"]["rate"] == pytest.approx(1.75)
    assert s["goodput"]["narwhal-static-4p4d"]["rate"] == pytest.approx(1.25)
    assert s["goodput"]["narwhal-static-5p3d"]["kind"] is None
    assert s["narwhal_full_vs_best_static"] == {"ratio": 1.4, "kind": "estimate"}
    phases = s["goodput_per_phase"]["narwhal-static-4p4d"]
    assert phases["p"] == {"rate": 1.25, "per_s": 75.0, "kind": "interpolated"}
    assert phases["q"] == {"rate": 1.5, "per_s": 60.0, "kind": "at_least"}
    assert s["goodput_per_phase"]["narwhal-static-5p3d"] == {}
    phases = s["goodput_per_phase"]["narwhal-static-4p4d"]
    assert phases["p"] == {"rate": 1.25, "per_s": 75.0, "kind": "interpolated"}
    assert phases["q"] == {"rate": 1.5, "per_s": 60.0, "kind": "at_least"}
    assert s["goodput_per_phase"]["narwhal-static-5p3d"] == {}


def test_compare_marks_bounds() -> None:
    exact = {"rate": 1.2, "kind": "interpolated"}
    floor = {"rate": 2.0, "kind": "at_least"}
    assert gr.compare(floor, exact) == {"ratio": 1.667, "kind": "at_least"}
    assert gr.compare(exact, floor) == {"ratio": 0.6, "kind": "at_most"}
    assert gr.compare(exact, {"rate": None, "kind": None})["ratio"] is None


def test_markdown_shows_attainment_per_rate_and_the_goodput() -> None:
    sweeps = {
        "narwhal-full": _sweep((1.0, 0.99), (1.5, 0.95)),
        "narwhal-static-4p4d": _sweep((1.0, 0.95), (1.5, 0.85)),
    }
    doc = {"config": {"rates": [1.0, 1.5]}, "sweeps": sweeps, "summary": gr.summary(sweeps, 0.9)}
    table = gr.markdown(doc)
    assert "| narwhal-full | 99.0% | 95.0% | >= 1.50 | >= 150.0 |" in table
    assert "| **narwhal-static-4p4d** | 95.0% | 85.0% | 1.25 | 125.0 |" in table


GRID = [0.5, 0.75, 1.0, 1.25, 1.5]


def test_the_sweep_walks_up_after_a_pass_and_down_after_a_miss() -> None:
    assert gr.next_rate(GRID, [], 1.0) == 1.0
    assert gr.next_rate(GRID, [(1.0, True)], 1.0) == 1.25
    assert gr.next_rate(GRID, [(1.0, True), (1.25, True)], 1.0) == 1.5
    assert gr.next_rate(GRID, [(1.0, False)], 1.0) == 0.75
    assert gr.next_rate(GRID, [(1.0, False), (0.75, False)], 1.0) == 0.5


def test_the_sweep_stops_when_bracketed_at_a_grid_end_or_after_a_failed_run() -> None:
    assert gr.next_rate(GRID, [(1.0, True), (1.25, False)], 1.0) is None
    assert gr.next_rate(GRID, [(1.0, False), (0.75, True)], 1.0) is None
    assert gr.next_rate(GRID, [(1.0, True), (1.25, True), (1.5, True)], 1.0) is None
    assert gr.next_rate(GRID, [(1.0, False), (0.75, False), (0.5, False)], 1.0) is None
    assert gr.next_rate(GRID, [(1.0, None)], 1.0) is None


def test_outcomes_judge_each_run_against_the_target() -> None:
    sweep = [
        {"rate": 1.0, "status": "ran", "attainment": 0.9},
        {"rate": 1.25, "status": "ran", "attainment": 0.89},
        {"rate": 1.5, "status": "failed", "reason": "x"},
    ]
    assert gr.outcomes(sweep, 0.9) == [(1.0, True), (1.25, False), (1.5, None)]


def test_initial_splits_resolve_best_and_start_a_converged_controller_there() -> None:
    chosen = goodput.select("narwhal-full,narwhal-static-4p4d,vllm-router-best")
    modelled = {3: 0.9, 6: 1.4, 7: 1.2}
    assert gr.initial_splits(chosen, modelled, converged=False) == {
        "narwhal-full": 4,
        "narwhal-static-4p4d": 4,
        "vllm-router-best": 6,
    }
    assert gr.initial_splits(chosen, modelled, converged=True)["narwhal-full"] == 6
    assert gr.initial_splits(chosen, modelled, converged=True)["narwhal-static-4p4d"] == 4


def test_compact_keeps_the_verdicts_and_the_split_but_not_the_big_series() -> None:
    phase = {"offered": 10, "offered_per_s": 1.0, "passing": 9, "attainment": 0.9}
    decisions = [{"t": 1.0, "result": "move", "gate": None}, {"t": 2.0, "result": "hold"}]
    result: dict[str, Any] = {
        "status": "ran",
        "split": "4P4D",
        "phases": {
            "all": {
                **phase,
                "refused": 1,
                "ttft_ms": {"p90": 120.0},
                "tpot_ms": {"p90": 30.0},
            },
            "decode_heavy": {**phase, "ttft_ms": {}},
        },
        "role_changes": 1,
        "pools": {"t": [0.0, 1.0], "prefill_engines": [4, 5], "decode_running": [3, 4]},
        "over_time": {"t": [0.0]},
        "controller_decisions": decisions,
        "wall_s": 10.0,
        "faithfulness": {},
    }
    kept = gr.compact(1.25, result, [("decode_heavy", 0.0, 10.0)])
    assert kept["controller_decisions"] == decisions
    assert kept["split_over_time"] == {"t": [0.0, 1.0], "prefill_engines": [4, 5]}
    assert kept["phases"] == {"decode_heavy": phase}
    assert (kept["rate"], kept["attainment"], kept["refused"]) == (1.25, 0.9, 1)
    failed = gr.compact(1.5, {"status": "failed", "reason": "fleet"}, [])
    assert failed == {"rate": 1.5, "status": "failed", "reason": "fleet"}
