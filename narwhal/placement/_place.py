"""Placement: which engines run a request's phases. Pure; no trio, no I/O.

docs/design.md#placement: filter by role, then availability, then exclusions (engines that
already failed this request), then projected SLO compliance; pick the lowest cost; break
ties by engine id. When every candidate would miss its projected SLO the request still
runs on the cheapest one and the placement is recorded as unserved.

Engines with role "both" serve aggregate inference (one leg, no KV handoff); engines with
role "prefill" and "decode" form disaggregated pairs. A fleet that has an available pair
disaggregates; otherwise it falls back to an available "both" engine; otherwise nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import attrs

from ..fleet import EngineView, Phase

Mode = Literal["disaggregated", "aggregate"]


@attrs.frozen
class Placement:
    mode: Mode
    prefill: str | None
    decode: str
    unserved: bool = False


@attrs.frozen
class NoPlacement:
    """Why no engine could take the request: the first filter that left nothing.
    `public`: the reason without engine ids, for a client (None: it names none)."""

    reason: str
    public: str | None = attrs.field(default=None, eq=False)


# A projected-SLO predicate and a cost per engine; the defaults are load-based until the
# profile-driven versions (admission and pricing) supply their own.
SloCheck = Callable[[EngineView], bool]
Cost = Callable[[EngineView], float]


def _prefill_cost(view: EngineView) -> float:
    return float(view.prefill_tokens_inflight)


def _decode_cost(view: EngineView) -> float:
    return view.decode_active + view.decode_tokens * 1e-6


def _always(view: EngineView) -> bool:
    return True


@attrs.frozen
class Policy:
    prefill_ok: SloCheck = _always
    decode_ok: SloCheck = _always
    prefill_cost: Cost = _prefill_cost
    decode_cost: Cost = _decode_cost


DEFAULT_POLICY = Policy()


def cached_load_policy(cached_tokens: Mapping[str, int], affinity: float) -> Policy:
    """The load-based policy with `affinity` (cache.affinity) times each engine's cached
    prefix of the prompt taken off its prefill cost (tokens it would not compute): with
    no profile to price seconds, tokens are the cost. At 0, or with nothing cached,
    `DEFAULT_POLICY` itself."""
    if not affinity or not any(cached_tokens.values()):
        return DEFAULT_POLICY

    def prefill_cost(view: EngineView) -> float:
        return view.prefill_tokens_inflight - affinity * cached_tokens.get(view.id, 0)

    return Policy(prefill_cost=prefill_cost)


def _pick(
    views: Sequence[EngineView],
    roles: tuple[str, ...],
    excluded: frozenset[str],
    slo_ok: SloCheck,
    cost: Cost,
    phase: Phase,
) -> tuple[EngineView | None, bool, NoPlacement | None]:
    """(engine, meets its projected SLO, why none)."""
    by_role = [v for v in views if v.role in roles]
    if not by_role:
        return None, False, NoPlacement(f"no engine has the {phase} role")
    gate: Phase = (
        "aggregate" if phase == "aggregate" else ("prefill" if phase == "prefill" else "decode")
    )
    available = [v for v in by_role if v.blocked(gate) is None]
    if not available:
        reasons = sorted({f"{v.id}: {v.blocked(phase)}" for v in by_role})
        public = f"no {phase} engine is available"
        return None, False, NoPlacement(f"{public} ({'; '.join(reasons)})", public)
    allowed = [v for v in available if v.id not in excluded]
    if not allowed:
        reason = f"every available {phase} engine already failed this request"
        return None, False, NoPlacement(reason)
    compliant = [v for v in allowed if slo_ok(v)]
    pool = compliant or allowed
    best = min(pool, key=lambda v: (cost(v), v.id))
    return best, bool(compliant), None


def choose(
    views: Sequence[EngineView],
    *,
    excluded: frozenset[str] = frozenset(),
    policy: Policy = DEFAULT_POLICY,
) -> Placement | NoPlacement:
    prefill, prefill_meets, prefill_reason = _pick(
        views, ("prefill",), excluded, policy.prefill_ok, policy.prefill_cost, "prefill"
    )
    decode, decode_meets, decode_reason = _pick(
        views, ("decode",), excluded, policy.decode_ok, policy.decode_cost, "decode"
    )
    if prefill is not None and decode is not None:
        return Placement(
            "disaggregated", prefill.id, decode.id, unserved=not (prefill_meets and decode_meets)
        )
    both, both_meets, both_reason = _pick(
        views,
        ("both",),
        excluded,
        lambda v: policy.prefill_ok(v) and policy.decode_ok(v),
        lambda v: policy.prefill_cost(v) + policy.decode_cost(v),
        "aggregate",
    )
    if both is not None:
        return Placement("aggregate", None, both.id, unserved=not both_meets)
    has_pairs = any(v.role in ("prefill", "decode") for v in views)
    if has_pairs:
        return prefill_reason or decode_reason or NoPlacement("no engine pair")
    return both_reason or NoPlacement("no engine")
