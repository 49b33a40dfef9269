"""The benchmarks' load generator: bare h11 on trio sockets, run as a process of its own.

    .venv/bin/python tools/bench/loadgen.py '<spec JSON>'   # prints one JSON result line

Why not httpx: its pool costs grow with the number of connections (63 ms of client CPU
per request at 256 in flight in ../shared/notes/stack-feasibility.md), which would bury
what is being measured. This client costs about 0.16 ms per request and a few tens of
microseconds per streamed chunk: it looks for markers in the raw bytes instead of parsing
SSE events.

Modes (`spec["mode"]`):

- "router" (overhead.py): `concurrency` closed-loop workers, each on its keep-alive
  connection, POST one body to one target (Narwhal or vllm-router), which runs both legs;
- "direct": the same, but each worker runs the vLLM P/D protocol itself against the
  engines, the legs exactly as Narwhal builds them (prefill with do_remote_decode and
  max_tokens 1; then decode with the prefill's kv_transfer_params): the difference
  between the two is what a router adds;
  Both: warm up for `warmup_s`, measure for `window_s`, then no new requests and up to
  `drain_s` for those in flight; a request counts when it completes inside the window.
  The CPU seconds of the `watch`ed processes, of this one and of the machine are read at
  the window's edges, by this process, so they cover exactly the window;
- "alternate": one client switching between named `targets` every `slice_s` within one
  window, so every target sees the same disturbance (concurrency 1);
- "replay" (the trace benchmarks): open loop, every request of `workload` sent at its
  own time (model seconds / `speed` after the start) whatever happened to the ones
  before; rows to `out`, stats to `stats` (formats at `replay`);
- "flood" (memory.py): `concurrency` workers share `requests` non-streaming requests,
  each sending its next as soon as its previous one is answered.

A stream succeeded only if it ended with `data: [DONE]` and carried no error event:
routers report failures after the 200 as a terminal `data: {"error": ...}` event.
"""

from __future__ import annotations

import json
import os
import re
import resource
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import h11
import trio
from benchkit import Json, cpu_seconds, machine_cpu_seconds, summarize, tree_cpu_seconds

from narwhal.engines._dialects import vllm_decode_body, vllm_kv_params, vllm_prefill_body

PATH = b"/v1/completions"
_READ = 65536
_TAIL = 32
_MAX_ERROR_SAMPLES = 5
_DATA = b"data: {"
_DONE = b"data: [DONE]"
_ERROR = b'"error"'
_ERROR_EVENT = b'data: {"error"'
_TEXT = b'"text":"'
_EMPTY_TEXT = b'"text":""'
_USAGE = re.compile(rb'"completion_tokens":\s*(\d+)')
_CODE = re.compile(rb'"code":\s*"([A-Za-z0-9_.:-]{1,64})"')


# ---------------------------------------------------------------------------- the client


class Broken(Exception):
    """The connection failed before the response ended."""


class Connection:
    __slots__ = ("h11", "host", "last_used", "port", "stream")

    def __init__(self, host: str, port: int, stream: trio.SocketStream) -> None:
        self.host = host
        self.port = port
        self.stream = stream
        self.h11 = h11.Connection(our_role=h11.CLIENT)
        self.last_used = trio.current_time()

    def close(self) -> None:
        self.stream.socket.close()


class Pool:
    """Idle keep-alive connections to one address, most recently used first.

    A connection idle for longer than `max_idle_s` is closed instead of reused: servers
    close idle keep-alive connections (hypercorn and the simulator after 5 s), and a
    request sent on one the server is closing would fail for the client's sake.
    """

    def __init__(self, host: str, port: int, max_idle_s: float = 2.0) -> None:
        self.host = host
        self.port = port
        self.max_idle_s = max_idle_s
        self.idle: list[Connection] = []
        self.opened = 0

    async def get(self) -> tuple[Connection, bool]:
        """(a connection, whether it was reused). Raises OSError if connecting fails."""
        now = trio.current_time()
        while self.idle:
            conn = self.idle.pop()
            if now - conn.last_used <= self.max_idle_s:
                return conn, True
            conn.close()
        stream = await trio.open_tcp_stream(self.host, self.port)
        self.opened += 1
        return Connection(self.host, self.port, stream), False

    async def request(
        self,
        body: bytes,
        reply: Reply,
        *,
        stream: bool,
        on_first_text: Callable[[], object] | None = None,
    ) -> None:
        """One POST on a connection of this pool, kept for the next request if the
        exchange left it reusable, closed otherwise (a failure, a cancellation)."""
        conn, reply.reused = await self.get()
        try:
            await exchange(conn, body, reply, stream=stream, on_first_text=on_first_text)
        except BaseException:
            conn.close()
            raise
        if reply.reusable:
            self.idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()


