"""Shared pieces of the benchmarks in tools/bench: machine and version facts, summary
statistics, CPU accounting from /proc, and child processes that are always stopped.

Everything here is synchronous; the load generators are trio programs of their own.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from importlib import metadata
from pathlib import Path
from types import FrameType
from typing import IO, Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
RUNS = REPO / "runs" / "bench"
TICKS = os.sysconf("SC_CLK_TCK")

# A JSON-able value, what the result files are made of. Any rather than a recursive
# union: the documents are built by nesting lists of dicts, which invariance rejects.
Json = Any


# ---------------------------------------------------------------------------- statistics


def summarize(samples: Sequence[float], *, digits: int = 3) -> dict[str, Json]:
    """n, p50, p90, p99 and mean of raw samples (the raw arrays are not kept)."""
    if not samples:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "mean": None}
    values = np.asarray(samples, dtype=float)
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {
        "n": len(values),
        "p50": round(float(p50), digits),
        "p90": round(float(p90), digits),
        "p99": round(float(p99), digits),
        "mean": round(float(values.mean()), digits),
    }


def median(values: Sequence[float | None]) -> float | None:
    """Median of the repetitions that produced a value; None when none did."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return float(np.median(present))


def rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


# ---------------------------------------------------------------------------- /proc


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all threads included (not its children)."""
    with open(f"/proc/{pid}/stat") as fh:
        # The command name may contain spaces and parentheses; fields follow the last ")".
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, interrupts): CPU seconds the whole machine spent since boot, all cores and
    processes; `interrupts` is the irq+softirq part, where loopback TCP work often lands
    without being charged to any process."""
    with open("/proc/stat") as fh:
        fields = fh.readline().split()
    # user nice system idle iowait irq softirq steal ...
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / TICKS, (irq + softirq) / TICKS


def wait_quiet(
    *, max_busy_cores: float, sample_s: float = 1.0, give_up_s: float = 30.0
) -> tuple[float, float]:
    """Wait until the machine (which our own idle processes barely use) has been quieter
    than `max_busy_cores` over one sample, or `give_up_s` passed. Returns (seconds waited,
    busy cores in the last sample). Other users of a shared box are not ours to stop;
    this only avoids starting a measurement in the middle of their burst."""
    started = time.monotonic()
    while True:
        before = machine_cpu_seconds()[0]
        time.sleep(sample_s)
        busy = (machine_cpu_seconds()[0] - before) / sample_s
        waited = time.monotonic() - started
        if busy <= max_busy_cores or waited >= give_up_s:
            return round(waited, 1), round(busy, 2)


def measure_guarded(
    run_once: Callable[[], dict[str, Json]],
    *,
    attempts: int,
    max_other_cores: float,
    quiet_give_up_s: float,
) -> dict[str, Json]:
    """Run one measurement cell, re-running it when other processes on the box used more
    than `max_other_cores` during its window; keep the least disturbed attempt.

    The choice depends only on the disturbance (`other_cpu_share`, CPU of processes that
    are not part of the benchmark), never on the measured values, and every attempt's
    disturbance is recorded in the cell under "guard".
    """
    kept: dict[str, Json] | None = None
    seen: list[Json] = []
    for _ in range(max(1, attempts)):
        waited, busy = wait_quiet(max_busy_cores=max_other_cores, give_up_s=quiet_give_up_s)
        cell = run_once()
        other = float(cell["other_cpu_share"])
        seen.append({"quiet_wait_s": waited, "busy_cores_before": busy, "other_cpu_share": other})
        if kept is None or other < float(kept["other_cpu_share"]):
            kept = cell
        if other <= max_other_cores:
            break
    assert kept is not None
    kept["guard"] = {
        "attempts": seen,
        "kept": next(
            i for i, a in enumerate(seen) if a["other_cpu_share"] == kept["other_cpu_share"]
        ),
        "max_other_cores": max_other_cores,
    }
    return kept


def disturbance(cells: Sequence[Mapping[str, Json]]) -> dict[str, Json]:
    """How much other users of the box disturbed a run, over the cells kept."""
    others = [float(c["other_cpu_share"]) for c in cells]
    guards = [c["guard"] for c in cells if isinstance(c.get("guard"), dict)]
    limit = float(guards[0]["max_other_cores"]) if guards else None
    return {
        "cells": len(cells),
        "median_other_cores": rounded(median(others)),
        "max_other_cores": rounded(max(others)) if others else None,
        "cells_rerun": sum(1 for g in guards if len(g["attempts"]) > 1),
        "cells_over_guard_after_reruns": sum(1 for o in others if limit is not None and o > limit),
    }


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------------- facts


def machine() -> dict[str, Json]:
    model = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_kib = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
                break
    return {
        "cpu_model": model,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kib / 2**20, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
    }


