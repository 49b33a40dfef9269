"""What a simulated SGLang engine refuses, in its order and its words.

Owns: `sampling_refusal` (its SamplingParams.verify, in its order) and
`max_request_input` (its scheduler's bound on a prompt).
Invariants: the wording is SGLang 0.5.23's, as recorded in
tests/conformance/recorded-sglang.json.
See: shared/notes/real-sglang.md, and the real engine's sampling_params.py.

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
