"""A non-streaming request's decode leg streams to the router (manual 4.3, 6).

The client sees one JSON document, the engine's own non-streaming answer, while the
first-token and decode-gap timers, the first-token signal and the TTFT/TPOT
observations apply exactly as for a streamed request.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from narwhal.fleet import EngineState
from narwhal.serving import DecodeGaps
from narwhal.serving._context import ServingSignals

from ..support import wait_for
from .conftest import MODEL, Stack, StartStack
from .test_failures import PROMPT, phases, post, settled, terminal_error
from .test_retries import requests as requests_on
from .test_sglang import sglang_stack


class _Recorder:
    """The request path's signals, recorded on their way to the real receiver."""

    def __init__(self, inner: ServingSignals) -> None:
        self.inner = inner
        self.first_token_timeouts: list[str] = []
        self.gaps: dict[str, list[DecodeGaps]] = {}

    def first_token_timeout(self, engine: EngineState) -> None:
        self.first_token_timeouts.append(engine.id)
        self.inner.first_token_timeout(engine)

    def ttft_breach(self) -> None:
        self.inner.ttft_breach()

    def decode_gaps(self, engine: EngineState, gaps: DecodeGaps) -> None:
        self.gaps.setdefault(engine.id, []).append(gaps)
        self.inner.decode_gaps(engine, gaps)


def record_signals(stack: Stack) -> _Recorder:
    recorder = _Recorder(stack.ctx.signals)
    stack.ctx.signals = recorder
    return recorder


async def decode_stalled_before_its_first_token(start_stack: StartStack) -> tuple[Stack, _Recorder]:
    """A 1P1D stack whose decode engine never sends a first token (0.3 s timer, one
    attempt), with the request path's signals recorded."""
    stack = await start_stack(
        engine={"first_token_timeout_s": 0.3},
        serving={"prefill_timeout_s": 0.3, "request_timeout_s": 3.0, "max_attempts": 1},
    )
    stack.fleet[1].set_faults(stall_before_first_token_s=5, leg="decode")
    return stack, record_signals(stack)


async def test_a_stall_before_the_first_token_is_a_first_token_timeout(
    start_stack: StartStack,
) -> None:
    stack, signals = await decode_stalled_before_its_first_token(start_stack)
    started = trio.current_time()
    response = await post(stack, {"max_tokens": 3})
    elapsed = trio.current_time() - started
    assert response.status_code == 504
    error = response.json()["error"]
    assert error["code"] == "first_token_timeout"
    assert "engine.first_token_timeout_s=0.3" in error["message"]
    assert 0.3 <= elapsed < 1.3  # not serving.request_timeout_s
    assert signals.first_token_timeouts == ["d1"]
    await wait_for(lambda: phases(stack, 1, "aborted") == ["decode"])
    await settled(stack)


async def test_a_first_token_timeout_the_router_lag_explains_sends_no_signal(
    start_stack: StartStack,
) -> None:
    # The controller resets its evidence window on the signal (manual 7.6); a timeout the
    # router's own lag explains says nothing about decode capacity.
    stack, signals = await decode_stalled_before_its_first_token(start_stack)

    async def starve_while_it_waits() -> None:
        await trio.sleep(0.15)
        stack.ctx.loop_lag.observe(0.05, at=trio.current_time())  # over a tenth of 0.3 s

    async with trio.open_nursery() as nursery:
        nursery.start_soon(starve_while_it_waits)
        response = await post(stack, {"max_tokens": 3})
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "first_token_timeout"
    assert signals.first_token_timeouts == []
    await settled(stack)


async def test_a_stall_after_the_first_token_is_a_decode_gap_error(
    start_stack: StartStack,
) -> None:
    stack = await start_stack(
        engine={"decode_read_timeout_s": 0.3}, serving={"request_timeout_s": 5.0}
    )
    stack.fleet[1].set_faults(stall_after_tokens=2, leg="decode")
    started = trio.current_time()
    response = await post(stack, {"max_tokens": 20})
    elapsed = trio.current_time() - started
    assert response.status_code == 504
    error = response.json()["error"]
    assert error["code"] == "decode_stalled"
    assert "engine.decode_read_timeout_s=0.3" in error["message"]
    assert elapsed < 2.0
    await settled(stack)


async def test_the_aggregate_leg_keeps_its_prefill_deadline(start_stack: StartStack) -> None:
    stack = await start_stack(
        ["both"],
        engine={"first_token_timeout_s": 0.3},
        serving={"prefill_timeout_s": 0.3, "request_timeout_s": 3.0, "max_attempts": 1},
    )
    stack.fleet[0].set_faults(stall_before_first_token_s=5)
    started = trio.current_time()
    response = await post(stack, {"max_tokens": 3})
    elapsed = trio.current_time() - started
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "first_token_timeout"
    # serving.prefill_timeout_s + engine.first_token_timeout_s
    assert 0.6 <= elapsed < 1.6
    await settled(stack)


