"""What a simulated engine sends back for a generation: its choices, chunks and bodies.

Owns: `Choice` (one of a request's ``n`` sequences: its words, where it stops and why),
`plan_choices` (stop strings found ahead of time in the deterministic output), logprobs
in both of vLLM's shapes, and `Shapes` (the stream chunks and non-streaming body of one
request, as its vLLM build sends them; `_sglang.SglangShapes` has SGLang's).
Invariants: the ``n`` choices of a request decode in step, on one scheduler sequence (one
sequence's cost, where vLLM decodes n); a choice's text never reaches past its stop string
(or past its end, with ``include_stop_str_in_output``); the chunks of the default case are
filled templates, so that a benchmark's simulator spends no json.dumps per token.
See: `_vllm` for what differs between vLLM builds; docs/design.md#engine-streams (0.29 shapes);
tests/conformance (0.32 shapes, recorded on real vLLM).
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Sequence
from typing import Any

from ._tokenizer import OutputText
from ._vllm import VllmBuild

_COMPACT = (",", ":")
# A template value: a string json.dumps writes as "\u0000name\u0000", filled at send time.
_SLOT = re.compile(r'"\\u0000(\w+)\\u0000"')


def compact(obj: Any) -> str:
    return json.dumps(obj, separators=_COMPACT)


def slot(name: str) -> str:
    return f"\x00{name}\x00"


class Template:
    """A JSON document with named slots, filled with already-encoded JSON values."""

    __slots__ = ("parts",)

    def __init__(self, obj: Any) -> None:
        self.parts = _SLOT.split(compact(obj))

    def fill(self, **values: str) -> str:
        parts = self.parts
        out = [parts[0]]
        for i in range(1, len(parts), 2):
            out.append(values[parts[i]])
            out.append(parts[i + 1])
        return "".join(out)


class Choice:
    """One of a request's n sequences, and how far it has been sent."""

    __slots__ = ("chars", "cut", "hold", "index", "key", "limit", "pending", "stop", "text")

    def __init__(
        self,
        index: int,
        text: OutputText,
        key: str,
        limit: int,
        stop: str | None,
        cut: int | None,
        hold: int = 0,
    ) -> None:
        self.index = index
        self.text = text
        self.key = key
        # Tokens it generates: the request's bound, or the token that completed a stop string.
        self.limit = limit
        # The stop string that ended it (finish_reason "stop", stop_reason the string).
        self.stop = stop
        # Characters of its text kept, when a stop string cut it short.
        self.cut = cut
        # Characters a stream holds back until the choice ends (vLLM's stop buffer: the
        # longest stop string less one, so a stop string is never half sent).
        self.hold = hold
        # Characters of its tokens so far (logprobs' text_offset), and those not yet sent.
        self.chars = 0
        self.pending = ""

    @property
    def finish_reason(self) -> str:
        return "length" if self.stop is None else "stop"

    def piece(self, start: int, end: int) -> str:
        """The text to send with tokens [start, end): all of it up to the cut when the
        choice ends with them, else all but the held-back characters."""
        new = self.text.text(start, end)
        self.chars += len(new)
        self.pending += new
        sent = self.chars - len(self.pending)
        if end >= self.limit:
            keep = len(self.pending) if self.cut is None else max(0, self.cut - sent)
        else:
            keep = max(0, len(self.pending) - self.hold)
        out, self.pending = self.pending[:keep], self.pending[keep:]
        if end >= self.limit:
            self.pending = ""
        return out

    def logprob(self, i: int, rank: int) -> float:
        """A fixed logprob for token i's `rank`-th candidate (0: the sampled one)."""
        h = zlib.crc32(f"{self.key}\x00{i}\x00{rank}".encode())
        return -round(0.05 + (h % 90_000) / 10_000, 4)


