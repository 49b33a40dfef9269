"""Defects real SGLang 0.5.23 exposed in Narwhal, each tested on the real engines.

- A fresh decode server publishes `sglang:num_running_reqs` and `sglang:num_queue_reqs`
  only once its scheduler first reports (40 decode steps, or an idle tick after serving):
  narwhal-check's metrics row failed it ("no load gauges") and the monitor recorded a
  failed scrape every pass, as for an engine started without --enable-metrics.
- SGLang appends the frame that raised, with its file path, to a validation error's
  message (`max_tokens: null`, say): Narwhal passed it on to the client.
- `n > 1`: SGLang serves it on an aggregate engine; a bootstrap pair given it hangs both
  legs (neither answered within 60 s here). Narwhal refused it everywhere; it now serves it
  where an aggregate engine is and refuses it, naming `n`, on pairs alone (the defects
  fix for vLLM, which holds for SGLang as it is).

The fresh-server test runs first in this folder, on the decode server as launched; when
the fleet is not fresh (attached from NARWHAL_SGLANG_FLEET, or a test ran before), it
relaunches the decode server first.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from narwhal.probe import metrics_row

from ...support import post_stream
from ..client import post_json, scrape, sse_events, unique_text
from ..conftest import MODEL, narwhal_in_front
from ..sglang_engines import SGLangFleet
from .conftest import aggregate_config, pair_config, total

GAUGES = ("sglang:num_running_reqs", "sglang:num_queue_reqs")


async def fresh_decode_page(fleet: SGLangFleet) -> str:
    """The decode server's /metrics while it has not published its load gauges yet."""
    decode = fleet["decode"]
    page = await scrape(decode)
    if any(name in page for name in GAUGES):
        await trio.to_thread.run_sync(decode.restart)
        page = await scrape(decode)
    assert not [name for name in GAUGES if name in page], (
        "a fresh SGLang decode server now publishes its load gauges at once: "
        "LoadSample.gauges_pending may be obsolete"
    )
    return page


async def test_a_fresh_decode_servers_missing_load_gauges_are_not_a_fault(
    sglang: SGLangFleet,
) -> None:
    page = await fresh_decode_page(sglang)

    row = metrics_row("decode", "sglang", 200, page.encode())
    assert (row.status, row.measured) == ("pass", "not yet published"), row

    config = pair_config(sglang, controller={"monitor_interval_s": 0.5})
    async with narwhal_in_front(config) as stack:
        monitor = stack.supervisor.monitor
        assert monitor is not None
        with trio.fail_after(60):
            while monitor.passes < 3:  # noqa: ASYNC110 (the monitor's own count)
                await trio.sleep(0.2)
        assert "decode" not in monitor.unscraped, monitor.unscraped
        last = monitor.last_pass
        assert last is not None
        [decode] = [e for e in last.engines if e.id == "decode"]
        assert decode.load_error is None, decode
        assert decode.load is not None
        assert (decode.load.running, decode.load.waiting) == (0, 0)
        assert monitor.consecutive_failures == 0
        # Still fresh: nothing was sent to it meanwhile.
        assert not [name for name in GAUGES if name in await scrape(sglang["decode"])]

        # It serves as any other; once its scheduler has reported, the gauges are read.
        async with httpx.AsyncClient(timeout=120.0) as client:
            body = {"model": MODEL, "prompt": unique_text(8), "max_tokens": 4}
            got = await post_json(client, f"{stack.url}/v1/completions", body)
        assert got["usage"]["completion_tokens"] == 4


