"""Open-loop replay of a goodput workload through one base URL (a process of its own).

    python tools/bench/goodput_loadgen.py --url http://127.0.0.1:8000 \
        --workload W.json --speed 0.25 --out RESULTS.jsonl --stats STATS.json

Every request is sent at its own time (model seconds / speed after the start), whatever
happened to the ones before: arrivals never wait for completions. Each is a streaming
``POST /v1/completions`` whose prompt is a list of token ids (an exact length for both
the engine and the router) and whose ``max_tokens`` is the trace's output length.

The client is bare h11 over trio sockets with a LIFO keep-alive pool, and it does not
parse SSE events: it looks for ``"text":"`` (first token), ``[DONE]`` and the usage
count in the raw bytes. That keeps it at a few tens of microseconds per chunk, so the
replay does not steal the CPU the simulated fleet and the router need; its own CPU use
and lateness (actual send time minus scheduled time) go to the stats file.

Per request, one JSON array per line:
``[index, lateness_s, status, outcome, ttft_s, tpot_s, tokens, end_s]`` (wall seconds;
``end_s`` from the replay's start). Outcomes: ok, refused (429), http_<status>[:<error code>],
stream_error[:<error code>] (an error event inside a 200 stream), truncated (stream ended without
[DONE]), timeout (the client gave up: no first token within --ttft-timeout-s, or not
finished within --total-timeout-s, both model seconds), conn_error.
TPOT is ``(last token time - first token time) / (tokens - 1)``.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import sys
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import h11
import trio

_DONE = b"data: [DONE]"
_TEXT = b'"text":"'
_EMPTY_TEXT = b'"text":""'
_USAGE = re.compile(rb'"completion_tokens":\s*(\d+)')
_ERROR = b'"error"'
_CODE = re.compile(rb'"code":\s*"([A-Za-z0-9_.:-]{1,64})"')
_TAIL = 32
_READ = 65536


class Pool:
    """Idle keep-alive connections, most recently used first.

    A connection idle for longer than `max_idle_s` is closed instead of reused: servers close
    idle keep-alive connections (hypercorn after 5 s), and a request sent on one that the
    server is closing would fail for the client's sake, not the server's.
    """

    def __init__(self, host: str, port: int, max_idle_s: float = 2.0) -> None:
        self.host = host
        self.port = port
        self.max_idle_s = max_idle_s
        self.idle: list[tuple[trio.SocketStream, h11.Connection, float]] = []
        self.opened = 0
        self.stale_retries = 0

    async def get(self) -> tuple[trio.SocketStream, h11.Connection, bool]:
        """(stream, connection, reused)."""
        now = trio.current_time()
        while self.idle:
            stream, conn, since = self.idle.pop()
            if now - since <= self.max_idle_s:
                return stream, conn, True
            with trio.move_on_after(1.0, shield=True):
                await stream.aclose()
        stream = await trio.open_tcp_stream(self.host, self.port)
        self.opened += 1
        return stream, h11.Connection(h11.CLIENT), False

    def put(self, stream: trio.SocketStream, conn: h11.Connection) -> None:
        self.idle.append((stream, conn, trio.current_time()))

    async def aclose(self) -> None:
        for stream, _, _ in self.idle:
            with trio.move_on_after(1.0, shield=True):
                await stream.aclose()
        self.idle.clear()


class Exchange:
    """What one request's response showed so far."""

    def __init__(self) -> None:
        self.status = 0
        self.outcome = "conn_error"
        self.first: float | None = None
        self.last = 0.0
        self.tokens = 0
        self.done = False
        self.got_bytes = False
        self.reusable = False


