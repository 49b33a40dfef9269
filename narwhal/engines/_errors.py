"""Engine error envelopes, in the shapes real engines send them.

vLLM >= 0.10.1 nests (`{"error": {"message", "type", "param", "code"}}`); older vLLM and
SGLang send the flat `{"object": "error", "message", ...}`; anything else (a proxy's
HTML page, an empty body) still yields a usable message.

An engine's message may carry a Python traceback: SGLang 0.5.23 appends the frame that
raised to a request's validation error (`1 validation error: ...` then `File
"/.../http_server.py", line 1860, in openai_v1_completions`). Messages go on to clients,
so `client_message` keeps the engine's own words before the traceback and puts no source
path in them; the whole message is logged (`narwhal.engines`).
"""

from __future__ import annotations

import json
import logging
import re

import attrs

log = logging.getLogger("narwhal.engines")

# Where a traceback starts: its header, or a frame line (`File "...", line N`).
_TRACEBACK = re.compile(
    r'Traceback \(most recent call last\):|^[ \t]*File "[^"\n]*", line \d+', re.MULTILINE
)
# A Python source file's path (what a traceback's frames name).
_SOURCE_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.+@~-]+)+[\\/]([\w.+@-]+\.py)\b")
_TRACEBACK_ONLY = "the engine reported an internal error (its traceback is in Narwhal's log)"


def client_message(message: str) -> str:
    """`message` without a Python traceback or source paths: the engine's words before the
    traceback (or, when it starts with one, its closing `Error: ...` line), source paths
    cut to their file names. Logs the whole message when it changed it."""
    found = _TRACEBACK.search(message)
    short = message[: found.start()] if found is not None else message
    if found is not None and not short.strip():
        # A bare traceback: its last unindented line names the exception.
        closing = [line for line in message.splitlines() if line and not line[0].isspace()]
        short = closing[-1] if len(closing) > 1 else ""
    short = _SOURCE_PATH.sub(r"\1", short).strip()
    if short == message:
        return message
    short = short or _TRACEBACK_ONLY
    log.warning(
        "an engine's error message carried a Python traceback or source paths; clients get "
        "%r; the engine's whole message: %s",
        short,
        message,
        extra={"event": "engine_error_detail"},
    )
    return short


@attrs.frozen
class EngineErrorInfo:
    status: int
    message: str
    type: str | None = None
    param: str | None = None


def parse_error_body(status: int, body: bytes) -> EngineErrorInfo:
    try:
        document = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError, RecursionError):
        document = None
    if isinstance(document, dict):
        inner = document.get("error")
        fields = inner if isinstance(inner, dict) else document
        message = fields.get("message")
        if isinstance(inner, str):
            message = inner
        if isinstance(message, str | dict | list):
            text = client_message(message if isinstance(message, str) else json.dumps(message))
            kind = fields.get("type")
            param = fields.get("param")
            return EngineErrorInfo(
                status,
                text[:2000],
                kind if isinstance(kind, str) else None,
                param if isinstance(param, str) else None,
            )
    text = client_message(body[:500].decode("utf-8", "replace").strip())
    return EngineErrorInfo(status, text or f"engine returned HTTP {status} with no body")