TRACEBACK_MARKS = ("Traceback", 'File "', ", line ", "site-packages", ".py")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_an_engine_traceback_never_reaches_the_client(
    sglang: SGLangFleet, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    body = {"model": MODEL, "prompt": unique_text(8), "max_tokens": None, "stream": stream}
    async with httpx.AsyncClient(timeout=120.0) as client:
        # What the engine answers itself: 400, the frame that raised appended.
        direct = await client.post(f"{sglang['agg'].url}/v1/completions", json=body)
        assert direct.status_code == 400, direct.text
        assert 'File "' in direct.json()["message"], direct.text
        async with narwhal_in_front(aggregate_config(sglang)) as stack:
            answer = await client.post(f"{stack.url}/v1/completions", json=body)

    assert answer.status_code == 400, answer.text
    assert not [mark for mark in TRACEBACK_MARKS if mark in answer.text], answer.text
    error = answer.json()["error"]
    assert error["message"] == (
        "aggregate engine returned HTTP 400: 1 validation error:\n  {'type': 'int_type', "
        "'loc': ('body', 'max_tokens'), 'msg': 'Input should be a valid integer', "
        "'input': None}"
    ), error
    # The operator's log has the engine's whole message.
    logged = [r.getMessage() for r in caplog.records if r.name == "narwhal.engines"]
    assert any('http_server.py", line ' in message for message in logged), logged


async def test_n_is_served_on_the_aggregate_engine_and_refused_on_a_pair_alone(
    sglang: SGLangFleet,
) -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": unique_text(8),
        "max_tokens": 4,
        "n": 2,
        "ignore_eos": True,
    }
    async with httpx.AsyncClient(timeout=120.0) as client:
        async with narwhal_in_front(aggregate_config(sglang)) as stack:
            got = await post_json(client, f"{stack.url}/v1/completions", body)
            status, _, raw = await post_stream(
                client, f"{stack.url}/v1/completions", {**body, "stream": True}
            )
        assert sorted(c["index"] for c in got["choices"]) == [0, 1]
        assert got["usage"]["completion_tokens"] == 8
        assert status == 200, raw
        events = sse_events(raw)
        finished = sorted(
            (c["index"], c["finish_reason"])
            for e in events
            for c in e["choices"]
            if c["finish_reason"]
        )
        assert finished == [(0, "length"), (1, "length")]

        prefill, decode = sglang.pair
        before = [await total(e, "sglang:prompt_tokens_total") for e in (prefill, decode)]
        async with narwhal_in_front(pair_config(sglang)) as stack:
            refused = await client.post(f"{stack.url}/v1/completions", json=body)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "n"
        assert error["message"].startswith(
            "n=2 is served only by an aggregate engine (role `both`), and the fleet has none"
        ), error
        # Refused before any leg: neither server of the pair saw it.
        after = [await total(e, "sglang:prompt_tokens_total") for e in (prefill, decode)]
        assert after == before


async def test_a_token_id_outside_the_vocabulary_never_reaches_the_engine(
    sglang: SGLangFleet,
) -> None:
    # SGLang 0.5.23 gives prompt ids to its embedding unchecked: one id past the vocabulary
    # raises in the scheduler and the server exits (found by the conformance corpus). With
    # engine.vocab_size Narwhal refuses the request; the engine never sees it.
    vocab_size = json.loads((sglang.model / "config.json").read_text())["vocab_size"]
    agg = sglang["agg"]
    before = await total(agg, "sglang:prompt_tokens_total")
    config = aggregate_config(sglang, engine={"vocab_size": vocab_size})
    async with (
        httpx.AsyncClient(timeout=120.0) as client,
        narwhal_in_front(config) as stack,
    ):
        for stream in (False, True):
            refused = await client.post(
                f"{stack.url}/v1/completions",
                json={"model": MODEL, "prompt": [1, vocab_size], "max_tokens": 4, "stream": stream},
            )
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == "prompt", error
            assert f"token id {vocab_size} at index 1 is outside the vocabulary" in error["message"]
        # The engine is up and serves the last id there is.
        served = await post_json(
            client,
            f"{stack.url}/v1/completions",
            {"model": MODEL, "prompt": [1, vocab_size - 1], "max_tokens": 2, "ignore_eos": True},
        )
    assert served["usage"]["completion_tokens"] == 2
    assert agg.alive()
    assert await total(agg, "sglang:prompt_tokens_total") == before + 2
