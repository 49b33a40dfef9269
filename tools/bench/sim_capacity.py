"""How much CPU the simulator spends per request and per SSE chunk, and how many tokens/s
one sim process sustains. Loopback only, bounded in time; prints one JSON line per scenario.

    .venv/bin/python tools/bench/sim_capacity.py [--seconds 5]

The load generator is a bare h11 client in this process; the simulator is a separate
`python -m narwhal.sim` process whose CPU time is read from /proc.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from functools import partial
from typing import Any

import h11
import trio

from narwhal.sim._http import request

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


class Totals:
    def __init__(self) -> None:
        self.requests = 0
        self.chunks = 0
        self.tokens = 0
        self.errors = 0


async def worker(port: int, body: bytes, deadline: float, totals: Totals) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    conn = h11.Connection(h11.CLIENT)
    head = [
        ("host", f"127.0.0.1:{port}"),
        ("content-type", "application/json"),
        ("content-length", str(len(body))),
    ]
    try:
        while trio.current_time() < deadline:
            out = conn.send(h11.Request(method="POST", target="/v1/completions", headers=head))
            out = (out or b"") + (conn.send(h11.Data(data=body)) or b"")
            out += conn.send(h11.EndOfMessage()) or b""
            await stream.send_all(out)
            status = 0
            while True:
                ev = conn.next_event()
                if ev is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                    continue
                if isinstance(ev, h11.Response):
                    status = ev.status_code
                elif isinstance(ev, h11.Data):
                    data = bytes(ev.data)
                    totals.chunks += data.count(b"data: {")
                elif isinstance(ev, h11.EndOfMessage):
                    break
            if status == 200:
                totals.requests += 1
            else:
                totals.errors += 1
            conn.start_next_cycle()
    finally:
        await stream.aclose()


async def scenario(
    name: str, args: list[str], *, conns: int, max_tokens: int, stream: bool, seconds: float
) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "narwhal.sim", "--port", "0", "--engines", "1", *args]
    proc = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        with trio.fail_after(20):
            line = b""
            while not line.endswith(b"\n"):
                line += await proc.stdout.receive_some(1)
        port = int(line.decode().strip().rsplit(":", 1)[1])
        body = json.dumps(
            {"prompt": "Hello there, simulator.", "max_tokens": max_tokens, "stream": stream}
        ).encode()
        # Warm-up, then the measured window.
        warm = Totals()
        async with trio.open_nursery() as n:
            for _ in range(min(conns, 8)):
                n.start_soon(worker, port, body, trio.current_time() + 0.5, warm)
        totals = Totals()
        cpu0, t0 = cpu_seconds(proc.pid), trio.current_time()
        async with trio.open_nursery() as n:
            for _ in range(conns):
                n.start_soon(worker, port, body, t0 + seconds, totals)
        cpu1, t1 = cpu_seconds(proc.pid), trio.current_time()
        state = (await request("127.0.0.1", port, "GET", "/_sim/state?outcomes=0")).json()
    finally:
        proc.terminate()
        with trio.move_on_after(5):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
    wall = t1 - t0
    cpu = cpu1 - cpu0
    tokens = totals.requests * max_tokens
    return {
        "scenario": name,
        "conns": conns,
        "requests_per_s": round(totals.requests / wall, 1),
        "tokens_per_s": round(tokens / wall),
        "chunks_per_s": round(totals.chunks / wall),
        "sim_cpu_share": round(cpu / wall, 2),
        "sim_cpu_ms_per_request": round(1000 * cpu / max(totals.requests, 1), 3),
        "sim_cpu_us_per_chunk": round(1e6 * cpu / max(totals.chunks, 1), 1) if stream else None,
        "tokens_per_chunk": round(tokens / max(totals.chunks, 1), 2) if stream else None,
        "errors": totals.errors,
        # Steps on which the sim fell more than 20 ms behind the law (CPU-bound).
        "step_lag_resets": state["step_lag"]["resets"],
        "max_step_lag_ms": round(1000 * state["step_lag"]["max_s"], 1),
    }


async def main(seconds: float) -> None:
    runs = [
        ("zero, non-stream, 1 token", ["--zero"], 32, 1, False),
        ("zero, stream 64 tokens", ["--zero"], 32, 64, True),
        ("law speed 1, stream 64 tokens", [], 128, 64, True),
        ("law speed 1, stream 64 tokens", [], 512, 64, True),
    ]
    for name, args, conns, tokens, stream in runs:
        result = await scenario(
            name, args, conns=conns, max_tokens=tokens, stream=stream, seconds=seconds
        )
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=5.0)
    trio.run(partial(main, p.parse_args().seconds))
