"""The load generator's modes against an in-process simulated fleet, with short windows."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import loadgen
import trio

from narwhal.sim import DEFAULT_MODEL, SimTiming, serve_fleet


def _address(url: str) -> list[str | int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return [host, int(port)]


async def test_direct_mode_runs_both_legs_and_times_the_first_token(
    nursery: trio.Nursery,
) -> None:
    fleet = await nursery.start(partial(serve_fleet, engines=2, timing=SimTiming.zero()))
    spec = {
        "mode": "direct",
        "concurrency": 2,
        "prefill": _address(fleet[0].url),
        "decode": _address(fleet[1].url),
        "body": {"model": DEFAULT_MODEL, "prompt": "hi", "max_tokens": 4, "stream": True},
        "warmup_s": 0.1,
        "window_s": 0.4,
        "drain_s": 2.0,
    }
    result = await loadgen.closed_loop(spec)
    assert result["errors"] == 0, result["error_samples"]
    assert result["completed"] > 0
    assert result["ttft_ms"]["n"] == result["completed"]
    assert result["ttft_ms"]["p50"] <= result["latency_ms"]["p50"]
    # One SSE data event per token at most, at least one per stream.
    assert result["completed"] <= result["events"] <= 4 * result["completed"]
    assert set(result["cpu_s"]) == {"loadgen", "machine", "machine_irq"}
    prefill_state = fleet[0].state()
    assert prefill_state["counters"]["requests"]["prefill"] >= result["completed"]


def _stream_reply(*chunks: bytes) -> loadgen.Reply:
    reply = loadgen.Reply()
    reply.status = 200
    for t, data in enumerate(chunks):
        reply.feed(data, now=float(t + 1))
    return reply


def test_a_stream_succeeds_only_with_done_and_no_error_event() -> None:
    ok = _stream_reply(b'data: {"choices":[]}\n\n', b"data: [DO", b"NE]\n\n")
    assert ok.stream_failure() is None
    assert (ok.events, ok.first_event_at) == (1, 1.0)
    failed = _stream_reply(b'data: {"choices":[]}\n\n', b'data: {"error":{"code":"expired"}}\n\n')
    assert failed.stream_failure() == (
        'error event in a 200 stream: b\'data: {"error":{"code":"expired"}}\\n\\n\''
    )
    assert loadgen.stream_outcome(failed) == "stream_error:expired"
    cut = _stream_reply(b'data: {"choices":[]}\n\n')
    assert (cut.stream_failure() or "").startswith("stream ended without [DONE]")
    assert loadgen.stream_outcome(cut) == "truncated"


def test_a_replayed_stream_times_its_text_and_reads_the_usage() -> None:
    reply = _stream_reply(
        b'data: {"choices":[{"text":""}]}\n\n',  # a role-only first event is not a token
        b'data: {"choices":[{"text":"a"}]}\n\n',
        b'data: {"choices":[{"text":"b"}]}\n\ndata: {"choices":[{"text":"c"}]}\n\n',
        b'data: {"choices":[],"usage":{"completion_tokens": 3}}\n\ndata: [DONE]\n\n',
    )
    assert (reply.first_event_at, reply.first_text_at, reply.last_text_at) == (1.0, 2.0, 3.0)
    assert (reply.reads, reply.events, reply.tokens) == (4, 5, 3)
    assert loadgen.stream_outcome(reply) == "ok"


async def test_alternating_mode_shares_the_window_between_targets(
    nursery: trio.Nursery,
) -> None:
    fleet = await nursery.start(partial(serve_fleet, engines=2, timing=SimTiming.zero()))
    pair = {"prefill": _address(fleet[0].url), "decode": _address(fleet[1].url)}
    spec = {
        "mode": "alternate",
        "body": {"model": DEFAULT_MODEL, "prompt": "hi", "max_tokens": 2, "stream": False},
        "warmup_s": 0.1,
        "window_s": 0.6,
        "slice_s": 0.1,
        "targets": {"a": pair, "b": pair},
    }
    result = await loadgen.alternate(spec)
    a, b = result["targets"]["a"], result["targets"]["b"]
    assert a["errors"] == b["errors"] == 0
    assert a["completed"] > 0
    assert b["completed"] > 0
    assert 0.2 <= a["active_s"] + b["active_s"] <= 0.8


async def test_replay_sends_each_request_at_its_time_and_writes_rows_and_stats(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    (engine,) = await nursery.start(partial(serve_fleet, engines=1, timing=SimTiming.zero()))
    workload = tmp_path / "workload.json"
    workload.write_text(json.dumps({"requests": [[0.0, 8, 3], [0.1, 16, 1], [0.2, 4, 5]]}))
    spec = {
        "mode": "replay",
        "url": engine.url,
        "workload": str(workload),
        "speed": 1.0,
        "model": DEFAULT_MODEL,
        "out": str(tmp_path / "rows.jsonl"),
        "stats": str(tmp_path / "stats.json"),
        "start_delay_s": 0.05,
    }
    stats = await loadgen.replay(spec)
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r[0] for r in rows] == [0, 1, 2]
    assert [(r[2], r[3], r[6]) for r in rows] == [(200, "ok", 3), (200, "ok", 1), (200, "ok", 5)]
    ttft = [r[4] for r in rows]
    assert all(t is not None and 0 <= t < 1.0 for t in ttft)
    assert rows[1][5] is None  # one token: no TPOT
    assert rows[2][7] >= 0.2  # ended after its own offered time
    assert json.loads((tmp_path / "stats.json").read_text()) == stats
    assert stats["requests"] == 3
    assert stats["connections_opened"] <= 3


async def test_flood_counts_answers_and_keeps_one_connection_per_worker(
    nursery: trio.Nursery,
) -> None:
    (engine,) = await nursery.start(partial(serve_fleet, engines=1, timing=SimTiming.zero()))
    spec = {
        "mode": "flood",
        "url": engine.url,
        "requests": 30,
        "concurrency": 3,
        "prompt_tokens": 8,
        "max_tokens": 2,
        "model": DEFAULT_MODEL,
        "request_timeout_s": 10.0,
        "deadline_s": 20.0,
    }
    result = await loadgen.flood(spec)
    assert result["outcomes"] == {"ok": 30}
    assert result["answered"] == 30
    assert not result["hit_deadline"]
    assert result["connections_opened"] == 3
    # Each worker's first request carried its connect.
    assert result["latency_s"]["ok (with connect)"]["n"] == 3
    assert result["latency_s"]["ok"]["n"] == 27


async def _refuse_and_close(stream: trio.SocketStream) -> None:
    """A router refusing with 429 and closing the connection after the answer."""
    request = b""
    while b"\r\n\r\n" not in request:
        request += await stream.receive_some(65536)
    body = b'{"error": {"code": "too_many_pending_bodies", "message": "m"}}'
    head = b"HTTP/1.1 429 Too Many Requests\r\nconnection: close\r\n"
    await stream.send_all(head + b"content-length: %d\r\n\r\n" % len(body) + body)
    await stream.aclose()


async def test_an_answer_that_closes_its_connection_is_counted_as_answered(
    nursery: trio.Nursery,
) -> None:
    (listener,) = await nursery.start(
        partial(trio.serve_tcp, _refuse_and_close, 0, host="127.0.0.1")
    )
    port = listener.socket.getsockname()[1]
    spec = {
        "mode": "flood",
        "url": f"http://127.0.0.1:{port}",
        "requests": 3,
        "concurrency": 1,
        "prompt_tokens": 4,
        "max_tokens": 1,
        "model": DEFAULT_MODEL,
        "request_timeout_s": 10.0,
        "deadline_s": 10.0,
    }
    result = await loadgen.flood(spec)
    # Not "broken": h11 cannot reuse such a connection, but the answer was whole.
    assert result["outcomes"] == {"429 too_many_pending_bodies": 3}
    assert result["connections_opened"] == 3


def test_a_replayed_request_sends_a_text_prompt_as_given() -> None:
    run = loadgen.Replay({"url": "http://127.0.0.1:9", "model": "m", "speed": 1.0})
    text = json.loads(run.body(' a "b"', 3))
    ids = json.loads(run.body(3, 3))
    assert (text["prompt"], ids["prompt"]) == (' a "b"', [791, 791, 791])
    assert text["max_tokens"] == ids["max_tokens"] == 3
