from __future__ import annotations

import json
from pathlib import Path

import accuracy
import pytest

from narwhal.profiles import PrefillModel


def _line(**fields: object) -> str:
    entry = {
        "ts": 100.0,
        "level": "info",
        "logger": "narwhal.request",
        "message": "request finished",
        "event": "request",
        "outcome": "ok",
        "attempts": 1,
        "duration_s": 2.0,
        "prompt_tokens": 100,
        "projected_ttft_s": 0.2,
        "observed_ttft_s": 0.25,
        "projected_in_domain": True,
    }
    entry.update(fields)
    return json.dumps(entry)


def test_request_lines_keep_only_request_events() -> None:
    lines = [
        "not json at all",
        '{"broken": ',
        json.dumps({"event": "verdict", "ts": 1.0}),
        _line(),
        "[1, 2]",
    ]
    assert [e["event"] for e in accuracy.request_lines(lines)] == ["request"]


def test_predictions_need_both_times_and_sort_by_arrival() -> None:
    entries = accuracy.request_lines(
        [
            _line(ts=10.0, duration_s=1.0),
            _line(ts=5.0, duration_s=3.0, projected_in_domain=False, attempts=2),
            _line(projected_ttft_s=None, outcome="ttft_budget"),
            _line(observed_ttft_s=None),
        ]
    )
    preds = accuracy.predictions(entries)
    assert [p.arrival for p in preds] == [2.0, 9.0]
    assert preds[0].in_domain is False
    assert preds[0].attempts == 2
    assert preds[1].projected_s == 0.2
    assert preds[1].observed_s == 0.25


def test_error_stats() -> None:
    # Errors: +0.1 on 0.5 (20 %), -0.1 on 1.0 (10 %), 0 on 0.2, +0.2 on 0.4 (50 %).
    stats = accuracy.error_stats([0.6, 0.9, 0.2, 0.6], [0.5, 1.0, 0.2, 0.4])
    assert stats["n"] == 4
    assert stats["mape"] == pytest.approx((0.2 + 0.1 + 0.0 + 0.5) / 4)
    assert stats["bias_ms"] == pytest.approx((100 - 100 + 0 + 200) / 4)
    assert stats["abs_error_ms"]["p50"] == pytest.approx(100.0)
    assert stats["rel_error_p90"] == pytest.approx(0.41)  # between 20 % and 50 %
    assert stats["observed_ms"]["n"] == 4
    # Overruns -100, +100, 0, -200 ms; ratios 0.83, 1.11, 1.0, 0.67.
    assert stats["overrun_ms_p90"] == pytest.approx(70.0)
    assert stats["ratio_p90"] == pytest.approx(1.078, abs=1e-3)
    assert accuracy.error_stats([], []) == {"n": 0}


def test_levels_by_arrival_in_model_time() -> None:
    bounds = [("load_0.3", 0.0, 10.0), ("load_0.6", 10.0, 20.0)]
    preds = [
        accuracy.Prediction(1000.0 + wall, 0.1, 0.1, True, 10, 1)
        for wall in (-1.0, 0.0, 19.9, 20.0, 39.9, 40.0)
    ]
    # Speed 0.5: 20 wall seconds are 10 model seconds.
    grouped = accuracy.by_level(preds, bounds, t0_wall=1000.0, speed=0.5)
    assert [p.arrival - 1000.0 for p in grouped["load_0.3"]] == pytest.approx([0.0, 19.9])
    assert [p.arrival - 1000.0 for p in grouped["load_0.6"]] == pytest.approx([20.0, 39.9])


def test_summarize_level_splits_by_domain_and_attempt_in_model_time() -> None:
    preds = [
        accuracy.Prediction(0.0, 0.2, 0.4, True, 10, 1, prefill_s=0.3),
        accuracy.Prediction(0.0, 0.2, 0.2, False, 9000, 1),
        accuracy.Prediction(0.0, 0.2, 0.8, True, 10, 2),
    ]
    out = accuracy.summarize_level(preds, speed=0.5)
    assert [out[k]["n"] for k in ("all", "first_attempt", "in_domain", "out_of_domain")] == [
        3,
        2,
        2,
        1,
    ]
    # Wall 0.2 s at speed 0.5 is 100 ms of model time.
    assert out["out_of_domain"]["projected_ms"]["p50"] == 100.0
    assert out["observed_prefill_ms"]["mean"] == 150.0
    assert out["observed_after_prefill_ms"]["mean"] == 50.0
    # By prompt size, in admission's error bands.
    by_size = out["by_prompt_tokens"]
    assert {label: a["n"] for label, a in by_size.items()} == {"0-127": 2, "8192-16383": 1}
    assert by_size["0-127"]["overrun_ms_p90"] == pytest.approx(280.0)
    # Without the projection's wait logged, a request is in neither of the wait splits.
    assert (out["backlog"]["n"], out["no_backlog"]["n"]) == (0, 0)


