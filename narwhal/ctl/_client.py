"""A blocking client for the control socket (narwhalctl is a short-lived CLI).

Errors: `DaemonUnreachable` when nothing answers on the path, saying why and what that
means for the daemon (`reason`): no such file (none listens there: down, or its
ctl.socket is another path), not a socket, permission denied (the socket or its folder
is the service user's: the daemon may well be running), connection refused on a socket
(stale: the daemon is down). `CtlProtocolError` once connected.
"""

from __future__ import annotations

import json
import os
import socket
import stat
from typing import Any, Literal

from ._protocol import MAX_RESPONSE_BYTES, CtlRequest, encode

Reason = Literal["missing", "not_a_socket", "permission_denied", "stale", "error"]


class DaemonUnreachable(Exception):
    """No daemon answers on `path`; `reason` says why, the message what it means."""

    def __init__(self, path: str, reason: Reason, message: str) -> None:
        self.path = path
        self.reason = reason
        self.detail = message
        super().__init__(f"{path}: {message}")


class CtlProtocolError(Exception):
    """The daemon answered badly or not in time."""


def call(path: str, request: CtlRequest, *, timeout_s: float) -> dict[str, Any]:
    """Send one request and return the decoded response object."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        try:
            sock.connect(path)
        except FileNotFoundError:
            raise DaemonUnreachable(
                path,
                "missing",
                "no such file: no narwhal listens there (it is not running, or its "
                "ctl.socket is another path)",
            ) from None
        except ConnectionRefusedError:
            if not _is_socket(path):
                raise DaemonUnreachable(
                    path, "not_a_socket", "not a socket: ctl.socket names something else"
                ) from None
            raise DaemonUnreachable(
                path,
                "stale",
                "connection refused: a stale socket, nothing listens; narwhal is down "
                "(killed or crashed: it removes its socket when it stops)",
            ) from None
        except PermissionError:
            raise DaemonUnreachable(
                path,
                "permission_denied",
                "permission denied: the socket is the service user's, and narwhal may well "
                "be running; run narwhalctl as that user (sudo -u narwhal narwhalctl ..., "
                "see docs/deploy-systemd.md)",
            ) from None
        except OSError as exc:
            reason = (exc.strerror or str(exc)).lower()
            raise DaemonUnreachable(path, "error", f"cannot connect: {reason}") from None
        try:
            sock.sendall(encode(request.to_json()))
            raw = _read_line(sock)
        except TimeoutError:
            raise CtlProtocolError(f"no answer from {path} within {timeout_s}s") from None
        except OSError as exc:
            raise CtlProtocolError(f"connection to {path} failed: {exc}") from None
    finally:
        sock.close()
    try:
        response = json.loads(raw)
    except ValueError:
        raise CtlProtocolError(f"malformed response from {path}") from None
    if not isinstance(response, dict) or not isinstance(response.get("ok"), bool):
        raise CtlProtocolError(f"malformed response from {path}")
    return response


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def _read_line(sock: socket.socket) -> bytes:
    parts: list[bytes] = []
    size = 0
    while True:
        data = sock.recv(65536)
        if not data:
            raise CtlProtocolError("the daemon closed the connection without an answer")
        end = data.find(b"\n")
        if end != -1:
            parts.append(data[:end])
            return b"".join(parts)
        parts.append(data)
        size += len(data)
        if size > MAX_RESPONSE_BYTES:
            raise CtlProtocolError(f"response longer than {MAX_RESPONSE_BYTES} bytes")
