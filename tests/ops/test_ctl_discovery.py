"""narwhalctl finds a running daemon from any directory, and when it cannot, says which
paths it tried and why: whether the daemon is really down there."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from .daemon import Launch, launcher

NOBODY = 65534


@pytest.fixture
async def launch(short_tmp: Path) -> AsyncIterator[Launch]:
    async with launcher(short_tmp) as start:
        yield start


def _document(**sections: Any) -> dict[str, Any]:
    return {
        "engines": [{"id": "a", "url": "http://127.0.0.1:9"}],
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"host": "127.0.0.1", "port": 0},
        "serving": {"admission": "open"},
        **sections,
    }


async def narwhalctl(
    *args: str, cwd: Path, env: dict[str, str] | None = None, as_nobody: bool = False
) -> tuple[int, str, str]:
    """narwhalctl as an operator runs it from `cwd`, with none of the NARWHAL_ variables
    of this process but those in `env`."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("NARWHAL_")}
    command = [sys.executable, "-m", "narwhal.cli.ctl", *args]
    if as_nobody:
        command = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *command]
    result = await trio.run_process(
        command,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        cwd=cwd,
        env={**environment, **(env or {})},
    )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


async def test_narwhalctl_finds_the_daemon_from_any_directory(
    launch: Launch, short_tmp: Path
) -> None:
    # A relative ctl.socket, a daemon started elsewhere: the socket is in the config's
    # folder, and narwhalctl --config finds it from anywhere. It was taken from each
    # one's working directory, so the two met only when run from the same place.
    started_in = short_tmp / "started-in"
    started_in.mkdir()
    daemon = await launch(_document(ctl={"socket": "ctl.sock"}), cwd=started_in)
    assert daemon.ctl_path.is_socket()
    relative = str(daemon.config_path.relative_to(short_tmp))
    status, out, err = await narwhalctl("--config", relative, "--json", "state", cwd=short_tmp)
    assert status == 0, err
    assert json.loads(out)["result"]["supervisor"]["ctl_socket"] == str(daemon.ctl_path)
    # The container image names its config in $NARWHAL_CONFIG: no flag needed there.
    status, _, err = await narwhalctl(
        "state", cwd=Path("/"), env={"NARWHAL_CONFIG": str(daemon.config_path)}
    )
    assert status == 0, err
    # A reload from yet another directory takes the paths as the start did: no change.
    status, out, err = await narwhalctl(
        "--config", str(daemon.config_path), "--json", "reload", cwd=Path("/")
    )
    assert status == 0, err
    plan = json.loads(out)["result"]["plan"]
    assert (plan["changes"], plan["restart_required"]) == ([], [])


@pytest.mark.skipif(
    os.path.lexists("/run/narwhal/narwhal.sock"),
    reason="a narwhal of this host's own may answer on the packaged default",
)
async def test_without_a_named_socket_the_defaults_are_tried_in_turn(
    launch: Launch, short_tmp: Path
) -> None:
    # The packaged default first, then a development daemon's runs/narwhal.sock here.
    here = short_tmp / "checkout"
    (here / "runs").mkdir(parents=True)
    await launch(_document(ctl={"socket": str(here / "runs" / "narwhal.sock")}))
    status, out, err = await narwhalctl("--json", "state", cwd=here)
    assert status == 0, err
    assert json.loads(out)["ok"] is True


def _stale(path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()  # what a killed daemon leaves


async def test_when_nothing_answers_every_path_tried_is_said_with_why(short_tmp: Path) -> None:
    (short_tmp / "runs").mkdir()
    stale = short_tmp / "runs" / "narwhal.sock"
    _stale(stale)
    status, out, err = await narwhalctl("--json", "state", cwd=short_tmp)
    assert status == 3
    lines = err.splitlines()
    assert lines[0] == "narwhalctl: cannot reach narwhal; tried:"
    assert lines[1].startswith("  /run/narwhal/narwhal.sock (the packaged default): ")
    assert lines[2:] == [
        f"  {stale} (runs/narwhal.sock in the current directory): connection refused: a "
        "stale socket, nothing listens; narwhal is down (killed or crashed: it removes its "
        "socket when it stops)",
        "name its socket with --config FILE (the daemon's config), --socket PATH or "
        "$NARWHAL_CTL_SOCKET",
    ]
    error = json.loads(out)["error"]
    assert error["code"] == "daemon_unreachable"
    assert error["tried"][1] == {
        "path": str(stale),
        "source": "runs/narwhal.sock in the current directory",
        "reason": "stale",
    }


@pytest.mark.parametrize("what", ["missing", "not a socket", "stale"])
async def test_a_named_socket_that_does_not_answer_is_said_once(short_tmp: Path, what: str) -> None:
    path = short_tmp / "ctl.sock"
    if what == "not a socket":
        path.write_text("")
    elif what == "stale":
        _stale(path)
    config = short_tmp / "narwhal.json"
    config.write_text(json.dumps(_document(ctl={"socket": "ctl.sock"})))
    status, _, err = await narwhalctl("--config", str(config), "state", cwd=Path("/"))
    assert status == 3
    said = {
        "missing": "no such file: no narwhal listens there (it is not running, or its "
        "ctl.socket is another path)",
        "not a socket": "not a socket: ctl.socket names something else",
        "stale": "connection refused: a stale socket, nothing listens; narwhal is down "
        "(killed or crashed: it removes its socket when it stops)",
    }[what]
    assert err == f"narwhalctl: cannot reach narwhal (ctl.socket of {config}): {path}: {said}\n"


async def test_permission_denied_says_to_run_as_the_service_user(
    launch: Launch, short_tmp: Path
) -> None:
    # The daemon's socket is 0600 and its folder 0700: another user cannot tell whether
    # it runs, and is told how to ask as the service user.
    daemon = await launch(_document())
    as_nobody = os.geteuid() == 0
    if as_nobody:
        if shutil.which("setpriv") is None:
            pytest.skip("needs setpriv (util-linux) to run narwhalctl as another user")
        os.chmod(short_tmp, 0o755)
        os.chmod(daemon.directory, 0o755)  # the socket's own mode keeps nobody out
    else:
        os.chmod(daemon.directory, 0o000)
    try:
        status, _, err = await narwhalctl(
            "--socket", str(daemon.ctl_path), "state", cwd=Path("/"), as_nobody=as_nobody
        )
    finally:
        os.chmod(daemon.directory, 0o700)
    assert status == 3
    assert err == (
        f"narwhalctl: cannot reach narwhal (--socket): {daemon.ctl_path}: permission denied: "
        "the socket is the service user's, and narwhal may well be running; run narwhalctl "
        "as that user (sudo -u narwhal narwhalctl ..., see docs/deploy-systemd.md)\n"
    )
