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
from collections.abc import Sequence
from typing import Any

import h11
import trio
from benchkit import Json, cpu_seconds, machine_cpu_seconds, summarize

from narwhal.engines._dialects import vllm_decode_body, vllm_kv_params, vllm_prefill_body

_RECEIVE = 65536
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
        self.concurrency: int = raw.get("concurrency", 1)
        self.path: bytes = raw.get("path", "/v1/completions").encode()
        self.body: dict[str, Any] = raw["body"]
        self.stream: bool = bool(self.body.get("stream"))
        self.warmup_s: float = raw["warmup_s"]
        self.window_s: float = raw["window_s"]
        self.drain_s: float = raw.get("drain_s", 10.0)
        self.slice_s: float = raw.get("slice_s", 0.5)
        self.watch: dict[str, int] = raw.get("watch", {})
        # "router" and "direct": one target given at top level; "alternate": named ones.
        self.targets: dict[str, dict[str, Any]] = raw.get("targets") or {"only": raw}


def _address(value: Sequence[Any]) -> tuple[str, int]:
    return str(value[0]), int(value[1])


class Target:
    """One way to send a request: to a router, or the P/D legs straight to the engines."""

    def __init__(self, spec: Spec) -> None:
        self.path = spec.path
        self.stream = spec.stream

    async def once(self) -> Result:
        raise NotImplementedError

    def reset(self) -> None:
        """Drop the connections after a failure; the next request opens new ones."""

    async def aclose(self) -> None:
        self.reset()
        await trio.lowlevel.checkpoint()


class RouterTarget(Target):
    def __init__(self, spec: Spec, address: tuple[str, int]) -> None:
        super().__init__(spec)
        self.address = address
        self.body = json.dumps(spec.body).encode()
        self.conn: _Conn | None = None

    async def once(self) -> Result:
        self.conn = await _fresh(self.conn, *self.address)
        return await exchange(self.conn, self.path, self.body, stream=self.stream)

    def reset(self) -> None:
        if self.conn is not None:
            self.conn.stream.socket.close()
        self.conn = None


class DirectTarget(Target):
    """The vLLM P/D protocol run by the client itself, as a router would run it."""

    def __init__(self, spec: Spec, prefill: tuple[str, int], decode: tuple[str, int]) -> None:
        super().__init__(spec)
        self.prefill = prefill
        self.decode = decode
        self.base = spec.body
        # The legs exactly as Narwhal builds them, so the comparison is transport only.
        self.prefill_body = json.dumps(vllm_prefill_body(spec.body)).encode()
        self.pconn: _Conn | None = None
        self.dconn: _Conn | None = None

    async def once(self) -> Result:
        self.pconn = await _fresh(self.pconn, *self.prefill)
        self.dconn = await _fresh(self.dconn, *self.decode)
        first = await exchange(self.pconn, self.path, self.prefill_body, stream=False)
        if first.status != 200:
            return first
        params = vllm_kv_params(json.loads(first.body))
        body = json.dumps(vllm_decode_body(self.base, params)).encode()
        return await exchange(self.dconn, self.path, body, stream=self.stream)

    def reset(self) -> None:
        for conn in (self.pconn, self.dconn):
            if conn is not None:
                conn.stream.socket.close()
        self.pconn = self.dconn = None


def make_target(spec: Spec, raw: dict[str, Any]) -> Target:
    if "target" in raw:
        return RouterTarget(spec, _address(raw["target"]))
    return DirectTarget(spec, _address(raw["prefill"]), _address(raw["decode"]))


async def _request(target: Target, stats: Stats, stream: bool) -> None:
    """One request, recorded in `stats`; failures reset the target's connections."""
    started = trio.current_time()
    try:
        result = await target.once()
    except (_Broken, OSError, ValueError) as exc:
        target.reset()
        stats.error(trio.current_time(), str(exc))
        await trio.sleep(0.01)
        return
    _record(stats, result, started, trio.current_time(), stream)


async def _worker(spec: Spec, stats: Stats, stop_at: float) -> None:
    target = make_target(spec, spec.targets["only"])
    try:
        while trio.current_time() < stop_at:
            await _request(target, stats, spec.stream)
    finally:
        await target.aclose()


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

    async def sample_cpu() -> None:
        await trio.sleep_until(start)
        cpu["start"] = _cpu(spec.watch)
        await trio.sleep_until(stop_at)
        cpu["stop"] = _cpu(spec.watch)

    with trio.move_on_after(spec.warmup_s + spec.window_s + spec.drain_s) as drain:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample_cpu)
            for _ in range(spec.concurrency):
                nursery.start_soon(_worker, spec, stats, stop_at)
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


async def run_alternating(spec: Spec) -> dict[str, Json]:
    """One client that switches target every `slice_s`, round-robin, so that every target
    sees the same disturbance from the rest of the machine (concurrency 1 only: at higher
    concurrency each switch would need its own warm-up). Idle routers use no CPU, so a
    router's CPU over the whole window divided by its own requests is its cost."""
    targets = {name: make_target(spec, raw) for name, raw in spec.targets.items()}
    names = list(targets)
    stats = {name: Stats() for name in names}
    active = dict.fromkeys(names, 0.0)
    start = trio.current_time() + spec.warmup_s
    stop = start + spec.window_s
    for s in stats.values():
        s.window = (stop, stop)  # nothing counts during the warm-up
    cpu: dict[str, dict[str, float]] = {}
    turn = 0
    try:
        while (now := trio.current_time()) < stop:
            if "start" not in cpu and now >= start:
                # The window opens at the first slice boundary after the warm-up.
                cpu["start"] = _cpu(spec.watch)
                for s in stats.values():
                    s.window = (now, stop)
            name = names[turn % len(names)]
            turn += 1
            slice_end = min(now + spec.slice_s, stop) if now >= start else now + spec.slice_s
            while trio.current_time() < slice_end:
                await _request(targets[name], stats[name], spec.stream)
            if now >= start:
                active[name] += trio.current_time() - now
        cpu["stop"] = _cpu(spec.watch)
    finally:
        for target in targets.values():
            await target.aclose()
    cpu.setdefault("start", cpu["stop"])
    cpu_s = {name: round(cpu["stop"][name] - cpu["start"][name], 3) for name in cpu["stop"]}
    return {
        "mode": "alternate",
        "stream": spec.stream,
        "window_s": spec.window_s,
        "slice_s": spec.slice_s,
        "cpu_s": cpu_s,
        "targets": {
            name: {
                "active_s": round(active[name], 3),
                "completed": stats[name].completed,
                "errors": stats[name].errors,
                "error_samples": list(stats[name].error_samples),
                "events": stats[name].events,
                "latency_ms": summarize(stats[name].latency_ms),
                "ttft_ms": summarize(stats[name].ttft_ms),
            }
            for name in names
        },
    }


def main() -> None:
    spec = Spec(json.loads(sys.argv[1]))
    result = trio.run(run_alternating if spec.mode == "alternate" else run, spec)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
