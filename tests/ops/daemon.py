"""Running the real daemon (`python -m narwhal serve`) and the real narwhalctl in tests.

The daemon gets a NOTIFY_SOCKET that the test binds (a unix datagram socket), so the
test learns the daemon is ready, and its bound address, from the READY=1 message, the
way systemd would: no polling, no log scraping.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

_URL = re.compile(r"listening on (http://[0-9.]+:[0-9]+); admin on (http://[0-9.]+:[0-9]+)")


@attrs.define
class Daemon:
    process: trio.Process
    directory: Path
    notify: trio.socket.SocketType
    messages: list[str] = attrs.Factory(list)
    url: str = ""
    admin_url: str = ""

    @property
    def ctl_path(self) -> Path:
        return self.directory / "ctl.sock"

    @property
    def config_path(self) -> Path:
        return self.directory / "narwhal.json"

    @property
    def log_path(self) -> Path:
        return self.directory / "daemon.log"

    def write_config(self, document: dict[str, Any]) -> None:
        """Replace the daemon's config file (keeping its control socket path)."""
        document = {"ctl": {"socket": str(self.ctl_path)}, **document}
        self.config_path.write_text(json.dumps(document))

    async def message(self, line: str, *, within_s: float = 15.0) -> str:
        """The next notify message that has `line` among its lines (earlier ones are kept
        in `messages` but skipped)."""
        with trio.fail_after(within_s):
            while True:
                text = (await self.notify.recv(65536)).decode()
                self.messages.append(text)
                if line in text.split("\n"):
                    return text

    async def ctl(self, *args: str, via_config: bool = False) -> subprocess.CompletedProcess[bytes]:
        """narwhalctl with `--socket`, or with `--config` (as the systemd unit's ExecReload)."""
        where = (
            ["--config", str(self.config_path)] if via_config else ["--socket", str(self.ctl_path)]
        )
        return await trio.run_process(
            [sys.executable, "-m", "narwhal.cli.ctl", *where, *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )

    async def state(self) -> dict[str, Any]:
        result = await self.ctl("--json", "state")
        assert result.returncode == 0, result.stderr
        response: dict[str, Any] = json.loads(result.stdout)
        return response["result"]  # type: ignore[no-any-return]

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        lines = self.log_path.read_text().splitlines()
        entries = [json.loads(line) for line in lines if line.startswith("{")]
        return [e for e in entries if name is None or e.get("event") == name]

    def signal(self, signum: signal.Signals) -> None:
        self.process.send_signal(signum)


Launch = Callable[..., Awaitable[Daemon]]


@asynccontextmanager
async def launcher(directory: Path) -> AsyncIterator[Launch]:
    """Start daemons in `directory`; any still running at the end is killed (by its pid)."""
    started: list[Daemon] = []

    async def launch(
        document: dict[str, Any],
        *,
        env: dict[str, str] | None = None,
        ready: bool = True,
        open_files: tuple[int, int | None] | None = None,
        cwd: Path | None = None,
    ) -> Daemon:
        """`open_files`: the daemon's soft and hard RLIMIT_NOFILE (None: inherited),
        set by a shell that then execs it, so this process's own is left alone. `cwd`:
        its working directory (None: this process's)."""
        sub = directory / f"d{len(started)}"
        sub.mkdir()
        document = {"ctl": {"socket": str(sub / "ctl.sock")}, **document}
        notify = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_DGRAM)
        await notify.bind(str(sub / "notify.sock"))
        (sub / "narwhal.json").write_text(json.dumps(document))
        environment = {
            key: value
            for key, value in os.environ.items()
            if key not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
        }
        environment.update({"NOTIFY_SOCKET": str(sub / "notify.sock"), **(env or {})})
        command = [sys.executable, "-m", "narwhal", "serve", "--config", str(sub / "narwhal.json")]
        if open_files is not None:
            soft, hard = open_files
            limits = f"ulimit -Sn {soft}" + ("" if hard is None else f" && ulimit -Hn {hard}")
            command = ["sh", "-c", f'{limits} && exec "$@"', "sh", *command]
        with (sub / "daemon.log").open("wb") as log:
            process = await trio.lowlevel.open_process(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=environment,
                cwd=cwd,
            )
        daemon = Daemon(process, sub, notify)
        started.append(daemon)
        if not ready:
            return daemon
        message = await daemon.message("READY=1", within_s=30)
        match = _URL.search(message)
        assert match is not None, message
        daemon.url, daemon.admin_url = match.group(1), match.group(2)
        return daemon

    try:
        yield launch
    finally:
        for daemon in started:
            if daemon.process.returncode is None:
                daemon.process.kill()
                with trio.move_on_after(5, shield=True):
                    await daemon.process.wait()
            daemon.notify.close()
