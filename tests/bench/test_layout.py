"""tools/bench as one package: results kept without matplotlib, commands at the top and
shared code in benchkit, the developer tools' tests out of the default run, and no
document naming a bench file that is not there."""

from __future__ import annotations

import ast
import itertools
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import benchkit
import overhead
import pytest

REPO = benchkit.REPO


def test_a_result_is_kept_without_matplotlib_and_the_message_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    document = {"benchmark": "overhead", "summary": [], "alternating_c1": {"summary": []}}
    path = tmp_path / "overhead.json"
    benchkit.publish(path, document, plot=overhead.plot)
    assert json.loads(path.read_text()) == document
    assert not path.with_suffix(".png").exists()
    out = capsys.readouterr()
    assert "no plot overhead.png: matplotlib is not installed" in out.err
    assert "pip install -e '.[bench]'" in out.err
    assert out.out == f"wrote {path}\n"
    # --replot has nothing else to do: it fails, saying the same.
    assert benchkit.show(path, replot=overhead.plot) == 1
    assert "pip install -e '.[bench]'" in capsys.readouterr().err


def test_the_extra_the_message_names_brings_matplotlib() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    bench = project["optional-dependencies"]["bench"]
    assert any(requirement.startswith("matplotlib") for requirement in bench)


def test_every_module_at_the_top_of_tools_bench_is_a_command() -> None:
    """Shared code lives in benchkit; a module at the top is something one runs."""
    for path in sorted(benchkit.BENCH.glob("*.py")) + sorted((benchkit.BENCH / "dev").glob("*.py")):
        tree = ast.parse(path.read_text())
        runs = any(
            isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body
        )
        assert runs or path.name == "codetree.py", f"{path.name} has no __main__"


def _collected(*args: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_the_developer_tools_tests_run_only_when_named() -> None:
    default = _collected("tests/bench")
    assert default
    assert not [t for t in default if t.startswith("tests/bench/dev/")]
    named = _collected("tests/bench/dev")
    assert named
    assert all(t.startswith("tests/bench/dev/") for t in named)


# Not after a colon: `git show REV:runs/bench/x.json` names a file of an earlier commit.
_PATH = re.compile(r"(?<![:\w/])(?:runs/bench|tools/bench)/[\w./{},*-]*")


def _expand(pattern: str) -> list[str]:
    """`a{,-b}.{json,png}` -> a.json, a.png, a-b.json, a-b.png."""
    parts = re.split(r"\{([^}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def _named_paths(text: str) -> set[str]:
    paths = set()
    for match in _PATH.finditer(text):
        pattern = match.group(0).rstrip(".,")
        if pattern.endswith(("/", "-")):
            continue  # a folder or a stem cut by a placeholder (runs/bench/<stem>...)
        paths.update(_expand(pattern))
    return paths


def _ignored(path: str) -> bool:
    """Written by runs, never committed (runs/bench/.gitignore)."""
    return "-quick" in path or "/logs" in path or "/profiles" in path or ".venv" in path


def test_the_documents_name_only_bench_files_that_exist() -> None:
    documents = [REPO / "tools" / "bench" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    missing = []
    for document in documents:
        for path in sorted(_named_paths(document.read_text())):
            if _ignored(path):
                continue
            if not (list(REPO.glob(path)) if "*" in path else (REPO / path).exists()):
                missing.append(f"{document.relative_to(REPO)}: {path}")
    assert missing == []
