"""Streamed legs are accounted in tokens, not SSE events.

An engine event can carry several tokens (vLLM merges deltas when its API server falls
behind, speculative decoding accepts several a step, SGLang packs --stream-interval), and
one read can bring several events when the router falls behind. The router asks the
engine for its final usage chunk, keeps it from clients that did not ask for it, and uses
the reported count for the decode intervals, TPOT, KV turnover and the engine's
tokens-per-event estimate that running streams' KV grows by.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import httpx
import pytest
import trio

from narwhal._errors import EngineFailed
from narwhal.fleet import EngineLoad, EngineState, Share
from narwhal.fleet._engine import PACKING_MAX
from narwhal.serving import DecodeGaps
from narwhal.serving._decisions import Decisions
from narwhal.serving._legs import KvGrowth
from narwhal.serving._meter import GapLoad, usage_report
from narwhal.sim import SimEngineSpec

from ..support import GapRecorder, claims
from .conftest import MODEL, Stack, StartStack
from .test_failures import settled
from .test_predictive import predictive_stack

INTERVAL = 4


async def packing_stack(
    start_stack: StartStack, interval: int = INTERVAL, *, vllm_version: str | None = None
) -> Stack:
    """A P/D pair at real speed whose decode engine sends `interval` tokens an event."""
    spec = SimEngineSpec(stream_interval=interval)
    if vllm_version is not None:
        spec = attrs.evolve(spec, vllm_version=vllm_version)
    return await start_stack(
        ["prefill", "decode"],
        speed=1.0,
        sim={"spec": spec},
        slo={"ttft_s": 5.0},  # the KV turnover window: long enough to read it back whole
    )


async def stream(stack: Stack, **extra: object) -> list[dict[str, Any]]:
    body = {"model": MODEL, "prompt": [5] * 500, "max_tokens": 100, "stream": True, **extra}
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream("POST", f"{stack.url}/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        lines = [line async for line in response.aiter_lines()]
    assert lines[-2:] == ["data: [DONE]", ""]
    return [json.loads(line[len("data: ") :]) for line in lines if line.startswith("data: {")]


async def test_the_usage_chunk_reaches_only_clients_that_asked_for_it(
    start_stack: StartStack,
) -> None:
    # Pinned to vLLM 0.29, whose include_usage is true once stream_options is there: the
    # router passes `{}` on as is (on 0.32, where it means false, no usage chunk comes).
    stack = await packing_stack(start_stack, vllm_version="0.29.0")
    # No stream_options: the router asked for usage, so it keeps the chunk to itself.
    chunks = await stream(stack)
    assert all(chunk["choices"] for chunk in chunks)
    assert sum(len(c["choices"][0]["text"].split()) for c in chunks) == 100
    # vLLM's default: stream_options present means include_usage; relayed once, intact.
    chunks = await stream(stack, stream_options={})
    *tokens, usage = chunks
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 500, "total_tokens": 600, "completion_tokens": 100}
    assert all(chunk["choices"] for chunk in tokens)
    # Asked not to: nothing, and no continuous usage either.
    chunks = await stream(
        stack, stream_options={"include_usage": False, "continuous_usage_stats": True}
    )
    assert all(chunk["choices"] and chunk["usage"] is None for chunk in chunks)


async def test_an_empty_stream_options_gets_no_usage_chunk_from_vllm_0_32(
    start_stack: StartStack,
) -> None:
    # vLLM 0.32's include_usage defaults to false: the client gets no usage chunk, as from
    # the engine itself, and the router still counts the tokens from the chunk it asked for.
    stack = await packing_stack(start_stack)
    decode = stack.ctx.fleet.get("d1")
    assert decode is not None
    chunks = await stream(stack, stream_options={})
    assert all(chunk["choices"] for chunk in chunks)
    assert len(chunks) < 40  # about 100 / 4 events
    await settled(stack)
    freed = stack.ctx.kv_turnover.current(decode, trio.current_time())
    assert 570 < freed <= 600


async def test_packed_events_count_as_their_tokens(start_stack: StartStack) -> None:
    stack = await packing_stack(start_stack)
    recorder = GapRecorder()
    stack.ctx.signals = recorder
    decode = stack.ctx.fleet.get("d1")
    assert decode is not None
    chunks = await stream(stack)
    assert len(chunks) < 40  # about 100 / 4 events
    # Intervals are per token: the simulator's step at one active stream (6 ms, 5 %
    # noise), not the 24 ms between 4-token events.
    (gaps,) = recorder.summaries
    assert 0.0045 < gaps.median_s < 0.009
    # The engine's tokens per event moved towards 4 (one stream, weight 0.2).
    assert 1.4 < decode.tokens_per_event < 1.7
    state = await settled(stack)
    assert state["engines"][1]["decode"]["tokens_per_event"] == round(decode.tokens_per_event, 3)
    # The turnover counts the 100 generated tokens the engine reported, not the ~26
    # events, plus the prompt. Read as it was set: by now (a loaded box can take seconds
    # to get here) it has decayed.
    turnover = stack.ctx.kv_turnover
    freed = turnover.current(decode, turnover.at[decode])
    assert 570 < freed <= 600


class GapSummaries:
    """A LegObserver in front of recovery that keeps what each decode leg's `gaps` said."""

    def __init__(self, stack: Stack) -> None:
        self.inner = stack.ctx.leg_observer
        self.seen: list[DecodeGaps | None] = []
        stack.ctx.leg_observer = self

    def leg_ok(self, engine: EngineState, phase: str, duration_s: float, **kw: Any) -> None:
        if phase == "decode":
            self.seen.append(kw.get("gaps"))
        self.inner.leg_ok(engine, phase, duration_s, **kw)

    def leg_failed(self, engine: EngineState, phase: str, failure: EngineFailed) -> None:
        self.inner.leg_failed(engine, phase, failure)


