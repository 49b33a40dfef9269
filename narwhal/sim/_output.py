"""What a simulated engine sends back for a generation, in either engine's shapes.

Owns: `Choice` (one of a request's ``n`` sequences: its words, where it stops and why),
`plan_choices` (stop strings found ahead of time in the deterministic output), `usage`,
and `Shapes`, the one chunk builder: a dialect's subclass (`_vllm_wire.VllmShapes`,
`_sglang_wire.SglangShapes`) describes its chunks and body, `Shapes` caches and fills them.
Invariants: the ``n`` choices of a request decode in step, on one scheduler sequence (one
sequence's cost, where vLLM decodes n); a choice's text never reaches past its stop string
(or past its end, with ``include_stop_str_in_output``); token and role chunks are filled
templates, so that a benchmark's simulator spends no json.dumps per token.
See: tests/conformance (the shapes, recorded on the real engines).
"""

from __future__ import annotations

import abc
import json
import re
import zlib
from collections.abc import Sequence
from typing import Any

from ._tokenizer import OutputText

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


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


class Shapes(abc.ABC):
    """The chunks and body of one request, in its engine's shapes.

    A chunk method returns the event's JSON (without ``data: ``). Token and role chunks
    are filled templates: a subclass describes each one once per choice index, finish
    state and usage (`_role_chunk`, `_token_chunk`, with `slot` values) and this class
    caches and fills it, so that a stream spends no json.dumps on a chunk's fixed parts.
    """

    # Whether a choice's last token chunk carries its finish_reason (else a chunk of
    # its own does, `finish_chunks`).
    finish_in_token_chunk = True

    def __init__(self, *, chat: bool, model: str, ids: Sequence[str], created: int) -> None:
        self.chat = chat
        self.model = model
        # One per choice, or one for them all (the body has the first).
        self.ids = ids
        self.created = created
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self._cache: dict[tuple[Any, ...], Template] = {}

    def _head(self, index: int) -> dict[str, Any]:
        return {
            "id": self.ids[min(index, len(self.ids) - 1)],
            "object": self.object,
            "created": self.created,
            "model": self.model,
        }

    # -- stream chunks ------------------------------------------------------------------
    def role_chunk(self, index: int, usage_so_far: dict[str, int] | None) -> str:
        key = ("role", index, usage_so_far is not None)
        template = self._cache.get(key)
        if template is None:
            template = self._cache[key] = Template(
                self._role_chunk(index, usage_so_far is not None)
            )
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
        final = final and self.finish_in_token_chunk
        key = ("tokens", choice.index, final, usage_so_far is not None)
        template = self._cache.get(key)
        if template is None:
            template = self._cache[key] = Template(
                self._token_chunk(choice, final, usage_so_far is not None)
            )
        return template.fill(
            text=compact(text),
            logprobs="null" if logprobs is None else compact(logprobs),
            usage=self._usage_json(usage_so_far),
        )

    @abc.abstractmethod
    def _role_chunk(self, index: int, with_usage: bool) -> dict[str, Any]:
        """A chat choice's first chunk; a ``slot("usage")`` where it carries usage."""
        raise NotImplementedError

    @abc.abstractmethod
    def _token_chunk(self, choice: Choice, final: bool, with_usage: bool) -> dict[str, Any]:
        """A chunk of a choice's tokens, with ``slot("text")``, ``slot("logprobs")`` and,
        where it carries usage, ``slot("usage")``."""
        raise NotImplementedError

    @abc.abstractmethod
    def _usage_json(self, so_far: dict[str, int] | None) -> str:
        """A chunk's running usage, encoded."""
        raise NotImplementedError

    def finish_chunks(self, choices: Sequence[Choice]) -> str:
        """Events after the last token chunks (``data: `` lines); none by default."""
        return ""

    @abc.abstractmethod
    def usage_chunk(self, totals: dict[str, int]) -> str:
        raise NotImplementedError

    @abc.abstractmethod
    def logprobs(self, choice: Choice, start: int, end: int, top: int) -> dict[str, Any]:
        """A choice's logprobs for tokens [start, end), `top` alternatives at each."""
        raise NotImplementedError

    # -- non-streaming body -------------------------------------------------------------
    @abc.abstractmethod
    def body(
        self,
        choices: Sequence[tuple[Choice, str, dict[str, Any] | None]],
        totals: dict[str, int],
        kv_transfer_params: dict[str, Any] | None,
    ) -> bytes:
        raise NotImplementedError