class Reply:
    """What a response showed so far: status, body (not a 200 stream), and for a 200
    stream its reads, SSE data events, first event, first and last text, [DONE], the
    usage count and any error event, found in the raw bytes."""

    __slots__ = (
        "body",
        "done",
        "error",
        "error_code",
        "events",
        "first_event_at",
        "first_text_at",
        "got_bytes",
        "last_text_at",
        "reads",
        "reusable",
        "reused",
        "status",
        "tail",
        "tokens",
    )

    def __init__(self) -> None:
        self.status = 0
        self.body = bytearray()
        self.reads = 0
        self.events = 0
        self.first_event_at = 0.0
        self.first_text_at: float | None = None
        self.last_text_at = 0.0
        self.done = False
        self.tokens = 0
        self.error: bytes | None = None
        self.error_code: str | None = None
        self.tail = b""
        self.got_bytes = False
        self.reusable = False
        self.reused = False

    def feed(self, data: bytes, now: float) -> bool:
        """Account one read of a 200 stream; True when it brought the first text."""
        self.reads += 1
        events = data.count(_DATA)
        if events:
            self.events += events
            self.first_event_at = self.first_event_at or now
        # Joined with the previous tail so that a marker split across reads is seen.
        window = self.tail + data
        first = False
        # A text marker counts once: in the read where it ends, not again from the tail.
        fresh = max(0, len(self.tail) - len(_TEXT) + 1)
        if window.find(_TEXT, fresh) >= 0:
            texts, empty = window.count(_TEXT, fresh), window.count(_EMPTY_TEXT, fresh)
            if self.first_text_at is None and texts > empty:
                self.first_text_at = now
                first = True
            self.last_text_at = now
        if _DONE in window:
            self.done = True
        if b'"usage"' in window:
            usage = _USAGE.search(window)
            if usage is not None:
                self.tokens = int(usage.group(1))
        if _ERROR in data:
            code = _CODE.search(window)
            self.error_code = code.group(1).decode() if code else ""
            if self.error is None:
                at = window.find(_ERROR_EVENT)
                self.error = window[at:] if at >= 0 else window
        self.tail = window[-_TAIL:]
        return first

    def stream_failure(self) -> str | None:
        if self.error is not None:
            return f"error event in a 200 stream: {self.error[:200]!r}"
        if not self.done:
            return f"stream ended without [DONE]: {self.tail!r}"
        return None


async def exchange(
    conn: Connection,
    body: bytes,
    reply: Reply,
    *,
    stream: bool,
    on_first_text: Callable[[], object] | None = None,
) -> None:
    """One POST on a keep-alive connection, accounted in `reply` as it arrives (so a
    caller sees how far it got when this raises Broken)."""
    h = conn.h11
    headers = [
        (b"host", f"{conn.host}:{conn.port}".encode()),
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
    ]
    if stream:
        headers.append((b"accept", b"text/event-stream"))
    wire = h.send(h11.Request(method=b"POST", target=PATH, headers=headers)) or b""
    wire += h.send(h11.Data(data=body)) or b""
    wire += h.send(h11.EndOfMessage()) or b""
    try:
        await conn.stream.send_all(wire)
        while True:
            event = h.next_event()
            if event is h11.NEED_DATA:
                data = await conn.stream.receive_some(_READ)
                reply.got_bytes = reply.got_bytes or bool(data)
                # b"" tells h11 the peer closed: a ProtocolError for a message cut short.
                h.receive_data(data)
                continue
            kind = type(event)
            if kind is h11.Data:
                data = bytes(event.data)  # type: ignore[union-attr]
                if stream and reply.status == 200:
                    if reply.feed(data, trio.current_time()) and on_first_text is not None:
                        on_first_text()
                else:
                    reply.body += data
            elif kind is h11.Response:
                reply.status = event.status_code  # type: ignore[union-attr]
            elif kind is h11.EndOfMessage:
                break
            elif kind is h11.ConnectionClosed:
                raise Broken("connection closed before the response ended")
    except (h11.ProtocolError, trio.BrokenResourceError, OSError) as exc:
        raise Broken(f"{type(exc).__name__}: {exc}") from None
    if h.our_state is h11.DONE and h.their_state is h11.DONE:
        h.start_next_cycle()
        conn.last_used = trio.current_time()
        reply.reusable = True