async def test_a_decode_legs_gap_summary_is_per_token_with_the_load_it_ran_at(
    start_stack: StartStack,
) -> None:
    # What a latency residual judges: the same per-token intervals the correction gets,
    # and the engine's load while they were measured (this stream alone, its 500-token
    # prompt plus what it had generated), not the load as the leg ended.
    stack = await packing_stack(start_stack)
    recorder = GapRecorder()
    stack.ctx.signals = recorder
    summaries = GapSummaries(stack)
    await stream(stack)
    (summary,) = summaries.seen
    # The live decode correction and the controller are told the same summary, made once.
    assert recorder.summaries == [summary]
    assert summary is recorder.summaries[0]
    assert summary.count == summary.positive >= 20  # about 100 tokens in 4-token events
    assert 0.0045 < summary.median_s == summary.positive_median_s < 0.009
    assert summary.mean_active == summary.max_active == 1
    assert 500 < summary.mean_kv_tokens < summary.max_kv_tokens <= 600


def test_a_gap_summary_is_withheld_when_the_gaps_are_not_the_engines_alone() -> None:
    engine = EngineState.__new__(EngineState)
    engine.load = EngineLoad()
    engine._share = Share()  # one replica: the ledger is the engine's whole load
    claims(engine.load.decode, 2, 1000)
    load = GapLoad()
    load.add(engine, 3, 0.0)
    claims(engine.load.decode, 4, 2000)  # 6 streams, 3000 tokens
    load.add(engine, 1, 0.0)
    load.add(engine, 0, 0.0)  # a read past the stream's kept gaps adds nothing
    # Within a quarter of the gaps' time (4 x 10 ms): too few gaps after it to matter.
    load.longest_write_s = 0.0099
    gaps = [0.01, 0.03, 0.01, 0.01]
    summary = load.summary(gaps)
    assert summary == DecodeGaps(
        count=4,
        median_s=0.01,
        positive=4,
        positive_median_s=0.01,
        mean_active=3.0,
        mean_kv_tokens=1500.0,
        max_active=6,
        max_kv_tokens=3000,
    )
    assert load.alone(summary)
    # A write that blocked for a quarter of them: had it outlasted the stream, a quarter
    # of the gaps would be partly the client's.
    load.longest_write_s = 0.01
    assert not load.alone(summary)
    # A prefill leg on the engine meanwhile: its chunks shared the decode steps.
    load.longest_write_s = 0.0
    engine.load.prefill(0)
    load.add(engine, 1, 0.0)
    assert not load.alone(summary)
    assert GapLoad().summary([]) is None


def test_a_gap_summary_gives_the_decode_correction_the_median_of_its_positive_gaps() -> None:
    # Two reads at one clock reading give zero gaps: the controller's and a residual's
    # median keeps them, the correction's samples are the positive ones (its rule 1).
    engine = EngineState.__new__(EngineState)
    engine.load = EngineLoad()
    engine._share = Share()  # one replica: the ledger is the engine's whole load
    claims(engine.load.decode, 1, 100)
    load = GapLoad()
    load.add(engine, 5, 0.0)
    summary = load.summary([0.02, 0.0, 0.04, 0.0, 0.01])
    assert summary is not None
    assert (summary.count, summary.median_s) == (5, 0.01)
    assert (summary.positive, summary.positive_median_s) == (3, 0.02)
    even = load.summary([0.0, 0.375, 0.125, 0.0, 0.25, 0.5])
    assert even is not None
    assert (even.median_s, even.positive, even.positive_median_s) == (0.1875, 4, 0.3125)
    none = load.summary([0.0, 0.0])
    assert none is not None
    assert (none.count, none.median_s, none.positive, none.positive_median_s) == (2, 0, 0, 0)


