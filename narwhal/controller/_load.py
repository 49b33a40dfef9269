"""Pool loads (docs/design.md#pool-load) and the projection model for adjacent splits
(docs/design.md#adjacent-splits).

Pure arithmetic: no trio, no I/O, no clock.

Measured loads (docs/design.md#pool-load)
-----------------------------------------
* Prefill load = predicted prefill work / TTFT target. For one engine the predicted work
  is the profile-priced prefill time of what it already holds and of what waits for one of
  its router-side slots (`serving.prefill_concurrency`); the pool's *measured prefill
  pressure* is the mean over live prefill engines (`measured_prefill_pressure`).
* Decode load uses the corrected idle floor, ``floor = idle_floor_s · correction`` (the
  profile's zero-contention interval times the engine's bounded live/profile ratio),
  and the remaining TPOT budget ``tpot − floor``:
  ``load = max(0, (interval − floor) / (tpot − floor))``. When the floor itself reaches
  the TPOT target there is no budget left to divide by, so the load is the raw ratio
  ``interval / tpot`` (`decode_load`). The pool's measured decode load is the mean over
  live decode engines that report an interval (an idle engine counts as 0).

Projection model (the loads a split *would* have)
-------------------------------------------------
A split is ``k`` live prefill engines and ``m`` live decode engines. Its loads are
projected only from the demand estimate and the *mean* profile (docs/design.md#reactive-parameters:
demand pricing uses the mean profile across configured engines), never from the instantaneous
measurements, so the projection of a given split is the same whichever split the fleet is in right
now. That consistency is what keeps a stationary mix from flapping: if split A is projected better
than B by the movement margin, B is never projected better than A at the same demand.

Demand (see `_demand`) is the offered arrival rate λ (requests/s, admitted plus refused,
raised to at least `reactive.demand_floor`), the first two moments of the mean-profile
prefill time of the offered prompts, E[s] and E[s²], the mean expected output tokens and
the token-weighted mean KV a decoding stream holds, κ = Σ oᵢ(pᵢ + oᵢ/2) / Σ oᵢ.

* Prefill, ``k`` engines. Each engine is an M/G/1 queue with arrival rate λ/k whose
  usable capacity is `reactive.utilization` (u) of the engine:
  ``ρ = λ·E[s] / (k·u)``; the Pollaczek–Khinchine mean wait is
  ``W = ρ/(1−ρ) · E[s²]/(2·E[s])`` and the projected TTFT is ``W + E[s]``, so
  ``prefill load = (W + E[s]) / ttft``: predicted prefill work over the TTFT target, as
  docs/design.md#pool-load defines it. Near saturation the queue formula explodes; above ρ = 0.98
  the load is the ρ = 0.98 value scaled by ρ/0.98, so an overloaded split still ranks by how
  overloaded it is (docs/design.md#adjacent-splits: the controller keeps acting under
  overload). ``k = 0`` has load `NO_CAPACITY`.
* Decode, ``m`` engines. Each engine receives r = λ·E[out] / (m·u) tokens/s (demand
  inflated by 1/u, so load 1.0 means the pool meets the TPOT target at u of its
  capacity). By Little's law a steady batch of B streams that each produce one token
  per step of duration t(B) satisfies ``B = r · t(B)``, with
  ``t(B) = correction · interval_s(B, κ·B)`` from the mean profile and the mean decode
  correction of the live decode engines. The controller takes the least fixed point
  (iteration from B = 0, then bisection near the critical rate). Candidate pricing
  includes resident plus pending decode work (docs/design.md#evidence-gate): the projected operating
  point is ``B' = max(B, (resident + pending)/m)`` and
  ``K' = max(κ·B, (resident KV + pending KV)/m)``, and the load is the pool-load formula at
  ``t = correction · interval_s(B', K')``. No fixed point below the KV capacity
  (``B·κ ≤ kv_capacity``), or below the decode slots per engine when the router caps
  them (``serving.decode_concurrency``: streams beyond it wait for a slot, so a batch
  that needs more is not reached), means overload: the load at the bound scaled by r·t/B.
  ``m = 0`` has load `NO_CAPACITY`.
* The worst projected SLO ratio of a split is ``max(prefill load, decode load)``.

Fractional batches are priced by interpolating the profile along the ray from the
origin through (B', K'), because profile models take whole requests and tokens.
"""

