"""Small builders for configuration documents, shared by the config tests."""

from __future__ import annotations

import copy
import pathlib
import re
import subprocess
import sys
from typing import Any

import pytest

from narwhal.config import ConfigError, load_config

REPO = pathlib.Path(__file__).resolve().parents[2]

# A message starts with a dotted path (keys that are not identifiers appear as JSON
# strings in brackets) or with the source name standing for the whole document.
_SEGMENT = r'(?:\[(?:\d+|"(?:[^"\\]|\\.)*")\])'
PATH_PREFIX = re.compile(
    rf"^(?:<config>|(?:[A-Za-z_]\w*|{_SEGMENT})(?:\.[A-Za-z_]\w*|{_SEGMENT})*): \S", re.ASCII
)


def run_validate(
    path: pathlib.Path, *, file_only: bool = True, cwd: pathlib.Path = REPO
) -> subprocess.CompletedProcess[str]:
    """`narwhal validate --config PATH` as an operator runs it; `file_only` leaves out
    the checks of this host (what `narwhal serve` would meet here)."""
    flags = ["--file-only"] if file_only else []
    return subprocess.run(
        [sys.executable, "-m", "narwhal", "validate", "--config", str(path), *flags],
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
        timeout=60,  # a validation that hangs fails its test
    )


def engine(index: int, role: str = "both", **fields: Any) -> dict[str, Any]:
    return {"id": f"e{index}", "url": f"http://127.0.0.1:{8100 + index}", "role": role, **fields}


def fleet(*roles: str) -> list[dict[str, Any]]:
    return [engine(index, role) for index, role in enumerate(roles)]


def document(**sections: Any) -> dict[str, Any]:
    """A valid two-engine document (one prefill, one decode) with `sections` merged in."""
    doc: dict[str, Any] = {"engines": fleet("prefill", "decode")}
    for name, value in sections.items():
        if isinstance(value, dict) and isinstance(doc.get(name), dict):
            doc[name] = {**doc[name], **value}
        else:
            doc[name] = value
    return doc


def with_value(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of `doc` with `value` at a dotted path such as `engines[1].role`."""
    out = copy.deepcopy(doc)
    node: Any = out
    parts = re.findall(r"[^.\[\]]+|\[\d+\]", path)
    for part in parts[:-1]:
        node = node[int(part[1:-1])] if part.startswith("[") else node.setdefault(part, {})
    last = parts[-1]
    if last.startswith("["):
        node[int(last[1:-1])] = value
    else:
        node[last] = value
    return out


def problems(doc: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(doc)
    return info.value.messages
