"""Other revisions of Narwhal for the developer tools' A/B runs (`--code NAME=DIR`).

Owns: parsing NAME=DIR, where DIR holds a narwhal package (say an extracted
`git archive REV narwhal`), timing code in a child process whose sys.path starts with
such a tree, so that each revision runs in a process of its own, and the result that
puts this checkout beside the named trees.
Errors: a DIR without narwhal/__init__.py is refused at parse time (argparse's
ArgumentTypeError): the child would otherwise import this checkout's narwhal silently.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchkit import REPO, Json, git_revision, machine, write_json


def parse_code(text: str) -> tuple[str, Path]:
    name, _, directory = text.partition("=")
    if not name or not directory or not (Path(directory) / "narwhal" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"expected NAME=DIR with DIR/narwhal/, got {text!r}")
    return name, Path(directory).resolve()


def in_child(program: str, tree: Path, *args: str) -> Any:
    """The JSON that `python -c program tree args...` prints; `program` puts `tree`
    first on its sys.path (it is sys.argv[1]) before importing narwhal."""
    done = subprocess.run(
        [sys.executable, "-c", program, str(tree), *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)


def compare(
    benchmark: str,
    config: Json,
    measure: Callable[[Path], Json],
    trees: Sequence[tuple[str, Path]],
    out: Path,
) -> Json:
    """`measure` this checkout ("current") and each named tree; the result, written to `out`."""
    document = {
        "benchmark": benchmark,
        "machine": machine(),
        "git": git_revision(),
        "config": config,
        "results": {name: measure(tree) for name, tree in [("current", REPO), *trees]},
    }
    write_json(out, document)
    return document