def plan_choices(
    seed: int | str,
    prompt_key: str,
    *,
    n: int,
    max_tokens: int,
    min_tokens: int,
    stops: Sequence[str],
    include_stop: bool,
) -> list[Choice]:
    """The n choices of a request: where each one's stop string first completes.

    As vLLM's detokenizer checks each new token once more than min_tokens have been
    generated: a stop string that ends in the new token (it may start in the ones before)
    ends the choice there, its text cut before the string (or after it, with
    include_stop_str_in_output); of several, the one that ends first, then the first
    listed."""
    choices: list[Choice] = []
    hold = max((len(s) for s in stops), default=1) - 1 if not include_stop else 0
    for index in range(n):
        key = prompt_key if index == 0 else f"{prompt_key}\x00{index}"
        text = OutputText(seed, key)
        limit, stop, cut = max_tokens, None, None
        if stops:
            out = ""
            for i in range(max_tokens):
                before = len(out)
                out += text.token(i)
                if i < min_tokens:
                    continue
                best: tuple[int, int, str] | None = None
                for s in stops:
                    at = out.find(s, max(0, before - len(s) + 1))
                    if at != -1 and (best is None or at + len(s) < best[0]):
                        best = (at + len(s), at, s)
                if best is not None:
                    end, at, stop = best
                    limit, cut = i + 1, end if include_stop else at
                    break
        choices.append(Choice(index, text, key, limit, stop, cut, hold))
    return choices


def completion_logprobs(choice: Choice, start: int, end: int, top: int) -> dict[str, Any]:
    """vLLM's completion logprobs for tokens [start, end): the sampled token and `top`
    others at each position (text_offset counts from the choice's first character)."""
    offsets: list[int] = []
    tokens: list[str] = []
    values: list[float] = []
    tops: list[dict[str, float]] = []
    offset = choice.chars
    for i in range(start, end):
        token = choice.text.token(i)
        offsets.append(offset)
        offset += len(token)
        tokens.append(token)
        values.append(choice.logprob(i, 0))
        entry = {token: values[-1]}
        for rank in range(1, top + 1):
            entry[choice.text.alternative(i, rank)] = choice.logprob(i, rank)
        tops.append(entry)
    return {
        "text_offset": offsets,
        "token_logprobs": values,
        "tokens": tokens,
        "top_logprobs": tops,
    }


def chat_logprobs(choice: Choice, start: int, end: int, top: int) -> dict[str, Any]:
    """vLLM's chat logprobs for tokens [start, end): `top` candidates at each position,
    the sampled one first."""
    content: list[dict[str, Any]] = []
    for i in range(start, end):
        token = choice.text.token(i)
        candidates = [(token, choice.logprob(i, 0))]
        candidates += [
            (choice.text.alternative(i, rank), choice.logprob(i, rank)) for rank in range(1, top)
        ]
        content.append(
            {
                "token": token,
                "logprob": candidates[0][1],
                "bytes": list(token.encode()),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode())}
                    for t, lp in candidates[:top]
                ],
            }
        )
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


