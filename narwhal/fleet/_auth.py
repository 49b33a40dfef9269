"""An engine refusing Narwhal's API key: one judgement, whichever request met the refusal.

The request path (a leg, /tokenize) and recovery (a verification leg, the identity
check) send the same key: both pools of an `EngineState` are built from, and reloaded
with, the engine's one configured key. So a 401/403 on any of them means the engine
will refuse the request path too, and each of them calls `key_refused`.
"""

from __future__ import annotations

import logging

from ..config import Config
from ._engine import EngineState

log = logging.getLogger("narwhal.fleet")


def key_refused(engine: EngineState, status: int, message: str, config: Config) -> str:
    """Mark `engine` as refusing Narwhal's API key: it answered 401/403 (`status`, with
    the engine's `message`) and will refuse every request until the keys agree. It
    leaves placement until recovery's key check sees the key accepted again, or a reload
    re-reads it. Logged once per refusal; returns why, for the caller's error."""
    if engine.serving_pool.sends_api_key:
        refusal = "refused narwhal's API key"
        fix = "check engine.api_key_file against the engine's --api-key"
    else:
        refusal = "requires an API key and narwhal sends none"
        fix = "set engine.api_key_file to the key of the engine's --api-key"
    why = f"{refusal} (HTTP {status}: {message}); {fix}"
    if engine.auth_refused is None:
        log.error(
            "engine %s %s; it takes no new work until it accepts the key again (checked "
            "with each health probe, recovery.health.interval_s=%s) or a reload",
            engine.id,
            why,
            config.recovery.health.interval_s,
            extra={"event": "engine_auth_refused", "engine": engine.id},
        )
    engine.auth_refused = f"{refusal} (HTTP {status})"
    return why