def _address(value: Sequence[Any]) -> tuple[str, int]:
    return str(value[0]), int(value[1])


def _cpu(pids: dict[str, int]) -> dict[str, float]:
    busy, interrupts = machine_cpu_seconds()
    out = {"loadgen": cpu_seconds(os.getpid()), "machine": busy, "machine_irq": interrupts}
    for name, pid in pids.items():
        out[name] = tree_cpu_seconds(pid)  # a Narwhal's worker processes are its
        out[f"{name}/core"] = cpu_seconds(pid)  # and this, the part of it the process's own
    return out


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------------------- closed loop


class Stats:
    def __init__(self) -> None:
        self.window = (0.0, 0.0)
        self.completed = 0
        self.errors = 0
        self.error_samples: list[str] = []
        self.latency_ms: list[float] = []
        self.ttft_ms: list[float] = []
        self.events = 0

    def in_window(self, t: float) -> bool:
        return self.window[0] <= t <= self.window[1]

    def error(self, t: float, message: str) -> None:
        if self.in_window(t):
            self.errors += 1
        if len(self.error_samples) < _MAX_ERROR_SAMPLES:
            self.error_samples.append(message[:300])

    def record(self, reply: Reply, started: float, ended: float, stream: bool) -> None:
        if reply.status != 200:
            self.error(ended, f"HTTP {reply.status}: {bytes(reply.body[:200])!r}")
            return
        failure = reply.stream_failure() if stream else None
        if failure is not None:
            self.error(ended, failure)
            return
        if not self.in_window(ended):
            return
        self.completed += 1
        self.latency_ms.append(1000 * (ended - started))
        if reply.first_event_at:
            self.ttft_ms.append(1000 * (reply.first_event_at - started))
        self.events += reply.events

    def to_json(self) -> dict[str, Json]:
        return {
            "completed": self.completed,
            "errors": self.errors,
            "error_samples": list(self.error_samples),
            "events": self.events,
            "latency_ms": summarize(self.latency_ms),
            "ttft_ms": summarize(self.ttft_ms),
        }


class Target:
    """One way to send the spec's request: to a router, or both P/D legs to the engines.
    Each worker has its own, so each holds at most one connection per address."""

    def __init__(self, spec: dict[str, Any], where: dict[str, Any]) -> None:
        self.body = spec["body"]
        self.stream = bool(self.body.get("stream"))
        self.direct = "target" not in where
        if self.direct:
            self.legs: tuple[Pool, ...] = (
                Pool(*_address(where["prefill"])),
                Pool(*_address(where["decode"])),
            )
            # The legs exactly as Narwhal builds them, so the comparison is transport only.
            self.first = json.dumps(vllm_prefill_body(self.body)).encode()
        else:
            self.legs = (Pool(*_address(where["target"])),)
            self.first = json.dumps(self.body).encode()

    async def once(self) -> Reply:
        if not self.direct:
            return await self._leg(self.legs[0], self.first, stream=self.stream)
        prefill = await self._leg(self.legs[0], self.first, stream=False)
        if prefill.status != 200:
            return prefill
        params = vllm_kv_params(json.loads(prefill.body))
        body = json.dumps(vllm_decode_body(self.body, params)).encode()
        return await self._leg(self.legs[1], body, stream=self.stream)

    async def _leg(self, pool: Pool, body: bytes, *, stream: bool) -> Reply:
        reply = Reply()
        await pool.request(body, reply, stream=stream)
        return reply

    def close(self) -> None:
        for pool in self.legs:
            pool.close()


