"""CPU pinning of the overhead benchmark's processes (tools/bench/overhead.py --pin)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import overhead
import pytest
from benchkit.harness import Procs, read_lines

_SHOW_AFFINITY = "import os; print(sorted(os.sched_getaffinity(0)))"


async def _affinity_of(procs: Procs, name: str) -> str:
    proc = await procs.start(name, [sys.executable, "-c", _SHOW_AFFINITY], stdout_pipe=True)
    (line,) = await read_lines(proc, 1, within_s=30)
    return line


async def test_a_named_child_runs_only_on_its_cpus_and_others_are_left_alone(
    tmp_path: Path,
) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    async with Procs(tmp_path, affinity={"pinned": [allowed[0]], "sim": [allowed[0]]}) as procs:
        assert await _affinity_of(procs, "pinned") == str([allowed[0]])
        # A name covers its numbered instances (the fleet's sim0, sim1).
        assert await _affinity_of(procs, "sim1") == str([allowed[0]])
        assert await _affinity_of(procs, "free") == str(allowed)
        assert (tmp_path / "free.log").exists()


def test_routers_get_the_last_cpu_alone() -> None:
    pins = overhead.pinning_for([2, 0, 3, 1])
    assert pins["narwhal"] == pins["vllm-router"] == (3,)
    assert pins["sim"] == pins["loadgen"] == pins["driver"] == (0, 1, 2)
    assert overhead.pinning_for([0, 1])["sim"] == (0,)


def test_pinning_needs_two_cpus() -> None:
    with pytest.raises(ValueError, match="--pin needs at least 2 CPUs"):
        overhead.pinning_for([5])


def test_pinned_plans_record_where_each_process_ran() -> None:
    plan = overhead.make_plan(
        quick=True, reps=None, targets=["direct"], pinning=overhead.pinning_for([0, 1])
    )
    assert plan.to_json()["pinning"] == {
        "narwhal": [1],
        "narwhal-lean": [1],
        "vllm-router": [1],
        "sim": [0],
        "loadgen": [0],
        "driver": [0],
    }
    assert (
        overhead.make_plan(quick=True, reps=None, targets=["direct"]).to_json()["pinning"] is None
    )
