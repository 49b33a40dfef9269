"""`narwhal validate` on this host: it warns of what `narwhal serve` would refuse or
degrade here, in the words serve uses, and knows a running daemon from a conflict."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from collections.abc import AsyncIterator, Iterator
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


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


def _document(directory: Path, **sections: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "engines": [{"id": "a", "url": "http://127.0.0.1:9"}],
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"host": "127.0.0.1", "port": 0},
        "ctl": {"socket": str(directory / "ctl.sock")},
        "serving": {"admission": "open"},
        "profiles": {"path": str(directory / "profiles.json")},
    }
    for name, value in sections.items():
        doc[name] = {**doc.get(name, {}), **value}
    return doc


async def validate(
    path: Path, *flags: str, open_files: int | None = None, as_nobody: bool = False
) -> tuple[int, str, list[str]]:
    """Exit status, stdout and stderr lines of `narwhal validate --config PATH`, run
    under an open-file limit of `open_files` (soft and hard) if given, as user nobody
    if `as_nobody` (by root)."""
    command = [sys.executable, "-m", "narwhal", "validate", "--config", str(path), *flags]
    if open_files is not None:
        limits = f"ulimit -Sn {open_files} && ulimit -Hn {open_files}"
        command = ["sh", "-c", f'{limits} && exec "$@"', "sh", *command]
    if as_nobody:
        ids = [f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        command = ["setpriv", *ids, *command]
    result = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
    return result.returncode, result.stdout.decode(), result.stderr.decode().splitlines()


async def test_validate_warns_of_every_reason_serve_would_refuse_or_degrade_here(
    short_tmp: Path, busy_port: int
) -> None:
    (short_tmp / "ctl.sock").write_text("not a socket")
    path = short_tmp / "narwhal.json"
    doc = _document(
        short_tmp,
        serving={"admission": "predictive"},
        listen={"port": busy_port},
        admin={"host": "0.0.0.0"},
    )
    path.write_text(json.dumps(doc))
    status, out, err = await validate(path)
    assert status == 2
    assert json.loads(out)["listen"]["port"] == busy_port  # valid: the effective config
    store = short_tmp / "profiles.json"
    assert err == [
        "narwhal: 3 warning(s): `narwhal serve` here would refuse to start:",
        f"serving.admission is predictive but profiles.path='{store}' gives no usable "
        f"profile ({store}: profile store is missing; run narwhal-profile --config FILE); "
        "run narwhal-profile, or set serving.admission to open",
        f"ctl.socket '{short_tmp}/ctl.sock' exists and is not a socket; set ctl.socket to a "
        "path of the daemon's own",
        f"listen.port: cannot listen on listen.host:listen.port = 127.0.0.1:{busy_port}: "
        "address already in use; free the port or choose another listen.host or listen.port",
        "narwhal: 1 warning(s): `narwhal serve` here would start degraded:",
        "admin.host: the admin listener on 0.0.0.0:0 asks no token: whoever reaches it reads "
        "every engine's url and the requests in flight; set admin.token_file",
    ]
    # --file-only: the file alone, for CI or another machine than the daemon's.
    status, out, err = await validate(path, "--file-only")
    assert (status, err) == (0, [])
    assert json.loads(out)["listen"]["port"] == busy_port


async def test_a_socket_folder_the_daemon_could_not_make_is_a_warning(short_tmp: Path) -> None:
    # As /run/narwhal for a user other than root before systemd makes it: the daemon
    # would make the folder, and may not.
    locked = short_tmp / "locked"
    locked.mkdir()
    path = short_tmp / "narwhal.json"
    path.write_text(json.dumps(_document(short_tmp, ctl={"socket": str(locked / "sub/x.sock")})))
    as_nobody = os.geteuid() == 0
    if as_nobody:
        if shutil.which("setpriv") is None:
            pytest.skip("needs setpriv (util-linux) to run validate as another user than root")
        os.chmod(short_tmp, 0o755)
        os.chmod(path, 0o644)
    else:
        os.chmod(locked, 0o555)
    status, _, err = await validate(path, as_nobody=as_nobody)
    assert status == 2
    uid = NOBODY if as_nobody else os.geteuid()
    assert err[:2] == [
        "narwhal: 1 warning(s): `narwhal serve` here would refuse to start:",
        f"ctl.socket '{locked}/sub/x.sock': its folder '{locked}/sub' cannot be made in "
        f"'{locked}': permission denied, as uid {uid}; create that folder for the daemon's "
        "user (systemd: RuntimeDirectory=) or set ctl.socket to a path in a folder it may "
        "write",
    ]


async def _refusals(path: Path, open_files: int | None) -> list[str]:
    status, _, err = await validate(path, open_files=open_files)
    assert status == 2, err
    start = err.index("narwhal: 1 warning(s): `narwhal serve` here would refuse to start:")
    return [err[start + 1]]


@pytest.mark.parametrize(
    "case", ["no profile store", "not a socket", "port in use", "open-file limit"]
)
async def test_serve_refuses_in_the_words_validate_warned_with(
    launch: Launch, short_tmp: Path, busy_port: int, case: str
) -> None:
    # One function decides each refusal for both: a config validate passes without a
    # warning cannot stop serve, and the warning is what serve will say.
    sections: dict[str, Any] = {}
    open_files = None
    if case == "no profile store":
        sections = {"serving": {"admission": "predictive"}}
    elif case == "not a socket":
        (short_tmp / "taken").write_text("")
        sections = {"ctl": {"socket": str(short_tmp / "taken")}}
    elif case == "port in use":
        sections = {"listen": {"port": busy_port}}
    else:
        open_files = 200
        sections = {"listen": {"max_open_connections": 600}, "serving": {"max_connections": 16}}
    doc = _document(short_tmp / "v", **sections)
    (short_tmp / "v").mkdir()
    path = short_tmp / "v" / "narwhal.json"
    path.write_text(json.dumps(doc))
    (warning,) = await _refusals(path, open_files)
    limits = None if open_files is None else (open_files, open_files)
    daemon = await launch(doc, ready=False, open_files=limits)
    with trio.fail_after(20):
        assert await daemon.process.wait() == 1
    said = daemon.log_path.read_text().splitlines()[-1]
    assert said.startswith("narwhal: ")
    assert said.removeprefix("narwhal: ").removesuffix("; refusing to start") in warning


async def test_beside_a_running_daemon_the_file_is_for_a_reload_and_its_ports_are_not_probed(
    launch: Launch, short_tmp: Path
) -> None:
    doc = _document(short_tmp)
    del doc["ctl"]  # the launcher's, which daemon.state() uses
    daemon = await launch(doc)
    state = await daemon.state()
    # The file as the running daemon has it, its ports the ones it holds.
    doc = json.loads(daemon.config_path.read_text())
    doc["listen"]["port"] = int(state["supervisor"]["listen"][0].rsplit(":", 1)[1])
    doc["admin"]["port"] = int(state["supervisor"]["admin"][0].rsplit(":", 1)[1])
    path = daemon.directory / "next.json"
    path.write_text(json.dumps(doc))
    status, _, err = await validate(path)
    assert err[0] == (
        f"narwhal: a narwhal answers on ctl.socket {daemon.ctl_path}: this file is for a "
        f"reload there (narwhalctl --config {path} reload); its ports are not probed"
    )
    # Only the profile store this open-admission fleet lacks is left to say.
    assert err[1:] == [
        "narwhal: 1 warning(s): `narwhal serve` here would start degraded:",
        f"profiles.path: {short_tmp}/profiles.json: profile store is missing; run "
        "narwhal-profile --config FILE",
    ]
    assert status == 2
    # The probe of the socket is no refused request in the daemon's log.
    assert [e for e in daemon.events("ctl") if e["level"] != "info"] == []