async def _request(target: Target, stats: Stats) -> None:
    """One request, recorded in `stats`; a failure drops the target's connections."""
    started = trio.current_time()
    try:
        reply = await target.once()
    except (Broken, OSError, ValueError) as exc:
        target.close()
        stats.error(trio.current_time(), str(exc))
        await trio.sleep(0.01)
        return
    stats.record(reply, started, trio.current_time(), target.stream)


async def closed_loop(spec: dict[str, Any]) -> dict[str, Json]:
    """Modes "router" and "direct" (the target given at the spec's top level)."""
    concurrency = int(spec.get("concurrency", 1))
    watch: dict[str, int] = spec.get("watch", {})
    stats = Stats()
    start = trio.current_time() + spec["warmup_s"]
    stop_at = start + spec["window_s"]
    stats.window = (start, stop_at)
    cpu: dict[str, dict[str, float]] = {}

    async def sample_cpu() -> None:
        await trio.sleep_until(start)
        cpu["start"] = _cpu(watch)
        await trio.sleep_until(stop_at)
        cpu["stop"] = _cpu(watch)

    async def worker() -> None:
        target = Target(spec, spec)
        try:
            while trio.current_time() < stop_at:
                await _request(target, stats)
        finally:
            target.close()

    with trio.move_on_after(
        spec["warmup_s"] + spec["window_s"] + spec.get("drain_s", 10.0)
    ) as drain:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample_cpu)
            for _ in range(concurrency):
                nursery.start_soon(worker)
    cpu_s = {name: cpu["stop"][name] - cpu["start"][name] for name in cpu["stop"]}
    return {
        "mode": spec["mode"],
        "concurrency": concurrency,
        "stream": bool(spec["body"].get("stream")),
        "window_s": spec["window_s"],
        "drain_cut": drain.cancelled_caught,
        "requests_per_s": stats.completed / spec["window_s"],
        **stats.to_json(),
        "cpu_s": {name: round(value, 3) for name, value in cpu_s.items()},
    }


async def alternate(spec: dict[str, Any]) -> dict[str, Json]:
    """One client that switches target every `slice_s`, round-robin, so that every target
    sees the same disturbance from the rest of the machine (concurrency 1 only: at higher
    concurrency each switch would need its own warm-up). Idle routers use no CPU, so a
    router's CPU over the whole window divided by its own requests is its cost."""
    targets = {name: Target(spec, where) for name, where in spec["targets"].items()}
    names = list(targets)
    stats = {name: Stats() for name in names}
    active = dict.fromkeys(names, 0.0)
    slice_s = spec.get("slice_s", 0.5)
    watch: dict[str, int] = spec.get("watch", {})
    start = trio.current_time() + spec["warmup_s"]
    stop = start + spec["window_s"]
    for s in stats.values():
        s.window = (stop, stop)  # nothing counts during the warm-up
    cpu: dict[str, dict[str, float]] = {}
    turn = 0
    try:
        while (now := trio.current_time()) < stop:
            if "start" not in cpu and now >= start:
                # The window opens at the first slice boundary after the warm-up.
                cpu["start"] = _cpu(watch)
                for s in stats.values():
                    s.window = (now, stop)
            name = names[turn % len(names)]
            turn += 1
            slice_end = min(now + slice_s, stop) if now >= start else now + slice_s
            while trio.current_time() < slice_end:
                await _request(targets[name], stats[name])
            if now >= start:
                active[name] += trio.current_time() - now
        cpu["stop"] = _cpu(watch)
    finally:
        for target in targets.values():
            target.close()
    cpu.setdefault("start", cpu["stop"])
    cpu_s = {name: round(cpu["stop"][name] - cpu["start"][name], 3) for name in cpu["stop"]}
    return {
        "mode": "alternate",
        "stream": bool(spec["body"].get("stream")),
        "window_s": spec["window_s"],
        "slice_s": slice_s,
        "cpu_s": cpu_s,
        "targets": {
            name: {"active_s": round(active[name], 3), **stats[name].to_json()} for name in names
        },
    }


