"""The demand estimator (manual 7.6, 7.7): offered demand over the short and long
horizons, demand_floor, pricing with the mean profile, the larger estimate, the
rising-demand test."""

from __future__ import annotations

from functools import partial

import pytest

from narwhal.admission import cached_prefill_s
from narwhal.config import Reactive
from narwhal.controller import Arrival, DemandEstimator, demand_rising, pricing_demand

from .helpers import PROFILE, demand

RX = Reactive(window_s=120.0, evidence_span_s=60.0, evidence_max_span_s=120.0)


def estimator(started_at: float = 0.0) -> DemandEstimator:
    return DemandEstimator.from_config(
        RX, started_at=started_at, price=partial(cached_prefill_s, PROFILE.prefill)
    )


def test_predictive_admission_refusals_count_toward_offered_demand() -> None:
    est = estimator()
    for i in range(10):
        est.record(Arrival(100.0 + i, 100, 10, admitted=i % 2 == 0))
    short, long = est.estimates(120.0)
    assert long.arrivals == 10
    assert long.refused == 5
    assert short.arrivals == 10
    assert short.refused == 5
    assert est.total == 10
    assert est.refused_total == 5


def test_short_horizon_is_evidence_span_and_long_horizon_is_window() -> None:
    est = estimator()
    est.record(Arrival(10.0, 100, 10))  # only in the long horizon at t=130
    est.record(Arrival(100.0, 100, 10))
    short, long = est.estimates(130.0)
    assert (short.horizon_s, long.horizon_s) == (60.0, 120.0)
    assert (short.arrivals, long.arrivals) == (1, 2)
    short, long = est.estimates(200.0)  # t=10 left the long horizon too
    assert (short.arrivals, long.arrivals) == (0, 1)
    assert short.rate == 0.0


def test_rate_uses_time_since_start_when_shorter_than_the_horizon() -> None:
    est = estimator(started_at=100.0)
    for i in range(20):
        est.record(Arrival(100.0 + i, 100, 10))
    _, long = est.estimates(120.0)
    assert long.span_s == 20.0
    assert long.rate == pytest.approx(1.0)
    _short, long = est.estimates(400.0)
    assert long.span_s == 120.0
    assert long.arrivals == 0


def test_demand_floor_is_minimum_accepted_demand_signal_in_requests_per_second() -> None:
    e = demand(0.1, 100, 10)  # 12 arrivals in 120 s
    assert e.rate == pytest.approx(0.1)
    assert e.floored_rate(0.5) == 0.5
    assert e.decode_token_rate(0.5) == pytest.approx(5.0)
    assert e.prefill_work(0.5) == pytest.approx(0.05)
    assert e.floored_rate(0.01) == pytest.approx(0.1)


def test_demand_pricing_uses_the_mean_profile_at_record_time_and_reprices_on_reload() -> None:
    est = DemandEstimator.from_config(RX, started_at=0.0)
    est.record(Arrival(1.0, 400, 10))
    _, long = est.estimates(2.0)
    assert not long.priced
    assert long.prefill_s_mean == 0.0
    est.set_pricer(partial(cached_prefill_s, PROFILE.prefill))
    est.record(Arrival(1.5, 200, 10))
    _, long = est.estimates(2.0)
    assert long.priced
    assert long.prefill_s_mean == pytest.approx(0.3)
    assert long.prefill_s_sq_mean == pytest.approx((0.16 + 0.04) / 2)


def test_decode_kv_per_stream_is_token_weighted() -> None:
    est = estimator()
    est.record(Arrival(1.0, 100, 10))  # mean resident KV 105 over 10 tokens
    est.record(Arrival(1.0, 1000, 90))  # mean resident KV 1045 over 90 tokens
    _, long = est.estimates(2.0)
    assert long.kv_per_stream == pytest.approx((10 * 105 + 90 * 1045) / 100)
    assert long.output_tokens_mean == 50.0
    assert long.prompt_tokens_mean == 550.0


def test_candidate_pricing_uses_the_larger_demand_estimate_per_phase() -> None:
    long = demand(2.0, 400, 100)  # more decode demand
    short = demand(3.0, 400, 10, horizon=60.0)  # more prefill work
    pre, dec = pricing_demand(short, long, RX)
    assert pre.rate == pytest.approx(3.0)
    assert dec.rate == pytest.approx(2.0)
    assert dec.output_tokens_mean == 100.0


def test_short_horizon_competes_only_with_evidence_min_arrivals_samples() -> None:
    long = demand(1.0, 100, 10)
    short = demand(5.0, 100, 10, horizon=60.0, arrivals=RX.evidence_min_arrivals - 1)
    pre, _ = pricing_demand(short, long, RX)
    assert pre.rate == pytest.approx(1.0)


def test_demand_rise_pauses_consolidation_when_short_exceeds_long_by_tolerance() -> None:
    long = demand(1.0, 100, 100)
    # 25 % tolerance: 1.25 is not above it, 1.3 is
    assert not demand_rising(demand(1.25, 100, 100, horizon=60.0), long, RX)
    assert demand_rising(demand(1.3, 100, 100, horizon=60.0), long, RX)


def test_demand_rise_applies_once_short_horizon_has_evidence_min_arrivals() -> None:
    long = demand(1.0, 100, 100)
    few = demand(5.0, 100, 100, horizon=60.0, arrivals=RX.evidence_min_arrivals - 1)
    assert not demand_rising(few, long, RX)
    enough = demand(5.0, 100, 100, horizon=60.0, arrivals=RX.evidence_min_arrivals)
    assert demand_rising(enough, long, RX)


def test_demand_rise_compares_decode_demand_not_request_rate() -> None:
    long = demand(1.0, 100, 100)
    # more requests, but shorter outputs: decode tokens/s unchanged
    assert not demand_rising(demand(2.0, 100, 50, horizon=60.0), long, RX)


def test_reconfigure_changes_horizons() -> None:
    est = estimator()
    est.record(Arrival(50.0, 100, 10))
    est.reconfigure(Reactive(window_s=30.0, evidence_span_s=10.0, evidence_max_span_s=30.0))
    short, long = est.estimates(70.0)
    assert (short.horizon_s, long.horizon_s) == (10.0, 30.0)
    assert (short.arrivals, long.arrivals) == (0, 1)


def test_a_cached_prefix_is_priced_out_of_the_prefill_demand() -> None:
    # The same prompts, one stream with 3000 of their 4000 tokens cached: the prefill
    # work the controller sizes the prefill pool for is what the engines compute.
    cold, warm = estimator(), estimator()
    for i in range(10):
        cold.record(Arrival(100.0 + i, 4000, 10))
        warm.record(Arrival(100.0 + i, 4000, 10, cached_tokens=3000))
    _, cold_long = cold.estimates(120.0)
    _, warm_long = warm.estimates(120.0)
    assert cold_long.prefill_s_mean == pytest.approx(PROFILE.prefill.prefill_s(4000))
    assert warm_long.prefill_s_mean == pytest.approx(cached_prefill_s(PROFILE.prefill, 4000, 3000))
    assert warm_long.prefill_s_mean < 0.5 * cold_long.prefill_s_mean
    assert warm_long.prompt_tokens_mean == cold_long.prompt_tokens_mean  # KV is the whole prompt
