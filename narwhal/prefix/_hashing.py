"""vLLM's prefix-cache block hashes, computed from token ids without vLLM.

Owns: `block_hashes` (the chained hashes of a prompt's full blocks), `hash_block` (one
block on top of its parent), `root_hash` (the parent of a chain's first block) and
`external_hash` (the 64-bit integer KV events publish for a hash).
Invariants: equal to vLLM 0.32's default ``prefix_caching_hash_algo="sha256"``
(vllm/v1/core/kv_cache_utils.py hash_block_tokens, vllm/utils/hashing.py sha256): a
block's hash is ``sha256(pickle((parent, tuple(token_ids), extra_keys)))``, the parent of
block 0 is ``sha256(pickle(seed))`` with seed ``"vllm-none-hash"`` unless the engine runs
with PYTHONHASHSEED, and only full blocks are hashed. ``extra_keys`` (LoRA, multimodal,
cache_salt) is None for a plain text prompt, the only kind Narwhal hashes. Pure: the
same ids give the same hashes in any process; tests/prefix/vllm_vectors.json holds
vectors computed by vLLM's own function.
See: narwhal/prefix/_events.py (the wire those hashes travel on).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence

# vLLM's DEFAULT_NONE_HASH_SEED: the seed of every chain when PYTHONHASHSEED is unset.
NONE_HASH_SEED = "vllm-none-hash"
# vLLM pickles with HIGHEST_PROTOCOL, which is 5 on every Python vLLM supports; a
# Python whose highest protocol moved on would hash differently, so it is pinned here.
_PICKLE_PROTOCOL = 5


def _sha256(value: object) -> bytes:
    # Only ever pickled from ints, bytes, tuples and None, never unpickled.
    return hashlib.sha256(pickle.dumps(value, protocol=_PICKLE_PROTOCOL)).digest()


def root_hash(seed: str = NONE_HASH_SEED) -> bytes:
    """The parent hash of a chain's first block (vLLM's NONE_HASH)."""
    return _sha256(seed)


ROOT_HASH = root_hash()


def hash_block(parent: bytes | None, token_ids: Sequence[int], *, root: bytes = ROOT_HASH) -> bytes:
    """The hash of one full block whose previous block hashed to `parent` (None: first)."""
    return _sha256((parent or root, tuple(token_ids), None))


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    parent: bytes | None = None,
    root: bytes = ROOT_HASH,
) -> list[bytes]:
    """The chained hashes of every full block of `token_ids` (a partial tail has none).

    `parent` continues a chain: the hash of the block just before ``token_ids[0]``.
    """
    if block_size < 1:
        raise ValueError(f"block_size is {block_size}; must be >= 1")
    out: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], root=root)
        out.append(parent)
    return out


def external_hash(block_hash: bytes) -> int:
    """A hash as KV events carry it: its last 8 bytes as an unsigned integer (vLLM's
    default, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)."""
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF
