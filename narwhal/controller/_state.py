"""The controller's memory between passes: a frozen record `decide` reads and replaces."""

from __future__ import annotations

import math
from typing import Literal

import attrs

from ._demand import EvidenceWindow

Direction = Literal["d2p", "p2d"]  # decode-to-prefill, prefill-to-decode
Rule = Literal["ordinary", "mixed-pressure"]


@attrs.frozen
class CandidateKey:
    """What a confirmation must match (docs/design.md#adjacent-splits): the proposed split, the
    demand completeness it was made under and the eligibility rule that admitted it. The direction
    is implied by the split but kept for readability."""

    direction: Direction
    prefill: int
    decode: int
    complete: bool
    rule: Rule


@attrs.frozen(kw_only=True)
class ControllerState:
    evidence: EvidenceWindow
    candidate: CandidateKey | None = None
    confirmations: int = 0
    # step_s: when the last scheduled adjacent-split evaluation ran, and whether the one
    # guarded breach-step evaluation allowed since then was used.
    last_scheduled_at: float = -math.inf
    breach_step_used: bool = False
    # cooldown_s: the last prefill-to-decode move (ordinary or floor recovery).
    last_p2d_at: float = -math.inf
    # dwell_s: the time each engine last changed role, sorted by engine id.
    role_changed_at: tuple[tuple[str, float], ...] = ()
    # The last pass found a floor breached (docs/design.md#role-floors). The first pass without a
    # breach then evaluates at once, whatever step_s says: the split re-enters the adjacent path
    # when capacity returns, and the breach it reported is no longer the news.
    floor_breached: bool = False

    def changed_at(self, engine_id: str) -> float:
        for name, at in self.role_changed_at:
            if name == engine_id:
                return at
        return -math.inf

    def since_role_change(self, engine_id: str, now: float) -> float:
        return now - self.changed_at(engine_id)

    def with_role_change(self, engine_id: str, now: float) -> ControllerState:
        stamps = dict(self.role_changed_at)
        stamps[engine_id] = now
        return attrs.evolve(self, role_changed_at=tuple(sorted(stamps.items())))

    def cleared(self) -> ControllerState:
        """No candidate: the confirmation sequence starts over."""
        return attrs.evolve(self, candidate=None, confirmations=0)


def initial_state(now: float, arrivals_total: int = 0) -> ControllerState:
    """A fresh controller: the evidence window opens now, nothing is confirmed."""
    return ControllerState(evidence=EvidenceWindow(now, arrivals_total))
