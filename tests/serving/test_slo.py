"""SLO attainment: how a finished request counts, and the windowed tally (no I/O)."""

from __future__ import annotations

import httpx
import pytest

from narwhal.serving._slo import SloTally, slo_result

from ..support import open_sse
from .conftest import MODEL, StartStack
from .test_failures import post, settled

BODY = {"model": MODEL, "prompt": "hello there"}

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
        ("body_timeout", None, None, None),  # a body too slow to arrive: as a 413
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


async def test_the_daemon_reports_slo_attainment_with_refusals_as_misses(
    start_stack: StartStack,
) -> None:
    stack = await start_stack(serving={"max_connections": 1}, slo={"ttft_s": 0.3})
    body = {"max_tokens": 8, "stream": True}
    for _ in range(3):
        assert (await post(stack, body)).status_code == 200  # met
    stack.fleet[1].set_faults(stall_before_first_token_s=0.5, leg="decode", count=1)
    assert (await post(stack, body)).status_code == 200  # missed: TTFT over 0.3 s
    stack.fleet[1].set_faults(stall_after_tokens=1, stall_s=1.0, leg="decode", count=1)
    async with open_sse(stack.url, "/v1/completions", {**BODY, **body}) as held:
        assert await held.event() is not None
        refused = await post(stack, body)
        assert refused.json()["error"]["code"] == "retained_ceiling"  # refused
        while await held.event() is not None:  # missed: a 1 s gap, TPOT over 50 ms
            pass
    async with httpx.AsyncClient(timeout=10) as client:
        bad = await client.post(f"{stack.url}/v1/completions", content=b"{")
    assert bad.status_code == 400  # the client's doing: not offered

    slo = (await settled(stack))["slo"]
    assert slo["counts"] == {"met": 3, "missed": 2, "refused": 1, "unmeasured": 0}
    assert (slo["attainment"], slo["meets_percentile"]) == (0.5, False)
    assert (slo["ttft_s"], slo["percentile"], slo["window_s"]) == (0.3, 0.9, 120.0)
    metrics = stack.ctx.metrics.render().decode()
    assert 'narwhal_slo_requests_total{result="refused"} 1.0' in metrics
    assert "narwhal_slo_attainment 0.5" in metrics
