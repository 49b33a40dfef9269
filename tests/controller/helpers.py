"""Builders for decision-core tests: a profile with round numbers, configs, engine and
fleet snapshots, demand estimates with fixed request shapes, and states.

The unit profile makes the projections easy to follow by hand:
prefill_s(n) = n / 1000 (1 ms per token), interval_s(B, K) = 10 ms + 1 ms·B.
With TTFT 1 s and TPOT 50 ms the idle floor is 10 ms and the remaining budget 40 ms.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from narwhal.config import Config, Controller, Reactive, Slo, Thresholds
from narwhal.controller import (
    AffineDecode,
    ControllerState,
    DemandEstimate,
    EngineSnapshot,
    EvidenceWindow,
    FleetSnapshot,
    QuadraticPrefill,
    StaticProfile,
    decide,
    initial_state,
)
from narwhal.controller._decide import Decision
from narwhal.controller._snapshot import Role, measured_prefill_pressure

PROFILE = StaticProfile(
    prefill=QuadraticPrefill(a=0.0, b=1.0e-3, c=0.0, min_tokens=1, max_tokens=16384),
    decode=AffineDecode(t0=0.01, per_kv=0.0, per_seq=1.0e-3, max_active=512, max_kv_tokens=10**6),
    kv_capacity_tokens=10**6,
    max_model_len=16384,
)

_THRESHOLDS = {f.name for f in attrs.fields(Thresholds)}
_REACTIVE = {f.name for f in attrs.fields(Reactive)}
_SLO = {"ttft_s", "tpot_s"}


def config(**overrides: Any) -> Config:
    """A Config with controller/threshold/reactive/slo fields overridden by bare name.

    Defaults differ from the manual's in two places to keep the arithmetic round:
    TTFT 1 s and utilization 1.0.
    """
    th: dict[str, Any] = {}
    rx: dict[str, Any] = {"utilization": 1.0}
    slo: dict[str, Any] = {"ttft_s": 1.0, "tpot_s": 0.05}
    ctl: dict[str, Any] = {}
    for key, value in overrides.items():
        if key in _THRESHOLDS:
            th[key] = value
        elif key in _REACTIVE:
            rx[key] = value
        elif key in _SLO:
            slo[key] = value
        else:
            ctl[key] = value
    return Config(
        slo=Slo(**slo),
        controller=Controller(thresholds=Thresholds(**th), reactive=Reactive(**rx), **ctl),
    )


def engine(engine_id: str, role: Role, **kw: Any) -> EngineSnapshot:
    kw.setdefault("profile", PROFILE)
    return EngineSnapshot(id=engine_id, role=role, **kw)


def fleet(spec: str, **per_engine: dict[str, Any]) -> tuple[EngineSnapshot, ...]:
    """'PPDD' -> p0, p1 (prefill), d0, d1 (decode); 'B' is a `both` engine (b0...).
    Keyword arguments per engine id override snapshot fields."""
    roles: dict[str, Role] = {"P": "prefill", "D": "decode", "B": "both"}
    counts: dict[str, int] = {}
    out = []
    for letter in spec:
        i = counts.get(letter, 0)
        counts[letter] = i + 1
        engine_id = f"{letter.lower()}{i}"
        out.append(engine(engine_id, roles[letter], **per_engine.get(engine_id, {})))
    return tuple(out)


def demand(
    rate: float,
    prompt: int,
    output: int,
    *,
    horizon: float = 120.0,
    arrivals: int | None = None,
    refused: int = 0,
    priced: bool = True,
) -> DemandEstimate:
    """An estimate of `rate` requests/s of identical requests over a full horizon; with
    `arrivals`, over the span that gives that rate (a sparse, recent burst)."""
    s = PROFILE.prefill.prefill_s(prompt)
    n = round(rate * horizon) if arrivals is None else arrivals
    span = horizon if arrivals is None or rate <= 0 else min(horizon, arrivals / rate)
    return DemandEstimate(
        horizon_s=horizon,
        span_s=span,
        arrivals=n,
        refused=refused,
        prompt_tokens_mean=float(prompt),
        output_tokens_mean=float(output),
        kv_per_stream=prompt + output / 2.0,
        prefill_s_mean=s,
        prefill_s_sq_mean=s * s,
        priced=priced,
    )


# Demand shapes against the unit profile.
# Prefill-heavy: 4 req/s of 400-token prompts (1.6 engine-s/s of prefill), 10 tokens out.
PREFILL_HEAVY = (4.0, 400, 10)
# Decode-heavy: 20 req/s of 20-token prompts, 100 tokens out (2000 tokens/s).
DECODE_HEAVY = (20.0, 20, 100)
# Decode-urgent: 20 req/s, 170 tokens out (3400 tokens/s: decode load 1.42 on 4 engines).
DECODE_URGENT = (20.0, 20, 170)


def snapshot(
    engines: tuple[EngineSnapshot, ...],
    shape: tuple[float, int, int] | None = None,
    *,
    short: DemandEstimate | None = None,
    long: DemandEstimate | None = None,
    ttft_s: float = 1.0,
    **kw: Any,
) -> FleetSnapshot:
    """A snapshot whose short and long estimates both show `shape` (unless given)."""
    if shape is not None:
        long = long or demand(*shape, horizon=120.0)
        short = short or demand(*shape, horizon=60.0)
    long = long or demand(0.0, 1, 1, arrivals=0)
    short = short or demand(0.0, 1, 1, horizon=60.0, arrivals=0)
    kw.setdefault("mean_profile", PROFILE)
    kw.setdefault("arrivals_total", long.arrivals)
    kw.setdefault("prefill_pressure", measured_prefill_pressure(engines, ttft_s))
    return FleetSnapshot(engines=engines, short=short, long=long, **kw)


def settled(now: float = 1000.0, **kw: Any) -> ControllerState:
    """A state whose evidence window opened long ago (closed, complete demand)."""
    return attrs.evolve(initial_state(now - 10_000.0), **kw)


def opened_at(when: float, arrivals_total: int = 0, **kw: Any) -> ControllerState:
    return ControllerState(evidence=EvidenceWindow(when, arrivals_total), **kw)


def run_passes(
    snap: FleetSnapshot,
    state: ControllerState,
    cfg: Config,
    times: list[float],
) -> list[Decision]:
    """Decide on the same snapshot at each time, carrying the state (nothing applied)."""
    out = []
    for t in times:
        d = decide(snap, state, t, cfg)
        state = d.state
        out.append(d)
    return out


def approx(value: float, rel: float = 1e-9) -> Any:
    import pytest

    return pytest.approx(value, rel=rel)


INF = math.inf
