"""Faults with real SGLang behind Narwhal: a client that goes away, an engine that dies.

What the engines did is read from their own counters: `sglang:realtime_tokens_total`
(mode `decode`) grows at every decode step, unlike `sglang:generation_tokens_total`, which
SGLang adds to when a request ends. The crash test kills the pair's decode server (its
whole process group) and relaunches it (`Engine.restart`, same port and flags).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from ...support import open_sse
from ..client import Throttle, post_json, unique_text
from ..conftest import MODEL, RealStack, narwhal_in_front
from ..engines import Engine
from ..sglang_engines import SGLangFleet
from .conftest import aggregate_config, pair_config, total

LONG = 1500  # tokens a stream is asked for; the tests end it long before
# The schedulers are throttled while a stream starts (`Throttle`), then stopped (SIGSTOP)
# after the client's third event to stage the fault, which needs a stream in progress: if
# the engines made half of it by then anyway, it is dropped and sent again.
ATTEMPTS = 3


def long_stream() -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": unique_text(12),
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": True,
    }


async def decoded(engines: list[Engine]) -> float:
    return sum([await total(e, "sglang:realtime_tokens_total", mode="decode") for e in engines])


async def settled(engines: list[Engine], *, within_s: float = 30.0) -> float:
    """The engines' decoded-token total once it has stopped rising (the same in two reads
    a second apart)."""
    with trio.fail_after(within_s):
        last = await decoded(engines)
        while True:
            await trio.sleep(1.0)
            now = await decoded(engines)
            if now == last:
                return now
            last = now


def scheduler_pid(engine: Engine) -> int:
    """The engine's scheduler process (SGLang runs the model outside its HTTP server)."""
    for pid in engine.children():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if cmdline.startswith(b"sglang::scheduler"):
            return pid
    raise AssertionError(f"engine {engine.name}: no sglang::scheduler among {engine.children()}")


def throttled(engines: list[Engine]) -> Throttle:
    return Throttle([scheduler_pid(engine) for engine in engines])


async def engine_state(stack: RealStack, engine_id: str) -> dict[str, Any]:
    [entry] = [e for e in (await stack.state())["engines"] if e["id"] == engine_id]
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


@pytest.mark.parametrize("kind", ["aggregate", "pair"])
async def test_a_client_disconnect_stops_the_engine_generating(
    sglang: SGLangFleet, kind: str
) -> None:
    # The schedulers stay stopped until Narwhal has ended the request: had Narwhal left
    # the engine's connection open, they would go on to LONG once continued.
    if kind == "aggregate":
        config, engines = aggregate_config(sglang), sglang.aggregate
    else:
        config, engines = pair_config(sglang), [sglang["decode"]]
    async with narwhal_in_front(config) as stack:
        for _ in range(ATTEMPTS):
            before = await settled(engines)
            with trio.fail_after(120), throttled(engines) as throttle:
                async with open_sse(stack.url, "/v1/completions", long_stream()) as reader:
                    assert reader.status == 200
                    for _ in range(3):
                        event = await reader.event()
                        assert event is not None
                        assert json.loads(event)["choices"][0]["text"] is not None
                    with throttle.stopped():
                        made = await decoded(engines) - before
                        if made >= LONG / 2:
                            continue
                        await reader.aclose()  # the client goes away
                        while (await stack.state())["requests"]["in_flight"]:  # noqa: ASYNC110
                            await trio.sleep(0.1)
                        # Time for the HTTP servers to see their connections closed.
                        await trio.sleep(1.0)
            break
        else:
            pytest.fail(f"{ATTEMPTS} streams were half made before the client read 3 events")
        stopped = await settled(engines)
    # Three events are the first token (prefill) and two decoded ones; the counter may
    # not show the last yet: SGLang streams a step's tokens before it reports the step.
    assert made >= 1
    assert stopped - before < made + LONG / 4, (made, stopped - before)


async def test_a_decode_server_killed_mid_stream_is_ejected_until_it_is_relaunched(
    sglang: SGLangFleet,
) -> None:
    decode = sglang["decode"]
    config = pair_config(sglang, recovery={"health": {"interval_s": 1.0}})
    async with (
        narwhal_in_front(config) as stack,
        httpx.AsyncClient(timeout=120.0) as client,
    ):
        rest: list[str] = []
        for _ in range(ATTEMPTS):
            before = await decoded([decode])
            with trio.fail_after(120), throttled([decode]) as throttle:
                async with open_sse(stack.url, "/v1/completions", long_stream()) as reader:
                    assert reader.status == 200
                    for _ in range(3):
                        assert await reader.event() is not None
                    with throttle.stopped():
                        made = await decoded([decode]) - before
                        if made >= LONG / 2:
                            continue
                        assert decode.pid is not None
                        os.killpg(decode.pid, signal.SIGKILL)
                    while (event := await reader.event()) is not None:
                        rest.append(event)
            break
        else:
            pytest.fail(f"{ATTEMPTS} streams were half made before the client read 3 events")
        # One terminal error event and no [DONE]; tokens before it are allowed.
        assert "[DONE]" not in rest, rest[-4:]
        assert rest, "the stream ended without an error event"
        last = json.loads(rest[-1])
        assert set(last) == {"error"}, last
        assert last["error"]["code"] == "engine_connection_lost", last
        assert last["error"]["message"].startswith("decode engine: engine closed "), last
        assert all("error" not in json.loads(e) for e in rest[:-1])

        gone = await wait_available(stack, "decode", False, within_s=30)
        assert gone["unavailable_reason"], gone
        # Nothing else can decode: a request now is refused, not sent to a dead engine.
        refused = await client.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": unique_text(8), "max_tokens": 4},
        )
        assert refused.status_code == 503, refused.text

        await trio.to_thread.run_sync(decode.restart)
        await wait_available(stack, "decode", True, within_s=120)
        served = await post_json(
            client,
            f"{stack.url}/v1/completions",
            {"model": MODEL, "prompt": unique_text(8), "max_tokens": 4, "ignore_eos": True},
        )
        assert served["usage"]["completion_tokens"] == 4
