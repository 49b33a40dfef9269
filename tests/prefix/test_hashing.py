"""Block hashes and KV event bytes against vectors computed by vLLM 0.32.0 itself."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from narwhal.prefix import (
    ROOT_HASH,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    block_hashes,
    decode_batch,
    encode_batch,
    external_hash,
    hash_block,
    root_hash,
)

VECTORS: dict[str, Any] = json.loads(
    (pathlib.Path(__file__).parent / "vllm_vectors.json").read_text()
)


def test_root_is_vllms_none_hash() -> None:
    assert ROOT_HASH.hex() == VECTORS["none_hash"]
    assert root_hash(VECTORS["seed"]) == ROOT_HASH


@pytest.mark.parametrize("vector", VECTORS["vectors"], ids=lambda v: v["name"])
def test_chain_matches_vllm(vector: dict[str, Any]) -> None:
    hashes = block_hashes(vector["token_ids"], vector["block_size"])
    assert [h.hex() for h in hashes] == vector["hashes"]
    assert [external_hash(h) for h in hashes] == vector["external"]


def test_only_full_blocks_and_chains_continue() -> None:
    ids = list(range(1, 13))
    whole = block_hashes(ids, 4)
    # A partial tail has no hash; a chain resumed from a parent equals the whole chain.
    assert block_hashes(ids[:11], 4) == whole[:2]
    assert block_hashes(ids[4:], 4, parent=whole[0]) == whole[1:]
    assert hash_block(None, ids[:4]) == whole[0]
    # The same block under another parent is another block.
    assert hash_block(whole[0], ids[:4]) != whole[0]
    assert block_hashes([], 4) == []


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"^block_size is 0; must be >= 1$"):
        block_hashes([1, 2], 0)


def test_batch_bytes_match_vllm() -> None:
    ext = VECTORS["vectors"][0]["external"]
    batch = EventBatch(
        ts=1700000000.5,
        events=[
            BlockStored(
                block_hashes=ext[1:],
                parent_block_hash=ext[0],
                token_ids=list(range(5, 13)),
                block_size=4,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=0,
            ),
            BlockRemoved(block_hashes=[ext[0]], medium="GPU", group_idx=0),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    payload = encode_batch(batch)
    assert payload.hex() == VECTORS["batch_msgpack_hex"]
    assert decode_batch(payload) == batch