from __future__ import annotations

import math

import attrs

from ._profile import DecodeCost

# The load of a pool with no engine at all: finite (JSON and Prometheus friendly) and
# larger than any load a pool with engines reaches in practice.
NO_CAPACITY = 1.0e6
# Above this utilisation the M/G/1 wait is replaced by a linear extension (see above).
RHO_CAP = 0.98
# Bounds on the decode fixed-point search.
_MAX_ACTIVE = 1.0e6
_ITERATIONS = 64
_BISECTIONS = 60


def prefill_load(work_s: float, ttft_s: float) -> float:
    """docs/design.md#pool-load: predicted prefill work over the TTFT target."""
    return max(0.0, work_s) / ttft_s


def corrected_idle_floor(idle_floor_s: float, correction: float) -> float:
    """docs/design.md#pool-load: the profile's idle floor times the bounded live/profile ratio."""
    return idle_floor_s * correction


def decode_load(interval_s: float, idle_floor_s: float, correction: float, tpot_s: float) -> float:
    """docs/design.md#pool-load: the observed interval above the corrected idle floor over the
    remaining TPOT budget, at least 0; the raw interval/target ratio when the floor
    itself reaches the target."""
    floor = corrected_idle_floor(idle_floor_s, correction)
    if floor >= tpot_s:
        return interval_s / tpot_s
    return max(0.0, (interval_s - floor) / (tpot_s - floor))


@attrs.frozen
class PrefillDemand:
    """Offered prefill demand priced with the mean profile."""

    rate: float  # requests/s
    service_mean_s: float  # E[s]
    service_sq_mean_s2: float  # E[s²]

    @property
    def work(self) -> float:
        """Engine-seconds of prefill per second."""
        return self.rate * self.service_mean_s


@attrs.frozen
class DecodeDemand:
    """Offered decode demand."""

    rate: float  # requests/s
    output_tokens_mean: float
    kv_per_stream: float  # κ: token-weighted mean KV of a decoding stream
    prompt_tokens_mean: float

    @property
    def token_rate(self) -> float:
        return self.rate * self.output_tokens_mean


@attrs.frozen
class ResidentWork:
    """Decode work already in the pool: resident streams and prefilled handoffs."""

    streams: int = 0
    kv_tokens: int = 0
    pending: int = 0
    pending_kv_tokens: float = 0.0


def project_prefill(
    demand: PrefillDemand, engines: int, *, utilization: float, ttft_s: float
) -> float:
    """Projected prefill load of `engines` live prefill engines (module docstring)."""
    if engines <= 0:
        return NO_CAPACITY
    mean = demand.service_mean_s
    if mean <= 0.0 or demand.rate <= 0.0:
        return max(0.0, mean) / ttft_s
    rho = demand.rate * mean / (engines * utilization)
    scale = 1.0
    if rho > RHO_CAP:
        scale = rho / RHO_CAP
        rho = RHO_CAP
    residual = max(demand.service_sq_mean_s2, mean * mean) / (2.0 * mean)
    wait = rho / (1.0 - rho) * residual
    return scale * (wait + mean) / ttft_s


@attrs.frozen
class DecodeProjection:
    """Projected per-engine decode operating point and load for one pool size."""

    load: float
    active: float  # streams per engine
    kv_tokens: float  # resident KV tokens per engine
    interval_s: float
    feasible: bool  # a steady state exists within the KV capacity
    in_domain: bool  # the operating point lies inside the measured profile domain


