"""SLO attainment: how a finished request counts, and the windowed tally (no I/O)."""

from __future__ import annotations

import pytest

from narwhal.serving._slo import SloTally, slo_result

TARGETS = {"ttft_target_s": 0.5, "tpot_target_s": 0.05}


@pytest.mark.parametrize(
    ("outcome", "ttft", "tpot", "expected"),
    [
        ("ok", 0.4, 0.04, "met"),
        ("ok", 0.5, 0.05, "met"),  # a target is met at equality
        ("ok", 0.51, 0.04, "missed"),
        ("ok", 0.4, 0.06, "missed"),
        ("ok", 0.4, None, "met"),  # one output token: no TPOT to miss
        ("ok", None, None, "unmeasured"),  # no first token seen (non-streaming)
        ("ttft_budget", None, None, "refused"),  # manual 7.6: refusals are misses
        ("queue_timeout", None, None, "refused"),
        ("retained_ceiling", None, None, "refused"),
        ("shutting_down", None, None, "refused"),
        ("expired", 0.3, None, "missed"),
        ("first_token_timeout", None, None, "missed"),
        ("engine_http_503", None, None, "missed"),
        ("internal_error", None, None, "missed"),
        ("invalid_json", None, None, None),  # the client's doing: not offered
        ("not_found", None, None, None),
        ("client_disconnected", 0.2, None, None),
        ("engine_rejected_request", None, None, None),
    ],
)
def test_how_a_finished_request_counts(
    outcome: str, ttft: float | None, tpot: float | None, expected: str | None
) -> None:
    assert slo_result(outcome, ttft_s=ttft, tpot_s=tpot, **TARGETS) == expected


def test_the_tally_counts_a_sliding_window_and_refusals_as_misses() -> None:
    tally = SloTally(window_s=10.0)
    assert tally.attainment(0.0) is None
    for _ in range(6):
        tally.record("met", 100.2)
    tally.record("missed", 101.0)
    tally.record("refused", 101.5)
    tally.record("unmeasured", 102.0)
    assert tally.counts(102.0) == {"met": 6, "missed": 1, "refused": 1, "unmeasured": 1}
    assert tally.attainment(102.0) == pytest.approx(6 / 8)
    # Ten seconds on, the first second's six hits have left the window.
    assert tally.counts(110.9)["met"] == 6
    assert tally.counts(111.0) == {"met": 0, "missed": 1, "refused": 1, "unmeasured": 1}
    assert tally.attainment(111.0) == 0.0
    assert tally.attainment(200.0) is None


def test_the_tally_memory_is_bounded_by_the_window() -> None:
    tally = SloTally(window_s=5.0)
    for i in range(10_000):
        tally.record("met", i * 0.01)  # 100 s at 100 requests a second
    assert len(tally._buckets) <= 6
    # Whole one-second buckets: seconds 94..99, a little over the 5 s window.
    assert tally.counts(99.99)["met"] == 600
