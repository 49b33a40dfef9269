"""The benchmark scripts in tools/bench import each other as top-level modules (they run
as `python tools/bench/X.py`), so their directory goes on sys.path for these tests."""

from __future__ import annotations

import sys
from pathlib import Path

_BENCH = str(Path(__file__).resolve().parents[2] / "tools" / "bench")
if _BENCH not in sys.path:
    sys.path.insert(0, _BENCH)
