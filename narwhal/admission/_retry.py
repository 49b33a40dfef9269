"""Retry budget and backoff (docs/design.md#retries). Pure: no trio, no clock."""

from __future__ import annotations

import random

import attrs


def backoff_ceiling(retry: int, *, base_s: float, cap_s: float) -> float:
    """Exponential ceiling for the `retry`-th retry (1-based): base, 2·base, ... ≤ cap."""
    return min(cap_s, base_s * 2.0 ** (retry - 1))


def full_jitter(retry: int, *, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Full jitter: uniform in [0, ceiling], so retries from a burst spread out."""
    return rng.uniform(0.0, backoff_ceiling(retry, base_s=base_s, cap_s=cap_s))


@attrs.define
class RetryBudget:
    """A pool of retry credits: each retry spends one, each successful original request
    returns `replenish`, never above `maximum`. When engines fail across the board the
    pool drains and retries stop, so retries cannot multiply an outage's load."""

    maximum: float
    replenish: float
    level: float = attrs.field()
    spent_total: int = 0
    denied_total: int = 0

    @level.default
    def _full(self) -> float:
        return self.maximum

    def try_spend(self) -> bool:
        if self.level >= 1.0:
            self.level -= 1.0
            self.spent_total += 1
            return True
        self.refused()
        return False

    def refused(self) -> None:
        """Count a retry the pool had no credit for."""
        self.denied_total += 1

    def on_success(self) -> None:
        self.level = min(self.maximum, self.level + self.replenish)

    def reconfigure(self, *, maximum: float, replenish: float) -> None:
        self.maximum = maximum
        self.replenish = replenish
        self.level = min(self.level, maximum)
