"""The pure parts of the benchmark harness: statistics, derived metrics, goals, config."""

from __future__ import annotations

from typing import Any

import benchkit
import overhead
import pytest
from benchkit import median, summarize

from narwhal.config import load_config


def test_summarize_reports_percentiles_not_samples() -> None:
    stats = summarize([float(x) for x in range(1, 101)])
    assert stats == {"n": 100, "p50": 50.5, "p90": 90.1, "p99": 99.01, "mean": 50.5}


def test_summarize_of_nothing_is_all_none() -> None:
    assert summarize([]) == {"n": 0, "p50": None, "p90": None, "p99": None, "mean": None}


def test_median_skips_missing_repetitions() -> None:
    assert median([3.0, None, 1.0, 2.0]) == 2.0
    assert median([None, None]) is None


def _raw(**overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "completed": 200,
        "errors": 0,
        "window_s": 4.0,
        "events": 6000,
        "latency_ms": summarize([10.0, 20.0]),
        "ttft_ms": summarize([2.0, 4.0]),
        "cpu_s": {
            "router": 0.8,
            "sim": 1.2,
            "loadgen": 0.4,
            "machine": 3.4,
            "machine_irq": 0.2,
        },
    }
    raw.update(overrides)
    return raw


def test_cell_metrics_divides_window_cpu_by_requests_chunks_and_tokens() -> None:
    cell = overhead.cell_metrics(_raw(), stream=True, tokens=32)
    assert cell["requests_per_s"] == 50.0
    assert cell["router_cpu_ms_per_request"] == 4.0
    assert cell["router_cpu_us_per_chunk"] == pytest.approx(133.3)
    assert cell["router_cpu_us_per_token"] == 125.0
    assert cell["chunks_per_stream"] == 30.0
    # 3.4 busy - 0.2 interrupts - 2.4 ours = 0.8 core-seconds of other processes.
    assert cell["other_cpu_share"] == 0.2
    assert cell["irq_cpu_share"] == 0.05


def test_cell_metrics_without_router_has_no_router_numbers() -> None:
    raw = _raw()
    del raw["cpu_s"]["router"]
    cell = overhead.cell_metrics(raw, stream=False, tokens=4)
    assert cell["router_cpu_ms_per_request"] is None
    assert cell["ttft_ms"] is None
    assert cell["sim_cpu_ms_per_request"] == 6.0


def test_added_ttft_is_router_minus_direct_within_a_repetition() -> None:
    def cell(p50: float, p99: float) -> dict[str, Any]:
        return {"ttft_ms": {"p50": p50, "p99": p99}, "errors": 0}

    reps = [
        {"direct": cell(5.0, 9.0), "narwhal": cell(6.5, 12.0)},
        {"direct": cell(6.0, 8.0), "narwhal": cell(6.25, 10.0)},
        {"direct": cell(5.0, 9.0), "narwhal": cell(4.5, 9.5)},
    ]
    overhead.add_differences(reps, stream=True)
    assert [r["narwhal"]["added_ttft_ms"]["p50"] for r in reps] == [1.5, 0.25, -0.5]
    row = overhead.median_of([r["narwhal"] for r in reps])
    assert row["added_ttft_p50_ms"] == 0.25
    assert row["added_ttft_p99_ms"] == 2.0  # of 3.0, 2.0 and 0.5
    assert "added_ttft_ms" not in reps[0]["direct"]


def test_goals_use_the_thresholds_fixed_before_measuring() -> None:
    def row(mode: str, conc: int, **values: float) -> dict[str, Any]:
        return {"mode": mode, "concurrency": conc, "target": "narwhal", **values}

    summary = [
        row("stream", 64, added_ttft_p50_ms=0.8, router_cpu_ms_per_request=2.0),
        row("stream", 512, router_cpu_ms_per_request=3.0),
        row("non-stream", 64, router_cpu_ms_per_request=1.0),
        row("non-stream", 512, router_cpu_ms_per_request=1.2),
    ]
    goals = overhead.evaluate_goals(summary)["narwhal"]
    assert goals["added_ttft_met"] is True
    assert goals["flat_cpu"]["non-stream"] == {
        "at_64": 1.0,
        "at_512": 1.2,
        "ratio_512_over_64": 1.2,
        "met": True,
    }
    assert goals["flat_cpu"]["stream"]["met"] is False
    assert overhead.evaluate_goals(summary)["vllm-router"]["added_ttft_met"] is None


