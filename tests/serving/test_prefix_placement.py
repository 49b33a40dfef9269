"""Cache-aware placement through the request path, on simulated vLLM engines with the
approximate index (docs/design.md#prefix-caching): a prompt goes where its prefix ran
when cache.affinity says so, exactly as before at 0, and a decode engine that holds
most of a prompt prefills it itself."""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import httpx
import pytest
import trio

from narwhal.admission import cached_prefill_s
from narwhal.sim import SimEngineSpec

from ..support import wait_for
from .conftest import MODEL, Stack, StartStack
from .test_predictive import LawDecode, LawPrefill, LawProfiles

SYSTEM = "You are a careful assistant. " * 80  # ~2300 chars: nine 256-char text blocks
# The decode engine, which pulled the prefix, never prefills it itself.
NOT_LOCAL = {"local_prefill_share": 1.0}


async def complete(stack: Stack, prompt: str, **extra: Any) -> httpx.Response:
    async with stack.client() as client:
        response = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra}
        )
    assert response.status_code == 200, response.text
    return response


def requests_by_phase(stack: Stack) -> list[dict[str, int]]:
    return [engine.state()["counters"]["completed"] for engine in stack.fleet]


async def prefill_engine_of(stack: Stack, prompt: str) -> str:
    before = requests_by_phase(stack)
    await complete(stack, prompt)
    after = requests_by_phase(stack)
    ran = [
        stack.config.engines[i].id
        for i, (b, a) in enumerate(zip(before, after, strict=True))
        if a.get("prefill", 0) > b.get("prefill", 0)
    ]
    assert len(ran) == 1, (before, after)
    return ran[0]


async def second_prefill_engine(stack: Stack) -> str:
    """Where a prompt goes whose prefix ran on p1 while p0 was drained."""
    p0 = stack.ctx.fleet.get("p0")
    assert p0 is not None
    p0.operator_drain()
    assert await prefill_engine_of(stack, SYSTEM + "First question?") == "p1"
    p0.operator_undrain()
    return await prefill_engine_of(stack, SYSTEM + "Second question?")


@pytest.mark.parametrize(("affinity", "second"), [(1.0, "p1"), (0.0, "p0")])
async def test_a_shared_prefix_goes_back_to_the_engine_it_ran_on(
    start_stack: StartStack, affinity: float, second: str
) -> None:
    cache = {"affinity": affinity, **NOT_LOCAL}
    stack = await start_stack(["prefill", "prefill", "decode"], cache=cache)
    # Both idle: without the cache the tie goes to p0, by id; with it the prefix wins.
    assert await second_prefill_engine(stack) == second
    metrics = stack.ctx.metrics.registry
    cached = metrics.get_sample_value("narwhal_cached_prompt_tokens_total", {"engine": "p1"})
    assert (cached or 0) > 0 if affinity else cached is None


async def test_no_approximate_index_places_as_before(start_stack: StartStack) -> None:
    cache = {"approximate_ttl_s": 0, **NOT_LOCAL}
    stack = await start_stack(["prefill", "prefill", "decode"], cache=cache)
    assert await second_prefill_engine(stack) == "p0"


def sim_with_cache() -> dict[str, Any]:
    return {"spec": SimEngineSpec(prefix_caching=True)}


