"""Recovery depends on the fleet and the signals module, never on serving: the request
path reports to recovery through `narwhal.signals`, and recovery reads the router it runs
in through `RecoveryHost`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import narwhal

ROOT = Path(narwhal.__file__).parent
# The narwhal packages each package may import (its own modules aside).
# `_records` is the state records' JSON conversion, a leaf like `_errors`.
ALLOWED = {
    "recovery": {
        "_codes",
        "_errors",
        "_records",
        "config",
        "engines",
        "fleet",
        "metrics",
        "signals",
    },
    "signals": {"_errors", "fleet"},
}


def _imported(package: str) -> dict[str, set[str]]:
    """The narwhal packages each module of `package` imports, by module."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).glob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module:
                names.add(node.module.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                parts = node.module.split(".")
                if parts[0] == "narwhal" and len(parts) > 1:
                    names.add(parts[1])
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == "narwhal" and len(parts) > 1:
                        names.add(parts[1])
        found[path.name] = names - {package}
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_it_may(package: str) -> None:
    imported = _imported(package)
    assert imported, f"no modules found in narwhal/{package}"
    extra = {name: sorted(names - ALLOWED[package]) for name, names in imported.items()}
    assert {name: names for name, names in extra.items() if names} == {}
