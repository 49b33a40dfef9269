"""The control socket: an AF_UNIX stream listener speaking the JSON-lines protocol.

The socket is the daemon's operator interface, so who can reach it matters:

- it is created mode 0600 (bound, chmod-ed, and only then listening, so no connection
  can arrive while it is briefly wider), owned by the daemon's user; a missing parent
  directory is created 0700;
- an existing path is only replaced when it is a socket owned by us that nobody
  answers on (a stale socket of a previous run). A path that is not a socket, a
  symlink, a socket owned by someone else, or a socket a live process answers on makes
  startup fail with a message naming ctl.socket and the path;
- peers are checked with SO_PEERCRED where the platform has it: only our own user
  (and root) may send commands;
- on exit the socket file is removed, if it is still the one we created.

Each connection is bounded: at most MAX_CONNECTIONS at once, IDLE_S to send each request
line, MAX_REQUESTS per connection, and request lines of at most MAX_REQUEST_BYTES. When
every slot is taken, a new connection evicts the one that has waited longest for its next
request line (it is told `evicted`): an operator's `narwhalctl drain` during an incident
must not wait out IDLE_S behind clients that connected and said nothing. Only when every
slot is busy running a command is the newcomer answered `busy`.

Every refusal is logged once at WARNING (`"event": "ctl"`) with the command, engine and
role the request named (as far as it could be read) and the reason, so the journal shows
who tried what; the client's text is clipped there. An evicted idle connection is INFO.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable
from typing import Literal

import trio

from .._errors import os_reason
from ._protocol import (
    MAX_REQUEST_BYTES,
    CtlError,
    CtlRequest,
    LineBuffer,
    error_response,
    ok_response,
    parse_request,
)

log = logging.getLogger("narwhal.ctl")

MAX_CONNECTIONS = 16
MAX_REQUESTS = 1000
IDLE_S = 30.0
_WRITE_S = 10.0
# How long a newcomer waits for an evicted connection to give its slot back.
_EVICT_WAIT_S = 1.0
# A request's fields and a refusal's reason carry the client's text (up to
# MAX_REQUEST_BYTES); the log keeps this much of each.
_LOGGED_NAME_CHARS = 128
_LOGGED_REASON_CHARS = 512
# Refused requests logged one by one per connection; the rest are counted in one line
# when it closes, so a looping client cannot write MAX_REQUESTS lines per connection.
LOGGED_REFUSALS = 20

Handler = Callable[[CtlRequest], Awaitable[object]]


class ControlSocketError(Exception):
    """The control socket cannot be created safely; the daemon must not start."""


def _refuse(path: str, why: str) -> ControlSocketError:
    return ControlSocketError(f"ctl.socket {path!r} {why}; refusing to start")


def _oserror(path: str, what: str, exc: OSError) -> ControlSocketError:
    reason = os_reason(exc)
    where = f" at {exc.filename!r}" if exc.filename not in (None, path) else ""
    return _refuse(path, f"{what}: {reason}{where}")


PathState = Literal["absent", "stale", "live"]
IN_USE = "is in use: another process (a running narwhal?) answers on it"


def inspect_path(path: str) -> PathState:
    """What is at `path`: nothing, a stale socket of ours (nobody answers on it), or a
    socket a live process answers on (whoever owns it: root's `narwhal validate` asks
    too, of the service user's socket). Anything else is a ControlSocketError. Reads
    only; blocking."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return "absent"
    except OSError as exc:
        raise _oserror(path, "cannot be checked", exc) from None
    if stat.S_ISLNK(info.st_mode):
        raise _refuse(path, "is a symbolic link")
    if not stat.S_ISSOCK(info.st_mode):
        raise _refuse(path, "exists and is not a socket")
    ours = info.st_uid == os.geteuid()
    foreign = f"is a socket owned by uid {info.st_uid}, not by us ({os.geteuid()})"
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        if not ours:
            raise _refuse(path, foreign) from None
        return "stale"
    except OSError as exc:
        raise _refuse(
            path, foreign if not ours else f"cannot be checked ({exc.strerror or exc})"
        ) from None
    finally:
        probe.close()
    return "live"


def prepare_path(path: str) -> None:
    """Make `path` free for our socket, or raise ControlSocketError. Blocking."""
    state = inspect_path(path)
    if state == "live":
        raise _refuse(path, IN_USE)
    if state == "absent":
        parent = os.path.dirname(path)
        if parent:
            try:
                os.makedirs(parent, mode=0o700, exist_ok=True)
            except OSError as exc:
                # Every failure to start names its setting: left to propagate, an
                # OSError here would be reported as the HTTP listener's.
                raise _oserror(path, "cannot be created", exc) from None
        return
    log.info(
        "replacing stale control socket %s",
        path,
        extra={"event": "ctl_socket", "path": path, "outcome": "stale_replaced"},
    )
    try:
        os.unlink(path)
    except OSError as exc:
        raise _oserror(path, "is a stale socket that cannot be removed", exc) from None


def create_socket(path: str) -> tuple[socket.socket, int]:
    """A listening AF_UNIX socket at `path`, mode 0600, and its inode. Blocking."""
    prepare_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            sock.bind(path)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise _refuse(path, "appeared while starting (another daemon?)") from None
            raise _refuse(path, f"cannot be bound ({exc.strerror or exc})") from None
        try:
            os.chmod(path, 0o600)
            info = os.lstat(path)
        except OSError as exc:
            raise _oserror(path, "cannot be made private", exc) from None
        if stat.S_IMODE(info.st_mode) != 0o600:
            raise _refuse(path, f"has mode {stat.S_IMODE(info.st_mode):o} after chmod 600")
        sock.listen(MAX_CONNECTIONS)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock, info.st_ino


def _remove_if_ours(path: str, inode: int) -> None:
    try:
        if os.lstat(path).st_ino == inode:
            os.unlink(path)
    except OSError:
        pass


def _peer_uid(sock: trio.socket.SocketType) -> int | None:
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
    except OSError:
        return None
    _pid, uid, _gid = struct.unpack("3i", raw)
    return int(uid)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _named(line: bytes) -> dict[str, str]:
    """The command, engine and role a request line names, as far as it is a JSON object
    with string values there: what the log says was attempted, even when the request
    was refused for its form."""
    try:
        document = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return {}
    if not isinstance(document, dict):
        return {}
    return {
        name: _clip(value, _LOGGED_NAME_CHARS)
        for name in ("command", "engine", "role")
        if isinstance(value := document.get(name), str)
    }


def _log_refusal(error: CtlError, line: bytes | None = None) -> None:
    """One line per refusal, so the journal shows who tried what when an operator's
    command fails (or someone else's). `line`: the request, when one was read; without
    one, the connection itself was refused or closed."""
    reason = _clip(error.message, _LOGGED_REASON_CHARS)
    named = {} if line is None else _named(line)
    extra = {
        "event": "ctl",
        "outcome": error.code,
        "command": named.get("command"),
        "engine": named.get("engine"),
        "role": named.get("role"),
        "reason": reason,
    }
    if line is None:
        if error.code == "evicted":
            # Not a refusal: an idle connection gave its slot to a newcomer.
            log.info("control connection closed (evicted): %s", reason, extra=extra)
        else:
            log.warning("control connection refused (%s): %s", error.code, reason, extra=extra)
        return
    attempted = " ".join(f"{name}={value!r}" for name, value in named.items())
    log.warning(
        "control request refused (%s): %s%s",
        error.code,
        f"{attempted}: " if attempted else "",
        reason,
        extra=extra,
    )


class _Refused:
    """One connection's refused requests: the first LOGGED_REFUSALS are logged one by
    one, the rest counted in one line when the connection closes."""

    def __init__(self) -> None:
        self.count = 0

    def log(self, error: CtlError, line: bytes) -> None:
        self.count += 1
        if self.count <= LOGGED_REFUSALS:
            _log_refusal(error, line)

    def close(self) -> None:
        unlogged = self.count - LOGGED_REFUSALS
        if unlogged > 0:
            log.warning(
                "control connection closed: %d more refused request(s) not logged one by "
                "one (%d refused in all)",
                unlogged,
                self.count,
                extra={"event": "ctl", "outcome": "refusals_unlogged", "reason": None},
            )


class ControlServer:
    def __init__(self, path: str, handler: Handler) -> None:
        self.path = path
        self.handler = handler
        self._slots = trio.CapacityLimiter(MAX_CONNECTIONS)
        # Connections waiting for a request line, oldest first (dicts keep insertion order).
        self._waiting: dict[object, trio.CancelScope] = {}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        raw, inode = await trio.to_thread.run_sync(create_socket, self.path)
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(raw))
        log.info(
            "control socket listening on %s",
            self.path,
            extra={"event": "ctl_socket", "path": self.path, "outcome": "listening"},
        )
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(trio.serve_listeners, self._connection, [listener])
                task_status.started()
        finally:
            _remove_if_ours(self.path, inode)

    async def _connection(self, stream: trio.SocketStream) -> None:
        async with stream:
            if not await self._acquire():
                error = CtlError(
                    "busy", f"all {MAX_CONNECTIONS} control connections are running commands"
                )
                _log_refusal(error)
                await self._send(stream, error_response(None, error))
                return
            try:
                await self._serve(stream)
            finally:
                self._slots.release()

    async def _acquire(self) -> bool:
        try:
            self._slots.acquire_nowait()
            return True
        except trio.WouldBlock:
            pass
        if not self._waiting:
            return False
        oldest = next(iter(self._waiting))
        self._waiting.pop(oldest).cancel()
        with trio.move_on_after(_EVICT_WAIT_S):
            await self._slots.acquire()
            return True
        return False

    async def _serve(self, stream: trio.SocketStream) -> None:
        uid = _peer_uid(stream.socket)
        if uid is not None and uid not in (os.geteuid(), 0):
            error = CtlError("forbidden", f"uid {uid} may not use this control socket")
            _log_refusal(error)
            await self._send(stream, error_response(None, error))
            return
        buffer = LineBuffer(MAX_REQUEST_BYTES)
        lines: list[bytes] = []
        refused = _Refused()
        try:
            for _ in range(MAX_REQUESTS):
                try:
                    line = await self._next_line(stream, buffer, lines)
                except CtlError as exc:
                    _log_refusal(exc)
                    await self._send(stream, error_response(None, exc))
                    return
                if line is None:
                    return
                if not await self._send(stream, await self._dispatch(line, refused)):
                    return
            log.warning(
                "control connection closed after its limit of %d requests",
                MAX_REQUESTS,
                extra={"event": "ctl", "outcome": "request_limit", "reason": None},
            )
        finally:
            refused.close()

    async def _next_line(
        self, stream: trio.SocketStream, buffer: LineBuffer, lines: list[bytes]
    ) -> bytes | None:
        """The next non-blank request line; None at EOF or after IDLE_S without one.

        Raises CtlError("evicted") when a newcomer needed this connection's slot."""
        key = object()
        with trio.CancelScope() as evictable:
            with trio.move_on_after(IDLE_S):
                while not lines:
                    self._waiting[key] = evictable
                    try:
                        data = await stream.receive_some(65536)
                    finally:
                        self._waiting.pop(key, None)
                    if not data:
                        return None
                    lines.extend(line for line in buffer.feed(data) if line.strip())
                return lines.pop(0)
            return None
        raise CtlError(
            "evicted",
            f"idle while all {MAX_CONNECTIONS} control connections were taken and another "
            "client needed one",
        )

    async def _dispatch(self, line: bytes, refused: _Refused) -> bytes:
        command: str | None = None
        try:
            request = parse_request(line)
            command = request.command
            result = await self.handler(request)
        except CtlError as exc:
            if not exc.logged:
                refused.log(exc, line)
            return error_response(command, exc)
        except Exception as exc:
            log.exception("control command %s failed", command)
            return error_response(
                command, CtlError("internal_error", f"{type(exc).__name__}: {exc}")
            )
        return ok_response(request.command, result)

    async def _send(self, stream: trio.SocketStream, data: bytes) -> bool:
        with trio.move_on_after(_WRITE_S):
            try:
                await stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return False
            return True
        return False
