"""Projected TTFT and the bounded decode correction: one test per rule."""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import pytest

from narwhal.config import Reactive
from narwhal.profiles import (
    DecodeCorrection,
    FleetProfiles,
    backlog_s,
    corrected_idle_floor_s,
    decode_load,
    load_profiles,
    projected_interval_s,
    projected_ttft_s,
    save_profiles,
)

from .helpers import config_for, decode, engine, handoff, store_for

PROFILE = engine("p0", "http://127.0.0.1:8100")
HANDOFF = handoff("p0", "d0")


def test_projected_ttft_adds_backlog_prefill_and_handoff() -> None:
    aggregate = projected_ttft_s(PROFILE, prompt_tokens=1000, backlog_s=0.2)
    assert aggregate.prefill_s == pytest.approx(PROFILE.prefill.prefill_s(1000))
    assert aggregate.seconds == pytest.approx(0.2 + aggregate.prefill_s)
    assert aggregate.handoff_s == 0.0
    assert aggregate.in_domain
    p50 = projected_ttft_s(PROFILE, prompt_tokens=1000, handoff=HANDOFF)
    p99 = projected_ttft_s(PROFILE, prompt_tokens=1000, handoff=HANDOFF, quantile="p99")
    assert p50.handoff_s == pytest.approx(HANDOFF.p50_s(1000))
    assert p99.handoff_s == pytest.approx(HANDOFF.p99_s(1000))
    assert p99.seconds > p50.seconds == pytest.approx(p50.prefill_s + p50.handoff_s)


@pytest.mark.parametrize("backlog", [-1.0, math.nan, math.inf])
def test_projected_ttft_ignores_nonsense_backlog(backlog: float) -> None:
    projection = projected_ttft_s(PROFILE, prompt_tokens=10, backlog_s=backlog)
    assert projection.backlog_s == 0.0
    assert math.isfinite(projection.seconds)


def test_projected_ttft_domain() -> None:
    assert not projected_ttft_s(PROFILE, prompt_tokens=1).in_domain  # below min_tokens=2
    assert not projected_ttft_s(PROFILE, prompt_tokens=7801).in_domain
    # Inside the prefill domain but below the pair's smallest measured context.
    assert not projected_ttft_s(PROFILE, prompt_tokens=10, handoff=HANDOFF).in_domain
    assert projected_ttft_s(PROFILE, prompt_tokens=100, handoff=HANDOFF).in_domain


def test_backlog_prices_each_queued_request() -> None:
    queued = [100, 4000]
    assert backlog_s(PROFILE, queued) == pytest.approx(
        PROFILE.prefill.prefill_s(100) + PROFILE.prefill.prefill_s(4000)
    )
    # Quadratic: one request of 4100 tokens costs more than the two apart minus one base.
    assert PROFILE.prefill.prefill_s(4100) != pytest.approx(backlog_s(PROFILE, queued))


def test_projected_interval_scales_by_the_correction() -> None:
    model = decode()
    plain = projected_interval_s(model, active=8, kv_tokens=8000)
    assert plain.seconds == pytest.approx(model.interval_s(8, 8000))
    assert plain.in_domain
    corrected = projected_interval_s(model, active=8, kv_tokens=8000, correction=1.5)
    assert corrected.seconds == pytest.approx(1.5 * plain.seconds)
    assert not projected_interval_s(model, active=65, kv_tokens=8000).in_domain


CORRECTION = DecodeCorrection(min_value=0.5, max_value=2.0, alpha=0.25, min_samples=4)


def test_correction_from_config() -> None:
    reactive = Reactive()
    c = DecodeCorrection.from_config(reactive)
    assert (c.value, c.min_value, c.max_value, c.alpha, c.min_samples) == (
        1.0,
        reactive.decode_correction_min,
        reactive.decode_correction_max,
        reactive.decode_correction_alpha,
        reactive.decode_correction_min_samples,
    )


def test_rule_too_few_samples_leaves_the_correction_unchanged() -> None:
    after = CORRECTION.update([0.02, 0.02, 0.02], 0.01)
    assert after is CORRECTION
    assert after.windows == 0


