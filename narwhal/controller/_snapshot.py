"""What the decision core sees of the fleet at one instant: frozen records, no trio.

`Controller` builds these from the live `EngineState`s once per monitor pass; the fluid
fleet model and the tests build them directly. Every flag the decision needs is copied
in, so `decide` is a pure function of (snapshot, state, now, config).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import attrs

from ._demand import DemandEstimate
from ._load import decode_load
from ._profile import Profile

Role = Literal["prefill", "decode", "both"]


@attrs.frozen(kw_only=True)
class EngineSnapshot:
    """One engine at one instant."""

    id: str
    role: Role
    # Why the engine takes no new work of that phase now (drained, removed, ejected,
    # restart hold, quarantined, breaker), or None.
    prefill_blocked: str | None = None
    decode_blocked: str | None = None
    pinned: bool = False
    # Why the engine's role cannot change at all (SGLang fixes it at launch), or None.
    fixed_role: str | None = None
    # Seconds since the engine last changed role (math.inf when it never has); the
    # builder derives it from the controller's dwell timestamps.
    since_role_change_s: float = math.inf
    decode_active: int = 0  # resident decode streams
    decode_tokens: int = 0  # resident KV tokens of those streams
    # Decode legs placed here that have not started (their prefill is still running, or
    # their KV waits for a decode slot), and their prompt tokens. A role change does not
    # move them (docs/design.md#placement: they keep the engine they were placed on), so a decode
    # engine turned prefill still starts every one of them: for the D-to-P candidate they are
    # resident work like the streams it holds.
    decode_pending: int = 0
    decode_pending_tokens: int = 0
    prefill_inflight: int = 0
    prefill_tokens_inflight: int = 0
    prefill_work_s: float = 0.0  # profile-priced prefill work the engine holds
    handoffs_pending: int = 0  # prefilled KV on this engine still waiting for decode
    profile: Profile | None = None
    # Measured mean decode token interval since the last pass (None: no decode tokens)
    # and the engine's bounded live/profile decode correction.
    decode_interval_s: float | None = None
    decode_correction: float = 1.0
    # The cap on the engine's resident decode streams: the router's
    # (`serving.decode_concurrency` or the engine's override) or the engine's own
    # (`max_num_seqs` in its profile), whichever is smaller; math.inf when neither is known.
    decode_slots: float = math.inf

    @property
    def decode_resident(self) -> int:
        """Decode streams that will run here whatever the engine's role becomes."""
        return self.decode_active + self.decode_pending

    @property
    def decode_resident_tokens(self) -> int:
        return self.decode_tokens + self.decode_pending_tokens

    @property
    def has_profile(self) -> bool:
        return self.profile is not None

    @property
    def unavailable(self) -> str | None:
        """The first reason the engine cannot take new work of any phase."""
        return self.prefill_blocked or self.decode_blocked

    @property
    def movable(self) -> bool:
        """A role change may touch it: a prefill or decode engine whose dialect lets its
        role change, fully available and not pinned. Engines with role `both` serve
        aggregate inference and are never moved."""
        return (
            self.role != "both"
            and self.fixed_role is None
            and not self.pinned
            and self.unavailable is None
        )

    def live_for(self, phase: Literal["prefill", "decode"]) -> bool:
        """Serves `phase` now: its role covers the phase and that phase is not blocked."""
        if self.role not in (phase, "both"):
            return False
        blocked = self.prefill_blocked if phase == "prefill" else self.decode_blocked
        return blocked is None

    def kv_capacity(self, mean: Profile | None) -> int | None:
        profile = self.profile or mean
        return profile.kv_capacity_tokens if profile is not None else None


@attrs.frozen(kw_only=True)
class FleetSnapshot:
    """The fleet and its offered demand at one instant."""

    engines: tuple[EngineSnapshot, ...]
    mean_profile: Profile | None
    short: DemandEstimate  # horizon = reactive.evidence_span_s
    long: DemandEstimate  # horizon = reactive.window_s
    arrivals_total: int  # every arrival ever recorded (for the evidence window)
    # Measured prefill pressure: predicted prefill work / TTFT target (pool mean).
    prefill_pressure: float = 0.0
    # Since the last pass: decode legs that hit engine.first_token_timeout_s, and
    # prefill-to-decode recovery moves made outside this controller.
    first_token_timeouts: int = 0
    p2d_recovery_moves: int = 0
    # A projected prefill TTFT breach was signalled (admission priced a request above
    # the TTFT target) since the last pass.
    ttft_breach: bool = False

    def engine(self, engine_id: str) -> EngineSnapshot | None:
        for engine in self.engines:
            if engine.id == engine_id:
                return engine
        return None

    @property
    def all_profiled(self) -> bool:
        return bool(self.engines) and all(e.has_profile for e in self.engines)


def measured_prefill_pressure(engines: Sequence[EngineSnapshot], ttft_s: float) -> float:
    """docs/design.md#pool-load over the live prefill pool: mean predicted prefill work / TTFT
    target."""
    live = [e for e in engines if e.live_for("prefill")]
    if not live:
        return 0.0
    return sum(max(0.0, e.prefill_work_s) for e in live) / len(live) / ttft_s


def engine_decode_load(engine: EngineSnapshot, mean: Profile | None, tpot_s: float) -> float | None:
    """docs/design.md#pool-load for one engine from its measured interval; None when it reported
    none or no profile gives its idle floor. An idle engine has load 0."""
    profile = engine.profile or mean
    if engine.decode_interval_s is None:
        return 0.0 if engine.decode_active == 0 else None
    if profile is None:
        return None
    return decode_load(
        engine.decode_interval_s, profile.decode.idle_floor_s, engine.decode_correction, tpot_s
    )


def measured_decode_load(
    engines: Sequence[EngineSnapshot], mean: Profile | None, tpot_s: float
) -> float:
    """The live decode pool's mean measured decode load (engines with no usable
    measurement are left out; an empty pool has load 0)."""
    loads = [
        load
        for e in engines
        if e.live_for("decode") and (load := engine_decode_load(e, mean, tpot_s)) is not None
    ]
    return sum(loads) / len(loads) if loads else 0.0


def decode_slots(router_slots: float, profile: Profile | None) -> float:
    """An engine's cap on resident decode streams: the router's limiter total (math.inf
    when unbounded) or the engine's measured `max_num_seqs`, whichever is smaller. The
    engine queues streams beyond its own cap however many the router lets through."""
    engine_cap = profile.max_num_seqs if profile is not None else 0
    return min(router_slots, engine_cap) if engine_cap > 0 else router_slots


def prefill_work_s(profile: Profile | None, inflight: int, tokens_inflight: int) -> float:
    """Profile-priced prefill work an engine holds. Only totals are known, so each
    in-flight prompt is priced at the mean length (exact for the linear part)."""
    if profile is None or inflight <= 0:
        return 0.0
    mean_tokens = max(0, round(tokens_inflight / inflight))
    return inflight * profile.prefill.prefill_s(mean_tokens)
