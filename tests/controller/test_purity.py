"""The decision core imports no trio, httpx or prometheus (style guide: decide
synchronously, pure functions of a snapshot and a clock value)."""

from __future__ import annotations

import ast
import pathlib

import pytest

import narwhal.controller

CORE = ("_decide", "_load", "_demand", "_snapshot", "_state", "_profile", "_apply", "_fluid")
FORBIDDEN = ("trio", "httpx", "prometheus_client", "time", "asyncio", "anyio")
PACKAGE = pathlib.Path(narwhal.controller.__file__).parent


def imported(module: str) -> set[str]:
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
            elif node.level == 2 and node.module:
                names.add(f"narwhal.{node.module.split('.')[0]}")
    return names


@pytest.mark.parametrize("module", CORE)
def test_decision_core_module_imports_no_io_or_clock(module: str) -> None:
    names = imported(module)
    assert not names & set(FORBIDDEN), names
    # the only sibling package the core may read is the config model
    assert {n for n in names if n.startswith("narwhal.")} <= {"narwhal.config"}
