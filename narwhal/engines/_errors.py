"""Engine error envelopes, in the shapes real engines send them.

vLLM >= 0.10.1 nests (`{"error": {"message", "type", "param", "code"}}`); older vLLM and
SGLang send the flat `{"object": "error", "message", ...}`; anything else (a proxy's
HTML page, an empty body) still yields a usable message.
"""

from __future__ import annotations

import json

import attrs


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
            text = message if isinstance(message, str) else json.dumps(message)
            kind = fields.get("type")
            param = fields.get("param")
            return EngineErrorInfo(
                status,
                text[:2000],
                kind if isinstance(kind, str) else None,
                param if isinstance(param, str) else None,
            )
    text = body[:500].decode("utf-8", "replace").strip()
    return EngineErrorInfo(status, text or f"engine returned HTTP {status} with no body")
