"""The developer tools in tools/bench/dev import each other and benchkit as top-level
modules (they run as `python tools/bench/dev/X.py`), so both folders go on sys.path.

These tests are left out of the default run (pyproject's norecursedirs); run them with
`.venv/bin/pytest tests/bench/dev`."""

from __future__ import annotations

import sys
from pathlib import Path

_BENCH = Path(__file__).resolve().parents[3] / "tools" / "bench"
for _folder in (str(_BENCH), str(_BENCH / "dev")):
    if _folder not in sys.path:
        sys.path.insert(0, _folder)