@pytest.mark.parametrize(("share", "local"), [(0.5, True), (1.0, False)])
async def test_a_decode_engine_holding_most_of_the_prompt_prefills_it_itself(
    start_stack: StartStack, caplog: pytest.LogCaptureFixture, share: float, local: bool
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.request")
    stack = await start_stack(cache={"local_prefill_share": share}, sim=sim_with_cache())
    prompt = SYSTEM + "A question?"
    await complete(stack, prompt)  # p0 prefills, d1 pulls the KV: both learn it
    before = requests_by_phase(stack)
    await complete(stack, prompt + " And one more.")
    after = requests_by_phase(stack)
    prefills = after[0].get("prefill", 0) - before[0].get("prefill", 0)
    assert prefills == (0 if local else 1)
    skipped = stack.ctx.metrics.registry.get_sample_value(
        "narwhal_local_prefills_total", {"engine": "d1"}
    )
    assert (skipped or 0) == (1 if local else 0)
    # The decode engine's own prefix cache served most of it, as priced.
    hits = stack.fleet[1].state()["prefix_cache"]["hits_tokens"]
    assert hits > 0 if local else True
    last = [r for r in caplog.records if getattr(r, "event", None) == "request"][-1]
    priced = last.cached_tokens  # type: ignore[attr-defined]
    assert (last.prefill_engine, last.decode_engine) == (None if local else "p0", "d1")  # type: ignore[attr-defined]
    # Either engine ran the first turn's prompt: the one that prefills holds most of it.
    assert priced >= 0.5 * last.prompt_tokens  # type: ignore[attr-defined]


async def test_a_local_prefill_is_projected_as_the_path_it_takes(
    start_stack: StartStack, caplog: pytest.LogCaptureFixture
) -> None:
    # Priced by the law: the decode engine's own cached prefill, whose step makes the first
    # token (d1 decodes nothing else), not the pair's path the admission quote priced (a
    # prefill, the whole prompt's handoff, then a decode step).
    caplog.set_level(logging.INFO, logger="narwhal.request")
    profiles = LawProfiles(speed=20.0)
    stack = await start_stack(
        serving={"admission": "predictive"},
        slo={"ttft_s": 5.0, "tpot_s": 0.05},
        cache={"local_prefill_share": 0.5},
        sim=sim_with_cache(),
        profiles=profiles,
    )
    prompt = SYSTEM + "A question?"
    await complete(stack, prompt)
    await complete(stack, prompt + " And one more.")
    first, second = [r.__dict__ for r in caplog.records if r.__dict__.get("event") == "request"]
    assert (first["prefill_engine"], second["prefill_engine"]) == ("p0", None)
    tokens, cached = second["prompt_tokens"], second["cached_tokens"]
    law = LawPrefill(profiles.timing, profiles.speed)
    local = cached_prefill_s(law, tokens, cached)
    # The wait is the decode engine's recent lag to a first token beyond its model.
    idle = second["projected_ttft_s"] - second["projected_wait_s"]
    assert idle == pytest.approx(local, rel=0.05, abs=1e-5)
    step = LawDecode(profiles.timing, profiles.speed).interval_s(1, tokens)
    assert local < profiles.handoff_s(tokens) + law.prefill_s(tokens) + step


@pytest.mark.parametrize(
    ("share", "computed", "extra"),
    [(1.0, "p0", {}), (0.5, "d1", {}), (0.5, "d1", {"echo": True})],
)
async def test_the_engine_that_computes_the_prompt_reports_what_it_found_cached(
    start_stack: StartStack,
    caplog: pytest.LogCaptureFixture,
    share: float,
    computed: str,
    extra: dict[str, Any],
) -> None:
    # vLLM with --enable-prompt-tokens-details: the prefill leg's answer (p0), or the
    # usage chunk of the decode engine's stream when it prefills itself (d1; with echo,
    # its whole answer: that leg is not streamed), says how much of the prompt it found
    # cached; logged beside Narwhal's own estimate.
    caplog.set_level(logging.INFO, logger="narwhal.request")
    sim = {"spec": SimEngineSpec(prefix_caching=True, prompt_tokens_details=True)}
    stack = await start_stack(cache={"local_prefill_share": share}, sim=sim)
    prompt = SYSTEM + "A question?"
    await complete(stack, prompt)
    await complete(stack, prompt + " And one more.", **extra)
    first, second = [r.__dict__ for r in caplog.records if r.__dict__.get("event") == "request"]
    assert first["engine_cached_tokens"] == 0  # p0 had seen nothing
    assert (second["prefill_engine"] or second["decode_engine"]) == computed
    index = stack.fleet[0 if computed == "p0" else 1].state()["prefix_cache"]
    reported = second["engine_cached_tokens"]
    # The engine's count: the prompt's full blocks it held, which its own counters
    # show. Narwhal's estimate, learnt from the prompts it routed, agrees within one of
    # the engine's 16-token blocks: it counts blocks of text, sized in tokens.
    assert 0 < reported == index["hits_tokens"] <= second["prompt_tokens"]
    assert second["cached_tokens"] == pytest.approx(reported, abs=16)
    counted = stack.ctx.metrics.registry.get_sample_value(
        "narwhal_engine_cached_prompt_tokens_total", {"engine": computed}
    )
    assert counted == reported


# Model seconds per wall second: slow enough that a prefill's booking can be read while
# it lasts.
SLOW = 0.02


async def slow_stack(start_stack: StartStack, profiles: LawProfiles, share: float) -> Stack:
    return await start_stack(
        speed=SLOW,
        serving={"admission": "predictive"},
        slo={"ttft_s": 30.0, "tpot_s": 5.0},
        cache={"local_prefill_share": share},
        sim=sim_with_cache(),
        profiles=profiles,
    )


@pytest.mark.parametrize(
    ("share", "engine", "leg", "whole"),
    [(1.0, "p0", "prefill", True), (0.5, "d1", "aggregate", False)],
)
async def test_a_prompt_is_booked_on_the_engine_that_computes_it_until_it_has(
    start_stack: StartStack,
    caplog: pytest.LogCaptureFixture,
    share: float,
    engine: str,
    leg: str,
    whole: bool,
) -> None:
    # Whichever engine computes the prompt, the pair's prefill engine or a decode engine
    # that prefills it itself, its prefill backlog holds the prompt's price until it is
    # computed (the prefill leg's answer, the local prefill's first token), and nothing
    # after: the uncached rest's on the decode engine, whose own prefills were priced as
    # no wait at all, and the whole prompt's on the prefill engine.
    caplog.set_level(logging.INFO, logger="narwhal.request")
    profiles = LawProfiles(speed=SLOW)
    stack = await slow_stack(start_stack, profiles, share)
    prompt = SYSTEM + "A question?"
    await complete(stack, prompt)

    def booked() -> float:
        return stack.ctx.load_signals(trio.current_time()).backlog_s[engine]

    assert booked() == 0.0
    index = [spec.id for spec in stack.config.engines].index(engine)
    stack.fleet[index].set_faults(stall_before_first_token_s=1.0, leg=leg, count=1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(complete, stack, prompt + " And one more.")
        await wait_for(lambda: booked() > 0)
        seen = booked()
    assert booked() == 0.0
    last = [r.__dict__ for r in caplog.records if r.__dict__.get("event") == "request"][-1]
    assert (last["prefill_engine"] or last["decode_engine"]) == engine
    law = LawPrefill(profiles.timing, profiles.speed)
    tokens, cached = last["prompt_tokens"], last["cached_tokens"]
    assert cached > 0.5 * tokens
    rest = cached_prefill_s(law, tokens, cached)
    assert rest + 0.2 < law.prefill_s(tokens)
    if whole:
        assert rest + 0.2 < seen <= law.prefill_s(tokens) + 0.01
    else:
        assert seen <= rest + 0.01


async def test_a_local_prefill_read_whole_is_not_booked(start_stack: StartStack) -> None:
    # With echo the decode engine's leg is read whole: no first token would end its
    # booking, which would then stand overdue on the engine for the whole decode.
    stack = await slow_stack(start_stack, LawProfiles(speed=SLOW), 0.5)
    prompt = SYSTEM + "A question?"
    await complete(stack, prompt)
    stack.fleet[1].set_faults(stall_before_first_token_s=1.0, leg="aggregate", count=1)

    def legs() -> int:
        return int(stack.fleet[1].state()["counters"]["requests"].get("aggregate", 0))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(complete, stack, prompt + " And one more.", echo=True))
        await wait_for(lambda: legs() == 1)
        assert stack.ctx.load_signals(trio.current_time()).backlog_s["d1"] == 0.0
    served = stack.ctx.metrics.registry.get_sample_value(
        "narwhal_local_prefills_total", {"engine": "d1"}
    )
    assert served == 1
