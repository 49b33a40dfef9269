"""CPU accounting from /proc, and the guard that keeps other users of a shared box out
of a measurement.

Owns: a process's CPU seconds, the machine's busy and interrupt seconds, waiting for a
quiet box, re-running a disturbed measurement cell, and the disturbance summary.
Invariants: the guard chooses which attempt to keep by its disturbance alone
(`other_cpu_share`), never by the measured values, and records every attempt.
Errors: `cpu_seconds` raises OSError for a process that is gone.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence

import trio

from ._facts import Json
from ._stats import median, rounded

TICKS = os.sysconf("SC_CLK_TCK")
# Other sessions share the box. Before each cell the benchmarks wait (bounded) until it is
# this quiet, and re-run a cell during which other processes used more than this.
GUARD_CORES = 0.35


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all threads included (not its children)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        # The command name may contain spaces and parentheses; fields follow the last ")".
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def descendants(pid: int) -> list[int]:
    """Pids of `pid`'s descendants now, from /proc (none once it is gone)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        kids: list[int] = []
        # Every thread's children: a child forked from another thread than the main one
        # (trio's open_process runs Popen in a worker thread) is listed under that thread.
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{parent}/task"):
                with (
                    contextlib.suppress(OSError),
                    open(f"/proc/{parent}/task/{task}/children", encoding="ascii") as fh,
                ):
                    kids.extend(int(p) for p in fh.read().split())
        found.extend(kids)
        todo.extend(kids)
    return found


def tree_cpu_seconds(pid: int) -> float:
    """`cpu_seconds` of a process and its live descendants (a Narwhal's worker
    processes, serving.workers); raises OSError when the process itself is gone."""
    total = cpu_seconds(pid)
    for child in descendants(pid):
        with contextlib.suppress(OSError):  # it exited meanwhile
            total += cpu_seconds(child)
    return total


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, interrupts): CPU seconds the whole machine spent since boot, all cores and
    processes; `interrupts` is the irq+softirq part, where loopback TCP work often lands
    without being charged to any process."""
    with open("/proc/stat", encoding="ascii") as fh:
        fields = fh.readline().split()
    # user nice system idle iowait irq softirq steal ...
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / TICKS, (irq + softirq) / TICKS


async def wait_quiet(
    *, max_busy_cores: float, sample_s: float = 1.0, give_up_s: float = 30.0
) -> tuple[float, float]:
    """Wait until the machine (which our own idle processes barely use) has been quieter
    than `max_busy_cores` over one sample, or `give_up_s` passed. Returns (seconds waited,
    busy cores in the last sample). Other users of a shared box are not ours to stop;
    this only avoids starting a measurement in the middle of their burst."""
    started = trio.current_time()
    while True:
        before = machine_cpu_seconds()[0]
        await trio.sleep(sample_s)
        busy = (machine_cpu_seconds()[0] - before) / sample_s
        waited = trio.current_time() - started
        if busy <= max_busy_cores or waited >= give_up_s:
            return round(waited, 1), round(busy, 2)


async def measure_guarded(
    run_once: Callable[[], Awaitable[dict[str, Json]]],
    *,
    attempts: int,
    max_other_cores: float,
    quiet_give_up_s: float,
) -> dict[str, Json]:
    """Run one measurement cell, re-running it when other processes on the box used more
    than `max_other_cores` during its window; keep the least disturbed attempt.

    Every attempt's disturbance is recorded in the kept cell under "guard".
    """
    kept: dict[str, Json] | None = None
    seen: list[Json] = []
    for _ in range(max(1, attempts)):
        waited, busy = await wait_quiet(max_busy_cores=max_other_cores, give_up_s=quiet_give_up_s)
        cell = await run_once()
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


def rotated(items: Sequence[str], k: int) -> list[str]:
    """`items` starting at the k-th: who goes first changes with every repetition, so a
    slow drift of the box hits every target alike."""
    k %= max(1, len(items))
    return [*items[k:], *items[:k]]


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