def test_summarize_level_splits_by_backlog() -> None:
    preds = [
        accuracy.Prediction(0.0, 0.1, 0.2, True, 10, 1, wait_s=0.0),
        accuracy.Prediction(0.0, 0.3, 0.35, True, 10, 1, wait_s=0.2),
        accuracy.Prediction(0.0, 0.4, 0.44, True, 5000, 1, wait_s=0.0),
    ]
    out = accuracy.summarize_level(preds, speed=1.0)
    assert (out["backlog"]["n"], out["no_backlog"]["n"]) == (1, 2)
    idle = out["by_prompt_tokens_no_backlog"]
    assert {label: a["n"] for label, a in idle.items()} == {"0-127": 1, "4096-8191": 1}
    assert out["by_prompt_tokens"]["0-127"]["n"] == 2


def test_the_band_table_lists_each_size_per_level() -> None:
    preds = [
        accuracy.Prediction(0.0, 0.1, 0.2, True, 10, 1),
        accuracy.Prediction(0.0, 0.4, 0.44, True, 5000, 1),
    ]
    levels = [
        {"load": 0.3, "accuracy": accuracy.summarize_level(preds, speed=1.0)},
        {"load": 0.6, "accuracy": accuracy.summarize_level(preds[:1], speed=1.0)},
    ]
    rows = accuracy.band_table({"result": {"levels": levels}}).splitlines()
    assert rows[2:] == [
        "| 0-127 | 1 / 50.0 % / 100.0 / 2.0 | 1 / 50.0 % / 100.0 / 2.0 |",
        "| 4096-8191 | 1 / 9.1 % / 40.0 / 1.1 | 0 |",
    ]


def test_parse_mix() -> None:
    assert accuracy.parse_mix("code:0.75,conv:0.25") == (("code", 0.75), ("conv", 0.25))
    with pytest.raises(ValueError, match=r"unknown trace 'chat'"):
        accuracy.parse_mix("chat:1")


def test_the_cached_law_is_judged_against_pricing_whole_prompts() -> None:
    model = PrefillModel(
        a_s=0.01, b_s_per_token=1e-5, c_s_per_token2=0.0, min_tokens=1, max_tokens=2000
    )
    samples = [
        # Nothing cached: both prices are the curve, 20 ms; observed 25 ms.
        accuracy.CachedSample(prompt_tokens=1000, cached_tokens=0, observed_s=0.025),
        # A quarter cached: the law 17.5 ms, observed 17.5 ms; whole 20 ms.
        accuracy.CachedSample(prompt_tokens=1000, cached_tokens=250, observed_s=0.0175),
        # Most of it cached, outside the measured domain: the law 12 ms, whole 40 ms.
        accuracy.CachedSample(prompt_tokens=3000, cached_tokens=2800, observed_s=0.012),
    ]
    result = accuracy.law_accuracy(samples, model, speed=2.0)
    assert result["n"] == 3
    assert result["cached_token_share"] == round(3050 / 5000, 4)
    law, whole = result["all"]["law"], result["all"]["uncached_price"]
    assert law["mape"] == pytest.approx((0.2 + 0.0 + 0.0) / 3, abs=1e-4)
    assert whole["mape"] == pytest.approx((0.2 + 2.5 / 17.5 + 28 / 12) / 3, abs=1e-4)
    # Model time: wall x speed.
    assert law["bias_ms"] == pytest.approx(-10 / 3, abs=0.01)
    assert result["in_domain"]["law"]["n"] == 2
    bands = result["by_cached_share"]
    assert {name: cell["law"]["n"] for name, cell in bands.items()} == {
        "none": 1,
        "under_half": 1,
        "half_or_more": 1,
    }
    assert bands["half_or_more"]["uncached_price"]["mape"] == pytest.approx(28 / 12, abs=1e-4)
    doc = {"result": {"accuracy": result}}
    table = accuracy.cached_table(doc).splitlines()
    assert table[2].startswith("| all | 3 | 6.7 % | ")


def test_a_request_log_summary_splits_the_paths_and_sums_the_cached_shares(tmp_path: Path) -> None:
    # At speed 0.5 a wall second is half a model second: errors in model ms.
    log = tmp_path / "narwhal.log"
    lines = [
        _line(prefill_engine="p0", cached_tokens=40, engine_cached_tokens=50),
        _line(prefill_engine=None, decode_engine="d1", cached_tokens=80, observed_ttft_s=0.4),
        _line(outcome="ttft_budget", observed_ttft_s=None, projected_ttft_s=0.9, prompt_tokens=7),
        "not a request line",
    ]
    log.write_text("\n".join(lines) + "\n")
    summary = accuracy.request_log_summary(log, speed=0.5)
    assert summary["outcomes"] == {"ok": 2, "ttft_budget": 1}
    pair, local = summary["accuracy"]["pair"], summary["accuracy"]["local_prefill"]
    assert (pair["n"], local["n"], summary["accuracy"]["all"]["n"]) == (1, 1, 2)
    assert pair["bias_ms"] == pytest.approx(-25.0)
    assert local["bias_ms"] == pytest.approx(-100.0)
    # Narwhal's estimate over the served prompts; the engines' over the lines that say.
    assert summary["cached_share"] == {"narwhal": 0.6, "engine": 0.5}
