"""Every benchmark command answers --help with its usage, as a person trying it would ask."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_help_prints_usage_and_exits_0(script: str) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCH / script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=BENCH,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    # argparse's usage line, or (loadgen.py, started with one JSON spec) its docstring.
    summary = ast.get_docstring(ast.parse((BENCH / script).read_text()))
    assert summary is not None
    first_line = summary.splitlines()[0]
    assert result.stdout.startswith(("usage:", first_line)), result.stdout[:200]
    assert "Traceback" not in result.stderr
