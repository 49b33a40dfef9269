"""The load generator against an in-process simulated P/D pair, with short windows."""

from __future__ import annotations

from functools import partial

import h11load
import trio

from narwhal.sim import DEFAULT_MODEL, SimTiming, serve_fleet


async def test_direct_mode_runs_both_legs_and_times_the_first_token(
    nursery: trio.Nursery,
) -> None:
    fleet = await nursery.start(partial(serve_fleet, engines=2, timing=SimTiming.zero()))
    prefill, decode = (h.url.removeprefix("http://").rsplit(":", 1) for h in fleet)
    spec = h11load.Spec(
        {
            "mode": "direct",
            "concurrency": 2,
            "prefill": [prefill[0], int(prefill[1])],
            "decode": [decode[0], int(decode[1])],
            "body": {"model": DEFAULT_MODEL, "prompt": "hi", "max_tokens": 4, "stream": True},
            "warmup_s": 0.1,
            "window_s": 0.4,
            "drain_s": 2.0,
        }
    )
    result = await h11load.run(spec)
    assert result["errors"] == 0, result["error_samples"]
    assert result["completed"] > 0
    assert result["ttft_ms"]["n"] == result["completed"]
    assert result["ttft_ms"]["p50"] <= result["latency_ms"]["p50"]
    # One SSE data event per token at most, at least one per stream.
    assert result["completed"] <= result["events"] <= 4 * result["completed"]
    assert set(result["cpu_s"]) == {"loadgen", "machine", "machine_irq"}
    prefill_state = fleet[0].state()
    assert prefill_state["counters"]["requests"]["prefill"] >= result["completed"]


def _stream_result(*chunks: bytes) -> h11load.Result:
    result = h11load.Result()
    result.status = 200
    for t, data in enumerate(chunks):
        result.feed_stream(data, now=float(t + 1))
    return result


def test_a_stream_succeeds_only_with_done_and_no_error_event() -> None:
    ok = _stream_result(b'data: {"choices":[]}\n\n', b"data: [DO", b"NE]\n\n")
    assert ok.stream_failure() is None
    assert (ok.events, ok.first_token_at) == (1, 1.0)
    failed = _stream_result(b'data: {"choices":[]}\n\n', b'data: {"error":{"code":"expired"}}\n\n')
    assert failed.stream_failure() == (
        'error event in a 200 stream: b\'data: {"error":{"code":"expired"}}\\n\\n\''
    )
    cut = _stream_result(b'data: {"choices":[]}\n\n')
    assert (cut.stream_failure() or "").startswith("stream ended without [DONE]")


async def test_alternating_mode_shares_the_window_between_targets(
    nursery: trio.Nursery,
) -> None:
    fleet = await nursery.start(partial(serve_fleet, engines=2, timing=SimTiming.zero()))
    prefill, decode = ([h.url.removeprefix("http://").rsplit(":", 1)] for h in fleet)
    pair = {
        "prefill": [prefill[0][0], int(prefill[0][1])],
        "decode": [decode[0][0], int(decode[0][1])],
    }
    spec = h11load.Spec(
        {
            "mode": "alternate",
            "body": {"model": DEFAULT_MODEL, "prompt": "hi", "max_tokens": 2, "stream": False},
            "warmup_s": 0.1,
            "window_s": 0.6,
            "slice_s": 0.1,
            "targets": {"a": pair, "b": pair},
        }
    )
    result = await h11load.run_alternating(spec)
    a, b = result["targets"]["a"], result["targets"]["b"]
    assert a["errors"] == b["errors"] == 0
    assert a["completed"] > 0
    assert b["completed"] > 0
    assert 0.2 <= a["active_s"] + b["active_s"] <= 0.8