def versions(names: Sequence[str]) -> dict[str, Json]:
    out: dict[str, Json] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_revision() -> dict[str, Json]:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=False
        ).stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD") or None,
        "branch": git("rev-parse", "--abbrev-ref", "HEAD") or None,
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def load_average() -> list[Json]:
    return [round(x, 2) for x in os.getloadavg()]


def save_figure(fig: Any, path: Path) -> None:
    """Lay out, write (110 dpi) and close a matplotlib figure."""
    import matplotlib.pyplot as plt  # the bench extra; only plotting needs it

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(path: Path, document: Mapping[str, Json]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")


def publish(
    path: Path,
    document: Mapping[str, Json] | None,
    *,
    plot: Callable[[Json, Path], None],
    table: Callable[[Json], str],
) -> None:
    """Write a result (None: re-read it from `path`), draw its PNG beside it, print its
    README table. With None this is a benchmark's `--replot`."""
    if document is None:
        document = json.loads(path.read_text())
    else:
        write_json(path, document)
    png = path.with_suffix(".png")
    plot(document, png)
    print(table(document))
    print(f"wrote {path} and {png}", flush=True)


def replot_or_run(
    path: Path,
    replot: bool,
    run: Callable[[], int],
    *,
    plot: Callable[[Json, Path], None],
    table: Callable[[Json], str],
) -> int:
    """A benchmark's main: `--replot` redraws the PNG from the JSON at `path`; else run."""
    if replot:
        publish(path, None, plot=plot, table=table)
        return 0
    return run()


# ---------------------------------------------------------------------------- processes


def free_port() -> int:
    """A loopback port that was free a moment ago (the benchmark owns the box's loopback)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Processes:
    """Children started by a benchmark; every one is stopped by PID on exit, even on failure.

    SIGTERM first (each process gets `grace_s` to exit cleanly), then SIGKILL. SIGTERM and
    SIGHUP sent to the benchmark itself become SystemExit, so the cleanup runs for them too.
    """

    def __init__(
        self, *, grace_s: float = 5.0, affinity: Mapping[str, Sequence[int]] | None = None
    ) -> None:
        self.grace_s = grace_s
        # CPUs per process name: a child started under a listed name runs only there (set
        # before exec, so every thread it starts inherits it).
        self.affinity = {name: tuple(cpus) for name, cpus in (affinity or {}).items()}
        self._children: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Processes:
        for signum in (signal.SIGTERM, signal.SIGHUP):
            self._previous[signum] = signal.signal(signum, _exit_on_signal)
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.stop_all()
        finally:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)  # type: ignore[arg-type]

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        stdout: int | IO[bytes] | None = subprocess.DEVNULL,
        stderr: int | IO[bytes] | None = subprocess.DEVNULL,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        cpus = self.affinity.get(name)
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            env=dict(env) if env is not None else None,
            cwd=REPO,
            preexec_fn=partial(os.sched_setaffinity, 0, cpus) if cpus is not None else None,
        )
        self._children.append((name, proc))
        return proc

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=self.grace_s)
        self._children = [(n, p) for n, p in self._children if p is not proc]

    def stop_all(self) -> None:
        # Routers before the fleet, so nothing is left talking to a dead engine.
        for _, proc in reversed(list(self._children)):
            self.stop(proc)


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def read_lines(proc: subprocess.Popen[bytes], count: int, *, timeout_s: float) -> list[str]:
    """The first `count` stdout lines of a child, or RuntimeError if it dies or is slow."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    deadline = time.monotonic() + timeout_s
    buffer = b""
    while buffer.count(b"\n") < count:
        if proc.poll() is not None:
            raise RuntimeError(f"process {proc.pid} exited with {proc.returncode} during startup")
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {proc.pid} printed nothing within {timeout_s}s")
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            time.sleep(0.02)
            continue
        if not chunk:
            time.sleep(0.02)
        buffer += chunk
    return buffer.decode().splitlines()[:count]


def http_get(host: str, port: int, path: str, *, timeout_s: float = 2.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def wait_ready(
    proc: subprocess.Popen[bytes], host: str, port: int, path: str, *, timeout_s: float
) -> float:
    """Poll GET path until 200; returns the seconds it took. Raises if the process dies."""
    started = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"process {proc.pid} exited with {proc.returncode} during startup")
        try:
            status, _ = http_get(host, port, path, timeout_s=1.0)
            if status == 200:
                return time.monotonic() - started
        except OSError:
            pass
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"{host}:{port}{path} not ready within {timeout_s}s")
        time.sleep(0.1)


@contextlib.contextmanager
def log_file(path: Path) -> Iterator[IO[bytes]]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        yield fh


def python() -> str:
    return sys.executable
