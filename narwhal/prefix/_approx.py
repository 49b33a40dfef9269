"""What one engine probably holds in its prefix cache, learnt from the prompts it was sent.

Owns: `PromptIndex`, for an engine without KV events: `learn` records a routed prompt's
text chain (`PromptKey.text_chain`) with the time it was last used, `match` gives the
longest prefix of a prompt, in chars, learnt within the last `ttl_s` seconds.
Invariants: an approximation. The engine evicts under memory pressure, which the
router does not see, so a block counts for `ttl_s` after its last use and no longer;
an expired block is dropped when met (at the front of the index, or in a match). At
most `max_blocks` blocks; past it the least recently used are dropped first and
counted (`dropped`). A prompt's blocks are recorded deepest first, so that its first
block is the last of them to go: a chain missing its first block matches nothing,
and its deeper blocks would only take room. `reset` empties the index and counts why.
Pure: no I/O; the clock is an argument (non-decreasing from call to call).
Errors: ValueError for a bound below 1 or a negative TTL.
See: narwhal/caches (which feeds it), narwhal/prefix/_index.py (the exact index).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from ._index import drop_oldest
from ._prompt import TEXT_BLOCK_CHARS, PromptKey


@attrs.frozen(kw_only=True)
class PromptIndexStatistics:
    blocks: int  # text blocks held, expired ones not met yet included
    max_blocks: int
    ttl_s: float
    learnt: int  # prompts learnt since the index was made
    dropped: int  # blocks dropped by the max_blocks bound, least recently used first
    expired: int  # blocks dropped for having gone unused for ttl_s
    resets: Mapping[str, int]  # by reason


class PromptIndex:
    def __init__(self, max_blocks: int, ttl_s: float) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks is {max_blocks}; must be >= 1")
        if ttl_s < 0:
            raise ValueError(f"ttl_s is {ttl_s}; must be >= 0")
        self.max_blocks = max_blocks
        self.ttl_s = ttl_s
        # hash -> time of last use; insertion order is use order, least recent first.
        # The blocks of one `learn` share its `now` float object.
        self._used: dict[int, float] = {}
        self.learnt = 0
        self.dropped = 0
        self.expired = 0
        self.resets: dict[str, int] = {}

    def __repr__(self) -> str:
        return (
            f"<PromptIndex {len(self._used)}/{self.max_blocks} blocks, ttl {self.ttl_s} s, "
            f"{self.learnt} learnt, {sum(self.resets.values())} resets>"
        )

    def __len__(self) -> int:
        return len(self._used)

    def learn(self, key: PromptKey, now: float) -> None:
        """The engine was sent `key`'s prompt at `now`: its full text blocks are cached."""
        self._expire(now)
        used = self._used
        for block_hash in reversed(key.text_chain):
            used.pop(block_hash, None)
            used[block_hash] = now
        self.learnt += 1
        excess = len(used) - self.max_blocks
        if excess > 0:
            drop_oldest(used, excess)
            self.dropped += excess

    def match(self, key: PromptKey, now: float) -> int:
        """The chars of `key`'s prompt, from its start, learnt within the last ttl_s."""
        self._expire(now)
        used = self._used
        oldest = now - self.ttl_s
        n = 0
        for block_hash in key.text_chain:
            last = used.get(block_hash)
            if last is None:
                break
            if last < oldest:
                # Out of use order only if the clock went back; counts nothing either way.
                del used[block_hash]
                self.expired += 1
                break
            n += 1
        return n * TEXT_BLOCK_CHARS

    def _expire(self, now: float) -> None:
        used = self._used
        oldest = now - self.ttl_s
        stale = 0
        for last in used.values():
            if last >= oldest:
                break
            stale += 1
        if stale:
            drop_oldest(used, stale)
            self.expired += stale

    def reset(self, reason: str) -> None:
        """Forget everything: what the engine holds is no longer known (`reason`)."""
        self._used.clear()
        self.resets[reason] = self.resets.get(reason, 0) + 1

    def statistics(self) -> PromptIndexStatistics:
        return PromptIndexStatistics(
            blocks=len(self._used),
            max_blocks=self.max_blocks,
            ttl_s=self.ttl_s,
            learnt=self.learnt,
            dropped=self.dropped,
            expired=self.expired,
            resets=dict(sorted(self.resets.items())),
        )
