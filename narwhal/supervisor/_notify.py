"""systemd's notify protocol (sd_notify), written directly: it is one datagram per message.

When systemd starts a `Type=notify` service it passes NOTIFY_SOCKET, the path of an
AF_UNIX datagram socket, or `@name` for one in the abstract namespace (sent as a
leading NUL byte). Each message is newline-separated KEY=VALUE assignments:

  READY=1                       once the HTTP listener and control socket are up
  RELOADING=1 + MONOTONIC_USEC  when a reload starts (SIGHUP or narwhalctl reload);
                                READY=1 when it is over, applied or rejected
  STOPPING=1                    on SIGTERM, before the graceful drain
  WATCHDOG=1                    every WATCHDOG_USEC / 2 while the event loop runs, when
                                the unit sets WatchdogSec (and WATCHDOG_PID, if set, is us)
  STATUS=...                    one line for `systemctl status`

Without NOTIFY_SOCKET every call is a no-op. Sends never block: a full receive queue
drops the message with a warning rather than stalling the daemon.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

import trio

log = logging.getLogger("narwhal.notify")


class Notifier:
    def __init__(self, address: str | None, *, watchdog_usec: int | None = None) -> None:
        self.address = address
        self.watchdog_usec = watchdog_usec
        self.sent: list[str] = []  # the last few messages but pings, for the state document
        self._socket: socket.socket | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Notifier:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET") or None
        watchdog: int | None = None
        raw = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        if raw and (not pid or pid == str(os.getpid())):
            try:
                watchdog = int(raw)
            except ValueError:
                log.warning("ignoring WATCHDOG_USEC=%r: not an integer", raw)
            if watchdog is not None and watchdog <= 0:
                watchdog = None
        return cls(address, watchdog_usec=watchdog)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def _target(self) -> str | bytes:
        assert self.address is not None
        if self.address.startswith("@"):
            return b"\0" + self.address[1:].encode()
        return self.address

    def notify(self, *lines: str) -> bool:
        if self.address is None:
            return False
        message = "\n".join(lines)
        if self._socket is None:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._socket.setblocking(False)
        try:
            self._socket.sendto(message.encode(), self._target())
        except OSError as exc:
            log.warning(
                "sd_notify to %s failed: %s",
                self.address,
                exc,
                extra={"event": "notify", "outcome": "failed", "notify_message": message},
            )
            return False
        if lines != ("WATCHDOG=1",):
            self.sent = [*self.sent[-19:], message]
        return True

    def ready(self, status: str) -> None:
        self.notify("READY=1", _status(status))

    def reloading(self) -> None:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.notify("RELOADING=1", f"MONOTONIC_USEC={usec}", _status("reloading configuration"))

    def stopping(self, status: str) -> None:
        self.notify("STOPPING=1", _status(status))

    def status(self, status: str) -> None:
        self.notify(_status(status))

    async def watchdog(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Ping at half the watchdog interval for as long as the trio loop is alive."""
        task_status.started()
        if self.address is None or self.watchdog_usec is None:
            return
        period = self.watchdog_usec / 2 / 1_000_000
        while True:
            self.notify("WATCHDOG=1")
            await trio.sleep(period)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _status(text: str) -> str:
    return "STATUS=" + " ".join(text.split())