def test_rotation_changes_who_goes_first_each_repetition() -> None:
    targets = ["direct", "narwhal", "vllm-router"]
    assert [benchkit.rotated(targets, k)[0] for k in range(4)] == [
        "direct",
        "narwhal",
        "vllm-router",
        "direct",
    ]


def test_benchmark_narwhal_config_is_a_valid_config() -> None:
    document = overhead.narwhal_config("http://127.0.0.1:9001", "http://127.0.0.1:9002", 9000)
    config = load_config(document)
    assert [e.role for e in config.engines] == ["prefill", "decode"]
    assert config.serving.admission == "open"


async def _quiet(**_: object) -> tuple[float, float]:
    return 0.0, 0.1


async def test_guard_reruns_a_disturbed_cell_and_keeps_the_least_disturbed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(benchkit._cpu, "wait_quiet", _quiet)
    others = iter([0.9, 0.5, 0.6])
    cells: list[dict[str, Any]] = []

    async def once() -> dict[str, Any]:
        cell = {"other_cpu_share": next(others), "value": len(cells)}
        cells.append(cell)
        return cell

    kept = await benchkit.measure_guarded(once, attempts=3, max_other_cores=0.35, quiet_give_up_s=1)
    assert kept["value"] == 1
    assert kept["guard"]["kept"] == 1
    assert [a["other_cpu_share"] for a in kept["guard"]["attempts"]] == [0.9, 0.5, 0.6]
    summary = benchkit.disturbance([kept, {"other_cpu_share": 0.1}])
    assert summary["cells_rerun"] == 1
    assert summary["cells_over_guard_after_reruns"] == 1


async def test_guard_stops_at_the_first_quiet_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(benchkit._cpu, "wait_quiet", _quiet)
    calls: list[int] = []

    async def once() -> dict[str, Any]:
        calls.append(1)
        return {"other_cpu_share": 0.1}

    await benchkit.measure_guarded(once, attempts=3, max_other_cores=0.35, quiet_give_up_s=1)
    assert len(calls) == 1


def test_alternating_probe_metrics_per_target() -> None:
    raw = {
        "window_s": 10.0,
        "cpu_s": {"sim": 2.0, "narwhal": 1.0, "machine": 4.0, "machine_irq": 0.5},
        "targets": {
            "direct": {
                "completed": 100,
                "errors": 0,
                "active_s": 5.0,
                "events": 3000,
                "latency_ms": {"p50": 40.0, "p99": 50.0},
                "ttft_ms": {"p50": 6.0, "p99": 9.0},
            },
            "narwhal": {
                "completed": 80,
                "errors": 0,
                "active_s": 5.0,
                "events": 2400,
                "latency_ms": {"p50": 45.0, "p99": 60.0},
                "ttft_ms": {"p50": 8.5, "p99": 15.0},
            },
        },
    }
    probe = overhead.alternating_metrics(raw, stream=True, tokens=32)
    assert probe["other_cpu_share"] == 0.05  # (4.0 - 0.5 - 3.0) / 10 s
    narwhal = probe["narwhal"]
    assert narwhal["router_cpu_ms_per_request"] == 12.5
    assert narwhal["router_cpu_us_per_chunk"] == pytest.approx(416.7)
    assert narwhal["added_ttft_ms"] == {"p50": 2.5, "p99": 6.0}
    assert narwhal["requests_per_s"] == 16.0
    assert "added_ttft_ms" not in probe["direct"]


def test_a_replay_whose_simulator_lagged_past_the_limit_carries_a_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from benchkit import harness

    limit = harness.STARVED_LAG_FRACTION
    assert harness.starved(None) is None  # no steps: nothing to judge
    assert harness.starved(limit) is None
    warning = harness.starved(0.085)
    assert warning is not None
    assert warning.startswith("the simulator lagged 8.5% of its steps (above 2%)")
    harness.warn_if_starved("goodput: narwhal-full", {"warning": warning})
    harness.warn_if_starved("goodput: narwhal-full", {"warning": None})
    assert capsys.readouterr().err == f"goodput: narwhal-full: WARNING: {warning}\n"
