"""A blocking client for the control socket (narwhalctl is a short-lived CLI)."""

from __future__ import annotations

import json
import os
import socket
import stat
from typing import Any

from ._protocol import MAX_RESPONSE_BYTES, CtlRequest, encode


class DaemonUnreachable(Exception):
    """No daemon answers on the socket path (not running, stale socket, not a socket)."""


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
                f"no control socket at {path}: narwhal is not running "
                "(or ctl.socket points elsewhere)"
            ) from None
        except ConnectionRefusedError:
            if not _is_socket(path):
                raise DaemonUnreachable(f"{path} is not a socket (check ctl.socket)") from None
            raise DaemonUnreachable(
                f"nothing is listening on {path}: narwhal is not running (stale socket)"
            ) from None
        except PermissionError:
            raise DaemonUnreachable(
                f"permission denied on {path}: run narwhalctl as the daemon's user"
            ) from None
        except OSError as exc:
            reason = (exc.strerror or str(exc)).lower()
            raise DaemonUnreachable(f"cannot connect to {path}: {reason}") from None
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
