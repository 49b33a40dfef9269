"""Faults with real vLLM behind Narwhal: a client that goes away, an engine that dies.

What the engines did is read from their own counters (`/metrics`), not from Narwhal's
account of it. The crash test kills `agg1`'s engine core and relaunches `agg1`
(`Engine.restart`, same port; the fleet's state file gets its new pid).
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import httpx
import pytest
import trio

from narwhal.ctl import CtlRequest
from narwhal.supervisor._operations import Operations

from ..support import open_sse
from .client import Throttle, counter, post_json, stepping, unique_text
from .conftest import MODEL, RealStack, aggregate_config, narwhal_in_front, pair_config
from .engines import Engine, RealFleet

LONG = 1500  # tokens a stream is asked for; the tests end it long before


def long_stream() -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": unique_text(12),
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": True,
    }


async def generated(engines: list[Engine]) -> float:
    return sum([await counter(e, "vllm:generation_tokens_total") for e in engines])


async def settled(engines: list[Engine], *, within_s: float = 30.0) -> float:
    """The engines' generated-token total once it has stopped rising (the same in two
    reads a second apart)."""
    with trio.fail_after(within_s):
        last = await generated(engines)
        while True:
            await trio.sleep(1.0)
            now = await generated(engines)
            if now == last:
                return now
            last = now


async def engine_state(stack: RealStack, engine_id: str) -> dict[str, Any]:
    state = await stack.state()
    [entry] = [e for e in state["engines"] if e["id"] == engine_id]
    return entry  # type: ignore[no-any-return]


async def wait_available(
    stack: RealStack, engine_id: str, available: bool, *, within_s: float
) -> dict[str, Any]:
    with trio.fail_after(within_s):
        while True:
            entry = await engine_state(stack, engine_id)
            if entry["available"] is available:
                return entry
            await trio.sleep(0.5)


async def operate(stack: RealStack, command: str, engine: str) -> None:
    """What `narwhalctl COMMAND ENGINE` does, without the socket."""
    await Operations(stack.supervisor)(CtlRequest(command=command, engine=engine))


def throttled(engines: list[Engine]) -> Throttle:
    return Throttle([engine.engine_core_pid() for engine in engines])


# The engine cores are throttled while a stream starts (`Throttle`), then stopped
# (SIGSTOP) after the client's third event to stage the fault, which needs a stream in
# progress: if the engines made half of it by then anyway, it is dropped and sent again.
ATTEMPTS = 3


@pytest.mark.parametrize("kind", ["aggregate", "pair"])
async def test_a_client_disconnect_stops_the_engine_generating(vllm: RealFleet, kind: str) -> None:
    # The cores stay stopped until Narwhal has ended the request: if Narwhal left the
    # engine's connection open, they would go on to LONG once continued.
    if kind == "aggregate":
        config, engines, cores = aggregate_config(vllm), vllm.aggregate, vllm.aggregate
    else:
        config, engines, cores = pair_config(vllm), list(vllm.pair), [vllm["decode"]]
    tries: list[float] = []  # tokens made by the stop, per attempt
    async with narwhal_in_front(config) as stack:
        for _ in range(ATTEMPTS):
            before = await settled(engines)
            with trio.fail_after(120), throttled(cores) as throttle:
                async with open_sse(stack.url, "/v1/completions", long_stream()) as reader:
                    assert reader.status == 200
                    for _ in range(3):
                        event = await reader.event()
                        assert event is not None
                        assert json.loads(event)["choices"][0]["text"] is not None
                    with throttle.stopped():
                        made = await generated(engines) - before
                        tries.append(made)
                        if made >= LONG / 2:
                            continue
                        await reader.aclose()  # the client goes away
                        while True:
                            if not (await stack.state())["requests"]["in_flight"]:
                                break
                            await trio.sleep(0.1)
                        # Time for the API servers to see their connection closed.
                        await trio.sleep(1.0)
            break
        else:
            pytest.fail(f"each stream was half made before the client read 3 events: {tries}")
        stopped = await settled(engines)
    assert made >= 3
    assert stopped - before < made + LONG / 4, (made, stopped - before)


async def test_an_engine_crash_mid_stream_ejects_it_until_it_is_relaunched(
    vllm: RealFleet,
) -> None:
    agg1 = vllm["agg1"]
    config = aggregate_config(vllm, recovery={"health": {"interval_s": 1.0}})
    async with (
        narwhal_in_front(config) as stack,
        httpx.AsyncClient(timeout=120.0) as client,
    ):
        # The stream goes to agg1: agg0 takes no new work while it starts.
        await operate(stack, "drain", "agg0")
        rest: list[str] = []
        tries: list[float] = []  # tokens made by the stop, per attempt
        for _ in range(ATTEMPTS):
            # Settled, so that a stream an earlier test left ending is not counted here.
            before = await settled([agg1])
            core = agg1.engine_core_pid()
            # The model runs 2 ms at a time (`stepping`): CI's client read its third event
            # only after a merely throttled engine had made all of the stream, 3 tries of 3.
            with trio.fail_after(120):
                async with (
                    stepping(agg1.model_pids()) as halt,
                    open_sse(stack.url, "/v1/completions", long_stream()) as reader,
                ):
                    assert reader.status == 200
                    for _ in range(3):
                        assert await reader.event() is not None
                    await halt()
                    made = await counter(agg1, "vllm:generation_tokens_total") - before
                    tries.append(made)
                    # Unfinished is all a crash needs: a core killed with the stream short
                    # of LONG must end it with an error event.
                    if made >= LONG - 8:
                        continue
                    os.kill(core, signal.SIGKILL)
                    await operate(stack, "undrain", "agg0")
                    while (event := await reader.event()) is not None:
                        rest.append(event)
            break
        else:
            pytest.fail(f"each stream was all made before the client read 3 events: {tries}")
        # One terminal error event and no [DONE]; tokens before it are allowed.
        assert "[DONE]" not in rest, rest[-4:]
        assert rest, "the stream ended without an error event"
        last = json.loads(rest[-1])
        assert set(last) == {"error"}, last
        assert last["error"]["code"] == "engine_stream_error", last
        assert "EngineCore encountered an issue" in last["error"]["message"], last
        assert all("error" not in json.loads(e) for e in rest[:-1])

        gone = await wait_available(stack, "agg1", False, within_s=30)
        assert gone["unavailable_reason"], gone
        # Meanwhile agg0 serves.
        served = await post_json(
            client,
            f"{stack.url}/v1/completions",
            {"model": MODEL, "prompt": unique_text(8), "max_tokens": 4},
        )
        assert served["usage"]["completion_tokens"] == 4

        await trio.to_thread.run_sync(agg1.restart)
        await wait_available(stack, "agg1", True, within_s=90)
        # Back in placement for real work: with agg0 drained, agg1 serves alone.
        await operate(stack, "drain", "agg0")
        before = await counter(agg1, "vllm:generation_tokens_total")
        served = await post_json(
            client,
            f"{stack.url}/v1/completions",
            {"model": MODEL, "prompt": unique_text(8), "max_tokens": 4, "ignore_eos": True},
        )
        assert served["usage"]["completion_tokens"] == 4
        assert await counter(agg1, "vllm:generation_tokens_total") == before + 4
