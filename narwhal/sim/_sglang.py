"""What a simulated SGLang engine answers and refuses, where it differs from vLLM.

Owns: `SglangShapes` (the chunks and non-streaming body of one request), SGLang's
logprobs shapes, `sampling_refusal` (its SamplingParams.verify, in its order),
`max_request_input` (its scheduler's bound on a prompt) and `error_event` (an error sent
after a stream's 200).
Invariants: every shape is SGLang 0.5.23's, as recorded in
tests/conformance/recorded-sglang.json; the chunks are filled templates, as `_output`'s
(no json.dumps per token).
See: `_api` (where each rule applies), and the real engine's
python/sglang/srt/entrypoints/openai/serving_{completions,chat}.py, sampling_params.py.

The rules, as SGLang 0.5.23 follows them:

- Its tokenizer manager checks a request (context, sampling parameters) inside the
  response generator, which its handler starts before answering: a refusal is a 400,
  streamed or not. Its scheduler then refuses a prompt of `max_request_input` tokens or
  more by aborting the request: a 400, or after a stream's 200 an error event whose
  `type` is the HTTP status's name ("BAD_REQUEST"), then [DONE]. A stream's 200 goes out
  with its first chunk, after the first token.
- A chat stream opens each choice with a role chunk (content ""), sends its tokens
  without a finish_reason, and ends each choice with a chunk of its own
  (``delta: {reasoning_content: null}``, finish_reason, matched_stop) once every choice
  has finished. Every chat delta carries ``reasoning_content: null``.
- A completion's last token chunk carries its finish_reason and matched_stop.
- `continuous_usage_stats` adds the running usage to each token chunk, with or without
  `include_usage`; streamed ``n > 1`` choices each carry an id of their own.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from ._output import Choice, Template, compact, slot

# The weight version an engine reports when nobody updated its weights.
_WEIGHT_VERSION = "default"


def usage_of(totals: dict[str, int]) -> dict[str, Any]:
    """SGLang's usage object: the counts, then its details, null unless asked for."""
    return {
        **totals,
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
        "completion_tokens_details": None,
    }


def completion_logprobs(choice: Choice, start: int, end: int, top: int) -> dict[str, Any]:
    """SGLang's completion logprobs for tokens [start, end): text offsets are not
    supported (-1), and each position's top logprobs are the `top` likeliest tokens,
    the sampled one not among them unless it is one of those."""
    tokens = [choice.text.token(i) for i in range(start, end)]
    return {
        "text_offset": [-1] * len(tokens),
        "token_logprobs": [choice.logprob(i, 0) for i in range(start, end)],
        "tokens": tokens,
        "top_logprobs": [
            {
                choice.text.alternative(i, rank): choice.logprob(i, rank)
                for rank in range(1, top + 1)
            }
            for i in range(start, end)
        ],
    }


def chat_logprobs(choice: Choice, start: int, end: int, top: int) -> dict[str, Any]:
    """SGLang's chat logprobs for tokens [start, end), `top` candidates at each."""
    content: list[dict[str, Any]] = []
    for i in range(start, end):
        token = choice.text.token(i)
        others = [
            (choice.text.alternative(i, rank), choice.logprob(i, rank))
            for rank in range(1, top + 1)
        ]
        content.append(
            {
                "token": token,
                "bytes": list(token.encode()),
                "logprob": choice.logprob(i, 0),
                "top_logprobs": [
                    {"token": t, "bytes": list(t.encode()), "logprob": lp} for t, lp in others
                ],
            }
        )
    return {"content": content}


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


def error_event(status: int, message: str) -> bytes:
    """An error after a stream's 200: json.dumps' spacing, the status's name as type."""
    error = {
        "object": "error",
        "message": message,
        "type": HTTPStatus(status).name,
        "param": None,
        "code": status,
    }
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


