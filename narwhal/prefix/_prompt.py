"""What a prompt is, to the caches: its size and the chains a cache index matches.

Owns: `PromptKey` (made by `prompt_key`): the prompt's char and token counts, the chain
of its full TEXT_BLOCK_CHARS-char text blocks (what `PromptIndex` learns and matches,
for engines without KV events), its token ids when known, and `block_chain`: vLLM's
external block hashes of its full token blocks (what `BlockIndex` matches).
Invariants: text block i's hash is a 64-bit blake2b of the prompt's first
(i + 1) * TEXT_BLOCK_CHARS chars, so equal hashes mean equal prefixes and a match is
always a prefix; a partial last block has no hash, as vLLM caches only full blocks.
`block_chain` is computed on first use per block size and kept: sha256 over pickled
token ids costs far more than the text chain, and most keys are read against one
block size only. Pure.
Errors: `block_chain` raises ValueError for a block size below 1.
See: narwhal/prefix/_approx.py, narwhal/prefix/_hashing.py.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import attrs

from ._hashing import block_hashes, external_hash

# Chars per text block: about 64 tokens of English, half a vLLM block of 128 tokens, so
# a learnt prefix is resolved to within a block or two of what the engine caches.
TEXT_BLOCK_CHARS = 256


@attrs.frozen(kw_only=True)
class PromptKey:
    chars: int
    tokens: int
    text_chain: tuple[int, ...]  # one hash per full text block, first block first
    token_ids: tuple[int, ...] | None
    _chains: dict[int, tuple[int, ...]] = attrs.field(
        factory=dict, init=False, eq=False, repr=False
    )

    def block_chain(self, block_size: int) -> tuple[int, ...]:
        """vLLM's external hashes of the full `block_size`-token blocks; empty without
        token ids."""
        chain = self._chains.get(block_size)
        if chain is None:
            if block_size < 1:
                raise ValueError(f"block_size is {block_size}; must be >= 1")
            ids = self.token_ids or ()
            chain = tuple(external_hash(h) for h in block_hashes(ids, block_size))
            self._chains[block_size] = chain
        return chain


def text_chain(text: str) -> tuple[int, ...]:
    # One running hash, copied at each block end: linear in the prompt, whatever its length.
    running = hashlib.blake2b(digest_size=8)
    chain: list[int] = []
    for end in range(TEXT_BLOCK_CHARS, len(text) + 1, TEXT_BLOCK_CHARS):
        # surrogatepass: JSON may carry a lone surrogate, which strict UTF-8 refuses.
        running.update(text[end - TEXT_BLOCK_CHARS : end].encode("utf-8", "surrogatepass"))
        chain.append(int.from_bytes(running.copy().digest(), "big"))
    return tuple(chain)


def prompt_key(text: str, prompt_tokens: int, token_ids: Sequence[int] | None = None) -> PromptKey:
    """The key of a prompt of `prompt_tokens` tokens (`token_ids` when known)."""
    return PromptKey(
        chars=len(text),
        tokens=prompt_tokens,
        text_chain=text_chain(text),
        token_ids=None if token_ids is None else tuple(token_ids),
    )