# ---------------------------------------------------------------------------- open loop


class Replay:
    """Every request of a workload at its own time, through one base URL (or several in
    turn).

    Each is a streaming `POST /v1/completions` whose prompt is a list of token ids (an
    exact length for both the engine and the router), or the workload's own text when it
    gives one (prefix_goodput.py's shared prefixes), and whose `max_tokens` is the
    trace's output length. Per request, one row:
    `[index, lateness_s, status, outcome, ttft_s, tpot_s, tokens, end_s, target]` (wall
    seconds; `end_s` from the replay's start; `target`: the index of the URL that took
    it). Outcomes: ok, refused (429),
    http_<status>[:<error code>], stream_error[:<error code>] (an error event inside a 200
    stream), truncated (ended without [DONE]), timeout (no first token within
    `ttft_timeout_s`, or not finished within `total_timeout_s`, both model seconds),
    conn_error. TTFT is to the first non-empty text; TPOT is
    `(last text - first text) / (tokens - 1)`.
    """

    def __init__(self, spec: dict[str, Any]) -> None:
        self.model = spec["model"]
        self.speed = float(spec["speed"])
        self.ttft_timeout = spec.get("ttft_timeout_s", 20.0) / self.speed
        self.total_timeout = spec.get("total_timeout_s", 120.0) / self.speed
        # Several base URLs, comma-separated (replicas): request i goes to URL i mod n,
        # as a balancer would, skipping one that refused a connection (down for good:
        # a balancer's health check with redispatch).
        self.pools = [
            Pool(parts.hostname or "127.0.0.1", parts.port or 80)
            for parts in map(urlsplit, spec["url"].split(","))
        ]
        self.down: set[int] = set()
        # {"pid": N, "at_s": model seconds}: SIGKILL that process then (a replica's
        # crash); when it was sent, in seconds after the start (`killed_at_s`).
        self.kill: dict[str, Any] | None = spec.get("kill")
        self.killed_at_s: float | None = None
        self.killed_at_epoch: float | None = None
        self.rows: list[list[Any]] = []
        self.reads = 0
        self.stale_retries = 0
        self.t0 = 0.0

    def body(self, prompt: int | str, output: int) -> bytes:
        if isinstance(prompt, str):
            encoded = json.dumps(prompt).encode()
        else:
            encoded = b"[" + b"791," * (prompt - 1) + b"791]"
        return (
            b'{"model":'
            + json.dumps(self.model).encode()
            + b',"prompt":'
            + encoded
            + b',"max_tokens":%d,"stream":true,"stream_options":{"include_usage":true}}' % output
        )

    async def one(self, index: int, at: float, prompt: int | str, output: int) -> None:
        scheduled = self.t0 + at / self.speed
        await trio.sleep_until(scheduled)
        sent = trio.current_time()
        body = self.body(prompt, output)
        reply = Reply()
        outcome = "conn_error"
        with trio.CancelScope(deadline=sent + self.ttft_timeout) as scope:

            def first_text() -> None:
                scope.deadline = sent + self.total_timeout

            target = index % len(self.pools)
            for _ in range(1 + len(self.pools)):
                reply = Reply()
                if target in self.down and len(self.down) < len(self.pools):
                    target = next(
                        (target + k) % len(self.pools)
                        for k in range(len(self.pools))
                        if (target + k) % len(self.pools) not in self.down
                    )
                try:
                    pool = self.pools[target]
                    await pool.request(body, reply, stream=True, on_first_text=first_text)
                    outcome = stream_outcome(reply)
                except (Broken, OSError):
                    outcome = broken_outcome(reply)
                finally:
                    self.reads += reply.reads
                # A reused keep-alive connection that failed before the server said anything
                # was being closed by it: the request never reached the router. Once more.
                if outcome == "conn_error" and reply.reused and not reply.got_bytes:
                    self.stale_retries += 1
                    continue
                # Refused outright: that replica is gone, and the balancer sends the
                # request to the next one.
                if outcome == "conn_error" and not reply.reused and len(self.pools) > 1:
                    self.down.add(target)
                    if len(self.down) < len(self.pools):
                        continue
                break
        if scope.cancelled_caught:
            outcome = "timeout"
        end = trio.current_time()
        tokens = reply.tokens
        if outcome == "ok" and tokens == 0:
            tokens = output
        first = reply.first_text_at
        ttft = None if first is None else round(first - sent, 6)
        tpot = None
        if first is not None and tokens > 1:
            tpot = round((reply.last_text_at - first) / (tokens - 1), 7)
        self.rows.append(
            [index, round(sent - scheduled, 6), reply.status, outcome, ttft, tpot, tokens,
             round(end - self.t0, 6), target]
        )  # fmt: skip

    async def run(self, requests: list[list[Any]], start_delay_s: float) -> float:
        self.t0 = trio.current_time() + start_delay_s
        async with trio.open_nursery() as nursery:
            if self.kill is not None:
                nursery.start_soon(self._kill, self.kill)
            for index, (at, prompt, output) in enumerate(requests):
                # Start tasks a little ahead of their time so a large workload does not
                # hold thousands of sleeping tasks at once.
                await trio.sleep_until(self.t0 + at / self.speed - 1.0)
                nursery.start_soon(self.one, index, at, prompt, output)
        for pool in self.pools:
            pool.close()
        return trio.current_time() - self.t0

    async def _kill(self, kill: dict[str, Any]) -> None:
        await trio.sleep_until(self.t0 + float(kill["at_s"]) / self.speed)
        os.kill(int(kill["pid"]), 9)
        self.killed_at_s = round(trio.current_time() - self.t0, 6)
        self.killed_at_epoch = time.time()


