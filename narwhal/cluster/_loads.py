"""The replicas' loads on each engine, shared through etcd, decided without I/O.

Owns
  `EngineWord`: what one replica publishes of one engine (`encode_word`,
  `decode_word`): the prefill seconds it ever booked there and its backlog left, its
  legs by phase and the tokens they hold; `Heard`, the other replicas' last words, when
  each arrived, and the prefill work each booked since its previous word
  (`Heard.heard`); `others_on`, the legs they add to one engine, as pricing reads them.

Invariants
  A replica's word is trusted for `trust_s` after it arrived: its writer repeats it at
  least every `refresh_s`, so a silent replica (dead, or cut off from etcd) stops
  counting within one missed repeat. The others' legs stand only when every other
  member's word is trusted: a missing one would price that member's legs at zero, where
  the engines' scrape (pricing's fallback) still shows them.
  Booked seconds are a running total, so a lost word loses nothing: the next one
  carries the difference. That difference counts at most the writer's backlog left plus
  the time since its previous word, so work booked during an outage and done by its end
  is not queued again. A replica first
  heard (or restarted) counts with its backlog left. Neither carries a clock value:
  replicas' clocks are not compared, and a word's milliseconds in etcd are not counted.

Errors
  `decode_word` raises ValueError naming what is malformed; the reader logs and skips it.

See
  `ClusterService` (writes and watches the words), `BacklogBook.heard`,
  `EngineState.saw_replica_loads`, tests/cluster/test_loads.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping

import attrs

from ..fleet import SeenLoad


@attrs.frozen
class EngineWord:
    """One replica's load on one engine."""

    booked_s: float
    backlog_s: float
    prefill: int
    prefill_tokens: int
    decode: int
    decode_tokens: int


Word = Mapping[str, EngineWord]


def refresh_s(interval_s: float) -> float:
    """How often a replica repeats an unchanged word (`cluster.load_interval_s`)."""
    return max(1.0, interval_s)


def trust_s(interval_s: float) -> float:
    """How long a word stands after it arrived: two and a half repeats, so one late or
    lost write is not yet silence."""
    return 2.5 * refresh_s(interval_s)


def encode_word(word: Word) -> bytes:
    """The word as etcd holds it: engine ids sorted, a word equal to the last one
    encodes the same (the writer skips it until its repeat is due)."""
    engines = {
        engine_id: [
            round(w.booked_s, 6),
            round(w.backlog_s, 4),
            w.prefill,
            w.prefill_tokens,
            w.decode,
            w.decode_tokens,
        ]
        for engine_id, w in sorted(word.items())
    }
    return json.dumps({"engines": engines}, separators=(",", ":")).encode()


def decode_word(value: bytes) -> dict[str, EngineWord]:
    try:
        body = json.loads(value)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    engines = body.get("engines") if isinstance(body, dict) else None
    if not isinstance(engines, dict):
        raise ValueError('no "engines" object')
    word: dict[str, EngineWord] = {}
    for engine_id, item in engines.items():
        if (
            not isinstance(item, list)
            or len(item) != 6
            or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in item)
            or not all(math.isfinite(x) and x >= 0 for x in item)
        ):
            raise ValueError(
                f"engine {engine_id!r}: expected [booked_s, backlog_s, prefill, "
                f"prefill_tokens, decode, decode_tokens], non-negative numbers, got {item!r}"
            )
        booked, backlog, *counts = item
        word[engine_id] = EngineWord(float(booked), float(backlog), *(int(c) for c in counts))
    return word


@attrs.define
class Heard:
    """The other replicas' last words, each with the trio time it arrived, and the
    booked seconds each last said per engine."""

    words: dict[str, tuple[float, Word]] = attrs.Factory(dict)
    booked: dict[tuple[str, str], float] = attrs.Factory(dict)

    def heard(self, replica: str, word: Word, now: float) -> dict[str, float]:
        """Take `replica`'s word; the prefill seconds it booked on each engine since its
        previous word (module docstring)."""
        previous = self.words.get(replica)
        # What it booked since its previous word may have drained for that long.
        since_s = now - previous[0] if previous is not None else 0.0
        self.words[replica] = (now, word)
        added: dict[str, float] = {}
        for engine_id, w in word.items():
            last = self.booked.get((replica, engine_id))
            self.booked[replica, engine_id] = w.booked_s
            if last is None or w.booked_s < last:
                work = w.backlog_s  # first heard, or its writer restarted
            else:
                work = min(w.booked_s - last, w.backlog_s + since_s)
            if work > 0:
                added[engine_id] = work
        return added

    def gone(self, replica: str) -> None:
        self.words.pop(replica, None)
        for key in [k for k in self.booked if k[0] == replica]:
            del self.booked[key]

    def trusted_until(self, others: Iterable[str], trust: float) -> float:
        """Until when every one of `others` has a trusted word (-inf: one has none)."""
        until = math.inf
        for replica in others:
            got = self.words.get(replica)
            if got is None:
                return -math.inf
            until = min(until, got[0] + trust)
        return until

    def busy_on(self, engine_id: str, others: Iterable[str]) -> bool:
        """Whether one of `others` last said it has prefill work booked on the engine
        (its backlog left; a replica never heard from counts as busy)."""
        for replica in others:
            got = self.words.get(replica)
            if got is None:
                return True
            w = got[1].get(engine_id)
            if w is not None and w.backlog_s > 0:
                return True
        return False

    def others_on(self, engine_id: str, others: Iterable[str], until: float) -> SeenLoad:
        """The legs `others` have on the engine, with the mean tokens one holds."""
        prefill = prefill_tokens = decode = decode_tokens = 0
        for replica in others:
            w = self.words[replica][1].get(engine_id)
            if w is None:
                continue
            prefill += w.prefill
            prefill_tokens += w.prefill_tokens
            decode += w.decode
            decode_tokens += w.decode_tokens
        return SeenLoad(
            prefill=prefill,
            decode=decode,
            prefill_tokens=prefill_tokens / prefill if prefill else 0.0,
            decode_tokens=decode_tokens / decode if decode else 0.0,
            until=until,
            source="replicas",
        )
