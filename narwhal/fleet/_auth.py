"""An engine refusing Narwhal's API key: one judgement, whichever request met the refusal.

The request path (a leg, /tokenize) and recovery (a verification leg, the identity
check) send the same key: both pools of an `EngineState` are built from, and reloaded
with, the engine's one configured key. So a 401/403 on any of them means the engine
will refuse the request path too, and each of them calls `key_refused`.

Every report of a refusal words it with `explain_refusal`: the daemon's error and log
line, recovery's probe, key check and verification details, narwhal-check's health row.
"""

from __future__ import annotations

import logging

from ..config import Config
from ._engine import EngineState

log = logging.getLogger("narwhal.fleet")


def explain_refusal(
    status: int, *, sends_key: bool, message: str | None = None, fix: bool = True
) -> str:
    """What an engine's 401/403 (`status`, with the engine's `message` if known) means,
    and with `fix` what to change, for a sentence whose subject is the engine ("engine
    p0 ...", "the engine ..."). Which fix depends on whether a key went with the request
    (`sends_key`, the pool's `sends_api_key`): a key sent and refused disagrees with the
    engine's --api-key; with none configured, the engine wants one."""
    if sends_key:
        refusal = "refused narwhal's API key"
        remedy = "check engine.api_key_file against the engine's --api-key"
    else:
        refusal = "requires an API key and narwhal sends none"
        remedy = "set engine.api_key_file to the key of the engine's --api-key"
    answer = f"HTTP {status}" if message is None else f"HTTP {status}: {message}"
    text = f"{refusal} ({answer})"
    return f"{text}; {remedy}" if fix else text


def key_refused(engine: EngineState, status: int, message: str, config: Config) -> str:
    """Mark `engine` as refusing Narwhal's API key: it answered 401/403 (`status`, with
    the engine's `message`) and will refuse every request until the keys agree. It
    leaves placement until recovery's key check sees the key accepted again, or a reload
    re-reads it. Logged once per refusal; returns why, for the caller's error."""
    sends_key = engine.serving_pool.sends_api_key
    why = explain_refusal(status, sends_key=sends_key, message=message)
    if engine.auth_refused is None:
        log.error(
            "engine %s %s; it takes no new work until it accepts the key again (checked "
            "with each health probe, recovery.health.interval_s=%s) or a reload",
            engine.id,
            why,
            config.recovery.health.interval_s,
            extra={"event": "engine_auth_refused", "engine": engine.id},
        )
    engine.note_key_refused(explain_refusal(status, sends_key=sends_key, fix=False))
    return why
