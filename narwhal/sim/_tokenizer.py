"""A deterministic stand-in tokenizer and chat template.

Pre-tokenisation is GPT-2-like (a leading space sticks to the next word, digits in groups of
three, punctuation one character at a time) and words longer than eight characters are split
into six-character pieces. On English prose that gives about 4.4 characters per token, so an
exact count from /tokenize differs measurably from a 3.8 chars/token estimate, as it does on
a real engine. Ids are a CRC of the piece folded into a Llama-3-sized vocabulary.
"""

from __future__ import annotations

import json
import re
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

VOCAB_SIZE = 128_256
BOS = "<|begin_of_text|>"
_SPECIAL_IDS = {
    BOS: 128_000,
    "<|end_of_text|>": 128_001,
    "<|start_header_id|>": 128_006,
    "<|end_header_id|>": 128_007,
    "<|eot_id|>": 128_009,
}
_PIECE = re.compile(r"<\|[a-z_]+\|>| ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]|\s+")
_LONG = 8
_SPLIT = 6

# Output vocabulary: short words, so each one is exactly one token when re-tokenised.
_WORDS = (  # noqa: SIM905 (a word list reads better as prose)
    "the of and to in is was for on as with by at from that this it be are or an not which "
    "have has had but were one all their there been its new more also than two may after "
    "first time only other into most over such some these many can would about year when "
    "where city state world river early known large part used under later work while music "
    "game film team group house water light north south east west small great local during "
    "since each both three third major form line name road area field model power found "
    "became began lived made built based set held given"
).split()


def _piece_count(piece: str) -> int:
    n = len(piece)
    if n <= _LONG or piece in _SPECIAL_IDS:
        return 1
    return -(-n // _SPLIT)


class Tokenizer:
    """Counts and ids for prompts; a small bounded cache makes the P and D legs cheap."""

    def __init__(self, *, cache_size: int = 512) -> None:
        self._cache: OrderedDict[str, int] = OrderedDict()
        self._cache_size = cache_size

    def count(self, text: str) -> int:
        hit = self._cache.get(text)
        if hit is not None:
            self._cache.move_to_end(text)
            return hit
        n = sum(_piece_count(p) for p in _PIECE.findall(text))
        self._cache[text] = n
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return n

    def pieces(self, text: str) -> list[str]:
        out: list[str] = []
        for piece in _PIECE.findall(text):
            if len(piece) <= _LONG or piece in _SPECIAL_IDS:
                out.append(piece)
            else:
                out.extend(piece[i : i + _SPLIT] for i in range(0, len(piece), _SPLIT))
        return out

    def encode(self, text: str) -> list[int]:
        return [piece_id(p) for p in self.pieces(text)]


def piece_id(piece: str) -> int:
    special = _SPECIAL_IDS.get(piece)
    if special is not None:
        return special
    return 256 + zlib.crc32(piece.encode()) % (128_000 - 256)


def render_chat(
    messages: Sequence[Any],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: Sequence[Any] | None = None,
) -> str:
    """Llama-3-style template: 5 tokens of framing per message (for a role of up to eight
    letters) and 5 for the generation prompt ("assistant" is two pieces).

    Tool schemas go into a system block as indented JSON, as Llama 3.1's and Qwen's
    templates put them, so tools cost prompt tokens the messages' text does not show.
    `continue_final_message` leaves the last message open for the model to continue.
    """
    if continue_final_message and add_generation_prompt:
        # vLLM's message; the template cannot both close and continue the last turn.
        raise ValueError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    parts = [BOS]
    if tools:
        if not all(isinstance(tool, dict) for tool in tools):
            raise ValueError("each tool must be an object")
        schemas = "\n\n".join(json.dumps(tool, indent=4) for tool in tools)
        parts.append(
            "<|start_header_id|>system<|end_header_id|>\n\n"
            f"You may call these functions:\n\n{schemas}<|eot_id|>"
        )
    for index, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError("each message must be an object")
        role = msg.get("role")
        if not isinstance(role, str):
            raise ValueError("each message needs a string 'role'")
        parts.append(f"<|start_header_id|>{role}<|end_header_id|>\n\n")
        parts.append(message_text(msg.get("content")))
        if not (continue_final_message and index == len(messages) - 1):
            parts.append("<|eot_id|>")
    if add_generation_prompt:
        parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)


def message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    raise ValueError("message content must be a string or a list of parts")


class OutputText:
    """Deterministic generated text: token i of a request is one short word."""

    def __init__(self, seed: int | str, prompt_key: str) -> None:
        self._offset = zlib.crc32(f"{seed}\x00{prompt_key}".encode()) % len(_WORDS)

    def token(self, i: int) -> str:
        return " " + _WORDS[(self._offset + 7 * i) % len(_WORDS)]

    def text(self, start: int, end: int) -> str:
        return "".join(self.token(i) for i in range(start, end))

    def alternative(self, i: int, rank: int) -> str:
        """The `rank`-th other word the engine might have sampled as token i (rank >= 1;
        a word other than token i's for every rank below the vocabulary's size)."""
        return " " + _WORDS[(self._offset + 7 * i + rank) % len(_WORDS)]
