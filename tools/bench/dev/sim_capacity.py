"""How much CPU the simulator spends per request and per SSE chunk, and how many tokens/s
one sim process sustains. Loopback only, bounded in time; prints one JSON line per scenario.

    .venv/bin/python tools/bench/dev/sim_capacity.py [--seconds 5]

The load comes from closed-loop workers in this process (the load generator's client);
the simulator is a separate `python -m narwhal.sim` process whose CPU time is read from
/proc.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchkit, one folder up
import loadgen
from benchkit import RUNS, cpu_seconds, harness

from narwhal.sim._http import request


class Totals:
    def __init__(self) -> None:
        self.requests = 0
        self.chunks = 0
        self.errors = 0


async def worker(
    pool: loadgen.Pool, body: bytes, stream: bool, deadline: float, totals: Totals
) -> None:
    while trio.current_time() < deadline:
        reply = loadgen.Reply()
        await pool.request(body, reply, stream=stream)
        totals.chunks += reply.events
        if reply.status == 200:
            totals.requests += 1
        else:
            totals.errors += 1
    pool.close()


async def scenario(
    name: str, zero: bool, *, conns: int, max_tokens: int, stream: bool, seconds: float
) -> dict[str, Any]:
    async with harness.Procs(RUNS / "logs" / "sim_capacity") as procs:
        ((url,),) = await harness.start_fleet(procs, engines=1, zero=zero)
        sim = procs.find("sim0")
        host, port = url.removeprefix("http://").rsplit(":", 1)
        body = json.dumps(
            {"prompt": "Hello there, simulator.", "max_tokens": max_tokens, "stream": stream}
        ).encode()

        async def load(n: int, until: float, totals: Totals) -> None:
            async with trio.open_nursery() as nursery:
                for _ in range(n):
                    pool = loadgen.Pool(host, int(port))
                    nursery.start_soon(worker, pool, body, stream, until, totals)

        # Warm-up, then the measured window.
        await load(min(conns, 8), trio.current_time() + 0.5, Totals())
        totals = Totals()
        cpu0, t0 = cpu_seconds(sim.pid), trio.current_time()
        await load(conns, t0 + seconds, totals)
        cpu1, t1 = cpu_seconds(sim.pid), trio.current_time()
        state = (await request(host, int(port), "GET", "/_sim/state?outcomes=0")).json()
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
        ("zero, non-stream, 1 token", True, 32, 1, False),
        ("zero, stream 64 tokens", True, 32, 64, True),
        ("law speed 1, stream 64 tokens", False, 128, 64, True),
        ("law speed 1, stream 64 tokens", False, 512, 64, True),
    ]
    for name, zero, conns, tokens, stream in runs:
        result = await scenario(
            name, zero, conns=conns, max_tokens=tokens, stream=stream, seconds=seconds
        )
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=5.0)
    trio.run(partial(main, p.parse_args().seconds))
