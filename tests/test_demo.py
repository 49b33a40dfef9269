"""The README's demo command works end to end (a short run of it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_demo_runs_the_fleet_router_and_workload() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "narwhal.demo", "--requests", "12", "--speed", "4"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "outcomes          {'ok': 12}" in proc.stdout
    assert '"retained": 0' in proc.stdout  # the final /narwhal/state is printed
    assert proc.stderr == ""
