"""The narwhalctl wire protocol: JSON lines over the AF_UNIX control socket. Pure.

One request per line, one response line per request, in order; a connection may carry
several requests. Requests are bounded by MAX_REQUEST_BYTES (a longer line is answered
with `message_too_large` and the connection is closed, since the stream cannot be
resynchronised); responses by MAX_RESPONSE_BYTES on the client side.

Request:  {"command": "pin", "engine": "p0", "role": "prefill"}
          commands and their fields: state, proposals; drain, undrain, unpin: engine;
          pin: engine and role ("prefill" or "decode"); reload. Unknown keys are refused.
Response: {"ok": true, "command": "pin", "result": {...}}
          {"ok": false, "command": "pin", "error": {"code": "unknown_engine", "message": "..."}}

Error codes: bad_request (not JSON, not an object, unknown command, missing or extra
fields), message_too_large, unknown_engine, invalid_config, reload_unavailable and
shutting_down (reload), busy (too many control connections), forbidden (peer is another user),
internal_error.
"""

from __future__ import annotations

import json
from typing import Literal

import attrs

MAX_REQUEST_BYTES = 64 * 1024
MAX_RESPONSE_BYTES = 16 * 1024 * 1024

Command = Literal["state", "proposals", "drain", "undrain", "pin", "unpin", "reload"]
FIELDS: dict[str, tuple[str, ...]] = {
    "state": (),
    "proposals": (),
    "drain": ("engine",),
    "undrain": ("engine",),
    "pin": ("engine", "role"),
    "unpin": ("engine",),
    "reload": (),
}
PIN_ROLES = ("prefill", "decode")


class CtlError(Exception):
    """A refused request: `code` is machine-readable, the message names the problem.

    The server logs every refusal, unless `logged` says whoever raised it already has
    (a rejected reload logs its problems itself, one line each)."""

    def __init__(
        self, code: str, message: str, *, details: object = None, logged: bool = False
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details
        self.logged = logged


@attrs.frozen
class CtlRequest:
    command: str
    engine: str | None = None
    role: str | None = None

    def to_json(self) -> dict[str, object]:
        document: dict[str, object] = {"command": self.command}
        for name in FIELDS[self.command]:
            document[name] = getattr(self, name)
        return document


def parse_request(line: bytes) -> CtlRequest:
    try:
        document = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CtlError("bad_request", f"request is not JSON: {exc}") from None
    except RecursionError:
        raise CtlError("bad_request", "request is not JSON: nested too deeply") from None
    if not isinstance(document, dict):
        raise CtlError("bad_request", "request must be a JSON object")
    command = document.get("command")
    if not isinstance(command, str) or command not in FIELDS:
        raise CtlError(
            "bad_request",
            f"unknown command {command!r}; commands: {', '.join(FIELDS)}",
        )
    wanted = FIELDS[command]
    extra = sorted(set(document) - {"command", *wanted})
    if extra:
        raise CtlError("bad_request", f"{command}: unexpected field(s) {', '.join(extra)}")
    values: dict[str, str] = {}
    for name in wanted:
        value = document.get(name)
        if not isinstance(value, str) or not value:
            raise CtlError("bad_request", f"{command}: `{name}` must be a non-empty string")
        values[name] = value
    if command == "pin" and values["role"] not in PIN_ROLES:
        raise CtlError("bad_request", f"pin: role is {values['role']!r}; must be prefill or decode")
    return CtlRequest(command, values.get("engine"), values.get("role"))


def encode(document: dict[str, object]) -> bytes:
    return json.dumps(document, separators=(",", ":"), default=str).encode() + b"\n"


def ok_response(command: str, result: object) -> bytes:
    return encode({"ok": True, "command": command, "result": result})


def error_response(command: str | None, error: CtlError) -> bytes:
    body: dict[str, object] = {"code": error.code, "message": error.message}
    if error.details is not None:
        body["details"] = error.details
    return encode({"ok": False, "command": command, "error": body})


class LineBuffer:
    """Splits a byte stream into lines, refusing to hold a line longer than `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._pending = b""

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._pending + data
        *lines, self._pending = buffer.split(b"\n")
        if len(self._pending) > self.limit or any(len(line) > self.limit for line in lines):
            raise CtlError(
                "message_too_large", f"message longer than the limit of {self.limit} bytes"
            )
        return lines

    @property
    def pending(self) -> int:
        return len(self._pending)
