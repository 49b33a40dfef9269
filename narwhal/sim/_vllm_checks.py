"""What a simulated vLLM engine refuses, in its order and its words, per build.

Owns: vLLM's request checks, each one function the vLLM protocol (`_vllm`) calls where
the engine runs it: the request model's validators (`check_body`), the served model
(`unknown_model`), `truncate_prompt_tokens` (`truncate`), the context (`fit_output` for
0.32's rule, `over_context` and `check_total` for 0.29's), SamplingParams
(`check_sampling`) and the input processor, after a stream's 200 (`check_inputs`).
Invariants: the wording is the build's (`_vllm_builds`); 0.32's is checked against
answers recorded on real vLLM (tests/conformance).
Errors: each check raises `ApiError`.
"""

from __future__ import annotations

from typing import Any

from .._values import json_int
from ._protocol import ApiError, token_prompt
from ._tokenizer import VOCAB_SIZE
from ._vllm_builds import VllmBuild

# vLLM's --max-logprobs default.
MAX_LOGPROBS = 20


def check_body(build: VllmBuild, body: dict[str, Any], *, stream: bool, chat: bool) -> None:
    """vLLM's request-model validators, before anything else runs."""
    stream_options = body.get("stream_options")
    if build.wire_032:
        # A VLLMValidationError in a model validator; `{}` passes (it checks truth).
        if stream_options and not stream:
            raise ApiError(
                400,
                "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
                param="stream_options",
            )
    elif stream_options is not None and not stream:
        # A pydantic model validator in vLLM, so FastAPI's validation handler answers.
        raise ApiError(
            400,
            "1 validation error:\n  {'type': 'value_error', 'loc': ('body',), 'msg': "
            "'Value error, Stream options can only be defined when `stream=True`.'}",
            type_="Bad Request",
            param="body",
        )
    name = "top_logprobs" if chat else "logprobs"
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(
            400,
            f"`{name}` must be an integer. (parameter={name}, value={value})",
            param=name,
        )
    if value < 0 and value != -1:
        raise ApiError(
            400,
            f"`{name}` must be a positive value or -1. (parameter={name}, value={value})",
            param=name,
        )
    if chat and value != 0 and not body.get("logprobs"):
        raise ApiError(
            400,
            "when using `top_logprobs`, `logprobs` must be set to true. "
            f"(parameter=top_logprobs, value={value})",
            param="top_logprobs",
        )


def unknown_model(build: VllmBuild, model: object, served: str) -> ApiError:
    """The refusal of a `model` other than the one the engine serves."""
    message = f"The model `{model}` does not exist."
    if build.wire_032:
        message += f" Valid aliases: {served}."
    return ApiError(404, message, type_="NotFoundError", param="model")


def truncate(build: VllmBuild, keep: int | None, prompt_tokens: int, limit: int) -> int:
    """The prompt after `truncate_prompt_tokens` (`keep`): its last `keep` tokens, before
    any other check (-1: as many as fit, 0.32 holding one back for the output)."""
    if keep is None:
        return prompt_tokens
    if build.wire_032 and keep > limit:
        raise ApiError(
            400,
            f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = "
            f"{limit}. Please request a smaller truncation size. "
            f"(parameter=truncate_prompt_tokens, value={keep})",
            param="truncate_prompt_tokens",
        )
    if keep == -1:
        keep = limit - 1 if build.wire_032 else limit
    if keep > limit:
        raise ApiError(
            400,
            f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
            f"({limit}). Please, select a smaller truncation size.",
        )
    if keep >= 1:
        return min(prompt_tokens, keep)
    return prompt_tokens


def fit_output(
    max_tokens: Any, param: str, prompt_tokens: int, limit: int, *, token_prompt: bool
) -> Any:
    """vLLM 0.32's context rule: a bound above max_model_len and a prompt alone over
    the context are refused; otherwise the output is capped at what the context leaves
    (a prompt of exactly the context leaves 0, refused by the sampling check)."""
    count = json_int(max_tokens)
    if count is not None and count > limit:
        raise ApiError(
            400,
            f"{param}={count} cannot be greater than max_model_len={limit}. Please "
            f"request fewer output tokens. (parameter={param}, value={count})",
            param=param,
        )
    if prompt_tokens > limit:
        # A text prompt is tokenized with truncation at the context + 1, so its count
        # stops there; a prompt of token ids is counted in full.
        shown = prompt_tokens if token_prompt else limit + 1
        qualifier = "" if token_prompt else "at least "
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your "
            f"prompt contains {qualifier}{shown} input tokens, which exceeds this limit "
            "even without any output tokens. Please reduce the length of the input "
            f"prompt. (parameter=input_tokens, value={shown})",
            param="input_tokens",
        )
    if count is not None:
        return min(count, limit - prompt_tokens)
    return max_tokens


