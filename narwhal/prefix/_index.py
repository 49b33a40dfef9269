"""What one engine holds in its prefix cache, as its KV events tell it.

Owns: `BlockIndex`: the external block hashes (`external_hash`) an engine holds, applied
from its event batches (`BlockStored` adds, `BlockRemoved` removes, `AllBlocksCleared`
empties), `match` (how many leading blocks of a prompt's chain it holds), `block_size`
(the tokens per block, as the last `BlockStored` says; None until one), and the event
sequence (`next_seq`, `Seq`): what a batch's seq means after the last one applied.
Invariants: at most `max_blocks` hashes; past it the oldest stored first is dropped and
counted (`dropped`), so memory is bounded by configuration whatever the engine says. A
hash is held while any of its stored copies is: vLLM stores one hash twice when two
requests computed the same block before either was cached, and removes each copy on
its own. Only blocks in the GPU pool count (`medium` "GPU", or none): a copy offloaded
elsewhere is another tier's, not a prefix a prefill skips. `reset` empties the index
and counts why. Pure: no I/O, no clock; the subscriber (`narwhal.caches`) feeds it.
Errors: none; an event about a hash it does not hold changes nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from itertools import islice
from typing import TypeVar

import attrs

from ._events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

T = TypeVar("T")


class Seq(enum.Enum):
    """What a batch's seq says, given the last one applied (`next_seq`)."""

    NEXT = "next"  # last + 1: apply it
    FIRST = "first"  # nothing applied yet: earlier batches may be replayed, then apply
    GAP = "gap"  # batches between were lost: replay them, or reset
    BACK = "back"  # at or before the last: a new publisher (a restarted engine)


def next_seq(last: int | None, seq: int) -> Seq:
    if last is None:
        return Seq.FIRST
    if seq == last + 1:
        return Seq.NEXT
    return Seq.GAP if seq > last else Seq.BACK


@attrs.frozen(kw_only=True)
class IndexStatistics:
    blocks: int  # hashes held
    max_blocks: int
    last_seq: int | None  # the seq of the last batch applied; None since a reset
    block_size: int | None  # tokens per block, from BlockStored; None since a reset
    events: int  # events applied
    batches: int
    dropped: int  # hashes dropped by the max_blocks bound, oldest first
    resets: Mapping[str, int]  # by reason


def drop_oldest(held: dict[int, T], n: int) -> None:
    """Delete the first `n` entries of `held` (in insertion order: the oldest)."""
    for key in list(islice(held, n)):
        del held[key]


def _counts(medium: str | None) -> bool:
    return medium is None or medium == MEDIUM_GPU


class BlockIndex:
    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks is {max_blocks}; must be >= 1")
        self.max_blocks = max_blocks
        # hash -> copies stored; insertion order is storing order, oldest first.
        self._held: dict[int, int] = {}
        self.last_seq: int | None = None
        self.block_size: int | None = None
        self.events = 0
        self.batches = 0
        self.dropped = 0
        self.resets: dict[str, int] = {}

    def __repr__(self) -> str:
        seq = "-" if self.last_seq is None else self.last_seq
        return (
            f"<BlockIndex {len(self._held)}/{self.max_blocks} blocks, seq {seq}, "
            f"{self.events} events, {sum(self.resets.values())} resets>"
        )

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._held

    def apply(self, seq: int, events: Iterable[KvEvent]) -> None:
        """Apply one batch; the caller has decided it follows the last (`next_seq`)."""
        for event in events:
            self.events += 1
            if isinstance(event, BlockStored):
                if _counts(event.medium):
                    self.block_size = event.block_size
                    self._store(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                if _counts(event.medium):
                    self._remove(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self._held.clear()
        self.batches += 1
        self.last_seq = seq

    def _store(self, hashes: Sequence[int]) -> None:
        held = self._held
        for block_hash in hashes:
            copies = held.pop(block_hash, 0)
            # Stored again: the newest now, last to be dropped.
            held[block_hash] = copies + 1
        excess = len(held) - self.max_blocks
        if excess > 0:
            drop_oldest(held, excess)
            self.dropped += excess

    def _remove(self, hashes: Sequence[int]) -> None:
        held = self._held
        for block_hash in hashes:
            copies = held.get(block_hash)
            if copies is None:
                continue
            if copies > 1:
                held[block_hash] = copies - 1
            else:
                del held[block_hash]

    def match(self, hashes: Sequence[int]) -> int:
        """How many of `hashes` (a prompt's chain, first block first) the engine holds
        from the start on: a block counts only if every block before it does."""
        n = 0
        held = self._held
        for block_hash in hashes:
            if block_hash not in held:
                break
            n += 1
        return n

    def reset(self, reason: str) -> None:
        """Forget everything: what the engine holds is no longer known (`reason`)."""
        self._held.clear()
        self.last_seq = None
        self.block_size = None  # a restarted engine may run with another
        self.resets[reason] = self.resets.get(reason, 0) + 1

    def statistics(self) -> IndexStatistics:
        return IndexStatistics(
            blocks=len(self._held),
            max_blocks=self.max_blocks,
            last_seq=self.last_seq,
            block_size=self.block_size,
            events=self.events,
            batches=self.batches,
            dropped=self.dropped,
            resets=dict(sorted(self.resets.items())),
        )