class SglangShapes:
    """The chunks and body of one request as SGLang 0.5.23 sends them. A chunk method
    returns the event's JSON (without ``data: ``)."""

    def __init__(
        self,
        *,
        chat: bool,
        model: str,
        ids: Sequence[str],
        created: int,
        continuous_usage: bool,
    ) -> None:
        self.chat = chat
        self.model = model
        # One per choice: a streamed choice carries its own (the body, the first).
        self.ids = ids
        self.created = created
        self.continuous_usage = continuous_usage
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self._cache: dict[tuple[Any, ...], Template] = {}

    def _head(self, index: int) -> dict[str, Any]:
        return {
            "id": self.ids[index],
            "object": self.object,
            "created": self.created,
            "model": self.model,
        }

    @staticmethod
    def _choice(
        index: int,
        fields: dict[str, Any],
        logprobs: Any = None,
        finish_reason: str | None = None,
        matched_stop: str | None = None,
    ) -> dict[str, Any]:
        return {
            "index": index,
            **fields,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "matched_stop": matched_stop,
        }

    # -- stream chunks ------------------------------------------------------------------
    def role_chunk(self, index: int, usage_so_far: dict[str, int] | None) -> str:
        key = ("role", index)
        template = self._cache.get(key)
        if template is None:
            delta = {"reasoning_content": None, "role": "assistant", "content": ""}
            chunk = {**self._head(index), "choices": [self._choice(index, {"delta": delta})]}
            template = self._cache[key] = Template(chunk)
        return template.fill()

    def token_chunk(
        self,
        choice: Choice,
        text: str,
        logprobs: dict[str, Any] | None,
        *,
        final: bool,
        usage_so_far: dict[str, int] | None,
    ) -> str:
        # A chat choice's finish_reason comes in a chunk of its own (`finish_chunks`).
        final = final and not self.chat
        key = ("tokens", choice.index, final)
        template = self._cache.get(key)
        if template is None:
            if self.chat:
                fields: dict[str, Any] = {
                    "delta": {"reasoning_content": None, "content": slot("text")}
                }
            else:
                fields = {"text": slot("text")}
            body = self._choice(
                choice.index,
                fields,
                slot("logprobs"),
                choice.finish_reason if final else None,
                choice.stop if final else None,
            )
            chunk: dict[str, Any] = {**self._head(choice.index), "choices": [body]}
            if self.continuous_usage:
                chunk["usage"] = slot("usage")
            elif not self.chat:
                chunk["usage"] = None
            template = self._cache[key] = Template(chunk)
        return template.fill(
            text=compact(text),
            logprobs="null" if logprobs is None else compact(logprobs),
            usage="null" if usage_so_far is None else compact(usage_of(usage_so_far)),
        )

    def finish_chunks(self, choices: Sequence[Choice]) -> str:
        """A chat stream's last events, one per choice: its finish_reason and matched
        stop string. A completion's ride on its last token chunk: none."""
        if not self.chat:
            return ""
        out = []
        for choice in choices:
            body = self._choice(
                choice.index,
                {"delta": {"reasoning_content": None}},
                finish_reason=choice.finish_reason,
                matched_stop=choice.stop,
            )
            chunk = {**self._head(choice.index), "choices": [body]}
            out.append(f"data: {compact(chunk)}\n\n")
        return "".join(out)

    def usage_chunk(self, totals: dict[str, int]) -> str:
        # A completion's is dumped without its null fields; a chat's with them.
        counts: dict[str, Any] = (
            usage_of(totals) if self.chat else {**totals, "reasoning_tokens": 0}
        )
        return compact({**self._head(0), "choices": [], "usage": counts})

    # -- non-streaming body -------------------------------------------------------------
    def body(
        self,
        choices: Sequence[tuple[Choice, str, dict[str, Any] | None]],
        totals: dict[str, int],
        kv_transfer_params: dict[str, Any] | None,
    ) -> bytes:
        parts = []
        for choice, text, logprobs in choices:
            if self.chat:
                message = {"role": "assistant", "content": text, "reasoning_content": None}
                fields: dict[str, Any] = {"message": message}
            else:
                fields = {"text": text}
            parts.append(
                self._choice(choice.index, fields, logprobs, choice.finish_reason, choice.stop)
            )
        # The tokens generated under the one weight version: a choice's, all of them
        # (a body is sent once every choice has run to its end).
        generated = choices[0][0].limit if choices else 0
        out = {
            **self._head(0),
            "object": "chat.completion" if self.chat else "text_completion",
            "choices": parts,
            "usage": usage_of(totals),
            "metadata": {
                "weight_version": _WEIGHT_VERSION,
                "weight_versions": [{"version": _WEIGHT_VERSION, "start": 0, "end": generated}],
            },
        }
        return compact(out).encode()
