"""Where results go and what every result says about how it was measured.

Owns: the repository's paths (REPO, RUNS for committed results, TMP for logs and raw
rows), the machine, package versions, the git revision and the load average.
Invariants: reading a fact never fails a benchmark (an unreadable /proc file or a
missing git gives "unknown", None or False).
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
BENCH = REPO / "tools" / "bench"
RUNS = REPO / "runs" / "bench"
# Logs, generated configs and raw per-request rows: git-ignored, never committed.
TMP = REPO / "runs" / "tmp"

# A JSON-able value, what the result files are made of. Any rather than a recursive
# union: the documents are built by nesting lists of dicts, which invariance rejects.
Json = Any


def machine() -> dict[str, Json]:
    """The box a result was measured on. `cpu` and `cpus` repeat `cpu_model` and `cores`
    under the names the trace benchmarks' and the soak's results have always used."""
    model = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_kib = 0
    with contextlib.suppress(OSError), open("/proc/meminfo", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
                break
    return {
        "cpu_model": model,
        "cpu": model,
        "cores": os.cpu_count(),
        "cpus": os.cpu_count(),
        "memory_gib": round(mem_kib / 2**20, 1),
        "kernel": platform.release(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
    }


def versions(names: Sequence[str]) -> dict[str, Json]:
    """Installed versions of these distributions (None: not installed)."""
    out: dict[str, Json] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_revision() -> dict[str, Json]:
    """The commit the benchmark ran from, its branch, and whether tracked files differ."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=REPO, capture_output=True, text=True, check=False, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    return {
        "commit": git("rev-parse", "HEAD") or None,
        "branch": git("rev-parse", "--abbrev-ref", "HEAD") or None,
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def load_average() -> list[Json]:
    return [round(x, 2) for x in os.getloadavg()]
