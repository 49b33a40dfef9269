"""The per-phase oracle over goodput_rate sweeps (tools/bench/rate_oracle.py)."""

from __future__ import annotations

from typing import Any

import rate_oracle as ro


def run(rate: float, **phases: tuple[int, int]) -> dict[str, Any]:
    rows = {p: {"passing": ok, "offered": n, "attainment": ok / n} for p, (ok, n) in phases.items()}
    return {"rate": rate, "status": "ran", "attainment": 0.0, "phases": rows}


def test_each_phase_takes_the_split_that_passed_most_of_it() -> None:
    first = {
        "sweeps": {
            "narwhal-static-3p5d": [run(1.0, a=(100, 100), b=(50, 100))],
            "narwhal-static-5p3d": [run(1.0, a=(60, 100), b=(90, 100)), run(1.25, a=(1, 9))],
            "narwhal-full": [run(1.0, a=(99, 100), b=(99, 100))],
        }
    }
    # A later file's run replaces an earlier one's: 5P3D's x1 is re-measured.
    later = {"sweeps": {"narwhal-static-5p3d": [run(1.0, a=(70, 100), b=(80, 100))]}}
    result = ro.oracle([first, later], ["3p5d", "5p3d"])
    # x1.25 lacks 3P5D: no oracle there. The controller's run is not a candidate.
    assert list(result) == ["1"]
    row = result["1"]
    assert row["attainment"] == 0.9  # (100 + 80) / 200
    assert {p: v["split"] for p, v in row["per_phase"].items()} == {
        "a": "narwhal-static-3p5d",
        "b": "narwhal-static-5p3d",
    }
    assert row["runs"]["narwhal-static-5p3d"] == 0.0
