"""tools/bench/assemble.py: its arguments, its table, and a real child measurement."""

from __future__ import annotations

import argparse

import assemble
import pytest
from benchkit import REPO


def test_code_trees_are_named_and_malformed_ones_refused() -> None:
    name, tree = assemble.parse_code("before=/tmp/x")
    assert (name, str(tree)) == ("before", "/tmp/x")
    with pytest.raises(argparse.ArgumentTypeError, match="expected NAME=DIR"):
        assemble.parse_code("/tmp/x")


def test_the_table_gives_the_cost_per_chunk() -> None:
    document = {"results": {"current": {"completions/1000": 0.002, "chat/16000": 0.032}}}
    assert assemble.table(document).splitlines()[2:] == [
        "| current | completions | 1000 | 2.0 | 2.00 |",
        "| current | chat | 16000 | 32.0 | 2.00 |",
    ]


def test_a_child_process_times_every_answer_kind_and_size() -> None:
    result = assemble.measure(REPO, reps=1)
    assert set(result) == {f"{k}/{n}" for k in ("completions", "chat") for n in assemble.SIZES}
    assert all(seconds > 0 for seconds in result.values())
