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

from .conftest import MODEL, StartStack
from .test_failures import settled
from .test_predictive import SPEED, predictive_stack

PROMPT_TOKENS = 2000


def finished(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [
        r.__dict__
        for r in caplog.records
        if r.name == "narwhal.request" and r.__dict__.get("event") == "request"
    ]


async def complete(url: str, *, tokens: int = PROMPT_TOKENS, **body: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(
            f"{url}/v1/completions",
            json={"model": MODEL, "prompt": [5] * tokens, "max_tokens": 4, **body},
        )


def error_sample_count(text: str) -> float:
    for line in text.splitlines():
        if line.startswith("narwhal_ttft_prediction_error_ratio_count"):
            return float(line.split()[-1])
    raise AssertionError("no narwhal_ttft_prediction_error_ratio_count in /metrics")


async def metrics_text(url: str) -> str:
    async with httpx.AsyncClient(timeout=10) as client:
        return (await client.get(f"{url}/metrics")).text


async def test_a_served_stream_records_its_projected_and_observed_ttft(
    start_stack: StartStack, caplog: pytest.LogCaptureFixture
) -> None:
    stack = await predictive_stack(start_stack, ttft_s=2.0)
    with caplog.at_level(logging.INFO, logger="narwhal.request"):
        response = await complete(stack.url, stream=True)
        assert response.status_code == 200
        assert response.text.endswith("data: [DONE]\n\n")
        await settled(stack)
    (line,) = finished(caplog)
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
    assert line["projected_in_domain"] is True
    # The simulator sleeps at least the law's prefill before the first token.
    assert prefill_s <= line["prefill_s"] <= line["observed_ttft_s"] <= line["duration_s"]
    assert error_sample_count(await metrics_text(stack.url)) == 1


async def test_a_non_streaming_response_has_no_observable_first_token(
    start_stack: StartStack, caplog: pytest.LogCaptureFixture
) -> None:
    stack = await predictive_stack(start_stack, ttft_s=2.0)
    with caplog.at_level(logging.INFO, logger="narwhal.request"):
        assert (await complete(stack.url)).status_code == 200
        await settled(stack)
    (line,) = finished(caplog)
    assert line["projected_ttft_s"] > 0
    assert line["observed_ttft_s"] is None
    assert error_sample_count(await metrics_text(stack.url)) == 0


async def test_a_refused_request_has_neither(
    start_stack: StartStack, caplog: pytest.LogCaptureFixture
) -> None:
    stack = await predictive_stack(start_stack, ttft_s=0.002)
    with caplog.at_level(logging.INFO, logger="narwhal.request"):
        response = await complete(stack.url, tokens=4000, stream=True)
        assert response.status_code == 429
        await settled(stack)
    (line,) = finished(caplog)
    assert line["outcome"] == "prompt_exceeds_ttft_target"
    assert line["projected_ttft_s"] is None
    assert line["observed_ttft_s"] is None
    assert line["projected_in_domain"] is None
    assert line["prefill_s"] is None


async def test_open_admission_observes_without_projecting(
    start_stack: StartStack, caplog: pytest.LogCaptureFixture
) -> None:
    stack = await start_stack(speed=SPEED)
    with caplog.at_level(logging.INFO, logger="narwhal.request"):
        assert (await complete(stack.url, stream=True)).status_code == 200
        await settled(stack)
    (line,) = finished(caplog)
    assert line["projected_ttft_s"] is None
    assert line["observed_ttft_s"] > 0
