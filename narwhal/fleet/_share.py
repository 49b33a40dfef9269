"""A replica's part of the fleet's capacity, when several Narwhal replicas front one fleet.

Owns
  `Share`: which of how many replicas this one is, and the scale it admits at. `of` splits
  one configured limit (`serving.max_connections`, an engine's phase concurrency).

Invariants
  Over the replicas of one membership, the parts of a limit add up to the limit: each gets
  `total // count`, and the remainder goes one each to the replicas after `offset` in id
  order. The offset is the engine's index, so an engine whose limit is below the replica
  count is whole on some replicas and absent on others, and each replica still gets a
  fair number of engines. `0` (no limit) stays `0` on every replica. A cut-off replica
  (`scale` < 1) takes the part rounded down: it never takes more than its scaled part.
  `Share()` is one replica: every limit whole, today's behaviour.

Errors
  ValueError from the constructor: an index outside the count, a scale outside [0, 1].
"""

from __future__ import annotations

import math

import attrs


@attrs.frozen
class Share:
    index: int = 0
    count: int = 1
    scale: float = 1.0

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"replica index {self.index} outside 0..{self.count - 1}")
        if not 0.0 <= self.scale <= 1.0:
            raise ValueError(f"share scale {self.scale} outside [0, 1]")

    @property
    def whole(self) -> bool:
        return self.count == 1 and self.scale == 1.0

    def of(self, total: int, offset: int = 0) -> int:
        """This replica's part of `total`; 0 when `total` is 0 (no limit) or when the
        part rounds to nothing (the caller treats that as none, not as no limit)."""
        if total == 0 or self.whole:
            return total
        base, extra = divmod(total, self.count)
        part = base + (1 if (self.index - offset) % self.count < extra else 0)
        return math.floor(part * self.scale)

    def describe(self, name: str, total: int, offset: int = 0) -> str:
        """`name=total`, and this replica's part of it when that is not all of it: for
        messages that name the limit a request met."""
        if self.whole:
            return f"{name}={total}"
        scaled = f", scaled by {self.scale} while cut off from etcd" if self.scale < 1 else ""
        return (
            f"this replica's {self.of(total, offset)} of {name}={total} "
            f"({self.count} replicas{scaled})"
        )