async def test_a_failure_before_the_answer_is_retried(start_stack: StartStack) -> None:
    stack = await start_stack(
        ["prefill", "decode", "decode"],
        engine={"first_token_timeout_s": 0.3},
        serving={"max_attempts": 2, "handoff_timeout_s": 5.0},
    )
    stack.fleet[1].set_faults(stall_before_first_token_s=5, leg="decode")
    response = await post(stack, {"max_tokens": 3})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3
    assert phases(stack, 1, "aborted") == ["decode"]
    assert stack.ctx.metrics.retries.labels("first_token_timeout")._value.get() == 1
    await settled(stack)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_stall_is_retried_only_while_nothing_is_visible(
    start_stack: StartStack, stream: bool
) -> None:
    stack = await start_stack(
        ["prefill", "decode", "decode"],
        engine={"decode_read_timeout_s": 0.3},
        serving={"max_attempts": 2, "handoff_timeout_s": 2.0, "request_timeout_s": 5.0},
    )
    stack.fleet[1].set_faults(stall_after_tokens=2, leg="decode")
    response = await post(stack, {"max_tokens": 20, "stream": stream})
    if stream:  # two tokens were relayed: a retry would repeat them
        assert terminal_error(response)["code"] == "decode_stalled"
        assert requests_on(stack, 2, "decode") == 0
    else:
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 20
        assert stack.ctx.metrics.retries.labels("decode_stalled")._value.get() == 1
    await settled(stack)


async def test_a_non_streaming_request_records_first_token_lag_and_decode_gaps(
    start_stack: StartStack,
) -> None:
    stack = await start_stack(speed=5.0)
    signals = record_signals(stack)
    response = await post(stack, {"max_tokens": 12})
    assert response.status_code == 200
    assert "d1" in stack.ctx.load_signals(trio.current_time()).first_token_lag_s
    (gaps,) = signals.gaps["d1"]
    assert gaps.count == gaps.positive >= 5
    state = await settled(stack)
    assert state["requests"]["unstreamed_decode_legs"] == {}


def _without_identity(document: dict[str, Any]) -> dict[str, Any]:
    # Each engine request has its own id and creation second.
    return {k: v for k, v in document.items() if k not in ("id", "created")}


async def _native(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(f"{url}{path}", json={"model": MODEL, **body})
    assert response.status_code == 200
    document: dict[str, Any] = response.json()
    return document


CHAT = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 7}
COMPLETION = {"prompt": PROMPT, "max_tokens": 7}


async def test_the_answer_is_the_engines_own_non_streaming_answer(
    start_stack: StartStack,
) -> None:
    # The assembled answer has vLLM 0.32's fields, whatever build the engine is.
    stack = await start_stack(["both"])
    engine = stack.fleet[0].url
    async with httpx.AsyncClient(timeout=30) as client:
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            native = await _native(engine, path, body)
            response = await client.post(f"{stack.url}{path}", json={"model": MODEL, **body})
            assert response.status_code == 200
            assert response.headers["content-type"] == "application/json"
            assembled = response.json()
            assert _without_identity(assembled) == _without_identity(native), path
            assert assembled["usage"]["completion_tokens"] == 7
    await settled(stack)


async def test_the_sglang_answer_is_the_engines_own_non_streaming_answer(
    nursery: trio.Nursery,
) -> None:
    stack = await sglang_stack(nursery)
    async with httpx.AsyncClient(timeout=30) as client:
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            response = await client.post(f"{stack.url}{path}", json={"model": MODEL, **body})
            assert response.status_code == 200
            assembled = response.json()
            # The decode server answers a stream; ask it for the same request's
            # non-streaming form, paired with the prefill server as the router pairs.
            room = 7 if path == "/v1/completions" else 8
            pairing = {"bootstrap_host": "127.0.0.1", "bootstrap_room": room}
            pairing["bootstrap_port"] = stack.fleet[0].port
            async with trio.open_nursery() as legs:
                legs.start_soon(_native, stack.fleet[0].url, path, {**body, **pairing})
                native = await _native(stack.fleet[1].url, path, {**body, **pairing})
            # But SGLang's weight versions, which no chunk carries.
            assert native.pop("metadata")["weight_version"] == "default"
            assert _without_identity(assembled) == _without_identity(native), path
            assert assembled["usage"]["completion_tokens"] == 7
    await settled(stack)


async def test_a_request_a_stream_cannot_answer_keeps_the_non_streaming_leg(
    start_stack: StartStack,
) -> None:
    stack = await start_stack()
    response = await post(stack, {"max_tokens": 3, "echo": True})
    assert response.status_code == 200
    state = await settled(stack)
    assert state["requests"]["unstreamed_decode_legs"] == {"echo": 1}
    metric = stack.ctx.metrics.unstreamed_legs.labels("echo")._value.get()
    assert metric == 1
