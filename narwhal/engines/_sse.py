"""Incremental server-sent-events scanning for relayed engine streams.

The router forwards the engine's bytes unchanged, but it must see event boundaries to
know when the first token arrived, whether the engine reported an error inside the 200
stream (vLLM and SGLang both do: `data: {"error": ...}` then `data: [DONE]`), and
whether the success terminator came. Full JSON parsing of every chunk would cost more
than the relay itself, so only error events are parsed.
"""

from __future__ import annotations

import enum
import json
from typing import NamedTuple

from ._errors import client_message


class SseKind(enum.Enum):
    DATA = "data"
    DONE = "done"
    ERROR = "error"
    OTHER = "other"  # comments, `event:`/`id:` lines, keep-alives


class SseEvent(NamedTuple):
    """One event; a tuple because a relayed stream makes one per engine event."""

    kind: SseKind
    payload: bytes
    raw: bytes  # the event as received, separator included, for verbatim relay
    error: dict[str, object] | None = None


# vLLM and SGLang terminate events with a blank line; tolerate CRLF framing too.
_SEPARATORS = (b"\n\n", b"\r\n\r\n")
_MAX_PENDING = 4 * 1024 * 1024


class SseOverflow(Exception):
    pass


class SseScanner:
    """Feed raw stream bytes; get complete events back."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    @property
    def pending(self) -> int:
        """Bytes of an incomplete event held back (a partial line from the engine)."""
        return len(self._pending)

    def feed(self, data: bytes) -> list[SseEvent]:
        buffer = self._pending + data if self._pending else data
        events: list[SseEvent] = []
        start = 0
        # Each separator kind is searched again only once the one found was consumed: a
        # batch of many events with no CRLF framing must not rescan the buffer per event.
        lf = buffer.find(b"\n\n")
        crlf = buffer.find(b"\r\n\r\n")
        while lf >= 0 or crlf >= 0:
            if crlf >= 0 and (lf < 0 or crlf < lf):
                end, stop = crlf, crlf + 4
            else:
                end, stop = lf, lf + 2
            events.append(_classify(buffer[start:end], buffer[start:stop]))
            start = stop
            if 0 <= lf < start:
                lf = buffer.find(b"\n\n", start)
            if 0 <= crlf < start:
                crlf = buffer.find(b"\r\n\r\n", start)
        self._pending = buffer[start:]
        if len(self._pending) > _MAX_PENDING:
            raise SseOverflow(f"engine sent an SSE event larger than {_MAX_PENDING} bytes")
        return events


def _classify(block: bytes, raw: bytes) -> SseEvent:
    if block.startswith(b"data:") and b"\n" not in block and b"\r" not in block:
        payload = block[5:].lstrip(b" ")  # the usual one-line event, without splitting
    else:
        data_lines = [
            line[5:].lstrip(b" ") for line in block.splitlines() if line.startswith(b"data:")
        ]
        if not data_lines:
            return SseEvent(SseKind.OTHER, block, raw)
        payload = b"\n".join(data_lines)
    # Looked at without copying the payload: a token chunk is hundreds of bytes.
    if len(payload) < 64 and payload.strip() == b"[DONE]":
        return SseEvent(SseKind.DONE, payload, raw)
    # Error events start with the "error" key in both engines' encoders; a token chunk
    # starts with "id". Anything else that fails to parse is still relayed as data.
    if payload.startswith(b'{"error"') or (
        payload[:1].isspace() and payload.lstrip().startswith(b'{"error"')
    ):
        try:
            parsed = json.loads(payload)
        except (ValueError, RecursionError):
            parsed = None
        if isinstance(parsed, dict) and "error" in parsed:
            return SseEvent(SseKind.ERROR, payload, raw, _error_fields(parsed["error"]))
    return SseEvent(SseKind.DATA, payload, raw)


def _error_fields(error: object) -> dict[str, object]:
    """An error event's fields, its message without a Python traceback (`client_message`)."""
    if isinstance(error, dict):
        fields = {str(k): v for k, v in error.items()}
    else:
        fields = {"message": str(error)}
    message = fields.get("message")
    if isinstance(message, str):
        fields["message"] = client_message(message)
    return fields