def interval_on_ray(decode: DecodeCost, active: float, kv_tokens: float) -> float:
    """The profile interval at a fractional batch, interpolated along the ray from the
    origin through (active, kv_tokens)."""
    active = max(0.0, active)
    kv_tokens = max(0.0, kv_tokens)
    lo = math.floor(active)
    frac = active - lo
    if frac == 0.0 or active == 0.0:
        return decode.interval_s(int(lo), round(kv_tokens))
    per = kv_tokens / active
    t_lo = decode.interval_s(int(lo), round(per * lo))
    t_hi = decode.interval_s(int(lo) + 1, round(per * (lo + 1)))
    return t_lo + frac * (t_hi - t_lo)


def _steady_batch(
    rate: float, kappa: float, decode: DecodeCost, correction: float, bound: float
) -> tuple[float, float]:
    """(B, overload factor): the least B with B = rate·t(B); factor 1 when it exists
    below `bound`, else (bound, rate·t(bound)/bound)."""

    def h(active: float) -> float:
        return rate * correction * interval_on_ray(decode, active, kappa * active)

    if rate <= 0.0:
        return 0.0, 1.0
    active = 0.0
    for _ in range(_ITERATIONS):
        nxt = h(active)
        if nxt > bound:
            break
        if abs(nxt - active) <= 1e-9 * max(1.0, nxt):
            return nxt, 1.0
        active = nxt
    at_bound = h(bound)
    if at_bound > bound:
        return bound, at_bound / bound
    # Slow convergence near the critical rate: h(active) > active here, h(bound) <= bound.
    lo, hi = active, bound
    for _ in range(_BISECTIONS):
        mid = 0.5 * (lo + hi)
        if h(mid) <= mid:
            hi = mid
        else:
            lo = mid
    return hi, 1.0


def project_decode(
    demand: DecodeDemand,
    engines: int,
    resident: ResidentWork,
    decode: DecodeCost,
    *,
    correction: float,
    utilization: float,
    tpot_s: float,
    kv_capacity_tokens: int,
    slots: float = math.inf,
) -> DecodeProjection:
    """Projected decode load of `engines` live decode engines (module docstring);
    `slots` is the router's cap on resident streams per engine."""
    if engines <= 0:
        return DecodeProjection(NO_CAPACITY, 0.0, 0.0, 0.0, feasible=False, in_domain=False)
    kappa = max(0.0, demand.kv_per_stream)
    bound = min(_MAX_ACTIVE, kv_capacity_tokens / kappa) if kappa > 0 else _MAX_ACTIVE
    bound = min(bound, max(1.0, slots))
    rate = demand.token_rate / (engines * utilization)
    active, factor = _steady_batch(rate, kappa, decode, correction, bound)
    eff_active = max(active, (resident.streams + resident.pending) / engines)
    eff_kv = max(kappa * active, (resident.kv_tokens + resident.pending_kv_tokens) / engines)
    interval = correction * interval_on_ray(decode, eff_active, eff_kv)
    load = decode_load(interval, decode.idle_floor_s, correction, tpot_s)
    # Handoffs waiting for a decode slot can push the operating point past the slots.
    feasible = factor <= 1.0 and eff_kv <= kv_capacity_tokens and eff_active <= slots
    if factor > 1.0:
        load = max(load, 1.0) * factor
    in_domain = feasible and decode.in_domain(math.ceil(eff_active), math.ceil(eff_kv))
    return DecodeProjection(load, eff_active, eff_kv, interval, feasible, in_domain)


@attrs.frozen
class SplitLoad:
    """Projected loads of one split of the live engines."""

    prefill: int
    decode: int
    prefill_load: float
    decode_projection: DecodeProjection

    @property
    def decode_load(self) -> float:
        return self.decode_projection.load

    @property
    def worst(self) -> float:
        """The worst projected SLO ratio (docs/design.md#adjacent-splits)."""
        return max(self.prefill_load, self.decode_projection.load)


def improves(current: float, target: float, margin: float) -> bool:
    """docs/design.md#adjacent-splits: the worst projected SLO ratio must fall by at least the
    movement margin (an absolute reduction in SLO-ratio units); with a margin of 0 the reduction
    must still be strictly positive."""
    if margin <= 0.0:
        return target < current
    return target <= current - margin