def test_rule_only_usable_gaps_count_towards_min_samples() -> None:
    gaps = [0.02, 0.02, 0.02, math.nan, -0.01, 0.0, math.inf]
    assert CORRECTION.update(gaps, 0.01) is CORRECTION
    # A gap whose prediction is unusable does not count either.
    assert CORRECTION.update([0.02] * 4, [0.01, 0.01, 0.01, 0.0]) is CORRECTION


def test_rule_alpha_of_the_window_ratio_is_applied() -> None:
    after = CORRECTION.update([0.012] * 4, 0.01)  # ratio 1.2
    assert after.value == pytest.approx(0.75 * 1.0 + 0.25 * 1.2)
    assert after.windows == 1
    again = after.update([0.012] * 4, 0.01)
    assert again.value == pytest.approx(0.75 * after.value + 0.25 * 1.2)


def test_rule_the_window_ratio_is_a_median() -> None:
    # One 1 s stall among fast gaps does not move the ratio.
    after = CORRECTION.update([0.01, 0.01, 0.01, 0.01, 1.0], 0.01)
    assert after.value == pytest.approx(1.0)


def test_rule_per_gap_predictions() -> None:
    after = CORRECTION.update([0.02, 0.04, 0.06, 0.08], [0.01, 0.02, 0.03, 0.04])
    assert after.value == pytest.approx(0.75 + 0.25 * 2.0)
    with pytest.raises(ValueError, match="4 gaps but 2 predictions"):
        CORRECTION.update([0.02] * 4, [0.01, 0.01])


def test_a_summarised_window_is_the_rules_window_with_one_prediction() -> None:
    # The request path summarises each stream once (its positive gaps' median and
    # count) and predicts it at one load: the median of the ratios to one prediction.
    odd = [0.011, 0.013, 0.012, 0.5, 0.009]
    assert CORRECTION.update_median(0.012, 5, 0.01) == CORRECTION.update(odd, 0.01)
    even = [0.011, 0.013, 0.012, 0.5]
    assert CORRECTION.update_median(0.0125, 4, 0.01).value == pytest.approx(
        CORRECTION.update(even, 0.01).value, rel=1e-15
    )
    assert CORRECTION.update_median(0.012, 3, 0.01) is CORRECTION  # too few samples
    for unusable in (0.0, -0.01, math.inf, math.nan):
        assert CORRECTION.update_median(0.012, 5, unusable) is CORRECTION


def test_rule_clamped_to_the_bounds() -> None:
    full = DecodeCorrection(min_value=0.5, max_value=2.0, alpha=1.0, min_samples=1)
    assert full.update([1.0], 0.01).value == 2.0  # ratio 100
    assert full.update([0.0001], 0.01).value == 0.5  # ratio 0.01
    assert DecodeCorrection(value=9.0).value == 2.0


def test_correction_validation() -> None:
    with pytest.raises(ValueError, match="alpha"):
        DecodeCorrection(alpha=0.0)
    with pytest.raises(ValueError, match=r"^max_value is 0\.4; must be >= min_value=0\.5$"):
        DecodeCorrection(max_value=0.4)
    with pytest.raises(ValueError, match="min_samples"):
        DecodeCorrection(min_samples=0)
    with pytest.raises(ValueError, match="min_value"):
        DecodeCorrection(min_value=-1.0)


def test_corrected_idle_floor() -> None:
    model = decode()
    c = DecodeCorrection(value=1.5)
    assert corrected_idle_floor_s(model, c) == pytest.approx(1.5 * model.idle_floor_s)
    assert c.idle_floor_s(model) == corrected_idle_floor_s(model, c)


def test_decode_load() -> None:
    # Manual 7.1: interval above the floor over the budget the floor leaves.
    assert decode_load(0.03, 0.01, 0.05) == pytest.approx(0.5)
    assert decode_load(0.005, 0.01, 0.05) == 0.0
    assert decode_load(0.05, 0.01, 0.05) == pytest.approx(1.0)
    # A floor at or above the target: the raw interval/target ratio.
    assert decode_load(0.06, 0.05, 0.05) == pytest.approx(1.2)
    with pytest.raises(ValueError, match="tpot_s"):
        decode_load(0.01, 0.01, 0.0)


