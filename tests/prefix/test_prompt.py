"""A prompt's key: its text chain (equal hashes, equal prefixes) and its token block
chain, which is vLLM's, computed once per block size."""

from __future__ import annotations

import pytest

from narwhal.prefix import TEXT_BLOCK_CHARS, block_hashes, external_hash, prompt_key

from .test_hashing import VECTORS


@pytest.mark.parametrize("vector", VECTORS["vectors"], ids=lambda v: v["name"])
def test_the_block_chain_is_vllms_external_hashes(vector: dict[str, object]) -> None:
    ids = vector["token_ids"]
    size = vector["block_size"]
    assert isinstance(ids, list)
    assert isinstance(size, int)
    key = prompt_key("text", len(ids), ids)
    want = tuple(external_hash(h) for h in block_hashes(ids, size))
    assert key.block_chain(size) == want
    assert key.block_chain(size) == tuple(vector["external"])  # type: ignore[arg-type]


def test_the_block_chain_is_computed_once_per_block_size() -> None:
    ids = list(range(100))
    key = prompt_key("x" * 400, 100, ids)
    first = key.block_chain(16)
    assert len(first) == 6
    assert key.block_chain(16) is first
    assert len(key.block_chain(32)) == 3
    # The memo is no part of the key's value.
    assert key == prompt_key("x" * 400, 100, ids)
    assert hash(key) == hash(prompt_key("x" * 400, 100, ids))


def test_without_token_ids_there_is_no_block_chain() -> None:
    key = prompt_key("x" * 1000, 250)
    assert key.token_ids is None
    assert key.block_chain(16) == ()
    with pytest.raises(ValueError, match=r"^block_size is 0; must be >= 1$"):
        key.block_chain(0)


def test_the_text_chain_has_one_hash_per_full_block_and_equal_hashes_mean_equal_prefixes() -> None:
    shared = "s" * (2 * TEXT_BLOCK_CHARS + 10)
    a = prompt_key(shared + "a" * 600, 300)
    b = prompt_key(shared + "b" * 600, 300)
    assert (a.chars, a.tokens) == (len(shared) + 600, 300)
    assert len(a.text_chain) == (len(shared) + 600) // TEXT_BLOCK_CHARS == 4
    assert a.text_chain[:2] == b.text_chain[:2]
    assert a.text_chain[2] != b.text_chain[2]
    # Block 1 of a prompt is not block 1 of another with another block 0, even when the
    # chars of block 1 are equal.
    c = prompt_key("t" * TEXT_BLOCK_CHARS + shared[TEXT_BLOCK_CHARS:], 300)
    assert c.text_chain[1] != a.text_chain[1]
    assert prompt_key("x" * (TEXT_BLOCK_CHARS - 1), 10).text_chain == ()
    # A lone surrogate (valid JSON, refused by strict UTF-8) still hashes.
    assert len(prompt_key("\ud800" * TEXT_BLOCK_CHARS, 10).text_chain) == 1
