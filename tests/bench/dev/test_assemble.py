"""tools/bench/dev/assemble.py: its code trees, its table, and a real child measurement."""

from __future__ import annotations

import argparse
from pathlib import Path

import assemble
import pytest
from benchkit import REPO
from codetree import parse_code


def test_code_trees_are_named_and_malformed_ones_refused(tmp_path: Path) -> None:
    (tmp_path / "narwhal").mkdir()
    (tmp_path / "narwhal" / "__init__.py").touch()
    assert parse_code(f"before={tmp_path}") == ("before", tmp_path.resolve())
    with pytest.raises(argparse.ArgumentTypeError, match="expected NAME=DIR"):
        parse_code(str(tmp_path))
    # A tree without a narwhal package would have the child import this checkout's.
    with pytest.raises(argparse.ArgumentTypeError, match="with DIR/narwhal/"):
        parse_code(f"before={tmp_path / 'narwhal'}")


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
