"""narwhal-profile and narwhal-check stopped by a signal: one line saying what was kept,
the store as it was, and the shell's exit status for the signal (not a traceback)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

_ROOT = str(Path(__file__).resolve().parents[2])


async def _healthy_then_silent(stream: trio.SocketStream) -> None:
    """Answers /health and nothing else, so a command is mid-probe for as long as it waits."""
    request = b""
    while b"\r\n\r\n" not in request:
        chunk = await stream.receive_some()
        if not chunk:
            return
        request += chunk
    if request.startswith(b"GET /health "):
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
    await trio.sleep_forever()


@pytest.mark.parametrize(
    ("command", "args", "started", "said"),
    [
        (
            "narwhal.cli.profile",
            ["--fast"],
            b"profiling 1 engine(s)",
            "narwhal-profile: interrupted by {sig}: nothing was written; {store} is as it was\n",
        ),
        (
            "narwhal.cli.check",
            ["--record"],
            b"narwhal-check: health p0: pass",
            "narwhal-check: interrupted by {sig} before the checks finished; nothing was "
            "recorded\n",
        ),
    ],
)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
async def test_a_signal_stops_the_command_and_keeps_the_store(
    tmp_path: Path,
    nursery: trio.Nursery,
    command: str,
    args: list[str],
    started: bytes,
    said: str,
    sig: signal.Signals,
) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    nursery.start_soon(trio.serve_listeners, _healthy_then_silent, listeners)
    port = listeners[0].socket.getsockname()[1]
    store = tmp_path / "profiles.json"
    store.write_text('{"schema_version": 1}\n')
    config = tmp_path / "narwhal.json"
    config.write_text(
        json.dumps(
            {
                "engines": [{"id": "p0", "url": f"http://127.0.0.1:{port}"}],
                "profiles": {"path": str(store)},
                # The key test times out (no refusal: healthy), then /tokenize hangs.
                "engine": {"health_timeout_s": 0.2, "tokenize_timeout_s": 30},
            }
        )
    )
    env = {**os.environ, "PYTHONPATH": _ROOT}
    with trio.fail_after(30):
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", command, "--config", str(config), *args],
            stderr=subprocess.PIPE,
            env=env,
            # Background jobs of a non-interactive shell inherit SIGINT ignored.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        assert process.stderr is not None
        err = b""
        while started not in err:
            chunk = await process.stderr.receive_some()
            assert chunk, err
            err += chunk
        # Either command is now waiting on a probe the engine never answers.
        process.send_signal(sig)
        while chunk := await process.stderr.receive_some():
            err += chunk
        code = await process.wait()
    assert code == 128 + sig
    last = err.decode().splitlines()[-1] + "\n"
    assert last == said.format(sig=sig.name, store=store)
    assert "Traceback" not in err.decode()
    assert store.read_text() == '{"schema_version": 1}\n'