async def resident_kv_seen(stack: Stack, tokens_per_event: float, **output: int) -> list[int]:
    """The decode engine's resident KV tokens at each event of a 500-token completion's
    stream, the engine's tokens per event set as if learnt from earlier streams."""
    decode = stack.ctx.fleet.get("d1")
    assert decode is not None
    decode.tokens_per_event = tokens_per_event
    body = {"model": MODEL, "prompt": [5] * 500, **output, "stream": True}
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream("POST", f"{stack.url}/v1/completions", json=body) as response,
    ):
        seen = [
            decode.load.decode_tokens
            async for line in response.aiter_lines()
            if line.startswith("data: {")
        ]
    assert decode.load.decode_tokens == 0
    return seen


async def test_a_learnt_packing_ratio_grows_running_streams_kv(start_stack: StartStack) -> None:
    stack = await packing_stack(start_stack)
    seen = await resident_kv_seen(stack, float(INTERVAL), max_tokens=100)
    # Counting events would have reached about 525; the estimate follows the tokens.
    assert max(seen) > 570


async def test_a_completion_without_max_tokens_grows_to_the_engines_default(
    start_stack: StartStack,
) -> None:
    # The engines stop it at 16 tokens. Taken as unbounded, its KV estimate ran on past
    # them by the tokens per event (16 here) with every event after the first.
    stack = await packing_stack(start_stack)
    seen = await resident_kv_seen(stack, PACKING_MAX)
    assert max(seen) == 500 + 16


async def test_without_packing_the_estimate_stays_at_one(start_stack: StartStack) -> None:
    stack = await packing_stack(start_stack, interval=1)
    decode = stack.ctx.fleet.get("d1")
    assert decode is not None
    await stream(stack)
    assert 1.0 <= decode.tokens_per_event < 1.1


async def test_predictive_admission_still_relays_usage_unchanged(
    start_stack: StartStack,
) -> None:
    stack = await predictive_stack(start_stack, ttft_s=5.0)
    *_, usage = await stream(stack, stream_options={"include_usage": True})
    assert usage["usage"]["completion_tokens"] == 100


def test_usage_report_reads_only_usage_objects() -> None:
    assert usage_report(b'{"choices":[{"text":"a"}],"usage":null}') is None
    assert usage_report(b'{"choices":[],"usage":{"completion_tokens":7}}') == (7, True, None)
    # Continuous usage stats: every chunk reports the running count.
    chunk = b'{"choices": [{"text": "a"}], "usage": {"completion_tokens": 3}}'
    assert usage_report(chunk) == (3, False, None)
    # vLLM with --enable-prompt-tokens-details: the prompt tokens it found cached.
    detailed = (
        b'{"choices":[],"usage":{"completion_tokens":2,'
        b'"prompt_tokens_details":{"cached_tokens":512}}}'
    )
    assert usage_report(detailed) == (2, True, 512)
    without = b'{"choices":[],"usage":{"completion_tokens":2,"prompt_tokens_details":null}}'
    assert usage_report(without) == (2, True, None)
    assert usage_report(b'{"choices":[],"usage":{"completion_tokens":-1}}') is None
    assert usage_report(b'{"choices":[],"usage":{"prompt_tokens":4}}') is None
    assert usage_report(b'{"usage":{"completion_tokens":') is None  # cut short


def test_packing_ratio_is_a_bounded_moving_average() -> None:
    engine = EngineState.__new__(EngineState)
    engine.tokens_per_event = 1.0
    engine.observe_packing(3, 30)  # too few events to say anything
    assert engine.tokens_per_event == 1.0
    engine.observe_packing(10, 30)
    assert engine.tokens_per_event == pytest.approx(1.4)
    engine.observe_packing(10, 5)  # a finish-only event: never under one token
    assert engine.tokens_per_event == pytest.approx(1.32)
    for _ in range(100):
        engine.observe_packing(10, 10_000)
    assert engine.tokens_per_event == pytest.approx(PACKING_MAX)


def test_running_growth_never_passes_max_tokens() -> None:
    engine = EngineState.__new__(EngineState)
    engine.load = EngineLoad()
    engine._share = Share()  # one replica: the ledger is the engine's whole load
    engine.tokens_per_event = 4.0
    decisions = Decisions(None, None)  # type: ignore[arg-type]  # no ctx until exit
    growth = KvGrowth(decisions, engine, cap=10)
    growth.add(2)
    assert engine.load.decode_tokens == 8
    growth.add(1)  # 12 by the ratio, but the request asked for at most 10
    assert (engine.load.decode_tokens, growth.tokens) == (10, 10)
    engine.tokens_per_event = 1.5
    unbounded = KvGrowth(decisions, engine, cap=None)
    unbounded.add(3)
    assert unbounded.tokens == 4  # 4.5 so far: whole tokens only
