"""Closed-loop HTTP load generator on raw h11 and trio sockets, run as its own process.

    .venv/bin/python tools/bench/h11load.py '<spec JSON>'   # prints one JSON result line

Why not httpx: its pool costs grow with the number of connections (63 ms of client CPU
per request at 256 in flight in ../shared/notes/stack-feasibility.md), which would bury
the router overhead being measured. A bare h11 client costs about 0.16 ms per request.

`concurrency` workers each own keep-alive connections and send one request after
another. Two modes:

- "router": POST the body to one target (Narwhal or vllm-router), which runs both legs;
- "direct": the client runs the vLLM P/D protocol itself against the engines, the same
  two legs a router runs (prefill with kv_transfer_params.do_remote_decode, max_tokens 1,
  stream false; then decode with the prefill's kv_transfer_params). The difference
  between the two is what the router adds.

Timeline: connect and warm up for `warmup_s`, then a measurement window of `window_s`,
then no new requests and up to `drain_s` for those in flight. A request counts when it
completes inside the window. CPU seconds of the watched processes (router, fleet) and of
this process are read from /proc at the window's edges, by this process, so they cover
exactly the window.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import h11
import trio
from benchkit import Json, cpu_seconds, machine_cpu_seconds, summarize

_RECEIVE = 65536
_PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_MAX_ERROR_SAMPLES = 5
# Servers close idle keep-alive connections (the simulator, like uvicorn, after 5 s); a
# request sent on one just as it closes is lost, so idle connections are replaced first.
_IDLE_REUSE_S = 2.0
_DONE = b"data: [DONE]"
_ERROR_EVENT = b'data: {"error"'


class _Conn:
    __slots__ = ("h11", "host", "last_used", "port", "stream")

    def __init__(self, host: str, port: int, stream: trio.SocketStream) -> None:
        self.host = host
        self.port = port
        self.stream = stream
        self.h11 = h11.Connection(our_role=h11.CLIENT)
        self.last_used = trio.current_time()


class _Broken(Exception):
    pass


class Result:
    """One reply: status, body (non-streaming or error), first-token time, SSE events.

    A stream succeeded only if it ended with `data: [DONE]` and carried no error event:
    routers report failures after the 200 as a terminal `data: {"error": ...}` event.
    """

    __slots__ = ("body", "events", "first_token_at", "status", "stream_error", "tail")

    def __init__(self) -> None:
        self.status = 0
        self.body = bytearray()
        self.events = 0
        self.first_token_at = 0.0
        self.tail = b""
        self.stream_error = b""

    def feed_stream(self, data: bytes, now: float) -> None:
        """Account one piece of a 200 SSE body: events, first token, error, [DONE]."""
        if not self.first_token_at and b"data: {" in data:
            self.first_token_at = now
        self.events += data.count(b"data: {")
        # Joined with the previous tail so that a marker split across reads is seen.
        seen = self.tail + data
        if not self.stream_error and _ERROR_EVENT in seen:
            self.stream_error = seen[seen.index(_ERROR_EVENT) :]
        self.tail = seen[-64:]

    def stream_failure(self) -> str | None:
        if self.stream_error:
            return f"error event in a 200 stream: {self.stream_error[:200]!r}"
        if _DONE not in self.tail:
            return f"stream ended without [DONE]: {self.tail!r}"
        return None


async def _connect(host: str, port: int) -> _Conn:
    stream = await trio.open_tcp_stream(host, port)
    return _Conn(host, port, stream)


async def _fresh(conn: _Conn | None, host: str, port: int) -> _Conn:
    """`conn` if it was used recently, else a new connection (the old one is closed)."""
    if conn is not None:
        if trio.current_time() - conn.last_used < _IDLE_REUSE_S:
            return conn
        conn.stream.socket.close()
    return await _connect(host, port)


async def exchange(conn: _Conn, path: bytes, body: bytes, *, stream: bool) -> Result:
    """One request on a keep-alive connection. For streams, SSE data events are counted
    and the arrival of the first one carrying a JSON payload is timed (first token)."""
    h = conn.h11
    headers = [
        (b"host", f"{conn.host}:{conn.port}".encode()),
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
    ]
    wire = h.send(h11.Request(method=b"POST", target=path, headers=headers)) or b""
    wire += h.send(h11.Data(data=body)) or b""
    wire += h.send(h11.EndOfMessage()) or b""
    result = Result()
    try:
        await conn.stream.send_all(wire)
        while True:
            event = h.next_event()
            if event is h11.NEED_DATA:
                h.receive_data(await conn.stream.receive_some(_RECEIVE))
                continue
            kind = type(event)
            if kind is h11.Data:
                data = event.data  # type: ignore[union-attr]
                if stream and result.status == 200:
                    result.feed_stream(bytes(data), trio.current_time())
                else:
                    result.body += data
            elif kind is h11.Response:
                result.status = event.status_code  # type: ignore[union-attr]
            elif kind is h11.EndOfMessage:
                break
            elif kind is h11.ConnectionClosed:
                raise _Broken("connection closed before the response ended")
        h.start_next_cycle()
        conn.last_used = trio.current_time()
    except (h11.ProtocolError, trio.BrokenResourceError, OSError) as exc:
        raise _Broken(f"{type(exc).__name__}: {exc}") from None
    return result


class Stats:
    def __init__(self) -> None:
        self.window = (0.0, 0.0)
        self.completed = 0
        self.errors = 0
        self.error_samples: list[str] = []
        self.latency_ms: list[float] = []
        self.ttft_ms: list[float] = []
        self.events = 0
        self.started = 0

    def in_window(self, t: float) -> bool:
        return self.window[0] <= t <= self.window[1]

    def error(self, t: float, message: str) -> None:
        if self.in_window(t):
            self.errors += 1
        if len(self.error_samples) < _MAX_ERROR_SAMPLES:
            self.error_samples.append(message[:300])


class Spec:
    def __init__(self, raw: dict[str, Any]) -> None:
        self.mode: str = raw["mode"]
        self.concurrency: int = raw["concurrency"]
        self.path: bytes = raw.get("path", "/v1/completions").encode()
        self.body: dict[str, Any] = raw["body"]
        self.stream: bool = bool(self.body.get("stream"))
        self.warmup_s: float = raw["warmup_s"]
        self.window_s: float = raw["window_s"]
        self.drain_s: float = raw.get("drain_s", 10.0)
        self.watch: dict[str, int] = raw.get("watch", {})
        if self.mode == "router":
            self.target: tuple[str, int] = (raw["target"][0], int(raw["target"][1]))
        else:
            self.prefill: tuple[str, int] = (raw["prefill"][0], int(raw["prefill"][1]))
            self.decode: tuple[str, int] = (raw["decode"][0], int(raw["decode"][1]))


async def _router_worker(spec: Spec, stats: Stats, stop_at: float) -> None:
    body = json.dumps(spec.body).encode()
    conn: _Conn | None = None
    while trio.current_time() < stop_at:
        started = trio.current_time()
        try:
            conn = await _fresh(conn, *spec.target)
            result = await exchange(conn, spec.path, body, stream=spec.stream)
        except (_Broken, OSError) as exc:
            if conn is not None:
                conn.stream.socket.close()
            conn = None
            stats.error(trio.current_time(), str(exc))
            await trio.sleep(0.01)
            continue
        _record(stats, result, started, trio.current_time(), spec.stream)
    if conn is not None:
        await conn.stream.aclose()


async def _direct_worker(spec: Spec, stats: Stats, stop_at: float) -> None:
    base = spec.body
    prefill_doc = dict(base)
    prefill_doc.update(kv_transfer_params=dict(_PREFILL_KV), stream=False, max_tokens=1)
    prefill_doc.pop("stream_options", None)
    prefill_body = json.dumps(prefill_doc).encode()
    pconn: _Conn | None = None
    dconn: _Conn | None = None
    while trio.current_time() < stop_at:
        started = trio.current_time()
        try:
            pconn = await _fresh(pconn, *spec.prefill)
            dconn = await _fresh(dconn, *spec.decode)
            first = await exchange(pconn, spec.path, prefill_body, stream=False)
            if first.status != 200:
                _record(stats, first, started, trio.current_time(), False)
                continue
            params = json.loads(first.body).get("kv_transfer_params")
            decode_doc = dict(base)
            decode_doc["kv_transfer_params"] = params
            result = await exchange(
                dconn, spec.path, json.dumps(decode_doc).encode(), stream=spec.stream
            )
        except (_Broken, OSError, ValueError) as exc:
            for conn in (pconn, dconn):
                if conn is not None:
                    conn.stream.socket.close()
            pconn = dconn = None
            stats.error(trio.current_time(), str(exc))
            await trio.sleep(0.01)
            continue
        _record(stats, result, started, trio.current_time(), spec.stream)
    for conn in (pconn, dconn):
        if conn is not None:
            await conn.stream.aclose()


def _record(stats: Stats, result: Result, started: float, ended: float, stream: bool) -> None:
    if result.status != 200:
        stats.error(ended, f"HTTP {result.status}: {bytes(result.body[:200])!r}")
        return
    failure = result.stream_failure() if stream else None
    if failure is not None:
        stats.error(ended, failure)
        return
    if not stats.in_window(ended):
        return
    stats.completed += 1
    stats.latency_ms.append(1000 * (ended - started))
    if result.first_token_at:
        stats.ttft_ms.append(1000 * (result.first_token_at - started))
    stats.events += result.events


def _cpu(pids: dict[str, int]) -> dict[str, float]:
    busy, interrupts = machine_cpu_seconds()
    out = {"loadgen": cpu_seconds(os.getpid()), "machine": busy, "machine_irq": interrupts}
    for name, pid in pids.items():
        out[name] = cpu_seconds(pid)
    return out


async def run(spec: Spec) -> dict[str, Json]:
    stats = Stats()
    now = trio.current_time()
    start = now + spec.warmup_s
    stop_at = start + spec.window_s
    stats.window = (start, stop_at)
    cpu: dict[str, dict[str, float]] = {}
    worker = _router_worker if spec.mode == "router" else _direct_worker

    async def sample_cpu() -> None:
        await trio.sleep_until(start)
        cpu["start"] = _cpu(spec.watch)
        await trio.sleep_until(stop_at)
        cpu["stop"] = _cpu(spec.watch)

    with trio.move_on_after(spec.warmup_s + spec.window_s + spec.drain_s) as drain:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample_cpu)
            for _ in range(spec.concurrency):
                nursery.start_soon(worker, spec, stats, stop_at)
    window = spec.window_s
    cpu_s = {name: cpu["stop"][name] - cpu["start"][name] for name in cpu["stop"]}
    return {
        "mode": spec.mode,
        "concurrency": spec.concurrency,
        "stream": spec.stream,
        "window_s": window,
        "completed": stats.completed,
        "errors": stats.errors,
        "error_samples": list(stats.error_samples),
        "drain_cut": drain.cancelled_caught,
        "requests_per_s": stats.completed / window,
        "events": stats.events,
        "latency_ms": summarize(stats.latency_ms),
        "ttft_ms": summarize(stats.ttft_ms),
        "cpu_s": {name: round(value, 3) for name, value in cpu_s.items()},
    }


def main() -> None:
    spec = Spec(json.loads(sys.argv[1]))
    result = trio.run(run, spec)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
