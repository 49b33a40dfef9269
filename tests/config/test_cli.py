"""`narwhal validate --config FILE` as an operator runs it."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from ..support import fifo
from .helpers import REPO, document, run_validate


@pytest.mark.parametrize("name", ["narwhal.json", "demo.json"])
def test_valid_config_prints_the_effective_config(name: str) -> None:
    proc = run_validate(REPO / "conf" / name)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    effective = json.loads(proc.stdout)
    assert len(effective["engines"]) == 4
    # defaults are filled in, not only the keys the file sets
    assert effective["controller"]["reactive"]["decode_correction_alpha"] == 0.2
    assert effective["serving"]["max_response_bytes"] == 16777216


def test_invalid_config_lists_every_problem_in_one_pass(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(
        json.dumps(
            {
                "engines": [{"id": "p0", "url": "http://127.0.0.1:8100"}],
                "serving": {"max_attempt": 2, "request_timeout_s": "30"},
                "listen": {"max_open_connections": 100},
                "controller": {"thresholds": {"shrink": -1}},
            }
        )
    )
    proc = run_validate(path)
    assert proc.returncode == 1
    assert proc.stdout == ""
    # The cross-field problem came only in a second run, once the types were right; the
    # rules that read an invalid value (or the key a typo was meant as) wait, and say so.
    assert proc.stderr.splitlines() == [
        f"narwhal: 4 problem(s) in {path}:",
        "serving.max_attempt: unknown key; did you mean 'max_attempts'?",
        'serving.request_timeout_s: expected a number, got "30"',
        "controller.thresholds.shrink: -1.0 must be nonnegative",
        "listen.max_open_connections: 100 must exceed serving.max_connections + "
        "serving.queue_capacity = 512, the retained-request ceiling",
        "narwhal: the cross-field rules that read controller.thresholds.shrink, "
        "serving.max_attempts, serving.request_timeout_s run once those values are valid",
    ]


def test_missing_config_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "nope.json"
    proc = run_validate(path)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"narwhal: 1 problem(s) in {path}:",
        f"{path}: no such file",
    ]


def test_a_fifo_as_api_key_file_fails_validation_at_once(tmp_path: pathlib.Path) -> None:
    # `narwhal validate` waited for a writer to the FIFO, forever.
    with fifo(tmp_path / "key") as key:
        path = tmp_path / "narwhal.json"
        path.write_text(json.dumps(document(engine={"api_key_file": key})))
        proc = run_validate(path)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"narwhal: 1 problem(s) in {path}:",
        f"engine.api_key_file: {json.dumps(key)}: cannot read file: it is a named pipe, not a "
        "regular file",
    ]


def test_help_documents_the_exit_statuses() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "narwhal", "validate", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert "exit status:\n  0  valid, and serve would start with it here, undegraded\n" in (
        proc.stdout
    )
    assert "  1  invalid: every problem is listed" in proc.stdout
    assert "  2  valid (printed), but serve here would refuse to start or start degraded" in (
        proc.stdout
    )
