"""Manual 7.1 load definitions and the projection model of adjacent splits."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from narwhal.controller import (
    NO_CAPACITY,
    AffineDecode,
    DecodeDemand,
    PrefillDemand,
    ResidentWork,
    corrected_idle_floor,
    decode_load,
    engine_decode_load,
    improves,
    measured_decode_load,
    measured_prefill_pressure,
    prefill_load,
    prefill_work_s,
    project_decode,
    project_prefill,
)
from narwhal.controller._load import interval_on_ray
from narwhal.profiles import DecodeModel

from .helpers import PROFILE, engine

# --- 7.1 measured loads -------------------------------------------------------------


def test_prefill_load_is_predicted_prefill_work_over_ttft_target() -> None:
    assert prefill_load(0.25, 0.5) == 0.5
    assert prefill_load(-1.0, 0.5) == 0.0


def test_corrected_idle_floor_is_profile_floor_times_bounded_live_ratio() -> None:
    assert corrected_idle_floor(0.01, 1.5) == pytest.approx(0.015)


def test_decode_load_divides_interval_above_corrected_floor_by_remaining_budget() -> None:
    # floor 10 ms x 1.5 = 15 ms; budget 50 - 15 = 35 ms; 30 ms observed -> 15/35.
    assert decode_load(0.030, 0.010, 1.5, 0.050) == pytest.approx(15 / 35)


def test_decode_load_has_a_minimum_of_zero() -> None:
    assert decode_load(0.005, 0.010, 1.0, 0.050) == 0.0


def test_decode_load_is_raw_ratio_when_idle_floor_reaches_tpot_target() -> None:
    # corrected floor 0.03 x 2 = 0.06 >= 0.05: raw interval / target.
    assert decode_load(0.08, 0.03, 2.0, 0.05) == pytest.approx(1.6)
    # exactly at the target also uses the raw ratio (no zero budget division)
    assert decode_load(0.05, 0.05, 1.0, 0.05) == pytest.approx(1.0)


def test_load_of_one_means_phase_target_reached() -> None:
    assert decode_load(0.05, 0.01, 1.0, 0.05) == pytest.approx(1.0)
    assert prefill_load(0.5, 0.5) == 1.0


def test_measured_decode_load_is_mean_over_live_decode_engines() -> None:
    engines = (
        engine("d0", "decode", decode_interval_s=0.03, decode_active=5),  # 0.5
        engine("d1", "decode"),  # idle: 0
        engine("d2", "decode", decode_interval_s=0.05, decode_blocked="drained"),
        engine("d3", "decode", decode_active=3),  # streams but no interval: left out
        engine("p0", "prefill", decode_interval_s=0.05),  # not a decode engine
    )
    assert engine_decode_load(engines[0], PROFILE, 0.05) == pytest.approx(0.5)
    assert engine_decode_load(engines[3], PROFILE, 0.05) is None
    assert measured_decode_load(engines, PROFILE, 0.05) == pytest.approx(0.25)


def test_measured_prefill_pressure_is_mean_predicted_work_over_ttft() -> None:
    engines = (
        engine("p0", "prefill", prefill_work_s=0.6),
        engine("p1", "prefill", prefill_work_s=0.2),
        engine("p2", "prefill", prefill_work_s=9.0, prefill_blocked="quarantined"),
        engine("d0", "decode", prefill_work_s=5.0),
    )
    assert measured_prefill_pressure(engines, 0.5) == pytest.approx(0.8)
    assert prefill_work_s(PROFILE, 2, 800) == pytest.approx(0.8)
    assert prefill_work_s(None, 2, 800) == 0.0


# --- projection model ---------------------------------------------------------------


def test_projected_prefill_load_follows_mg1_wait_plus_service() -> None:
    d = PrefillDemand(rate=4.0, service_mean_s=0.4, service_sq_mean_s2=0.16)
    # k=2, u=1: rho=0.8, wait = 0.8/0.2 * 0.16/0.8 = 0.8, load = (0.8 + 0.4) / 1
    assert project_prefill(d, 2, utilization=1.0, ttft_s=1.0) == pytest.approx(1.2)
    # utilization derates capacity: u=0.8 with k=3 is rho=0.6667
    rho = 1.6 / 2.4
    expected = rho / (1 - rho) * 0.2 + 0.4
    assert project_prefill(d, 3, utilization=0.8, ttft_s=1.0) == pytest.approx(expected)


def test_projected_prefill_load_falls_with_engines_and_ranks_overload() -> None:
    d = PrefillDemand(rate=10.0, service_mean_s=0.4, service_sq_mean_s2=0.16)
    loads = [project_prefill(d, k, utilization=1.0, ttft_s=1.0) for k in range(1, 9)]
    assert all(a > b for a, b in itertools.pairwise(loads))
    # k=1..3 are overloaded (rho >= 1) but still ranked: fewer engines, worse
    assert loads[0] > loads[1] > loads[2] > 1.0
    assert project_prefill(d, 0, utilization=1.0, ttft_s=1.0) == NO_CAPACITY


# No correction, full utilization, a 50 ms TPOT and room for any batch.
PLAIN: dict[str, Any] = {
    "correction": 1.0,
    "utilization": 1.0,
    "tpot_s": 0.05,
    "kv_capacity_tokens": 10**6,
}


def test_projected_decode_load_solves_littles_law_fixed_point() -> None:
    d = DecodeDemand(rate=20.0, output_tokens_mean=100.0, kv_per_stream=70.0, prompt_tokens_mean=20)
    p = project_decode(
        d,
        4,
        ResidentWork(),
        PROFILE.decode,
        correction=1.0,
        utilization=1.0,
        tpot_s=0.05,
        kv_capacity_tokens=10**6,
    )
    # r = 500 tokens/s per engine; t = 0.01 + 0.001 B and B = r t  =>  t = 0.02, B = 10
    assert p.interval_s == pytest.approx(0.02)
    assert p.active == pytest.approx(10.0)
    assert p.load == pytest.approx(0.25)
    assert p.feasible
    assert p.in_domain


def test_projected_decode_load_applies_correction_and_utilization() -> None:
    d = DecodeDemand(rate=20.0, output_tokens_mean=100.0, kv_per_stream=70.0, prompt_tokens_mean=20)
    kw: dict[str, Any] = {"tpot_s": 0.05, "kv_capacity_tokens": 10**6}
    base = project_decode(
        d, 4, ResidentWork(), PROFILE.decode, correction=1.0, utilization=1.0, **kw
    )
    derated = project_decode(
        d, 4, ResidentWork(), PROFILE.decode, correction=1.0, utilization=0.5, **kw
    )
    slower = project_decode(
        d, 4, ResidentWork(), PROFILE.decode, correction=1.2, utilization=1.0, **kw
    )
    assert derated.load > base.load
    # correction 1.2: r = 500, t = 1.2 (0.01 + 0.001 B), B = r t  =>  t = 0.012 / 0.4 = 0.03
    assert slower.interval_s == pytest.approx(0.03)
    assert slower.load == pytest.approx((0.03 - 0.012) / (0.05 - 0.012))


def test_no_demand_and_nothing_resident_is_the_idle_point_inside_the_domain() -> None:
    idle = DecodeDemand(rate=0.0, output_tokens_mean=0.0, kv_per_stream=0.0, prompt_tokens_mean=0)
    p = project_decode(idle, 3, ResidentWork(), PROFILE.decode, **PLAIN)
    assert (p.active, p.kv_tokens, p.load) == (0.0, 0.0, 0.0)
    assert p.in_domain  # the idle floor measures it
    assert PROFILE.decode.in_domain(0, 0)
    assert not PROFILE.decode.in_domain(0, 1)  # KV with no request is no operating point


def test_the_test_profiles_domain_is_the_real_profiles_domain() -> None:
    # The controller's tests price with AffineDecode; production with the fitted model.
    # A difference in the box once hid a gate that blocked every idle D->P candidate.
    real = DecodeModel(
        t0_s=0.01,
        kv_s_per_token=1e-7,
        active_s_per_request=1e-4,
        idle_floor_s=0.01,
        min_active=1,
        max_active=192,
        min_kv_tokens=512,
        max_kv_tokens=300_000,
    )
    double = AffineDecode(max_active=192, max_kv_tokens=300_000)
    for active, kv in itertools.product((0, 1, 2, 192, 193), (0, 1, 512, 300_000, 300_001)):
        assert double.in_domain(active, kv) == real.in_domain(active, kv), (active, kv)


def test_projected_decode_includes_resident_and_pending_work() -> None:
    d = DecodeDemand(rate=0.5, output_tokens_mean=10.0, kv_per_stream=100.0, prompt_tokens_mean=50)
    idle = project_decode(d, 2, ResidentWork(), PROFILE.decode, **PLAIN)
    busy = project_decode(d, 2, ResidentWork(streams=30, pending=10), PROFILE.decode, **PLAIN)
    assert busy.active == pytest.approx(20.0)
    assert busy.load == pytest.approx((0.001 * 20) / 0.04)
    assert busy.load > idle.load


def test_projected_decode_overload_and_kv_capacity() -> None:
    d = DecodeDemand(
        rate=20.0, output_tokens_mean=300.0, kv_per_stream=1000.0, prompt_tokens_mean=20
    )
    kw: dict[str, Any] = {"correction": 1.0, "utilization": 1.0, "tpot_s": 0.05}
    three = project_decode(d, 3, ResidentWork(), PROFILE.decode, kv_capacity_tokens=10**6, **kw)
    two = project_decode(d, 2, ResidentWork(), PROFILE.decode, kv_capacity_tokens=10**6, **kw)
    # 2000 and 3000 tokens/s per engine exceed 1 / (1 ms per stream): no steady state
    assert not three.feasible
    assert not two.feasible
    assert two.load > three.load > 1.0
    assert not three.in_domain
    # a small KV capacity makes an otherwise feasible point infeasible
    light = DecodeDemand(
        rate=1.0, output_tokens_mean=100.0, kv_per_stream=1000.0, prompt_tokens_mean=20
    )
    tight = project_decode(light, 1, ResidentWork(), PROFILE.decode, kv_capacity_tokens=50, **kw)
    assert not tight.feasible
    none = project_decode(light, 0, ResidentWork(), PROFILE.decode, kv_capacity_tokens=50, **kw)
    assert none.load == NO_CAPACITY


def test_projected_decode_batch_is_bounded_by_the_routers_decode_slots() -> None:
    d = DecodeDemand(rate=20.0, output_tokens_mean=100.0, kv_per_stream=70.0, prompt_tokens_mean=20)
    free = project_decode(d, 4, ResidentWork(), PROFILE.decode, **PLAIN)
    roomy = project_decode(d, 4, ResidentWork(), PROFILE.decode, slots=20, **PLAIN)
    capped = project_decode(d, 4, ResidentWork(), PROFILE.decode, slots=4, **PLAIN)
    assert free.active == pytest.approx(10.0)  # the steady batch needs 10 streams
    assert roomy == free
    # Four slots: streams beyond them wait, so the steady batch is not reached. At the
    # cap t = 14 ms, so the engine serves 4 / 0.014 tokens/s of the 500 it is offered.
    assert not capped.feasible
    assert capped.active == pytest.approx(4.0)
    assert capped.load == pytest.approx(500 * 0.014 / 4)
    assert not capped.in_domain
    # Demand the slots hold, but resident streams and waiting handoffs they do not.
    light = DecodeDemand(
        rate=1.0, output_tokens_mean=10.0, kv_per_stream=70.0, prompt_tokens_mean=20
    )
    queued = ResidentWork(streams=16, pending=8)
    assert project_decode(light, 4, queued, PROFILE.decode, slots=5, **PLAIN).feasible is False
    assert project_decode(light, 4, queued, PROFILE.decode, slots=8, **PLAIN).feasible is True


def test_projection_outside_profile_domain_is_flagged() -> None:
    small = AffineDecode(t0=0.01, per_kv=0.0, per_seq=1e-4, max_active=4)
    d = DecodeDemand(rate=20.0, output_tokens_mean=100.0, kv_per_stream=70.0, prompt_tokens_mean=20)
    p = project_decode(
        d,
        4,
        ResidentWork(),
        small,
        correction=1.0,
        utilization=1.0,
        tpot_s=0.05,
        kv_capacity_tokens=10**6,
    )
    assert p.feasible
    assert p.active > 4
    assert not p.in_domain


def test_fractional_batches_interpolate_the_profile() -> None:
    assert interval_on_ray(PROFILE.decode, 2.5, 250.0) == pytest.approx(0.0125)
    assert interval_on_ray(PROFILE.decode, 0.0, 0.0) == pytest.approx(0.01)


def test_movement_margin_is_an_absolute_reduction_and_strict_at_zero() -> None:
    assert improves(0.9, 0.85, 0.05)
    assert not improves(0.9, 0.86, 0.05)
    assert improves(0.9, 0.899, 0.0)
    assert not improves(0.9, 0.9, 0.0)
