"""Projected vs observed TTFT, recorded per request (issue 8 part 3).

Predictive admission's quote for the path a request took is kept on its record and
logged with the TTFT the client saw, so prediction accuracy can be measured from the
logs and the narwhal_ttft_prediction_error_ratio histogram.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest

from narwhal.sim import SimTiming
from narwhal.sim._core import idle_prefill_s

from .conftest import MODEL, Stack, StartStack
from .test_failures import settled
from .test_predictive import SPEED, predictive_stack

PROMPT_TOKENS = 2000


async def served_line(
    stack: Stack, caplog: pytest.LogCaptureFixture, status: int, **body: Any
) -> dict[str, Any]:
    """Send one completion, wait until it has left the router, return its log line."""
    with caplog.at_level(logging.INFO, logger="narwhal.request"):
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.post(
                f"{stack.url}/v1/completions",
                json={"model": MODEL, "prompt": [5] * PROMPT_TOKENS, "max_tokens": 4, **body},
            )
        assert response.status_code == status
        await settled(stack)
    (line,) = [
        r.__dict__
        for r in caplog.records
        if r.name == "narwhal.request" and r.__dict__.get("event") == "request"
    ]
    return line


async def error_samples(stack: Stack) -> float:
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(f"{stack.admin_url}/metrics")).text
    for line in text.splitlines():
        if line.startswith("narwhal_ttft_prediction_error_ratio_count"):
            return float(line.split()[-1])
    raise AssertionError("no narwhal_ttft_prediction_error_ratio_count in /metrics")


async def test_a_served_stream_records_its_projected_and_observed_ttft(
    start_stack: StartStack, caplog: pytest.LogCaptureFixture
) -> None:
    stack = await predictive_stack(start_stack, ttft_s=2.0)
    line = await served_line(stack, caplog, 200, stream=True)
    assert line["outcome"] == "ok"
    assert line["prompt_tokens"] == PROMPT_TOKENS
    # The quote of an idle fleet is the profile itself: prefill + handoff + first step.
    timing = SimTiming()
    prefill_s = idle_prefill_s(timing, PROMPT_TOKENS) / SPEED
    expected = (
        prefill_s
        + timing.kv_transfer_s(PROMPT_TOKENS) / SPEED
        + timing.decode_step_s(PROMPT_TOKENS, 1) / SPEED
    )
    assert line["projected_ttft_s"] == pytest.approx(expected, abs=1e-6)
    assert line["projected_wait_s"] == 0.0  # nothing queued, no decode lag, KV to spare
    assert line["projected_in_domain"] is True
    # The simulator sleeps at least the law's prefill before the first token.
    assert prefill_s <= line["prefill_s"] <= line["observed_ttft_s"] <= line["duration_s"]
    assert await error_samples(stack) == 1


async def test_a_non_streaming_response_observes_its_first_token(
    start_stack: StartStack, caplog: pytest.LogCaptureFixture
) -> None:
    # Its decode leg streams to the router (manual 6), which sees the first token even
    # though the client sees only the whole answer.
    stack = await predictive_stack(start_stack, ttft_s=2.0)
    line = await served_line(stack, caplog, 200)
    assert line["projected_ttft_s"] > 0
    assert 0 < line["observed_ttft_s"] <= line["duration_s"]
    assert await error_samples(stack) == 1


async def test_a_refused_request_records_the_projection_that_refused_it(
    start_stack: StartStack, caplog: pytest.LogCaptureFixture
) -> None:
    # 2000 tokens take ~50 ms at speed 1, ~2.5 ms at speed 20: above a 2 ms target.
    stack = await predictive_stack(start_stack, ttft_s=0.002)
    line = await served_line(stack, caplog, 429, stream=True)
    assert line["outcome"] == "prompt_exceeds_ttft_target"
    # The cheapest path's quote, as an admitted request's: over the 2 ms target on an
    # idle fleet, so none of it is backlog.
    assert line["projected_ttft_s"] > 0.002
    assert line["projected_wait_s"] == 0.0
    assert line["projected_in_domain"] is True
    # Nothing was served, so nothing was observed, nor compared with the projection.
    assert line["observed_ttft_s"] is None
    assert line["prefill_s"] is None
    assert await error_samples(stack) == 0


async def test_open_admission_observes_without_projecting(
    start_stack: StartStack, caplog: pytest.LogCaptureFixture
) -> None:
    stack = await start_stack(speed=SPEED)
    line = await served_line(stack, caplog, 200, stream=True)
    assert line["projected_ttft_s"] is None
    assert line["observed_ttft_s"] > 0
