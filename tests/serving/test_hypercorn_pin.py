"""hypercorn stays behind one module and one range: only narwhal/serving/_server.py imports
it, pyproject.toml pins the releases that module was checked against, and a release
outside them stops startup with a message naming both (narwhal/_hypercorn_pin.py)."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import narwhal
from narwhal._hypercorn_pin import HYPERCORN_RANGE, hypercorn_refusal, supported_text

ROOT = Path(narwhal.__file__).parent
REPO = ROOT.parent
SERVER = Path("serving/_server.py")


def _imports_hypercorn(tree: ast.AST) -> list[int]:
    """The lines of `tree` that import hypercorn or one of its modules."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if any(name == "hypercorn" or name.startswith("hypercorn.") for name in names):
            lines.append(node.lineno)
    return lines


def test_only_the_server_module_imports_hypercorn() -> None:
    found = {
        str(path.relative_to(ROOT)): lines
        for path in sorted(ROOT.rglob("*.py"))
        if (lines := _imports_hypercorn(ast.parse(path.read_text())))
    }
    assert set(found) == {str(SERVER)}


def test_the_import_check_sees_every_form_of_import() -> None:
    source = "import hypercorn\nimport hypercorn.config as c\nfrom hypercorn.trio import serve\n"
    assert _imports_hypercorn(ast.parse(source)) == [1, 2, 3]
    assert _imports_hypercorn(ast.parse("import hypercornish\nfrom .hypercorn import x\n")) == []


def test_pyproject_pins_the_range_the_server_was_checked_against() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = [d for d in project["dependencies"] if d.startswith("hypercorn")]
    assert pins == [f"hypercorn{supported_text()}"]
    assert supported_text() == ">=0.17,<0.19"
    assert HYPERCORN_RANGE == ((0, 17), (0, 19))


@pytest.mark.parametrize("version", ["0.17.0", "0.17.3", "0.18.0", "0.18.12", "0.18.1rc1"])
def test_a_release_in_the_range_is_served(version: str) -> None:
    assert hypercorn_refusal(version) is None


@pytest.mark.parametrize("version", ["0.16.0", "0.19.0", "0.19.0rc1", "1.0", "1.18.0", "dev"])
def test_a_release_outside_the_range_is_refused_by_name(version: str) -> None:
    refusal = hypercorn_refusal(version)
    assert refusal is not None
    assert str(refusal) == (
        f"hypercorn {version} is installed; narwhal's HTTP server supports hypercorn "
        ">=0.17,<0.19 only (it relies on hypercorn internals checked against those "
        "releases): pip install 'hypercorn>=0.17,<0.19'"
    )


def test_no_hypercorn_distribution_is_refused() -> None:
    refusal = hypercorn_refusal(None)
    assert refusal is not None
    assert str(refusal).startswith("no hypercorn distribution is installed; ")


# `narwhal serve` in a fresh interpreter whose hypercorn reports `version` (the code
# imported is still the installed one): the check must run before any of hypercorn's
# private names are touched, and before the config is read.
_SERVE_WITH_VERSION = """
import importlib.metadata, runpy, sys
real = importlib.metadata.version
importlib.metadata.version = lambda name: {version!r} if name == "hypercorn" else real(name)
for name in {missing!r}:
    sys.modules[name] = None  # a private module a release moved away
sys.argv = ["narwhal", "serve", "--config", "/nonexistent/narwhal.json"]
runpy.run_module("narwhal", run_name="__main__")
"""


def _serve(version: str, missing: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    code = _SERVE_WITH_VERSION.format(version=version, missing=missing)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


def test_startup_on_an_unsupported_release_fails_naming_it_and_the_range() -> None:
    result = _serve("0.19.0")
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        "narwhal: hypercorn 0.19.0 is installed; "
        "narwhal's HTTP server supports hypercorn >=0.17,<0.19 only (it relies on hypercorn "
        "internals checked against those releases): pip install 'hypercorn>=0.17,<0.19'"
    )
    assert "Traceback" not in result.stderr


def test_a_supported_release_missing_a_private_module_says_so() -> None:
    result = _serve("0.18.0", missing=("hypercorn.trio.tcp_server",))
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        "narwhal: hypercorn 0.18.0 is installed "
        "but lacks what narwhal's HTTP server imports (import of hypercorn.trio.tcp_server "
        "halted; None in sys.modules): reinstall hypercorn>=0.17,<0.19"
    )


def test_startup_on_a_supported_release_gets_past_the_check() -> None:
    result = _serve("0.18.0")
    assert "UnsupportedHypercorn" not in result.stderr
    assert "/nonexistent/narwhal.json" in result.stderr  # it went on to read the config
