"""The per-engine block index: events in, `match` out, bounded, and its sequence rule."""

from __future__ import annotations

import msgspec
import pytest

from narwhal.prefix import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockIndex,
    BlockRemoved,
    BlockStored,
    Seq,
    block_hashes,
    external_hash,
    next_seq,
)


def stored(*hashes: int, medium: str | None = MEDIUM_GPU) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=[],
        block_size=16,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def removed(*hashes: int, medium: str | None = MEDIUM_GPU) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium=medium)


def test_stored_blocks_match_from_the_start_of_the_chain() -> None:
    tokens = list(range(100))
    chain = [external_hash(h) for h in block_hashes(tokens, 16)]
    assert len(chain) == 6
    index = BlockIndex(max_blocks=100)
    index.apply(0, [stored(*chain[:4])])
    assert index.match(chain) == 4
    assert index.match(chain[:2]) == 2
    # A hole ends the match: block 3 without block 2 is no prefix.
    index.apply(1, [removed(chain[2])])
    assert index.match(chain) == 2
    assert index.match([]) == 0
    assert index.match([12345, *chain]) == 0


def test_removed_and_cleared_blocks_are_gone() -> None:
    index = BlockIndex(max_blocks=100)
    index.apply(0, [stored(1, 2, 3), removed(2, 99)])
    assert (1 in index, 2 in index, 3 in index) == (True, False, True)
    index.apply(1, [AllBlocksCleared(), stored(4)])
    assert len(index) == 1
    assert index.match([4]) == 1
    stats = index.statistics()
    assert (stats.events, stats.batches, stats.last_seq) == (4, 2, 1)


def test_a_hash_stored_twice_is_held_until_both_copies_are_removed() -> None:
    index = BlockIndex(max_blocks=100)
    index.apply(0, [stored(7), stored(7)])
    index.apply(1, [removed(7)])
    assert index.match([7]) == 1
    index.apply(2, [removed(7)])
    assert index.match([7]) == 0


def test_only_the_gpu_pool_counts() -> None:
    index = BlockIndex(max_blocks=100)
    index.apply(0, [stored(1, medium="CPU"), stored(2, medium=None), stored(3)])
    index.apply(1, [removed(3, medium="CPU")])
    assert (1 in index, 2 in index, 3 in index) == (False, True, True)


def test_the_bound_drops_the_oldest_stored_first_and_counts_them() -> None:
    index = BlockIndex(max_blocks=3)
    index.apply(0, [stored(1, 2, 3)])
    index.apply(1, [stored(1)])  # stored again: now the newest
    index.apply(2, [stored(4, 5)])
    assert [h for h in (1, 2, 3, 4, 5) if h in index] == [1, 4, 5]
    stats = index.statistics()
    assert (stats.blocks, stats.max_blocks, stats.dropped) == (3, 3, 2)
    many = BlockIndex(max_blocks=10)
    many.apply(0, [stored(*range(1000))])
    assert len(many) == 10
    assert many.match(list(range(990, 1000))) == 10
    assert many.statistics().dropped == 990


def test_reset_forgets_the_blocks_and_the_seq_and_counts_the_reason() -> None:
    index = BlockIndex(max_blocks=10)
    index.apply(5, [stored(1, 2)])
    index.reset("gap")
    index.reset("gap")
    index.reset("restart")
    assert index.match([1]) == 0
    stats = index.statistics()
    assert stats.last_seq is None
    assert stats.resets == {"gap": 2, "restart": 1}
    assert repr(index) == "<BlockIndex 0/10 blocks, seq -, 1 events, 3 resets>"
    index.apply(0, [stored(3)])
    assert repr(index) == "<BlockIndex 1/10 blocks, seq 0, 2 events, 3 resets>"


@pytest.mark.parametrize(
    ("last", "seq", "verdict"),
    [
        (None, 0, Seq.FIRST),
        (None, 7, Seq.FIRST),
        (3, 4, Seq.NEXT),
        (3, 6, Seq.GAP),
        (3, 3, Seq.BACK),
        (3, 0, Seq.BACK),
    ],
)
def test_what_a_seq_says_after_the_last(last: int | None, seq: int, verdict: Seq) -> None:
    assert next_seq(last, seq) is verdict


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^max_blocks is 0; must be >= 1$"):
        BlockIndex(max_blocks=0)


def test_the_block_size_is_the_last_stored_blocks_and_unknown_since_a_reset() -> None:
    index = BlockIndex(max_blocks=10)
    assert index.statistics().block_size is None
    index.apply(0, [removed(1)])
    assert index.statistics().block_size is None
    index.apply(1, [stored(1)])
    assert index.statistics().block_size == 16
    # A copy offloaded elsewhere says nothing of the GPU pool's blocks.
    index.apply(2, [msgspec.structs.replace(stored(2), block_size=64, medium="CPU")])
    assert index.statistics().block_size == 16
    index.reset("restart")
    assert index.statistics().block_size is None
