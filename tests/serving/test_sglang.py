"""The SGLang dialect: both legs at once, paired by bootstrap room."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from narwhal.config import load_config
from narwhal.ctl import CtlError, CtlRequest
from narwhal.sim import Fleet, SimEngineSpec, serve_fleet
from narwhal.supervisor import Supervisor
from narwhal.supervisor._operations import Operations

from ..support import sse_json, wait_for
from .conftest import MODEL, Stack, fleet_config, pd_sim_fleet
from .test_failures import settled, terminal_error


async def sglang_stack(
    nursery: trio.Nursery,
    spec: SimEngineSpec | None = None,
    config_path: Path | None = None,
    api_key: str | None = None,
    engine: dict[str, Any] | None = None,
    roles: tuple[str, ...] = ("prefill", "decode"),
    **serving: Any,
) -> Stack:
    """An SGLang fleet, by default 1P1D (launched in their roles' modes; `api_key`:
    started with --api-key), and a Narwhal in front of it; `engine` is the config's
    engine section."""
    fleet = await pd_sim_fleet(nursery, "sglang", spec=spec, api_key=api_key, roles=roles)
    document = fleet_config(fleet, list(roles), serving=serving, engine=engine or {})
    for entry, handle in zip(document["engines"], fleet, strict=True):
        entry["dialect"] = "sglang"
        # narwhal-sim serves the bootstrap endpoints on the engine's HTTP port.
        entry["bootstrap_port"] = handle.port
    if config_path is not None:
        await trio.Path(config_path).write_text(json.dumps(document))
    config = load_config(document)
    supervisor: Supervisor = await nursery.start(
        Supervisor(config, config_path=None if config_path is None else str(config_path)).run
    )
    return Stack(fleet, supervisor, config)


async def stream(stack: Stack, max_tokens: int) -> httpx.Response:
    """One streamed completion through the stack, read whole."""
    async with httpx.AsyncClient(timeout=20) as client:
        return await client.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": "hello", "max_tokens": max_tokens, "stream": True},
        )


async def test_pin_refuses_another_role_for_an_sglang_engine(nursery: trio.Nursery) -> None:
    stack = await sglang_stack(nursery)
    operations = Operations(stack.supervisor)
    with pytest.raises(CtlError) as refused:
        await operations(CtlRequest("pin", "p0", "decode"))
    assert refused.value.code == "role_fixed"
    assert refused.value.message.startswith(
        "pin: engine 'p0' (dialect sglang) has role 'prefill' and cannot be pinned as "
        "'decode': an sglang server's role is fixed when it is launched"
    )
    p0 = stack.ctx.fleet.get("p0")
    assert p0 is not None
    assert (p0.role, p0.pinned) == ("prefill", False)
    # Pinning it to the role it has only keeps the controller off it.
    result = await operations(CtlRequest("pin", "p0", "prefill"))
    assert isinstance(result, dict)
    assert (result["role"], result["previous_role"], result["pinned"]) == (
        "prefill",
        "prefill",
        True,
    )
    assert (p0.role, p0.pinned) == ("prefill", True)


async def test_a_reload_applies_an_sglang_engines_new_launch_role_even_when_pinned(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # The operator relaunched both servers in the other mode and says so in the
    # configuration; keeping d1's pinned old role would send it legs it refuses.
    path = trio.Path(tmp_path / "narwhal.json")
    stack = await sglang_stack(nursery, config_path=Path(path))
    await Operations(stack.supervisor)(CtlRequest("pin", "d1", "decode"))
    document = json.loads(await path.read_text())
    document["engines"][0]["role"] = "decode"
    document["engines"][1]["role"] = "prefill"
    await path.write_text(json.dumps(document))
    result = await stack.supervisor.reload()
    assert result.applied
    p0, d1 = stack.ctx.fleet.get("p0"), stack.ctx.fleet.get("d1")
    assert p0 is not None
    assert d1 is not None
    assert (p0.role, p0.pinned) == ("decode", False)
    assert (d1.role, d1.pinned) == ("prefill", True)


async def test_streaming_pair(nursery: trio.Nursery) -> None:
    stack = await sglang_stack(nursery)
    async with httpx.AsyncClient(timeout=20) as client:
        response = await client.post(
            f"{stack.url}/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5,
                "stream": True,
            },
        )
        plain = await client.post(
            f"{stack.url}/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 4}
        )
    assert response.status_code == 200
    events = sse_json(response.content)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert plain.status_code == 200
    assert plain.json()["usage"]["completion_tokens"] == 4
    prefill, decode = (handle.state() for handle in stack.fleet)
    assert prefill["counters"]["completed"]["prefill"] == 2
    assert decode["counters"]["completed"]["decode"] == 2
    await settled(stack)


async def test_usage_reaches_the_client_as_sglang_would_send_it(nursery: trio.Nursery) -> None:
    # SGLang's include_usage defaults to false even with stream_options present (unlike
    # vLLM): the router asks for the chunk for its own accounting and keeps it. Its
    # engines pack 4 tokens an event here, which only the usage count reveals.
    stack = await sglang_stack(nursery, spec=SimEngineSpec(stream_interval=4))
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 32, "stream": True}
    async with httpx.AsyncClient(timeout=20) as client:
        quiet = await client.post(
            f"{stack.url}/v1/completions", json={**body, "stream_options": {}}
        )
        asked = await client.post(
            f"{stack.url}/v1/completions",
            json={**body, "stream_options": {"include_usage": True}},
        )
    assert all(event["choices"] for event in sse_json(quiet.content))
    *_, usage = sse_json(asked.content)
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 32
    decode = stack.ctx.fleet.get("d1")
    assert decode is not None
    # Both streams reported their tokens to the router: two moves towards ~3.5 per event.
    assert decode.tokens_per_event > 1.6
    await settled(stack)


async def test_decode_failure_after_commit(nursery: trio.Nursery) -> None:
    stack = await sglang_stack(nursery)
    stack.fleet[1].set_faults(crash_after_tokens=2, leg="decode")
    response = await stream(stack, 20)
    assert terminal_error(response)["code"] == "engine_connection_lost"
    await settled(stack)


@pytest.mark.parametrize("failing", ["prefill", "decode"])
async def test_a_failing_leg_cancels_the_other_at_once(nursery: trio.Nursery, failing: str) -> None:
    # A failure before the stream is committed is still an HTTP error. The other leg
    # would otherwise sit in its bootstrap wait until SGLang's timeout (peer routers hang
    # here: sglang #9726); after a prefill failure the simulator ends the decode itself,
    # after a decode failure only the router's cancel ends the prefill.
    stack = await sglang_stack(nursery)
    stack.fleet[0 if failing == "prefill" else 1].set_faults(error_status=503, leg=failing)
    started = trio.current_time()
    response = await stream(stack, 4)
    assert response.status_code == 503
    assert trio.current_time() - started < 2.0
    await settled(stack)
    if failing == "decode":
        assert stack.fleet[0].state()["counters"]["requests"]["prefill"] == 1


async def test_an_error_event_in_the_prefill_stream_fails_the_prefill(
    nursery: trio.Nursery,
) -> None:
    # The prefill leg shares the client's streamed body, so SGLang reports its late
    # errors inside a 200 stream. Read as success, the client got a 200 stream ending in
    # an error blamed on the decode engine, with no retry.
    stack = await sglang_stack(nursery)
    stack.fleet[0].set_faults(sse_error_after_tokens=0, leg="prefill")
    response = await stream(stack, 4)
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "engine_stream_error"
    assert response.json()["error"]["message"].startswith("prefill engine: ")
    metrics = stack.ctx.metrics.render().decode()
    assert (
        'narwhal_engine_failures_total{code="engine_stream_error",engine="p0",phase="prefill"} 1.0'
        in metrics
    )
    await settled(stack)


async def test_a_pair_holds_both_slots_before_it_sends_either_leg(nursery: trio.Nursery) -> None:
    # One decode slot, held 1.5 s by the first stream. The second pair's prefill must
    # not go out before its decode has a slot: it would wait in the prefill engine's
    # bootstrap queue, time out at serving.prefill_timeout_s and count against p0.
    stack = await sglang_stack(
        nursery, prefill_concurrency=1, decode_concurrency=1, prefill_timeout_s=0.5
    )
    stack.fleet[1].set_faults(stall_after_tokens=1, stall_s=1.5, leg="decode", count=1)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": True}
    statuses: list[int] = []

    async def one() -> None:
        async with httpx.AsyncClient(timeout=20) as client:
            statuses.append(
                (await client.post(f"{stack.url}/v1/completions", json=body)).status_code
            )

    async with trio.open_nursery() as requests:
        requests.start_soon(one)
        await wait_for(lambda: stack.ctx.fleet.get("d1").load.decode_active == 1)  # type: ignore[union-attr]
        requests.start_soon(one)
    assert statuses == [200, 200]
    assert "narwhal_engine_failures_total{" not in stack.ctx.metrics.render().decode()
    await settled(stack)


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({"stream": True}, id="stream"),
        pytest.param({"stream": False}, id="non-streaming"),
        # An answer a stream cannot give: the decode leg is a plain request, and the
        # failure an HTTP 500.
        pytest.param({"stream": False, "echo": True}, id="unstreamed"),
    ],
)
async def test_a_failed_kv_transfer_is_charged_to_neither_server_and_retried(
    nursery: trio.Nursery, extra: dict[str, Any]
) -> None:
    # The decode server reports that the pair's KV transfer failed (SGLang's
    # KVTransferError: "Failed to get kvcache from prefill instance, it might be dead").
    # That names the transfer, not the decode server, which is usually the one that
    # reports it first when its prefill dies. Charged to the decode server, a prefill
    # crash counted against every healthy decoder paired with it, and the retry left
    # the decoder out: in this 1P1D fleet, 503 no_engine_available for one transient
    # failure.
    stack = await sglang_stack(nursery, max_attempts=2, handoff_timeout_s=1.0)
    stack.fleet[1].set_faults(kv_pull_fail=True, leg="decode", count=1)
    async with httpx.AsyncClient(timeout=20) as client:
        response = await client.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": "hello", "max_tokens": 4, **extra},
        )
    assert response.status_code == 200, response.text
    if extra["stream"]:
        assert sse_json(response.content)[-1]["choices"][0]["finish_reason"] == "length"
    else:
        assert response.json()["usage"]["completion_tokens"] == 4
    assert stack.fleet[1].state()["counters"]["kv_pull_failures_injected"] == 1
    metrics = stack.ctx.metrics.render().decode()
    assert (
        'narwhal_engine_failures_total{code="kv_transfer_failed",engine="d1",phase="decode"} 1.0'
        in metrics
    )
    state = await stack.state()
    breakers = state["recovery"]["engines"]["d1"]["breakers"]
    assert breakers["decode"]["failures_in_window"] == 0
    await settled(stack)


async def test_a_retry_after_a_failed_kv_transfer_takes_another_prefill_server(
    nursery: trio.Nursery,
) -> None:
    # SGLang's own diagnosis of a failed transfer is that the prefill "might be dead",
    # and the failure cancelled that prefill's leg before it could show it. The retry
    # goes to the other prefill server; placement alone would pick p0 again (equal
    # cost, the lower id), which, had it died, would fail the retry the same way.
    fleet: Fleet = await nursery.start(
        partial(
            serve_fleet,
            engines=3,
            speed=20.0,
            model=MODEL,
            dialect="sglang",
            disaggregation_modes=("prefill", "prefill", "decode"),
        )
    )
    document = fleet_config(
        fleet,
        ["prefill", "prefill", "decode"],
        serving={"max_attempts": 2, "handoff_timeout_s": 1.0},
    )
    for entry, handle in zip(document["engines"], fleet, strict=True):
        entry["dialect"] = "sglang"
        entry["bootstrap_port"] = handle.port
    config = load_config(document)
    stack = Stack(fleet, await nursery.start(Supervisor(config).run), config)
    fleet[2].set_faults(kv_pull_fail=True, leg="decode", count=1)
    response = await stream(stack, 4)
    assert response.status_code == 200
    assert sse_json(response.content)[-1]["choices"][0]["finish_reason"] == "length"
    p0, p1 = (handle.state()["counters"] for handle in (fleet[0], fleet[1]))
    assert (p0["requests"]["prefill"], p0["aborted"]["prefill"]) == (1, 1)
    assert (p1["requests"]["prefill"], p1["completed"]["prefill"]) == (1, 1)
    await settled(stack)


@pytest.mark.parametrize("stream", [True, False])
async def test_a_request_past_the_context_is_refused_before_either_leg(
    nursery: trio.Nursery, stream: bool
) -> None:
    # SGLang's /tokenize reports its tokenizer's limit (a Llama-3.1 tokenizer's 131072),
    # not the server's context (8192, on its /v1/models card): nothing was checked, and
    # both servers refused the pair (older builds: a stream with a 200 and an error event,
    # which read as the prefill engine's failure, 502).
    spec = SimEngineSpec(dialect="sglang", tokenizer_max_length=131072)
    stack = await sglang_stack(nursery, spec)
    async with httpx.AsyncClient(timeout=20) as client:
        answer = await client.post(f"{stack.fleet[0].url}/tokenize", json={"prompt": "hello"})
        count = answer.json()["count"]
        assert answer.json()["max_model_len"] == 131072
        body = {"model": MODEL, "prompt": "hello", "stream": stream}
        response = await client.post(
            f"{stack.url}/v1/completions", json={**body, "max_tokens": 8193 - count}
        )
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", "max_tokens")
        assert error["message"] == (
            "Requested token count exceeds the model's maximum context length of 8192 "
            f"tokens. You requested a total of 8193 tokens: {count} tokens from the input "
            f"messages and {8193 - count} tokens for the completion. Please reduce the "
            "number of tokens in the input messages or the completion to fit within the "
            "limit."
        )
        # SGLang's request models have no truncate_prompt_tokens: it runs the prompt whole.
        ids = {
            "model": MODEL,
            "prompt": [5] * 8192,
            "max_tokens": 1,
            "stream": stream,
            "truncate_prompt_tokens": 100,
        }
        response = await client.post(f"{stack.url}/v1/completions", json=ids)
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", "input_tokens")
        assert error["message"] == (
            "The input (8192 tokens) is longer than the model's context length (8192 tokens)."
        )
        for handle in stack.fleet:
            assert sum(handle.state()["counters"]["requests"].values()) == 0
        fits = await client.post(
            f"{stack.url}/v1/completions", json={**body, "max_tokens": 8192 - count}
        )
        assert fits.status_code == 200
    state = await settled(stack)
    assert state["requests"]["context_checks"] == {"passed": 1, "refused": 2}


async def test_n_choices_are_served_by_the_aggregate_engine_as_it_answers_them(
    nursery: trio.Nursery,
) -> None:
    # SGLang 0.5.23 serves n > 1 on an aggregate server; a bootstrap pair given it answers
    # neither leg (tests/real/sglang/test_defects.py), so the pair is never sent it.
    stack = await sglang_stack(nursery, roles=("prefill", "decode", "both"))
    aggregate = stack.fleet[2]
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "n": 2}
    async with httpx.AsyncClient(timeout=20) as client:
        got = await client.post(f"{stack.url}/v1/completions", json=body)
        streamed = await client.post(f"{stack.url}/v1/completions", json={**body, "stream": True})
        native = await client.post(f"{aggregate.url}/v1/completions", json=body)
    assert got.status_code == 200, got.text
    # The engine's own answer but its weight versions, which no chunk carries.
    expected = {k: v for k, v in native.json().items() if k not in ("id", "created", "metadata")}
    assert {k: v for k, v in got.json().items() if k not in ("id", "created")} == expected
    assert expected["usage"]["completion_tokens"] == 6
    finished = sorted(
        (c["index"], c["finish_reason"])
        for event in sse_json(streamed.content)
        for c in event["choices"]
        if c["finish_reason"]
    )
    assert finished == [(0, "length"), (1, "length")]
    for handle in (stack.fleet[0], stack.fleet[1]):
        assert sum(handle.state()["counters"]["requests"].values()) == 0
    await settled(stack)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prompt_the_scheduler_refuses_is_answered_with_its_refusal(
    nursery: trio.Nursery, stream: bool
) -> None:
    # Within the context with its output, but at or past SGLang's longest request less 5
    # tokens: the servers' schedulers refuse it, a stream with a 200 and an error event.
    # The client gets the refusal's status, not a failed pair.
    stack = await sglang_stack(nursery)
    body = {"model": MODEL, "prompt": [5] * 8190, "max_tokens": 1, "stream": stream}
    async with httpx.AsyncClient(timeout=20) as client:
        response = await client.post(f"{stack.url}/v1/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    # Both legs are refused at once; the first refusal read is the answer.
    leg, refusal = error.pop("message").split(" returned 400 in its stream: ")
    assert leg in ("prefill engine", "decode engine")  # no engine id: expose_engine_details
    assert refusal == (
        "Input length (8190 tokens) exceeds the maximum allowed length (8186 tokens). Use a "
        "shorter input or enable --allow-auto-truncate."
    )
    assert error == {
        "type": "invalid_request_error",
        "param": None,
        "code": "engine_rejected_request",
    }
    state = await settled(stack)
    assert state["requests"]["outcomes"] == {"engine_rejected_request": 1}
