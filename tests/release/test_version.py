"""Every command is installed on PATH and answers `--version` with the installed version."""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import subprocess
import sys
import sysconfig
import tomllib

import pytest

import narwhal

REPO = pathlib.Path(__file__).resolve().parents[2]
COMMANDS = sorted(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"])


def test_the_installed_entry_points_are_the_declared_commands() -> None:
    installed = importlib.metadata.distribution("narwhal").entry_points
    assert sorted(ep.name for ep in installed if ep.group == "console_scripts") == COMMANDS
    assert {"narwhal", "narwhalctl", "narwhal-check", "narwhal-profile", "narwhal-sim"} <= set(
        COMMANDS
    )


def test_the_version_is_the_installed_distributions() -> None:
    assert narwhal.__version__ == importlib.metadata.version("narwhal")
    assert narwhal.__version__ != "0.0" or not (REPO / ".git").exists(), (
        "installed from a git checkout, the version comes from git (tag or commit count)"
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_prints_the_version_and_exits_0(command: str) -> None:
    # The scripts directory of the interpreter running the tests: where `pip install`
    # put the commands, the directory a user's PATH names.
    path = pathlib.Path(sysconfig.get_path("scripts")) / command
    assert os.access(path, os.X_OK), f"{command} is not installed in {path.parent}"
    proc = subprocess.run(
        [str(path), "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        0,
        f"{command} {narwhal.__version__}\n",
        "",
    )


def test_python_dash_m_narwhal_has_the_version_too() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "narwhal", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith(f" {narwhal.__version__}\n")
