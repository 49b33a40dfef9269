"""Retries (manual 4.2): transient failures before visible output, a fresh prefill each
time, the failed engine excluded, a budget that runs out, never after output."""

from __future__ import annotations

import random

import pytest
import trio

from narwhal._errors import RETRYABLE_ENGINE_STATUSES, client_status_for_engine_status

from ..support import wait_for
from .conftest import Stack, StartStack
from .test_failures import post, settled, terminal_error

RETRYING = {"max_attempts": 2, "handoff_timeout_s": 5.0, "retry_base_s": 0.01, "retry_cap_s": 0.05}
PD4 = ["prefill", "prefill", "decode", "decode"]


def requests(stack: Stack, index: int, phase: str) -> int:
    """Legs of `phase` the engine saw, whatever their outcome (injected errors included)."""
    return sum(1 for o in stack.fleet[index].state()["outcomes"] if o["phase"] == phase)


async def test_prefill_failure_is_retried_on_another_prefill_engine(
    start_stack: StartStack,
) -> None:
    stack = await start_stack(PD4, serving=RETRYING)
    stack.fleet[0].set_faults(error_status=503, leg="prefill")
    response = await post(stack, {"max_tokens": 3, "stream": True})
    assert response.status_code == 200
    assert (requests(stack, 0, "prefill"), requests(stack, 1, "prefill")) == (1, 1)
    state = await settled(stack)
    assert state["retry_budget"]["spent_total"] == 1
    assert state["requests"]["in_flight"] == []


@pytest.mark.parametrize("leg", ["prefill", "decode"])
async def test_a_retry_goes_back_to_the_failed_engine_when_its_role_has_no_other(
    start_stack: StartStack, leg: str
) -> None:
    # 1P1D: the retry excluded the engine that failed and found no other, so one
    # transient 503 was refused as 503 no_engine_available with an engine still in
    # placement.
    stack = await start_stack(serving=RETRYING)
    index = 0 if leg == "prefill" else 1
    stack.fleet[index].set_faults(error_status=503, leg=leg, count=1)
    response = await post(stack, {"max_tokens": 3})
    assert response.status_code == 200, response.text
    assert requests(stack, index, leg) == 2
    state = await settled(stack)
    assert state["retry_budget"]["spent_total"] == 1


async def test_decode_failure_retries_the_pair_with_a_fresh_prefill(
    start_stack: StartStack,
) -> None:
    stack = await start_stack(PD4, serving=RETRYING)
    stack.fleet[2].set_faults(error_status=500, leg="decode")
    response = await post(stack, {"max_tokens": 3})  # non-streaming: nothing visible yet
    assert response.status_code == 200
    prefills = requests(stack, 0, "prefill") + requests(stack, 1, "prefill")
    assert prefills == 2  # the retry did not reuse the first handoff
    assert (requests(stack, 2, "decode"), requests(stack, 3, "decode")) == (1, 1)


async def test_client_errors_are_not_retried(start_stack: StartStack) -> None:
    stack = await start_stack(PD4, serving=RETRYING)
    stack.fleet[0].set_faults(error_status=400, leg="prefill")
    response = await post(stack, {"max_tokens": 3})
    assert response.status_code == 400
    assert requests(stack, 1, "prefill") == 0


async def test_no_retry_after_the_stream_is_committed(start_stack: StartStack) -> None:
    stack = await start_stack(PD4, serving=RETRYING)
    stack.fleet[2].set_faults(error_status=503, leg="decode")
    response = await post(stack, {"max_tokens": 3, "stream": True})
    assert terminal_error(response)["code"] == "engine_http_503"
    assert requests(stack, 3, "decode") == 0
    assert requests(stack, 0, "prefill") + requests(stack, 1, "prefill") == 1


async def test_attempts_are_capped(start_stack: StartStack) -> None:
    stack = await start_stack(PD4, serving=RETRYING)
    for handle in stack.fleet:
        handle.set_faults(error_status=503, leg="prefill")
    response = await post(stack, {"max_tokens": 3})
    assert response.status_code == 503
    assert requests(stack, 0, "prefill") + requests(stack, 1, "prefill") == 2


async def test_an_exhausted_budget_stops_retries(start_stack: StartStack) -> None:
    stack = await start_stack(PD4, serving={**RETRYING, "retry_budget": 1, "retry_replenish": 0.0})
    stack.fleet[0].set_faults(error_status=503, leg="prefill")
    stack.fleet[1].set_faults(error_status=503, leg="prefill")
    first = await post(stack, {"max_tokens": 3})
    second = await post(stack, {"max_tokens": 3})
    assert first.status_code == second.status_code == 503
    assert "retry budget exhausted" not in first.json()["error"]["message"]
    assert second.json()["error"]["message"].endswith("(retry budget exhausted)")
    assert requests(stack, 0, "prefill") + requests(stack, 1, "prefill") == 3
    state = await settled(stack)
    assert state["retry_budget"] == {
        "level": 0.0,
        "maximum": 1.0,
        "spent_total": 1,
        "denied_total": 1,
    }


class _LongestBackoff(random.Random):
    """Full jitter drawing its ceiling's whole length, every time."""

    def random(self) -> float:
        return 0.999


