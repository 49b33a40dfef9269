"""The benchmark scripts in tools/bench import benchkit and each other as top-level
modules (they run as `python tools/bench/X.py`), so their folder goes on sys.path for
these tests. The developer tools' tests (tests/bench/dev) are not in the default run."""

from __future__ import annotations

import sys
from pathlib import Path

_BENCH = str(Path(__file__).resolve().parents[2] / "tools" / "bench")
if _BENCH not in sys.path:
    sys.path.insert(0, _BENCH)
