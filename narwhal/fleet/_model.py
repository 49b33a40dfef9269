"""An engine that does not serve the model the configuration names for it.

vLLM checks each request's `model` against the names it serves (--served-model-name,
its LoRA adapters, and any a LoRA resolver loads on demand) and answers 404 with
`param: "model"` for any other ("The model `x` does not exist."). The router has already
matched the client's model to the engine's engines[].model, so that answer means the
engine was launched under another name: every request placed on it would be refused,
while it answers its health probes and its breakers see only client errors.

It is judged by that answer, not by /v1/models alone: a name a LoRA resolver would load
is absent from /v1/models until first asked for, and SGLang's OpenAI routes do not check
the name (its serving_base validates the request's fields, not `model`; newer builds read
a `base:adapter` name as a LoRA adapter), so an absent name does not mean a refused
request. (narwhal-sim does the same: its vLLM engines refuse an unknown name, its SGLang
ones take any plain name and refuse an adapter with 400.) Recovery reads /v1/models at each
good probe while the engine is out, and readmits it once the model is listed
(`narwhal.recovery`).
"""

from __future__ import annotations

import logging

from ..config import Config
from ..engines import EngineErrorInfo
from ._engine import EngineState

log = logging.getLogger("narwhal.fleet")


def names_model(status: int, info: EngineErrorInfo) -> bool:
    """Whether an engine's error answer refuses the request's model: vLLM's 404 with
    `param: "model"` ("The model `x` does not exist.", its `_check_model`), for the
    completions routes and /tokenize alike."""
    return status == 404 and info.param == "model"


def model_refused(engine: EngineState, message: str, config: Config) -> str:
    """Mark `engine` as not serving its configured model: it answered a leg 404 naming
    the model (with the engine's `message`). It leaves placement until its /v1/models
    lists the model, or a reload changes engines[].model. Logged once per episode;
    returns why, for the caller's error."""
    why = (
        f"does not serve model {engine.spec.model!r} (engines[].model; HTTP 404: {message}); "
        "check the engine's --served-model-name"
    )
    if engine.model_missing is None:
        log.error(
            "engine %s %s; it takes no new work until its /v1/models lists the model "
            "(read with each health probe, recovery.health.interval_s=%s) or a reload "
            "changes engines[].model",
            engine.id,
            why,
            config.recovery.health.interval_s,
            extra={
                "event": "engine_model_missing",
                "engine": engine.id,
                "model": engine.spec.model,
            },
        )
    engine.note_model_missing(f"HTTP 404: {message}")
    # Read /v1/models at each good probe until it lists the model (`Recovery._read_context`).
    engine.context_due = True
    return why
