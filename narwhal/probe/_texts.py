"""Prompt texts for direct engine probes.

English-like prose from a fixed vocabulary, so the engine's tokenizer sees ordinary word
and punctuation statistics (the chars-per-token ratio measured on these texts is the one
the router's character fallback needs). Every prompt starts with a distinct serial and a
nonce of its `TextMaker`, so no two prompts share a prefix, within a run or across runs,
and an engine's prefix cache cannot shorten a measured prefill. (With the seed alone, a
second narwhal-profile of an engine that kept its cache sent it the first run's prompts
again, and timed cache hits as cold prefills.)
"""

from __future__ import annotations

import random
import secrets

_VOCAB = (  # noqa: SIM905 (a word list reads better as prose)
    "the of and to in is was for on as with by at from that this it be are or an not which "
    "have has had but were one all their there been its new more also than two may after "
    "first time only other into most over such some these many can would about year when "
    "where city state world river early known large part used under later work while music "
    "game film team group house water light north south east west small great local during "
    "since each both three third major form line name road area field model power found "
    "became began lived made built based set held given system history government people "
    "between national university following including population building development "
    "company service children several american population important together different "
    "received published production located original according program station english"
).split()
_PUNCT = (".", ".", ".", ",", ",", ",", ";", ":")


class TextMaker:
    """Deterministic prompt texts; `text(chars)` is about `chars` characters long."""

    def __init__(self, seed: int | str = 0) -> None:
        self._rng = random.Random(seed)
        self._serial = 0
        self._nonce = secrets.token_hex(3)

    def text(self, chars: int) -> str:
        self._serial += 1
        rng = self._rng
        if chars < 32:
            # Too short for a serial; prefix caching works on whole blocks of tokens, so a
            # prompt this short is never served from the cache anyway.
            words: list[str] = []
            while sum(len(w) + 1 for w in words) < chars:
                words.append(rng.choice(_VOCAB))
            return " ".join(words).capitalize() or "Hello"
        parts = [f"Record {self._nonce} {self._serial:06d} {rng.randrange(10**6):06d}."]
        size = len(parts[0])
        sentence = 0
        while size < chars:
            word = rng.choice(_VOCAB)
            if sentence == 0:
                word = word.capitalize()
            sentence += 1
            if sentence > 6 and rng.random() < 0.2:
                word += rng.choice(_PUNCT)
                if word.endswith("."):
                    sentence = 0
            parts.append(word)
            size += len(word) + 1
        return " ".join(parts)[: max(1, chars)]
