"""The control socket: who may create and replace it, and what it does with bad input."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from narwhal.ctl import (
    LOGGED_REFUSALS,
    MAX_REQUEST_BYTES,
    MAX_REQUESTS,
    ControlServer,
    ControlSocketError,
    CtlError,
    CtlRequest,
    DaemonUnreachable,
    call,
)


async def echo(request: CtlRequest) -> object:
    if request.engine == "nope":
        raise CtlError("unknown_engine", "no engine 'nope'; engines: p0, d0")
    if request.command == "reload":
        # As the supervisor's reload: it logged its problems itself.
        raise CtlError("invalid_config", "reload of x.json rejected", logged=True)
    return {"command": request.command, "engine": request.engine, "role": request.role}


async def serve(nursery: trio.Nursery, path: Path) -> trio.CancelScope:
    scope = trio.CancelScope()

    async def run(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            await ControlServer(str(path), echo).run(task_status=task_status)

    await nursery.start(run)
    return scope


async def exchange(path: Path, payload: bytes) -> list[dict[str, Any]]:
    """Send raw bytes, then read response lines until the server closes or goes quiet."""
    stream = await trio.open_unix_socket(str(path))
    async with stream:
        await stream.send_all(payload)
        buffer = b""
        with trio.move_on_after(2.0):
            while chunk := await stream.receive_some(65536):
                buffer += chunk
                if buffer.count(b"\n") >= payload.count(b"\n") and buffer.endswith(b"\n"):
                    break
    return [json.loads(line) for line in buffer.splitlines()]


def stale_socket(path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()  # the file stays, nobody listens: what a crashed daemon leaves


async def test_socket_is_0600_ours_and_removed_on_exit(
    nursery: trio.Nursery, short_tmp: Path
) -> None:
    path = short_tmp / "sub" / "ctl.sock"
    scope = await serve(nursery, path)
    info = path.lstat()
    assert stat.S_ISSOCK(info.st_mode)
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_uid == os.geteuid()
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    response = await trio.to_thread.run_sync(
        lambda: call(str(path), CtlRequest("drain", "d0"), timeout_s=5)
    )
    assert response == {
        "ok": True,
        "command": "drain",
        "result": {"command": "drain", "engine": "d0", "role": None},
    }
    scope.cancel()
    await trio.testing.wait_all_tasks_blocked()
    assert not path.exists()


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda p: p.write_text("precious"), "exists and is not a socket"),
        (lambda p: p.mkdir(), "exists and is not a socket"),
        (lambda p: p.symlink_to("/tmp"), "is a symbolic link"),
    ],
    ids=["file", "directory", "symlink"],
)
async def test_refuses_a_path_that_is_not_our_socket(short_tmp: Path, make: Any, why: str) -> None:
    path = short_tmp / "ctl.sock"
    make(path)
    with pytest.raises(
        ControlSocketError, match=rf"^ctl.socket '{path}' {why}; refusing to start$"
    ):
        await ControlServer(str(path), echo).run()
    assert path.exists() or path.is_symlink()  # left exactly as it was
    if path.is_file():
        assert path.read_text() == "precious"


async def test_a_path_that_cannot_be_created_is_refused_naming_ctl_socket(
    short_tmp: Path,
) -> None:
    # Not an OSError: the daemon reports those as the HTTP listener's.
    blocker = short_tmp / "file"
    blocker.write_text("")
    path = blocker / "sub" / "ctl.sock"
    with pytest.raises(
        ControlSocketError,
        match=rf"^ctl.socket '{path}' cannot be checked: not a directory; refusing to start$",
    ):
        await ControlServer(str(path), echo).run()


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs procfs, where mkdir fails")
async def test_a_parent_directory_that_cannot_be_made_is_refused_naming_ctl_socket() -> None:
    path = "/proc/narwhal-test/ctl.sock"
    with pytest.raises(
        ControlSocketError,
        match=r"^ctl.socket '/proc/narwhal-test/ctl.sock' cannot be created: .+ at "
        r"'/proc/narwhal-test'; refusing to start$",
    ):
        await ControlServer(path, echo).run()


async def test_refuses_a_socket_another_process_answers_on(
    nursery: trio.Nursery, short_tmp: Path
) -> None:
    path = short_tmp / "ctl.sock"
    await serve(nursery, path)
    with pytest.raises(ControlSocketError, match="is in use: another process"):
        await ControlServer(str(path), echo).run()
    assert path.exists()


async def test_replaces_a_stale_socket_of_ours(
    nursery: trio.Nursery, short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = short_tmp / "ctl.sock"
    stale_socket(path)
    with caplog.at_level(logging.INFO, logger="narwhal.ctl"):
        await serve(nursery, path)
    assert [r.__dict__.get("outcome") for r in caplog.records] == ["stale_replaced", "listening"]
    (response,) = await exchange(path, b'{"command": "state"}\n')
    assert response["ok"] is True


async def test_oversized_message_is_refused_and_the_connection_closed(
    nursery: trio.Nursery, short_tmp: Path
) -> None:
    path = short_tmp / "ctl.sock"
    await serve(nursery, path)
    payload = b'{"command": "drain", "engine": "' + b"x" * MAX_REQUEST_BYTES + b'"}\n'
    stream = await trio.open_unix_socket(str(path))
    async with stream:
        with trio.fail_after(5):
            try:
                await stream.send_all(payload)
            except trio.BrokenResourceError:
                pass  # the server may close before it has read everything
            received = b""
            while chunk := await stream.receive_some(65536):
                received += chunk
    (line,) = received.splitlines()
    assert json.loads(line) == {
        "ok": False,
        "command": None,
        "error": {
            "code": "message_too_large",
            "message": f"message longer than the limit of {MAX_REQUEST_BYTES} bytes",
        },
    }


async def test_malformed_requests_get_errors_and_the_connection_carries_on(
    nursery: trio.Nursery, short_tmp: Path
) -> None:
    path = short_tmp / "ctl.sock"
    await serve(nursery, path)
    lines = [
        b"not json",
        b"[1, 2]",
        b'{"command": "explode"}',
        b'{"command": "drain"}',
        b'{"command": "drain", "engine": "d0", "force": true}',
        b'{"command": "pin", "engine": "d0", "role": "both"}',
        b'{"command": "drain", "engine": "nope"}',
        b'{"command": "pin", "engine": "d0", "role": "prefill"}',
    ]
    responses = await exchange(path, b"\n".join(lines) + b"\n")
    assert [(r["ok"], r.get("error", {}).get("code")) for r in responses] == [
        *[(False, "bad_request")] * 6,
        (False, "unknown_engine"),
        (True, None),
    ]
    assert [r.get("error", {}).get("message") for r in responses[:7]] == [
        "request is not JSON: Expecting value: line 1 column 1 (char 0)",
        "request must be a JSON object",
        "unknown command 'explode'; commands: state, proposals, drain, undrain, pin, unpin, reload",
        "drain: `engine` must be a non-empty string",
        "drain: unexpected field(s) force",
        "pin: role is 'both'; must be prefill or decode",
        "no engine 'nope'; engines: p0, d0",
    ]


def refusals(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str, dict[str, Any]]]:
    """The control server's log records: level, message and the fields an SRE filters on."""
    fields = ("event", "outcome", "command", "engine", "role", "reason")
    return [
        (r.levelname, r.getMessage(), {name: r.__dict__.get(name) for name in fields})
        for r in caplog.records
        if r.name == "narwhal.ctl" and r.__dict__.get("event") == "ctl"
    ]