class Replay:
    def __init__(
        self,
        url: str,
        model: str,
        speed: float,
        ttft_timeout_s: float,
        total_timeout_s: float,
    ) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.model = model
        self.speed = speed
        self.ttft_timeout = ttft_timeout_s / speed
        self.total_timeout = total_timeout_s / speed
        self.pool = Pool(self.host, self.port)
        self.results: list[list[Any]] = []
        self.events = 0
        self.t0 = 0.0
        self.head = [
            ("host", f"{self.host}:{self.port}"),
            ("content-type", "application/json"),
            ("accept", "text/event-stream"),
        ]

    def body(self, prompt: int, output: int) -> bytes:
        ids = b"[" + b"791," * (prompt - 1) + b"791]"
        return (
            b'{"model":'
            + json.dumps(self.model).encode()
            + b',"prompt":'
            + ids
            + b',"max_tokens":%d,"stream":true,"stream_options":{"include_usage":true}}' % output
        )

    async def one(self, index: int, at: float, prompt: int, output: int) -> None:
        scheduled = self.t0 + at / self.speed
        await trio.sleep_until(scheduled)
        sent = trio.current_time()
        body = self.body(prompt, output)
        ex = Exchange()
        with trio.CancelScope(deadline=sent + self.ttft_timeout) as scope:
            # A second attempt only when a reused keep-alive connection failed before the
            # server said anything (it was closing it): the request never reached the router.
            for _ in range(2):
                ex = Exchange()
                stream: trio.SocketStream | None = None
                reused = False
                try:
                    stream, conn, reused = await self.pool.get()
                    await self.exchange(stream, conn, body, ex, scope, sent)
                except (OSError, h11.ProtocolError, trio.BrokenResourceError):
                    if ex.status == 200:
                        ex.outcome = "truncated"
                    elif ex.status:
                        ex.outcome = "refused" if ex.status == 429 else f"http_{ex.status}"
                    else:
                        ex.outcome = "conn_error"
                finally:
                    if stream is not None:
                        if ex.reusable and not scope.cancel_called:
                            self.pool.put(stream, conn)
                        else:
                            with trio.move_on_after(1.0, shield=True):
                                await stream.aclose()
                if ex.outcome == "conn_error" and reused and not ex.got_bytes:
                    self.pool.stale_retries += 1
                    continue
                break
        if scope.cancelled_caught:
            ex.outcome = "timeout"
        end = trio.current_time()
        tokens = ex.tokens
        if ex.outcome == "ok" and tokens == 0:
            tokens = output
        ttft = None if ex.first is None else round(ex.first - sent, 6)
        tpot = None
        if ex.first is not None and tokens > 1:
            tpot = round((ex.last - ex.first) / (tokens - 1), 7)
        self.results.append(
            [
                index,
                round(sent - scheduled, 6),
                ex.status,
                ex.outcome,
                ttft,
                tpot,
                tokens,
                round(end - self.t0, 6),
            ]
        )

    async def exchange(
        self,
        stream: trio.SocketStream,
        conn: h11.Connection,
        body: bytes,
        ex: Exchange,
        scope: trio.CancelScope,
        sent: float,
    ) -> None:
        head = [*self.head, ("content-length", str(len(body)))]
        out = conn.send(h11.Request(method="POST", target="/v1/completions", headers=head))
        out = (out or b"") + (conn.send(h11.Data(data=body)) or b"")
        out += conn.send(h11.EndOfMessage()) or b""
        await stream.send_all(out)
        tail = b""
        error_body = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(_READ)
                if data:
                    ex.got_bytes = True
                # b"" tells h11 the peer closed: it then reports ConnectionClosed, or a
                # ProtocolError for a message cut short.
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Response):
                ex.status = event.status_code
                continue
            if isinstance(event, h11.Data):
                data = bytes(event.data)
                if ex.status != 200:
                    error_body = (error_body + data)[-4096:]
                    continue
                self.events += 1
                window = tail + data
                if _TEXT in window:
                    now = trio.current_time()
                    if ex.first is None and window.count(_TEXT) > window.count(_EMPTY_TEXT):
                        ex.first = now
                        scope.deadline = sent + self.total_timeout
                    ex.last = now
                if _DONE in window:
                    ex.done = True
                if b'"usage"' in window:
                    m = _USAGE.search(window)
                    if m is not None:
                        ex.tokens = int(m.group(1))
                if _ERROR in data:
                    code = _CODE.search(window)
                    ex.outcome = "stream_error" + (f":{code.group(1).decode()}" if code else "")
                tail = window[-_TAIL:]
                continue
            if isinstance(event, h11.EndOfMessage):
                if ex.status == 429:
                    ex.outcome = "refused"
                elif ex.status != 200:
                    code = _CODE.search(error_body)
                    ex.outcome = f"http_{ex.status}" + (
                        f":{code.group(1).decode()}" if code else ""
                    )
                elif not ex.outcome.startswith("stream_error"):
                    ex.outcome = "ok" if ex.done and ex.first is not None else "truncated"
                if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                    conn.start_next_cycle()
                    ex.reusable = True
                return
            if isinstance(event, h11.ConnectionClosed):
                ex.outcome = f"http_{ex.status}" if ex.status not in (0, 200) else "truncated"
                if ex.status == 0:
                    ex.outcome = "conn_error"
                return

    async def run(self, requests: list[list[Any]], start_delay_s: float) -> float:
        self.t0 = trio.current_time() + start_delay_s
        async with trio.open_nursery() as nursery:
            for index, (at, prompt, output) in enumerate(requests):
                # Start tasks a little ahead of their time so a large workload does not
                # hold thousands of sleeping tasks at once.
                await trio.sleep_until(self.t0 + at / self.speed - 1.0)
                nursery.start_soon(self.one, index, at, prompt, output)
        await self.pool.aclose()
        return trio.current_time() - self.t0


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--workload", required=True, help='JSON {"requests": [[t, prompt, output]]}')
    p.add_argument("--speed", type=float, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--stats", required=True)
    p.add_argument("--ttft-timeout-s", type=float, default=20.0, help="model seconds")
    p.add_argument("--total-timeout-s", type=float, default=120.0, help="model seconds")
    p.add_argument("--start-delay-s", type=float, default=0.5, help="wall seconds")
    args = p.parse_args(argv)
    with open(args.workload, encoding="utf-8") as fh:
        requests = json.load(fh)["requests"]
    replay = Replay(args.url, args.model, args.speed, args.ttft_timeout_s, args.total_timeout_s)
    cpu0 = _cpu()
    wall = trio.run(partial(replay.run, requests, args.start_delay_s))
    cpu = _cpu() - cpu0
    replay.results.sort(key=lambda r: int(r[0]))
    with open(args.out, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(row) + "\n" for row in replay.results)
    late = sorted(r[1] for r in replay.results)
    stats = {
        "requests": len(replay.results),
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "cpu_share": round(cpu / wall, 3) if wall > 0 else None,
        "cpu_ms_per_request": round(1000 * cpu / max(len(late), 1), 3),
        "cpu_us_per_chunk": round(1e6 * cpu / max(replay.events, 1), 1),
        "chunks": replay.events,
        "connections_opened": replay.pool.opened,
        "stale_connection_retries": replay.pool.stale_retries,
        "lateness_s": {
            "p50": late[len(late) // 2] if late else None,
            "p99": late[int(len(late) * 0.99)] if late else None,
            "max": late[-1] if late else None,
        },
    }
    with open(args.stats, "w", encoding="utf-8") as fh:
        json.dump(stats, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
