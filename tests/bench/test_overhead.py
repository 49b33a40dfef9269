"""CPU pinning of the overhead benchmark's processes (tools/bench/overhead.py --pin)."""

from __future__ import annotations

import os
import subprocess
import sys

import overhead
import pytest
from benchkit import Processes

_SHOW_AFFINITY = "import os; print(sorted(os.sched_getaffinity(0)))"


def _affinity_of(procs: Processes, name: str) -> str:
    proc = procs.start(name, [sys.executable, "-c", _SHOW_AFFINITY], stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=30)
    return out.decode().strip()


def test_a_named_child_runs_only_on_its_cpus_and_others_are_left_alone() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    with Processes(affinity={"pinned": [allowed[0]]}) as procs:
        assert _affinity_of(procs, "pinned") == str([allowed[0]])
        assert _affinity_of(procs, "free") == str(allowed)


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
        "vllm-router": [1],
        "sim": [0],
        "loadgen": [0],
        "driver": [0],
    }
    assert (
        overhead.make_plan(quick=True, reps=None, targets=["direct"]).to_json()["pinning"] is None
    )
