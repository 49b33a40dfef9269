"""What the role controller needs from an engine profile, as structural types.

The profile store (`narwhal.profiles`) is built separately; the controller codes against
these protocols so any object with the same members works: the real `EngineProfile`
(whose `prefill` is a `PrefillModel` and `decode` a `DecodeModel`), or the small fixed
profiles the tests and the fluid fleet model use (`QuadraticPrefill`, `AffineDecode`,
`StaticProfile` in `_fluid`).

Every member is read-only, so plain (frozen) attributes satisfy the property members.
Token counts are ints, as the profile domain is measured in whole tokens and requests;
the controller rounds or interpolates its fractional projections before asking.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class PrefillCost(Protocol):
    """Prefill time of one prompt on an idle engine, and the measured prompt range."""

    @property
    def min_tokens(self) -> int: ...

    @property
    def max_tokens(self) -> int: ...

    def prefill_s(self, n: int) -> float: ...

    def in_domain(self, n: int) -> bool: ...


class DecodeCost(Protocol):
    """Decode token interval as a function of active requests and resident KV tokens."""

    @property
    def idle_floor_s(self) -> float:
        """The zero-contention decode interval (docs/design.md#pool-load: the idle floor)."""
        ...

    def interval_s(self, active: float, kv_tokens: float) -> float: ...

    def in_domain(self, active: int, kv_tokens: int) -> bool:
        """Measured batches, plus the idle point (0, 0) that the idle floor measures."""
        ...


class Profile(Protocol):
    """One engine's profile (or the mean profile across configured engines)."""

    @property
    def prefill(self) -> PrefillCost: ...

    @property
    def decode(self) -> DecodeCost: ...

    @property
    def kv_capacity_tokens(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def max_num_seqs(self) -> int:
        """Requests the engine runs at once; 0 when unknown."""
        ...


# `ProfileStore.mean_profile` and `ProfileStore.profile` fit these directly; a store that
# raises when it holds no profile should be wrapped to return None instead.
MeanProfile = Callable[[], Profile | None]
EngineProfiles = Callable[[str], Profile | None]