def over_context(prompt_tokens: int, limit: int) -> ApiError:
    """vLLM 0.29's refusal of a prompt that fills the context."""
    return ApiError(
        400,
        f"This model's maximum context length is {limit} tokens. However, your request "
        f"has {prompt_tokens} input tokens. Please reduce the length of the input "
        "messages.",
        param="input_tokens",
    )


def check_total(max_tokens: int, prompt_tokens: int, limit: int) -> None:
    """vLLM 0.29's context rule: the prompt and the output bound must fit together."""
    if prompt_tokens + max_tokens > limit:
        raise ApiError(
            400,
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
            f"model's maximum context length is {limit} tokens and your request has "
            f"{prompt_tokens} input tokens ({max_tokens} > {limit} - {prompt_tokens}).",
            param="max_tokens",
        )


def check_sampling(build: VllmBuild, body: dict[str, Any], max_tokens: int, min_tokens: Any) -> int:
    """SamplingParams' own checks, after the context check, before the stream: the
    number of choices (n)."""
    n = body.get("n")
    n = 1 if n is None else n
    if isinstance(n, bool) or not isinstance(n, int):
        raise ApiError(400, f"n must be an int, but is of type {type(n)}")
    if n < 1:
        raise ApiError(400, f"n must be at least 1, got {n}.")
    temperature = body.get("temperature")
    if isinstance(temperature, int | float) and not isinstance(temperature, bool):
        if temperature < 0:
            raise ApiError(
                400,
                f"temperature must be non-negative, got {float(temperature)}. "
                f"(parameter=temperature, value={float(temperature)})",
                param="temperature",
            )
        if temperature > 2:
            raise ApiError(
                400,
                f"temperature must be in [0, 2], got {float(temperature)}. "
                f"(parameter=temperature, value={float(temperature)})",
                param="temperature",
            )
    if isinstance(min_tokens, int) and not 0 <= min_tokens <= max_tokens:
        message = (
            f"min_tokens must be greater than or equal to 0, got {min_tokens}."
            if min_tokens < 0
            else f"min_tokens must be less than or equal to max_tokens={max_tokens}, got "
            f"{min_tokens}."
        )
        if build.wire_032:
            # Raised without a parameter: no suffix, param null.
            raise ApiError(400, message)
        message += f" (parameter=min_tokens, value={min_tokens})"
        raise ApiError(400, message, param="min_tokens")
    return n


def check_inputs(body: dict[str, Any], *, chat: bool, stream: bool) -> int | None:
    """The engine's input processor, inside its generator (an error event after a
    stream's 200): the logprobs asked for, then the prompt's token ids. Returns how
    many top logprobs each token carries (None: no logprobs)."""
    if chat:
        top = (json_int(body.get("top_logprobs")) or 0) if body.get("logprobs") else None
    else:
        top = json_int(body.get("logprobs"))
    if top is not None:
        asked = VOCAB_SIZE if top == -1 else top
        if asked > MAX_LOGPROBS:
            raise ApiError(
                400,
                f"Requested sample logprobs of {asked}, which is greater than max "
                f"allowed: {MAX_LOGPROBS} (parameter=logprobs, value={asked})",
                param="logprobs",
                streamed=stream,
            )
    prompt = None if chat else body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if token_prompt(prompt):
        assert isinstance(prompt, list)
        ids = [json_int(t) or 0 for t in prompt]
        wrong = min(ids) if min(ids) < 0 else max(ids)
        if not 0 <= wrong < VOCAB_SIZE:
            raise ApiError(400, f"Token id {wrong} is out of vocabulary", streamed=stream)
    return top