async def test_every_refusal_is_logged_once_with_its_command_target_and_reason(
    nursery: trio.Nursery, short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = short_tmp / "ctl.sock"
    await serve(nursery, path)
    lines = [
        b"not json",
        b'{"command": "pin", "engine": "d0", "role": "both"}',
        b'{"command": "drain", "engine": "nope"}',
        b'{"command": "reload"}',  # refused, but logged where it was refused
        b'{"command": "drain", "engine": "d0"}',  # applied: the handler logs changes
        b'{"command": "drain", "engine": "' + b"x" * 1000 + b'", "force": 1}',
    ]
    with caplog.at_level(logging.INFO, logger="narwhal.ctl"):
        responses = await exchange(path, b"\n".join(lines) + b"\n")
    assert [r["ok"] for r in responses] == [False, False, False, False, True, False]
    clipped = "x" * 125 + "..."  # the client's text is clipped in the log
    assert refusals(caplog) == [
        (
            "WARNING",
            "control request refused (bad_request): request is not JSON: Expecting value: "
            "line 1 column 1 (char 0)",
            {
                "event": "ctl",
                "outcome": "bad_request",
                "command": None,
                "engine": None,
                "role": None,
                "reason": "request is not JSON: Expecting value: line 1 column 1 (char 0)",
            },
        ),
        (
            "WARNING",
            "control request refused (bad_request): command='pin' engine='d0' role='both': "
            "pin: role is 'both'; must be prefill or decode",
            {
                "event": "ctl",
                "outcome": "bad_request",
                "command": "pin",
                "engine": "d0",
                "role": "both",
                "reason": "pin: role is 'both'; must be prefill or decode",
            },
        ),
        (
            "WARNING",
            "control request refused (unknown_engine): command='drain' engine='nope': "
            "no engine 'nope'; engines: p0, d0",
            {
                "event": "ctl",
                "outcome": "unknown_engine",
                "command": "drain",
                "engine": "nope",
                "role": None,
                "reason": "no engine 'nope'; engines: p0, d0",
            },
        ),
        (
            "WARNING",
            f"control request refused (bad_request): command='drain' engine='{clipped}': "
            "drain: unexpected field(s) force",
            {
                "event": "ctl",
                "outcome": "bad_request",
                "command": "drain",
                "engine": clipped,
                "role": None,
                "reason": "drain: unexpected field(s) force",
            },
        ),
    ]


async def test_a_looping_client_s_refusals_are_logged_in_bulk_and_the_request_limit_named(
    nursery: trio.Nursery, short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Each refused request was a WARNING line: one connection could write MAX_REQUESTS of
    # them, and its close at that limit was not logged at all.
    path = short_tmp / "ctl.sock"
    await serve(nursery, path)
    refused = b'{"command": "drain", "engine": "nope"}\n'
    accepted = b'{"command": "state"}\n'
    extra = LOGGED_REFUSALS + 10
    payload = refused * extra + accepted * (MAX_REQUESTS - extra) + accepted
    with caplog.at_level(logging.INFO, logger="narwhal.ctl"):
        responses = await exchange(path, payload)
        await trio.testing.wait_all_tasks_blocked()
    assert len(responses) == MAX_REQUESTS  # the one past the limit is not answered
    assert sum(not r["ok"] for r in responses) == extra
    logged = refusals(caplog)
    assert [entry[2]["outcome"] for entry in logged] == [
        *["unknown_engine"] * LOGGED_REFUSALS,
        "request_limit",
        "refusals_unlogged",
    ]
    assert logged[-2][1] == f"control connection closed after its limit of {MAX_REQUESTS} requests"
    assert logged[-1][1] == (
        f"control connection closed: 10 more refused request(s) not logged one by one "
        f"({extra} refused in all)"
    )


async def test_refused_connections_are_logged(
    nursery: trio.Nursery, short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = short_tmp / "ctl.sock"
    await serve(nursery, path)
    payload = b'{"command": "drain", "engine": "' + b"x" * MAX_REQUEST_BYTES + b'"}\n'
    with caplog.at_level(logging.INFO, logger="narwhal.ctl"):
        stream = await trio.open_unix_socket(str(path))
        async with stream:
            with trio.fail_after(5):
                with contextlib.suppress(trio.BrokenResourceError):
                    await stream.send_all(payload)
                while await stream.receive_some(65536):
                    pass
    message = f"message longer than the limit of {MAX_REQUEST_BYTES} bytes"
    assert refusals(caplog) == [
        (
            "WARNING",
            f"control connection refused (message_too_large): {message}",
            {
                "event": "ctl",
                "outcome": "message_too_large",
                "command": None,
                "engine": None,
                "role": None,
                "reason": message,
            },
        )
    ]


async def test_client_errors_when_no_daemon_answers(short_tmp: Path) -> None:
    missing = short_tmp / "missing.sock"
    stale = short_tmp / "stale.sock"
    stale_socket(stale)
    regular = short_tmp / "file.sock"
    regular.write_text("")
    cases = {
        missing: ("missing", f"{missing}: no such file: no narwhal listens there"),
        stale: ("stale", f"{stale}: connection refused: a stale socket, nothing listens"),
        regular: ("not_a_socket", f"{regular}: not a socket: ctl.socket names something else"),
    }
    for path, (reason, message) in cases.items():
        with pytest.raises(DaemonUnreachable) as caught:
            call(str(path), CtlRequest("state"), timeout_s=1)
        assert caught.value.reason == reason
        assert str(caught.value).startswith(message)
    # The real narwhalctl, as an operator runs it: exit code 3 and the same message.
    result = await trio.run_process(
        [sys.executable, "-m", "narwhal.cli.ctl", "--socket", str(stale), "drain", "d0"],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert result.returncode == 3
    assert result.stderr.decode().startswith(
        f"narwhalctl: cannot reach narwhal (--socket): {cases[stale][1]}"
    )
    assert result.stdout == b""