def stream_outcome(reply: Reply) -> str:
    """The outcome of a replayed request whose response ended."""
    if reply.status == 429:
        return "refused"
    if reply.status != 200:
        code = _CODE.search(bytes(reply.body[-4096:]))
        return f"http_{reply.status}" + (f":{code.group(1).decode()}" if code else "")
    if reply.error_code is not None:
        return "stream_error" + (f":{reply.error_code}" if reply.error_code else "")
    return "ok" if reply.done and reply.first_text_at is not None else "truncated"


def broken_outcome(reply: Reply) -> str:
    """The outcome of a replayed request whose connection failed first."""
    if reply.status == 200:
        return "truncated"
    if reply.status:
        return "refused" if reply.status == 429 else f"http_{reply.status}"
    return "conn_error"


async def replay(spec: dict[str, Any]) -> dict[str, Json]:
    """Mode "replay": rows (one JSON array a line, by index) to `out`, and stats (CPU,
    lateness = actual send time minus scheduled time) to `stats`, which it also returns."""
    requests = json.loads(await trio.Path(spec["workload"]).read_text())["requests"]
    run = Replay(spec)
    cpu0 = _own_cpu()
    wall = await run.run(requests, spec.get("start_delay_s", 0.5))
    cpu = _own_cpu() - cpu0
    run.rows.sort(key=lambda r: int(r[0]))
    await trio.Path(spec["out"]).write_text("".join(json.dumps(row) + "\n" for row in run.rows))
    late = sorted(r[1] for r in run.rows)
    stats = {
        "requests": len(run.rows),
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "cpu_share": round(cpu / wall, 3) if wall > 0 else None,
        "cpu_ms_per_request": round(1000 * cpu / max(len(late), 1), 3),
        "cpu_us_per_chunk": round(1e6 * cpu / max(run.reads, 1), 1),
        "chunks": run.reads,
        "connections_opened": sum(pool.opened for pool in run.pools),
        "stale_connection_retries": run.stale_retries,
        "targets_down": sorted(run.down),
        "killed_at_s": run.killed_at_s,
        "killed_at_epoch": run.killed_at_epoch,
        "lateness_s": {
            "p50": late[len(late) // 2] if late else None,
            "p99": late[int(len(late) * 0.99)] if late else None,
            "max": late[-1] if late else None,
        },
    }
    await trio.Path(spec["stats"]).write_text(json.dumps(stats))
    return stats


# ---------------------------------------------------------------------------- flood


def outcome_of(status: int, body: bytes) -> str:
    """A flood answer: "ok" for 200, else the status and the error envelope's code
    ("429 queue_full")."""
    if status == 200:
        return "ok"
    code = "unparsed"
    try:
        document = json.loads(body)
    except ValueError:
        document = None
    if isinstance(document, dict) and isinstance(document.get("error"), dict):
        code = str(document["error"].get("code") or "none")[:64]
    return f"{status} {code}"


async def flood(spec: dict[str, Any]) -> dict[str, Json]:
    """Mode "flood": each worker on its own keep-alive connection (reopened when the
    router closes it), so the router sees as many open sockets as workers and an offered
    rate bounded only by how fast it answers; refusals come back at once and the worker
    moves on. Outcome counts ("ok", "<status> <error code>", "timeout", "broken",
    "connect_error"), answer latency per outcome class, wall time, CPU."""
    parts = urlsplit(spec["url"])
    address = (parts.hostname or "127.0.0.1", parts.port or 80)
    total = int(spec["requests"])
    timeout_s = float(spec["request_timeout_s"])
    ids = ",".join(["791"] * int(spec["prompt_tokens"]))
    body = (
        f'{{"model":{json.dumps(spec["model"])},"prompt":[{ids}],'
        f'"max_tokens":{int(spec["max_tokens"])},"stream":false}}'
    ).encode()
    issued = 0
    outcomes: Counter[str] = Counter()
    latency: dict[str, list[float]] = {}
    pools: list[Pool] = []

    def done(outcome: str, seconds: float, *, connecting: bool = False) -> None:
        outcomes[outcome] += 1
        kind = outcome if outcome == "ok" else outcome.split(" ", 1)[0]
        # A connection's first request includes its connect and the router's accept: kept
        # apart, so a slow accept does not pass for a slow answer.
        if connecting:
            kind += " (with connect)"
        latency.setdefault(kind, []).append(seconds)

    async def worker() -> None:
        nonlocal issued
        pool = Pool(*address)
        pools.append(pool)
        while issued < total:
            issued += 1
            started = trio.current_time()
            reply = Reply()
            try:
                with trio.move_on_after(timeout_s) as timer:
                    await pool.request(body, reply, stream=False)
            except OSError:
                done("connect_error", trio.current_time() - started)
                continue
            except Broken:
                done("broken", trio.current_time() - started)
                continue
            if timer.cancelled_caught:
                done("timeout", trio.current_time() - started)
                continue
            outcome = outcome_of(reply.status, bytes(reply.body))
            done(outcome, trio.current_time() - started, connecting=not reply.reused)
        pool.close()

    started = trio.current_time()
    with trio.move_on_after(float(spec["deadline_s"])) as limit:
        async with trio.open_nursery() as nursery:
            for _ in range(int(spec["concurrency"])):
                nursery.start_soon(worker)
    for pool in pools:
        pool.close()
    wall = trio.current_time() - started
    answered = sum(outcomes.values())
    return {
        "requests": total,
        "answered": answered,
        "unanswered_at_deadline": total - answered if limit.cancelled_caught else 0,
        "hit_deadline": limit.cancelled_caught,
        "wall_s": round(wall, 2),
        "offered_per_s": round(answered / wall, 1) if wall > 0 else None,
        "connections_opened": sum(p.opened for p in pools),
        "outcomes": dict(sorted(outcomes.items())),
        "latency_s": {k: summarize(v, digits=4) for k, v in sorted(latency.items())},
        "cpu_s": round(_own_cpu(), 2),
    }


MODES = {
    "router": closed_loop,
    "direct": closed_loop,
    "alternate": alternate,
    "replay": replay,
    "flood": flood,
}


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        # Benchmarks start it with one spec; a person asking gets the docstring.
        print(__doc__)
        raise SystemExit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)
    spec = json.loads(sys.argv[1])
    print(json.dumps(trio.run(MODES[spec["mode"]], spec)), flush=True)


if __name__ == "__main__":
    main()
