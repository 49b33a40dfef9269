"""A command whose reader goes away (`narwhalctl state | head`) ends quietly: no
BrokenPipeError traceback, no "Exception ignored" from the last flush, status 0.

Each command runs as a real process whose stdout is a pipe with no reader left, so its
first write fails as it does when `head` has read enough."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]


def _run_into_closed_pipe(args: list[str], cwd: Path = _ROOT) -> subprocess.CompletedProcess[str]:
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)


@pytest.fixture
def fake_daemon(tmp_path: Path) -> Iterator[Path]:
    """A control socket that answers `state` with a fleet of 200 engines."""
    path = tmp_path / "ctl.sock"
    engine = {
        "role": "decode",
        "available": True,
        "unavailable_reason": None,
        "prefill": {"inflight": 0},
        "decode": {"active": 0},
    }
    state = {
        "narwhal": {"version": "0", "uptime_s": 1.0, "accepting": True, "degraded": None},
        "engines": [{"id": f"d{i}", **engine} for i in range(200)],
    }
    answer = json.dumps({"ok": True, "command": "state", "result": state}).encode() + b"\n"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen()

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield path
    server.close()


def _assert_quiet(done: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in done.stderr
    assert "Exception ignored" not in done.stderr
    assert done.stderr == ""
    assert done.returncode == 0


def test_narwhalctl_state_into_a_closed_pipe(fake_daemon: Path) -> None:
    _assert_quiet(
        _run_into_closed_pipe(["-m", "narwhal.cli.ctl", "--socket", str(fake_daemon), "state"])
    )


def test_narwhal_validate_into_a_closed_pipe() -> None:
    _assert_quiet(
        _run_into_closed_pipe(["-m", "narwhal", "validate", "--config", "conf/demo.json"])
    )


def test_narwhal_sim_into_a_closed_pipe() -> None:
    # It prints its URL first; with no one to read it, it stops rather than serve unseen.
    _assert_quiet(_run_into_closed_pipe(["-m", "narwhal.cli.sim", "--port", "0", "--engines", "1"]))