class Shapes:
    """The chunks and body of one request, as its vLLM build sends them.

    A chunk method returns the event's JSON (without ``data: ``); values are filled into
    templates cached per choice index and finish state."""

    def __init__(
        self,
        *,
        build: VllmBuild,
        chat: bool,
        model: str,
        response_id: str,
        created: int,
        fingerprint: str | None,
        include_usage: bool,
        continuous_usage: bool,
    ) -> None:
        self.new = build.wire_032
        self.chat = chat
        self.fingerprint = fingerprint
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.head: dict[str, Any] = {
            "id": response_id,
            "object": ("chat.completion.chunk" if chat else "text_completion"),
            "created": created,
            "model": model,
        }
        self._cache: dict[tuple[Any, ...], Template] = {}

    # -- stream chunks ------------------------------------------------------------------
    def role_chunk(self, index: int, usage_so_far: dict[str, int] | None) -> str:
        key = ("role", index, usage_so_far is not None)
        template = self._cache.get(key)
        if template is None:
            chunk: dict[str, Any] = {
                **self.head,
                "choices": [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            if usage_so_far is not None:
                chunk["usage"] = slot("usage")
            if self.new:
                chunk.update({"prompt_token_ids": None, "prompt_text": None})
            template = self._cache[key] = Template(chunk)
        return template.fill(usage=self._usage_json(usage_so_far))

    def token_chunk(
        self,
        choice: Choice,
        text: str,
        logprobs: dict[str, Any] | None,
        *,
        final: bool,
        usage_so_far: dict[str, int] | None,
    ) -> str:
        stop = choice.stop if final else None
        key = ("tokens", choice.index, final, stop, usage_so_far is not None)
        template = self._cache.get(key)
        if template is None:
            template = self._cache[key] = Template(
                self._token_chunk(choice, final, stop, usage_so_far is not None)
            )
        return template.fill(
            text=compact(text),
            logprobs="null" if logprobs is None else compact(logprobs),
            usage=self._usage_json(usage_so_far),
        )

    def _token_chunk(
        self, choice: Choice, final: bool, stop: str | None, with_usage: bool
    ) -> dict[str, Any]:
        finish = choice.finish_reason if final else None
        body: dict[str, Any] = {"index": choice.index}
        if self.chat:
            body["delta"] = {"content": slot("text")}
        else:
            body["text"] = slot("text")
        body["logprobs"] = slot("logprobs")
        body["finish_reason"] = finish
        chunk: dict[str, Any] = {**self.head, "choices": [body]}
        if not self.chat:
            # Completion choices carry every field, nulls included.
            body.update({"stop_reason": stop, "prompt_token_ids": None, "token_ids": None})
        elif final:
            body["stop_reason"] = stop
        if self.chat and self.new:
            body["token_ids"] = None
        if not self.new and not self.chat:
            chunk["usage"] = None
        if with_usage:
            chunk["usage"] = slot("usage")
        if self.new and final and not self.include_usage and self.fingerprint is not None:
            # 0.32 stamps its fingerprint on a choice's last chunk unless a usage chunk
            # follows, which then carries it.
            chunk["system_fingerprint"] = self.fingerprint
        return chunk

    def finish_chunks(self, choices: Sequence[Choice]) -> str:
        """Events after the last token chunks: none (a choice's last chunk ends it)."""
        return ""

    def usage_chunk(self, totals: dict[str, int]) -> str:
        chunk: dict[str, Any] = {**self.head, "choices": [], "usage": totals}
        if self.new and self.fingerprint is not None:
            chunk["system_fingerprint"] = self.fingerprint
        return compact(chunk)

    def _usage_json(self, so_far: dict[str, int] | None) -> str:
        """Continuous usage as each build dumps it: a 0.29 completion chunk replaces its
        null usage with one that has a null prompt_tokens_details; a 0.32 chat chunk's
        usage has a null completion_tokens_details; the others have the counts only."""
        if so_far is None:
            return "null"
        if self.new and self.chat:
            return compact({**so_far, "completion_tokens_details": None})
        if not self.new and not self.chat:
            return compact({**so_far, "prompt_tokens_details": None})
        return compact(so_far)

    # -- non-streaming body -------------------------------------------------------------
    def body(
        self,
        choices: Sequence[tuple[Choice, str, dict[str, Any] | None]],
        totals: dict[str, int],
        kv_transfer_params: dict[str, Any] | None,
    ) -> bytes:
        out: dict[str, Any] = {
            **self.head,
            "object": "chat.completion" if self.chat else "text_completion",
        }
        out["choices"] = [self._body_choice(c, text, lp) for c, text, lp in choices]
        out["service_tier"] = None
        out["system_fingerprint"] = self.fingerprint
        details: dict[str, Any] = {"prompt_tokens_details": None}
        if self.new:
            details["completion_tokens_details"] = None
        out["usage"] = {**totals, **details}
        if self.chat:
            out["prompt_logprobs"] = None
            if self.new:
                out.update({"prompt_token_ids": None, "prompt_text": None})
        out["kv_transfer_params"] = kv_transfer_params
        if self.new:
            out.update({"ec_transfer_params": None, "metrics": None})
        return compact(out).encode()

    def _body_choice(
        self, choice: Choice, text: str, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        out: dict[str, Any] = {"index": choice.index}
        if self.chat:
            message: dict[str, Any] = {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
            }
            if self.new:
                # 0.32 leaves an empty tool_calls out and names the field reasoning.
                message["reasoning"] = None
            else:
                message.update({"tool_calls": [], "reasoning_content": None})
            out["message"] = message
        else:
            out["text"] = text
        out["logprobs"] = logprobs
        out["finish_reason"] = choice.finish_reason
        out["stop_reason"] = choice.stop
        if not self.chat:
            # CompletionResponseChoice dumps every field; the streamed choices carry
            # the same token_ids/prompt_token_ids keys.
            out.update({"token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None})
        elif self.new:
            out["token_ids"] = None
        if self.new:
            out["routed_experts"] = None
        return out
