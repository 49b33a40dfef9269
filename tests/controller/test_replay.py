"""tools/replay.py: a trace through the controller in simulated time, JSON report."""

from __future__ import annotations

import importlib.util
import json
import pathlib
from types import ModuleType

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
AZURE = pathlib.Path("/work/shared/traces/azure2023/AzureLLMInferenceTrace_conv.csv")


def replay() -> ModuleType:
    spec = importlib.util.spec_from_file_location("replay", REPO / "tools" / "replay.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_synthetic_phase_shift_is_reported(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "r.json"
    argv = [
        "--synthetic",
        "200:30:300:100,200:8:2500:20",
        "--profile",
        "scenario",
        "--ttft",
        "1.5",
        "--out",
        str(out),
    ]
    assert replay().main(argv) == 0
    report = json.loads(out.read_text())
    assert report["initial_split"] == "4P:4D"
    summary = report["summary"]
    assert summary["flips"] == len(report["flips"]) > 0
    assert {"time_in_split_s", "gates", "results", "reasons", "slo_attainment"} <= set(summary)
    assert sum(summary["time_in_split_s"].values()) == pytest.approx(400.0, abs=1.0)
    assert report["proposals"]
    assert report["proposals"][0]["proposed"] != report["proposals"][0]["current"]


def test_static_mode_keeps_roles_and_lists_proposals(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "r.json"
    argv = ["--synthetic", "200:30:300:100", "--profile", "scenario", "--ttft", "1.5"]
    argv += ["--static", "--out", str(out)]
    assert replay().main(argv) == 0
    report = json.loads(out.read_text())
    assert report["summary"]["flips"] == 0
    assert report["final_split"] == report["initial_split"]
    assert report["controller"]["advisory"] is True
    assert any(p["result"] == "advisory" for p in report["proposals"])


@pytest.mark.skipif(not AZURE.exists(), reason="shared Azure trace not present")
def test_recorded_azure_trace_replays_bounded(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "r.json"
    argv = ["--trace", str(AZURE), "--max-requests", "600", "--speed", "4", "--out", str(out)]
    assert replay().main(argv) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 600
    assert report["source"]["traces"] == [str(AZURE)]


def test_azure_timestamps_keep_sub_microsecond_digits() -> None:
    ts = replay()._timestamp
    assert ts("2023-11-16 18:17:04.0319600") - ts("2023-11-16 18:17:03.9799600") == pytest.approx(
        0.052
    )