def test_fleet_profiles_serves_only_usable_profiles(tmp_path: Path) -> None:
    urls = {"p0": "http://127.0.0.1:8100", "d0": "http://127.0.0.1:8101", "d1": "http://x:1"}
    store = store_for(urls)
    engines = dict(store.engines)
    engines["d1"] = attrs.evolve(engines["d1"], model="another")
    path = tmp_path / "profiles.json"
    save_profiles(attrs.evolve(store, engines=engines), path)
    fleet = FleetProfiles(load_profiles(path, config_for(urls)), quantile="p99")
    assert fleet.prefill_curve("p0") == store.engines["p0"].prefill
    assert fleet.decode_curve("d0") == store.engines["d0"].decode
    assert fleet.prefill_curve("d1") is None
    assert fleet.decode_curve("nope") is None
    assert fleet.profile("d1") is None
    mean = fleet.mean_profile()
    assert mean is not None
    assert mean.build.endswith("p0, d0")
    # Mean of the pairs between usable engines only (p0 -> d0 and d0 -> p0).
    usable_pairs = [store.handoffs[("p0", "d0")], store.handoffs[("d0", "p0")]]
    expected = sum(h.p99_s(1000) for h in usable_pairs) / 2
    assert fleet.handoff_s(1000) == pytest.approx(expected)
    assert "2/3 usable" in repr(fleet)


def test_fleet_profiles_tracks_a_correction_per_engine(tmp_path: Path) -> None:
    urls = {"p0": "http://127.0.0.1:8100"}
    path = tmp_path / "profiles.json"
    save_profiles(store_for(urls), path)
    template = DecodeCorrection(alpha=0.5, min_samples=2)
    fleet = FleetProfiles(load_profiles(path, config_for(urls)), correction=template)
    assert fleet.decode_correction("p0") == 1.0
    updated = fleet.observe_decode("p0", 0.02, 2, 0.01)
    assert updated.value == pytest.approx(1.5)
    assert fleet.decode_correction("p0") == pytest.approx(1.5)
    assert fleet.decode_correction("other") == 1.0
    floor = fleet.corrected_idle_floor_s("p0")
    assert floor == pytest.approx(1.5 * store_for(urls).engines["p0"].decode.idle_floor_s)
    assert fleet.corrected_idle_floor_s("other") is None
    empty = FleetProfiles(load_profiles(tmp_path / "none.json", config_for(urls)))
    assert empty.handoff_s(100) == 0.0
    assert empty.mean_profile() is None


def test_a_reload_keeps_what_was_learnt_of_an_unchanged_engine_s_decode_speed(
    tmp_path: Path,
) -> None:
    # Every reload re-reads the profiles; each engine's correction started again from 1.0,
    # so rotating an API key reset the whole fleet's TPOT pricing.
    urls = {"p0": "http://127.0.0.1:8100", "d0": "http://127.0.0.1:8101"}
    path = tmp_path / "profiles.json"
    store = store_for(urls)
    save_profiles(store, path)
    template = DecodeCorrection(alpha=0.5, min_samples=2)
    before = FleetProfiles(load_profiles(path, config_for(urls)), correction=template)
    before.observe_decode("p0", 0.03, 2, 0.01)  # 2.0, capped at 2.0
    before.observe_decode("d0", 0.02, 2, 0.01)  # 1.5
    # d0 was profiled again: its learnt correction was relative to the old model.
    engines = dict(store.engines)
    engines["d0"] = attrs.evolve(engines["d0"], decode=decode(t0=0.02))
    save_profiles(attrs.evolve(store, engines=engines), path)
    narrower = DecodeCorrection(max_value=1.8, alpha=0.5, min_samples=2)
    after = FleetProfiles(load_profiles(path, config_for(urls)), correction=narrower)
    assert after.carry_corrections(before, ["p0", "d0", "gone"]) == ["p0"]
    assert after.decode_correction("p0") == 1.8  # within the reloaded bounds
    assert after.correction("p0").windows == 1
    assert after.decode_correction("d0") == 1.0
    # A replaced engine (another url) keeps neither its profile nor its correction.
    before.forget(["p0"])
    assert before.prefill_curve("p0") is None
    assert before.decode_correction("p0") == 1.0
    assert before.decode_curve("d0") is not None
