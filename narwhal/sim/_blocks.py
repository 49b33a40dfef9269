"""The KV blocks of one simulated engine: who holds them, and the prefix cache over them.

Owns: `BlockPool`: allocation and freeing of block ids, reference counts, and with
prefix caching on, vLLM v1's cache (vllm/v1/core/block_pool.py): a full prompt block is
cached under its chained hash (`narwhal.prefix.block_hashes`) once scheduled; a freed
cached block stays findable until its id is handed out again; a request whose prompt
starts with cached blocks shares them instead of computing them.
Invariants: the free queue holds every block with no holder, evictable ones included,
so `free_count` is what an allocation can take. Eviction is LRU: a freed request's
blocks join the queue's tail last block first, allocation takes from the head, and a
hit takes its blocks out of the queue. With caching off the queue is FIFO over plain
ids, exactly as before caching existed. A cache hit stops one token short of the
prompt (vLLM recomputes the last token for its logits). With events on, every cache
change is one `narwhal.prefix` event, taken by the engine once per step.
Errors: none; callers check `free_count` before allocating.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from narwhal.prefix import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    external_hash,
)


class BlockPool:
    def __init__(
        self, num_blocks: int, block_size: int, *, caching: bool = False, events: bool = False
    ) -> None:
        self.block_size = block_size
        self.caching = caching
        self.events_on = caching and events
        # Ids with no holder, next to hand out first (an OrderedDict as a queue that can
        # also drop an id from its middle when a hit takes it back).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs: dict[int, int] = {}
        # hash -> ids cached under it (two requests that computed the same block
        # before either was cached both insert it, as in vLLM); id -> its hash.
        self._cached: dict[bytes, dict[int, None]] = {}
        self._hash_of: dict[int, bytes] = {}
        self.events: list[KvEvent] = []
        # Prompt tokens looked up in the cache, and found (vllm:prefix_cache_*).
        self.queries = 0
        self.hits = 0

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def cached_blocks(self) -> int:
        return len(self._hash_of)

    def allocate(self, n: int) -> list[int]:
        out: list[int] = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._refs[block] = 1
            out.append(block)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one hold on each block; a block nobody holds joins the free queue."""
        if not self.caching:
            for block in blocks:
                del self._refs[block]
                self._free[block] = None
            return
        # The tail of a sequence is the least likely to be shared: evicted first.
        for block in reversed(blocks):
            refs = self._refs[block] - 1
            if refs:
                self._refs[block] = refs
                continue
            del self._refs[block]
            self._free[block] = None
            if block not in self._hash_of:
                # Holding nothing findable, it goes to the head: reused before any cache.
                self._free.move_to_end(block, last=False)

    # -- the prefix cache ------------------------------------------------------------------
    def lookup(self, hashes: Sequence[bytes], prompt_tokens: int) -> list[int]:
        """The cached blocks the prompt starts with (not held yet: see `touch`)."""
        if not self.caching:
            return []
        usable = (prompt_tokens - 1) // self.block_size
        hit: list[int] = []
        for block_hash in hashes[:usable]:
            ids = self._cached.get(block_hash)
            if not ids:
                break
            hit.append(next(iter(ids)))
        return hit

    def count_lookup(self, prompt_tokens: int, hit_blocks: int) -> None:
        self.queries += prompt_tokens
        self.hits += hit_blocks * self.block_size

    def evictable(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` sit in the free queue (holding them takes them out)."""
        return sum(1 for block in blocks if block in self._free)

    def touch(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            refs = self._refs.get(block, 0)
            if not refs:
                del self._free[block]
            self._refs[block] = refs + 1

    def cache(
        self,
        blocks: Sequence[int],
        hashes: Sequence[bytes],
        token_ids: Sequence[int],
        done: int,
        upto: int,
    ) -> None:
        """Cache blocks [done, upto) of a sequence under their hashes (already cached
        below `done`), as one BlockStored event."""
        if not self.caching or upto <= done:
            return
        for i in range(done, upto):
            block, block_hash = blocks[i], hashes[i]
            self._hash_of[block] = block_hash
            self._cached.setdefault(block_hash, {})[block] = None
        if self.events_on:
            size = self.block_size
            self.events.append(
                BlockStored(
                    block_hashes=[external_hash(h) for h in hashes[done:upto]],
                    parent_block_hash=external_hash(hashes[done - 1]) if done else None,
                    token_ids=list(token_ids[done * size : upto * size]),
                    block_size=size,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    lora_name=None,
                    group_idx=0,
                )
            )

    def _evict(self, block: int) -> None:
        block_hash = self._hash_of.pop(block, None)
        if block_hash is None:
            return
        ids = self._cached[block_hash]
        del ids[block]
        if not ids:
            del self._cached[block_hash]
        if self.events_on:
            self.events.append(
                BlockRemoved(
                    block_hashes=[external_hash(block_hash)], medium=MEDIUM_GPU, group_idx=0
                )
            )

    def reset(self) -> bool:
        """Forget every cached hash (vLLM's reset_prefix_cache): only while no block is
        held, else nothing changes and the answer is False."""
        if self._refs:
            return False
        self._cached.clear()
        self._hash_of.clear()
        if self.events_on:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KvEvent]:
        events, self.events = self.events, []
        return events
