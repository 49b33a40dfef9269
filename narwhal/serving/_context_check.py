"""The context check: refuse up front what the engines would refuse for their context.

Owns
  `context_rule` (which rule an engine build refuses by), `context_refusal` (one engine's
  refusal in its words), `check_context` (the fleet's verdict) and `output_bound` (the
  output a request can have, which pricing uses).

Rules
  "prompt", vLLM 0.32 and later: prompt + max_tokens over the context is served, the
  output capped at the room left (finish_reason "length"). Refused, in vLLM's order and
  words: a `max_tokens` (a chat's `max_completion_tokens` first) above the context, then
  a prompt past it. A prompt that fills it leaves no room for one token; vLLM's answer,
  "max_tokens must be at least 1, got 0", names `max_tokens` whether or not the client
  sent it, so Narwhal's refusal names the prompt (`input_tokens`).
  "total", vLLM before 0.32 and every SGLang build: a prompt of at least the context,
  and prompt + output past it, are refused; for a completion that sent no `max_tokens`,
  the engines' default of 16 counts, and the refusal names the prompt.
  An engine whose version is unknown (no /version answer yet, or an unparsable one) is
  held to "prompt": refusing what it would serve is worse than leaving a refusal to it.

Invariants
  A request is refused only when every available engine that reports its context would
  refuse it (placement may pick any of them), in the words of the widest one, the more
  lenient rule first. A refusal never names a field the client did not send.

See
  README "What clients can rely on"; vLLM's `renderers/params.py` (TokenizeParams) and
  `entrypoints/serve/utils/api_utils.py` (get_max_tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from .._codes import ErrorCode
from .._errors import BadRequest
from ..engines import Dialect, release
from ..fleet import EngineState
from ._request import ClientRequest

ContextRule = Literal["prompt", "total"]
CheckResult = Literal["passed", "refused", "unknown"]

# The first vLLM release seen to serve prompt + max_tokens over the context, capped
# (0.32.0, on the real-engine tier); the builds before it refused the total.
VLLM_CAPPED_FROM = (0, 32)


def context_rule(dialect: Dialect, version: str | None) -> ContextRule:
    """The rule an engine of `dialect` reporting `version` on /version refuses by."""
    if dialect.name != "vllm":
        return "total"
    found = release(version)
    return "prompt" if found is None or found >= VLLM_CAPPED_FROM else "total"


def engine_rule(engine: EngineState) -> ContextRule:
    return context_rule(engine.dialect, engine.version)


def _sent_bound(request: ClientRequest) -> int | None:
    """The output bound the client sent; None when it sent none (a completion's default
    of 16 is the router's reading of the engines' rule, not a field the client sent)."""
    if request.body.get(request.max_tokens_field) is None:
        return None
    return request.max_tokens


def _vllm_suffix(param: str, value: int) -> str:
    # vLLM's VLLMValidationError appends this to every message it words.
    return f" (parameter={param}, value={value})"


def context_refusal(
    request: ClientRequest,
    prompt_tokens: int,
    context: int,
    dialect: Dialect,
    rule: ContextRule,
) -> BadRequest | None:
    """What an engine of `dialect` with this `context` and `rule` would refuse, in its
    words; None when it would serve the request (perhaps capped)."""
    if rule == "prompt":
        return _prompt_rule(request, prompt_tokens, context)
    return _total_rule(request, prompt_tokens, context, dialect)


def _prompt_rule(request: ClientRequest, prompt_tokens: int, context: int) -> BadRequest | None:
    sent = _sent_bound(request)
    key = request.max_tokens_field
    if sent is not None and sent > context:
        return BadRequest(
            f"{key}={sent} cannot be greater than max_model_len={context}. Please request "
            f"fewer output tokens.{_vllm_suffix(key, sent)}",
            code=ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            param=key,
        )
    if prompt_tokens < context:
        return None
    if prompt_tokens > context:
        why = "which exceeds this limit even without any output tokens"
    else:
        why = "which leaves no room for an output token"
    return BadRequest(
        f"This model's maximum context length is {context} tokens. However, your prompt "
        f"contains {prompt_tokens} input tokens, {why}. Please reduce the length of the "
        f"input prompt.{_vllm_suffix('input_tokens', prompt_tokens)}",
        code=ErrorCode.CONTEXT_LENGTH_EXCEEDED,
        param="input_tokens",
    )


def _total_rule(
    request: ClientRequest, prompt_tokens: int, context: int, dialect: Dialect
) -> BadRequest | None:
    # Older SGLang builds refused a total equal to the context too, and under EAGLE
    # speculative decoding SGLang counts some reserved draft tokens as input: what only
    # some builds refuse is left to the engine. (An SGLang server started with
    # --allow-auto-truncate refuses nothing: recovery reports no context for it.)
    if prompt_tokens >= context:
        if dialect.name == "sglang":
            message = (
                f"The input ({prompt_tokens} tokens) is longer than the model's context "
                f"length ({context} tokens)."
            )
        else:
            message = (
                f"This model's maximum context length is {context} tokens. However, your "
                f"request has {prompt_tokens} input tokens. Please reduce the length of the "
                "input messages."
            )
        return BadRequest(message, code=ErrorCode.CONTEXT_LENGTH_EXCEEDED, param="input_tokens")
    wanted = request.max_tokens
    if wanted is None or prompt_tokens + wanted <= context:
        return None
    # A completion that sent no max_tokens is refused for its prompt: the field is not
    # the client's to fix (vLLM and SGLang name it all the same).
    key = request.max_tokens_field if _sent_bound(request) is not None else "input_tokens"
    if dialect.name == "sglang":
        message = (
            "Requested token count exceeds the model's maximum context length of "
            f"{context} tokens. You requested a total of {prompt_tokens + wanted} tokens: "
            f"{prompt_tokens} tokens from the input messages and {wanted} tokens for the "
            "completion. Please reduce the number of tokens in the input messages or the "
            "completion to fit within the limit."
        )
    elif key == "input_tokens":
        message = (
            f"This model's maximum context length is {context} tokens. However, your "
            f"request has {prompt_tokens} input tokens and a completion's default of "
            f"{wanted} output tokens ({prompt_tokens} + {wanted} > {context}). Please "
            f"reduce the length of the input prompt, or set max_tokens to at most "
            f"{context - prompt_tokens}."
        )
    else:
        message = (
            f"'{key}' is too large: {wanted}. This model's maximum context length is "
            f"{context} tokens and your request has {prompt_tokens} input tokens ({wanted} "
            f"> {context} - {prompt_tokens})."
        )
    return BadRequest(message, code=ErrorCode.CONTEXT_LENGTH_EXCEEDED, param=key)


def check_context(
    request: ClientRequest, prompt_tokens: int, engines: Sequence[EngineState]
) -> tuple[CheckResult, BadRequest | None]:
    """The fleet's verdict on a request whose exact prompt length is `prompt_tokens`,
    over the available `engines`: "unknown" when none reports its context, "refused"
    (with the refusal) when every one that does would refuse it, else "passed"."""
    known = [e for e in engines if e.context_length is not None]
    if not known:
        return "unknown", None
    verdicts = []
    for engine in known:
        assert engine.context_length is not None
        rule = engine_rule(engine)
        refusal = context_refusal(
            request, prompt_tokens, engine.context_length, engine.dialect, rule
        )
        if refusal is None:
            return "passed", None
        verdicts.append((engine.context_length, rule == "prompt", refusal))
    _, _, refusal = max(verdicts, key=lambda v: (v[0], v[1]))
    return "refused", refusal


def widest_context(engines: Sequence[EngineState]) -> int | None:
    """The largest context an engine of `engines` reports (None: none does)."""
    return max((e.context_length for e in engines if e.context_length is not None), default=None)


def output_bound(
    max_tokens: int | None, prompt_tokens: int | None, context: int | None
) -> int | None:
    """The most tokens a request can generate, for pricing (KV growth, demand): its
    `max_tokens`, or the room its prompt leaves in the `context` when that is less (an
    engine that serves the excess caps the output there); None: no bound but the
    context, as the request sets none."""
    if max_tokens is None or prompt_tokens is None or context is None:
        return max_tokens
    return min(max_tokens, max(0, context - prompt_tokens))
