"""What a simulated SGLang engine refuses, in its order and its words.

Owns: SGLang's request checks, each one function the SGLang protocol (`_sglang`) calls
where the engine runs it: FastAPI's validation of its request models (`check_declared`,
`choices`, `check_prompt`, in `validation_error`'s words), its LoRA selection
(`check_lora`), its tokenizer manager's context check (`check_context`),
`sampling_refusal` (its SamplingParams.verify, in its order) and `max_request_input`
(its scheduler's bound on a prompt).
Invariants: the wording is SGLang 0.5.23's, as recorded in
tests/conformance/recorded-sglang.json.
See: the real engine's sampling_params.py.

- Its tokenizer manager checks a request (context, sampling parameters) inside the
  response generator, which its handler starts before answering: a refusal is a 400,
  streamed or not. Its scheduler then refuses a prompt of `max_request_input` tokens or
  more by aborting the request: a 400, or after a stream's 200 an error event whose
  `type` is the HTTP status's name ("BAD_REQUEST"), then [DONE]. A stream's 200 goes out
  with its first chunk, after the first token.
"""

from __future__ import annotations

import math
from typing import Any

from .._values import json_int
from ._protocol import ApiError


def _number(body: dict[str, Any], key: str, default: float) -> float | None:
    """A sampling parameter as SGLang reads it (null: its default), None when it is
    not a number (FastAPI's validation answers those, not verify)."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def sampling_refusal(body: dict[str, Any], max_tokens: int | None, min_tokens: int) -> str | None:
    """Why SGLang's SamplingParams.verify refuses the request's sampling parameters (its
    first failed check, in its order), or None."""
    temperature = _number(body, "temperature", 1.0)
    if temperature is not None and (not math.isfinite(temperature) or temperature < 0.0):
        return f"temperature must be a non-negative finite number, got {temperature}."
    top_p = _number(body, "top_p", 1.0)
    if top_p is not None and not 0.0 < top_p <= 1.0:
        return f"top_p must be in (0, 1], got {top_p}."
    min_p = _number(body, "min_p", 0.0)
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        return f"min_p must be in [0, 1], got {min_p}."
    top_k = body.get("top_k")
    if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k != -1 and top_k < 1:
        # -1 (and a null) mean the whole vocabulary; a greedy temperature sets 1.
        return f"top_k must be -1 (disable) or at least 1, got {top_k}."
    for key in ("frequency_penalty", "presence_penalty"):
        value = _number(body, key, 0.0)
        if value is not None and not -2.0 <= value <= 2.0:
            return f"{key} must be in [-2, 2], got {value}."
    repetition = _number(body, "repetition_penalty", 1.0)
    if repetition is not None and not 0.0 < repetition <= 2.0:
        return f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {repetition}."
    if min_tokens < 0:
        return f"min_new_tokens must be in [0, max_new_tokens], got {min_tokens}."
    if max_tokens is not None and min_tokens > max_tokens:
        return f"min_new_tokens must be in [0, max_new_tokens({max_tokens})], got {min_tokens}."
    return None


def max_request_input(context: int, kv_capacity: int) -> int:
    """The prompt length from which SGLang's scheduler refuses a request: its longest
    request (the context or the KV pool, less one) less 5 (tp_worker.py)."""
    return min(context - 1, kv_capacity - 1) - 5


def validation_error(
    loc: tuple[str, ...], kind: str, msg: str, value: object, cause: Exception | None = None
) -> ApiError:
    """FastAPI's refusal of a body its pydantic model rejects, as SGLang's validation
    handler answers it: 400, "Bad Request", the error's text then its list's. `value` is
    what pydantic reports as the input (the field's value; the body for a missing field),
    `cause` a field validator's exception."""
    error: dict[str, object] = {"type": kind, "loc": loc, "msg": msg, "input": value}
    if cause is not None:
        error["ctx"] = {"error": cause}
    return ApiError(400, f"1 validation error:\n  {error!r} {[error]!r}", type_="Bad Request")


def check_declared(body: dict[str, Any], *, chat: bool) -> None:
    """The fields its request models declare with a type FastAPI enforces: `stream:
    bool = False` and `n: int = 1` refuse a null (protocol.py@9b116dff); a completion's
    `max_tokens: int = 16`, with a validator that it be positive, refuses null or 0
    before SGLang's code runs, where vLLM reads null as no bound."""
    for key, kind, msg in (
        ("stream", "bool_type", "Input should be a valid boolean"),
        ("n", "int_type", "Input should be a valid integer"),
    ):
        if key in body and body[key] is None:
            raise validation_error(("body", key), kind, msg, None)
    if chat or "max_tokens" not in body:
        return
    value = body["max_tokens"]
    if value is None:
        raise validation_error(
            ("body", "max_tokens"), "int_type", "Input should be a valid integer", None
        )
    count = json_int(value)
    if count is not None and count <= 0:
        cause = ValueError("max_tokens must be positive")
        raise validation_error(
            ("body", "max_tokens"), "value_error", f"Value error, {cause}", count, cause
        )


def choices(value: object, *, stream: bool) -> int:
    """The choices SGLang serves for `n` (`n: int = 1` in its request models): n above 1
    as asked, else one. Its non-streaming answer of n=0 divides by n (`range(0, len, n)`
    in its usage processor) once the request has run; the simulator answers it without
    running it."""
    n = json_int(value)
    if n is None:
        raise validation_error(("body", "n"), "int_type", "Input should be a valid integer", value)
    if n == 0 and not stream:
        raise ApiError(400, "range() arg 3 must not be zero", type_="BadRequest")
    return max(n, 1)


def top_logprobs(body: dict[str, Any], *, chat: bool) -> int | None:
    """How many top logprobs SGLang sends per token (None: no logprobs): a completion's
    `logprobs`, a chat's `top_logprobs` (0 unless set) once `logprobs` is true. It has
    no upper bound."""
    if chat:
        return (json_int(body.get("top_logprobs")) or 0) if body.get("logprobs") else None
    return json_int(body.get("logprobs"))


def check_prompt(body: dict[str, Any]) -> None:
    """SGLang's CompletionRequest requires `prompt` (FastAPI refuses a body without it),
    and its `_validate_request` an unempty one, before anything else runs (so never after
    a stream's 200)."""
    if "prompt" not in body:
        raise validation_error(("body", "prompt"), "missing", "Field required", body)
    prompt = body["prompt"]
    if not prompt or (isinstance(prompt, list) and all(not p for p in prompt)):
        raise ApiError(400, "Prompt cannot be empty")


def check_lora(body: dict[str, Any]) -> None:
    """SGLang does not check `model` against the name it serves: its OpenAI routes take
    any name. Newer builds read `base:adapter` as a LoRA adapter selection, ahead of the
    request's own `lora_path` (sgl-project/sglang
    python/sglang/srt/entrypoints/openai/serving_completions.py@004c82e0, the same in
    serving_chat: `_validate_request` checks the prompt only, and
    `_resolve_lora_path(request.model, request.lora_path)` in serving_base splits the
    name at its first colon, an empty adapter meaning none). Its tokenizer manager
    (`_validate_and_resolve_lora`) then refuses any adapter on a server launched without
    --enable-lora, which every simulated one is, with a ValueError: 400, streamed or
    not, like the context check after it."""
    model = body.get("model")
    adapter: object = None
    if isinstance(model, str) and ":" in model:
        adapter = model.split(":", 1)[1].strip() or None
    if adapter is None:
        adapter = body.get("lora_path")
        if isinstance(adapter, list):
            adapter = next((a for a in adapter if a), None)
    if adapter:
        raise ApiError(
            400,
            f"LoRA adapter '{adapter}' was requested, but LoRA is not enabled. Please "
            "launch the server with --enable-lora flag and preload adapters using "
            "--lora-paths or /load_lora_adapter endpoint.",
        )


def check_context(prompt_tokens: int, max_tokens: int, limit: int) -> None:
    """Its tokenizer manager's context check (newer builds: a total equal to the context
    passes), on a prefill server too: that sets max_new_tokens to 1 later, in its
    bootstrap queue."""
    if prompt_tokens + max_tokens > limit:
        raise ApiError(
            400,
            "Requested token count exceeds the model's maximum context length of "
            f"{limit} tokens. You requested a total of {prompt_tokens + max_tokens} "
            f"tokens: {prompt_tokens} tokens from the input messages and {max_tokens} "
            "tokens for the completion. Please reduce the number of tokens in the input "
            "messages or the completion to fit within the limit.",
        )
