"""What recovery and the monitor need of the router they run in.

Owns
  `RecoveryHost` and `MonitorHost`, the protocols serving's `ServingContext` satisfies;
  recovery never imports serving.

Invariants
  Read each time, never copied: a reload replaces `config`.
  The monitor is the only writer of `degraded_reason`.
"""

from __future__ import annotations

from typing import Protocol

from ..config import Config
from ..fleet import Fleet
from ..metrics import Metrics
from ..signals import RouterLag


class RecoveryHost(Protocol):
    @property
    def config(self) -> Config: ...

    @property
    def fleet(self) -> Fleet: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def loop_lag(self) -> RouterLag:
        """Asked whether a deadline that expired was the router's, not the engine's."""

    @property
    def started_at(self) -> float:
        """When the router started (`recent_changes` times count from it)."""


class MonitorHost(RecoveryHost, Protocol):
    # Set while consecutive monitor failures stop new admissions (`Monitor._account`).
    degraded_reason: str | None