async def test_a_retry_that_cannot_start_before_the_deadline_spends_no_credit(
    start_stack: StartStack,
) -> None:
    # The backoff (~5 s) outlasts the request (1 s): the deadline answers, as it always
    # did, but the retry that could never start no longer spends a credit of the budget.
    serving = {**RETRYING, "handoff_timeout_s": 0.5, "retry_base_s": 5.0, "retry_cap_s": 5.0}
    stack = await start_stack(PD4, serving={**serving, "request_timeout_s": 1.0})
    stack.ctx.rng = _LongestBackoff()
    for index in (0, 1):
        stack.fleet[index].set_faults(error_status=503, leg="prefill")
    response = await post(stack, {"max_tokens": 3})
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "expired"
    assert requests(stack, 0, "prefill") + requests(stack, 1, "prefill") == 1
    state = await settled(stack)
    assert state["retry_budget"]["spent_total"] == 0
    assert "narwhal_retries_total{" not in stack.ctx.metrics.render().decode()


async def test_expired_handoff_is_redone_with_a_fresh_prefill(start_stack: StartStack) -> None:
    stack = await start_stack(
        ["prefill", "decode"],
        serving={**RETRYING, "decode_concurrency": 1, "handoff_timeout_s": 0.3},
    )
    stack.fleet[1].set_faults(stall_after_tokens=1, stall_s=0.45, leg="decode", count=1)
    # The first request holds the only decode slot for ~0.45 s; the second request's
    # handoff waits for it past the 0.3 s cap, so it is redone instead of decoding
    # against possibly released blocks.
    async with trio.open_nursery() as nursery:
        nursery.start_soon(post, stack, {"max_tokens": 3, "stream": True})
        await wait_for(lambda: stack.ctx.fleet.get("d1").load.decode_active == 1)  # type: ignore[union-attr]
        response = await post(stack, {"max_tokens": 3})
    assert response.status_code == 200
    assert requests(stack, 0, "prefill") == 3
    metrics = stack.ctx.metrics.render().decode()
    assert 'narwhal_retries_total{code="handoff_expired"} 1.0' in metrics


async def test_the_wait_for_a_prefill_slot_is_not_handoff_age(start_stack: StartStack) -> None:
    # Manual 4.2: the handoff's age counts from the prefill HTTP request. Three requests
    # share one prefill slot, each prefill takes 0.35 s of a 0.5 s cap and decode slots
    # are free: the third waits 0.7 s for its slot, which no KV existed during. Counted
    # from arrival, two handoffs "expired" and each redo added prefill load.
    stack = await start_stack(
        ["prefill", "decode"],
        serving={"prefill_concurrency": 1, "decode_concurrency": 8, "handoff_timeout_s": 0.5},
    )
    stack.fleet[0].set_faults(stall_before_first_token_s=0.35, leg="prefill")
    statuses: list[int] = []

    async def one() -> None:
        statuses.append((await post(stack, {"max_tokens": 3})).status_code)

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(one)
    assert statuses == [200, 200, 200]
    assert requests(stack, 0, "prefill") == 3
    assert "handoff_expired" not in stack.ctx.metrics.render().decode()


@pytest.mark.parametrize("status", sorted(RETRYABLE_ENGINE_STATUSES))
async def test_each_transient_engine_status_is_retried(
    start_stack: StartStack, status: int
) -> None:
    # Manual 4.2's list: 408, 429, 500, 502, 503, 504.
    stack = await start_stack(PD4, serving=RETRYING)
    stack.fleet[0].set_faults(error_status=status, leg="prefill")
    response = await post(stack, {"max_tokens": 3})
    assert response.status_code == 200
    assert (requests(stack, 0, "prefill"), requests(stack, 1, "prefill")) == (1, 1)


@pytest.mark.parametrize("status", [400, 404, 409, 422, 501])  # 401/403: test_api_key
async def test_other_engine_statuses_are_not_retried(start_stack: StartStack, status: int) -> None:
    stack = await start_stack(PD4, serving=RETRYING)
    stack.fleet[0].set_faults(error_status=status, leg="prefill")
    response = await post(stack, {"max_tokens": 3})
    assert response.status_code == client_status_for_engine_status(status)
    assert requests(stack, 1, "prefill") == 0


async def test_an_unreachable_engine_is_retried(start_stack: StartStack) -> None:
    stack = await start_stack(PD4, serving=RETRYING)
    stack.fleet[0].set_faults(down_s=30.0)
    response = await post(stack, {"max_tokens": 3})
    assert response.status_code == 200
    assert requests(stack, 1, "prefill") == 1
    assert 'code="engine_unreachable"' in stack.ctx.metrics.render().decode()


async def test_a_connection_lost_mid_leg_is_retried(start_stack: StartStack) -> None:
    stack = await start_stack(PD4, serving=RETRYING)
    stack.fleet[2].set_faults(crash_after_tokens=1, leg="decode")
    response = await post(stack, {"max_tokens": 3})  # non-streaming: nothing visible yet
    assert response.status_code == 200
    assert (requests(stack, 2, "decode"), requests(stack, 3, "decode")) == (1, 1)
    assert 'code="engine_connection_lost"' in stack.ctx.metrics.render().decode()
