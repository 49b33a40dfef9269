"""Each engine fault and each deadline gives the manual's outcome (4.2, 4.3, 6).

Timings here are behaviour, not performance: a deadline must fire near its configured
value. The bounds are generous (the box is shared) but would catch a timer that is not
armed or armed at the wrong place. Tests on `start_memory_stack` run with no sockets
under a MockClock, where a deadline fires at its exact virtual time.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from narwhal._errors import EngineFailed
from narwhal.engines import ConnectError
from narwhal.fleet import EngineState
from narwhal.serving import ServingContext

from ..support import wait_for
from .conftest import MODEL, Stack, StartStack
from .in_memory import MemoryStack, start_memory_stack

PROMPT = "the quick brown fox jumps over the lazy dog"


async def post(stack: Stack | MemoryStack, body: dict[str, Any], **kw: Any) -> httpx.Response:
    async with stack.client() as client:
        return await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": PROMPT, **body}, **kw
        )


def sse_events(response: httpx.Response) -> list[str]:
    text = response.text
    assert text.endswith("\n\n"), text[-200:]
    return [block.removeprefix("data: ") for block in text[:-2].split("\n\n")]


def terminal_error(response: httpx.Response) -> dict[str, Any]:
    """A failed stream: 200, then an error event as the last event, and no [DONE]."""
    assert response.status_code == 200
    events = sse_events(response)
    assert "[DONE]" not in events
    last = json.loads(events[-1])
    assert set(last) == {"error"}
    error: dict[str, Any] = last["error"]
    return error


def phases(stack: Stack | MemoryStack, index: int, outcome: str) -> list[str]:
    return [o["phase"] for o in stack.fleet[index].state()["outcomes"] if o["outcome"] == outcome]


async def settled(stack: Stack | MemoryStack) -> dict[str, Any]:
    """Router state once every request has left (nothing retained, nothing leaked)."""
    await wait_for(lambda: stack.ctx.retained == 0)
    state = await stack.state()
    assert state["admission"]["admitted"] == 0
    for engine in state["engines"]:
        assert engine["prefill"]["inflight"] == 0, engine
        assert engine["decode"]["active"] == 0, engine
        assert engine["decode"]["pending"] == engine["decode"]["pending_tokens"] == 0, engine
        assert engine["prefill"]["queued_tokens"] == 0, engine
        assert engine["handoffs_pending"] == 0, engine
        assert engine["pools"]["serving"]["in_use"] == 0, engine
    return state


@pytest.mark.parametrize(
    ("status", "client_status", "code"),
    [(503, 503, "engine_http_503"), (429, 429, "engine_http_429"), (500, 502, "engine_http_500")],
)
async def test_prefill_engine_errors_are_mapped_not_passed_through(
    start_stack: StartStack, status: int, client_status: int, code: str
) -> None:
    stack = await start_stack()
    stack.fleet[0].set_faults(error_status=status, leg="prefill")
    response = await post(stack, {"max_tokens": 3, "stream": True})
    assert response.status_code == client_status
    error = response.json()["error"]
    assert error["code"] == code
    assert error["message"].startswith(f"prefill engine returned HTTP {status}: ")
    assert stack.fleet[1].state()["counters"]["requests"]["decode"] == 0
    await settled(stack)


@pytest.mark.parametrize("timeout_s", [None, 1.5])
async def test_a_connect_failure_reaches_recovery_with_its_deadline(
    start_stack: StartStack, monkeypatch: pytest.MonkeyPatch, timeout_s: float | None
) -> None:
    # A connect that ran out engine.connect_timeout_s carries the deadline, so recovery
    # can set it aside when the router's own loop lag explains it; a refusal carries none.
    stack = await start_stack()
    prefill = stack.ctx.fleet.get("p0")
    assert prefill is not None

    async def cannot_connect() -> object:
        raise ConnectError("connect to 127.0.0.1:9 did not work", timeout_s=timeout_s)

    monkeypatch.setattr(prefill.serving_pool, "_checkout", cannot_connect)
    seen: list[EngineFailed] = []
    observer = stack.ctx.leg_observer
    original = observer.leg_failed

    def leg_failed(engine: EngineState, phase: str, failure: EngineFailed) -> None:
        seen.append(failure)
        original(engine, phase, failure)

    monkeypatch.setattr(observer, "leg_failed", leg_failed)
    response = await post(stack, {"max_tokens": 3})
    assert response.json()["error"]["code"] == "engine_unreachable"
    assert [(f.engine_id, f.code, f.deadline_s) for f in seen] == [
        ("p0", "engine_unreachable", timeout_s)
    ]


@pytest.mark.parametrize("lagged", [True, False], ids=["lagged", "not-lagged"])
async def test_a_decode_connect_that_the_routers_lag_explains_is_made_again(
    start_stack: StartStack, monkeypatch: pytest.MonkeyPatch, lagged: bool
) -> None:
    # The handed-off KV waits on the prefill engine; a connect deadline that ran out only
    # because the router stalled says nothing about the decode engine, so the router
    # connects once more rather than failing the pair. Without the lag it fails the leg.
    stack = await start_stack()
    decode = stack.ctx.fleet.get("d1")
    assert decode is not None
    checkout = decode.serving_pool._checkout
    attempts: list[float] = []

    async def stalled_once() -> object:
        attempts.append(trio.current_time())
        if len(attempts) == 1:
            if lagged:
                stack.ctx.loop_lag.observe(1.0, at=trio.current_time())  # over a tenth of 1.5 s
            raise ConnectError("connect to 127.0.0.1:9 exceeded it", timeout_s=1.5)
        return await checkout()

    monkeypatch.setattr(decode.serving_pool, "_checkout", stalled_once)
    seen: list[EngineFailed] = []
    original = stack.ctx.leg_observer.leg_failed

    def leg_failed(engine: EngineState, phase: str, failure: EngineFailed) -> None:
        seen.append(failure)
        original(engine, phase, failure)

    monkeypatch.setattr(stack.ctx.leg_observer, "leg_failed", leg_failed)
    response = await post(stack, {"max_tokens": 3})
    # Reported once either way (recovery sets the lagged one aside, test_service.py).
    assert [(f.engine_id, f.code) for f in seen] == [("d1", "engine_unreachable")]
    if lagged:
        assert response.status_code == 200, response.text
        assert len(attempts) == 2
        assert response.json()["usage"]["completion_tokens"] == 3
    else:
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "engine_unreachable"
        assert len(attempts) == 1
    await settled(stack)


async def test_client_errors_from_the_engine_keep_their_status(start_stack: StartStack) -> None:
    # Without /tokenize's context length the engine is the one to say it.
    stack = await start_stack(engine={"tokenize": False})
    response = await post(stack, {"max_tokens": 10_000})  # beyond the sim's max_model_len
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "engine_rejected_request"
    assert "cannot be greater than max_model_len=8192" in error["message"]


async def tokenize(stack: Stack) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(
            f"{stack.fleet[0].url}/tokenize", json={"model": MODEL, "prompt": PROMPT}
        )
    answer: dict[str, Any] = response.json()
    return answer


async def test_decode_failure_after_commit_is_a_terminal_error_event(
    start_stack: StartStack,
) -> None:
    stack = await start_stack()
    stack.fleet[1].set_faults(error_status=500, leg="decode")
    response = await post(stack, {"max_tokens": 3, "stream": True})
    error = terminal_error(response)
    assert error["code"] == "engine_http_500"
    assert sse_events(response) == [sse_events(response)[-1]]  # nothing but the error
    await settled(stack)


async def test_non_streaming_decode_failure_is_an_http_error(start_stack: StartStack) -> None:
    stack = await start_stack()
    stack.fleet[1].set_faults(error_status=503, leg="decode")
    response = await post(stack, {"max_tokens": 3})
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "engine_http_503"


async def test_crash_mid_stream(start_stack: StartStack) -> None:
    stack = await start_stack()
    stack.fleet[1].set_faults(crash_after_tokens=3, leg="decode")
    response = await post(stack, {"max_tokens": 20, "stream": True})
    error = terminal_error(response)
    assert error["code"] == "engine_connection_lost"
    assert len(sse_events(response)) >= 2  # tokens were relayed before the crash
    await settled(stack)


async def test_engine_error_event_inside_the_stream_ends_it(start_stack: StartStack) -> None:
    stack = await start_stack()
    stack.fleet[1].set_faults(sse_error_after_tokens=2, leg="decode")
    response = await post(stack, {"max_tokens": 20, "stream": True})
    error = terminal_error(response)
    assert error["code"] == "engine_stream_error"
    assert "mid-stream" in error["message"]
    # The engine's own error event and its [DONE] are not relayed.
    assert sum('"error"' in event for event in sse_events(response)) == 1


async def test_prefill_engine_down(start_stack: StartStack) -> None:
    stack = await start_stack()
    await stack.fleet[0].go_down()
    response = await post(stack, {"max_tokens": 3})
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "engine_unreachable"
    # The log has the engine and its address (connection refused); the client neither.
    assert error["message"] == "prefill engine: could not connect to the engine"


async def test_expired_kv_lease_fails_the_decode(start_stack: StartStack) -> None:
    stack = await start_stack(sim={"lease_s": 0.0001}, speed=1.0)
    response = await post(stack, {"max_tokens": 3})
    assert response.status_code == 502
    # The non-streaming request's decode leg streams: vLLM reports the KV load failure
    # as an error event.
    assert response.json()["error"]["code"] == "engine_stream_error"
    assert stack.fleet[0].state()["counters"]["kv_expired"] >= 1


async def test_request_deadline_mid_stream_emits_expired(start_stack: StartStack) -> None:
    stack = await start_stack(serving={"request_timeout_s": 0.5})
    stack.fleet[1].set_faults(stall_after_tokens=2, leg="decode")
    started = trio.current_time()
    response = await post(stack, {"max_tokens": 20, "stream": True})
    elapsed = trio.current_time() - started
    error = terminal_error(response)
    assert error["code"] == "expired"
    assert error["type"] == "timeout_error"
    assert 0.5 <= elapsed < 1.5
    await wait_for(lambda: phases(stack, 1, "aborted") == ["decode"])
    await settled(stack)


async def test_request_deadline_before_output_is_504(start_stack: StartStack) -> None:
    stack = await start_stack(serving={"request_timeout_s": 0.4})
    stack.fleet[0].set_faults(stall_before_first_token_s=5, leg="prefill")
    started = trio.current_time()
    response = await post(stack, {"max_tokens": 3})
    elapsed = trio.current_time() - started
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "expired"
    assert 0.4 <= elapsed < 1.4
    await wait_for(lambda: phases(stack, 0, "aborted") == ["prefill"])


class Deadlines:
    """Records which deadline each failed leg tells recovery about (`deadline_s`: recovery
    sets a deadline aside when the router's own event loop lag explains it)."""

    def __init__(self, ctx: ServingContext) -> None:
        self.inner = ctx.leg_observer
        self.seen: list[tuple[str | None, float | None]] = []
        ctx.leg_observer = self

    def leg_ok(self, engine: EngineState, phase: str, duration_s: float, **kw: Any) -> None:
        self.inner.leg_ok(engine, phase, duration_s, **kw)

    def leg_failed(self, engine: EngineState, phase: str, failure: EngineFailed) -> None:
        self.seen.append((failure.code, failure.deadline_s))
        self.inner.leg_failed(engine, phase, failure)


async def test_prefill_timeout(start_stack: StartStack) -> None:
    stack = await start_stack(serving={"prefill_timeout_s": 0.3})
    stack.fleet[0].set_faults(stall_before_first_token_s=5, leg="prefill")
    deadlines = Deadlines(stack.ctx)
    started = trio.current_time()
    response = await post(stack, {"max_tokens": 3, "stream": True})
    elapsed = trio.current_time() - started
    assert response.status_code == 504
    error = response.json()["error"]
    assert error["code"] == "prefill_timeout"
    assert "serving.prefill_timeout_s=0.3" in error["message"]
    assert 0.3 <= elapsed < 1.3
    assert ("prefill_timeout", 0.3) in deadlines.seen
    await wait_for(lambda: phases(stack, 0, "aborted") == ["prefill"])


async def test_first_token_timeout(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    stack = await start_memory_stack(nursery, engine={"first_token_timeout_s": 0.3})
    stack.fleet[1].set_faults(stall_before_first_token_s=5, leg="decode")
    deadlines = Deadlines(stack.ctx)
    started = trio.current_time()
    response = await post(stack, {"max_tokens": 3, "stream": True})
    elapsed = trio.current_time() - started
    error = terminal_error(response)
    assert error["code"] == "first_token_timeout"
    assert "engine.first_token_timeout_s=0.3" in error["message"]
    assert 0.3 <= elapsed < 1.3
    # What the decode leg waited for its first token: the whole budget, to the tick on a
    # MockClock.
    ((code, waited),) = deadlines.seen
    assert code == "first_token_timeout"
    assert waited is not None
    assert 0.3 <= waited < 1.3
    assert waited == pytest.approx(0.3)
    await wait_for(lambda: phases(stack, 1, "aborted") == ["decode"])
    await settled(stack)


async def test_decode_gap_timeout(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    stack = await start_memory_stack(nursery, engine={"decode_read_timeout_s": 0.3})
    stack.fleet[1].set_faults(stall_after_tokens=2, leg="decode")
    deadlines = Deadlines(stack.ctx)
    response = await post(stack, {"max_tokens": 20, "stream": True})
    error = terminal_error(response)
    assert error["code"] == "decode_stalled"
    assert len(sse_events(response)) >= 2
    assert deadlines.seen == [("decode_stalled", 0.3)]


async def test_zero_gap_timeout_leaves_the_request_deadline_in_charge(
    start_stack: StartStack,
) -> None:
    stack = await start_stack(
        engine={"decode_read_timeout_s": 0}, serving={"request_timeout_s": 0.6}
    )
    stack.fleet[1].set_faults(stall_after_tokens=2, leg="decode")
    response = await post(stack, {"max_tokens": 20, "stream": True})
    assert terminal_error(response)["code"] == "expired"
