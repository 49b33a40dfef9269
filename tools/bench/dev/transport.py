"""Engine transport alone: client CPU per request of Narwhal's ConnectionPool, one
httpx.AsyncClient, and httpx sharded into many small clients, at 1-512 requests in flight.

    .venv/bin/python tools/bench/dev/transport.py [--quick] [--reps N] [--replot]

Writes runs/bench/transport.json and runs/bench/transport.png (--quick: *-quick.*).

The engine is one zero-latency simulated vLLM engine (`python -m narwhal.sim --zero`) in
its own process. Each cell runs the client under test in a fresh process of its own
(this script with --worker): `inflight` trio tasks each send one non-streaming
completion (max_tokens 1) after another through the shared client and read the whole
body. The client's CPU is its process's utime+stime over the measurement window, so it
includes the trio scheduler and sockets, as a router would pay them.

All three clients may open 512 connections, so none of them ever waits for a slot:
- narwhal-pool: narwhal.engines.ConnectionPool(max_connections=512);
- httpx: one httpx.AsyncClient, Limits(max_connections=512, max_keepalive=512);
- httpx-sharded: 64 AsyncClients of 8 connections each, used round-robin (the
  workaround in ../shared/notes/stack-feasibility.md for httpcore's pool scans).
Cells are repeated --reps times with the clients interleaved in a rotating order; the
numbers reported are medians over repetitions.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchkit, one folder up
import benchkit
from benchkit import (
    GUARD_CORES,
    RUNS,
    Json,
    cpu_seconds,
    disturbance,
    git_revision,
    harness,
    load_average,
    machine,
    machine_cpu_seconds,
    measure_guarded,
    median,
    rotated,
    rounded,
    summarize,
    versions,
)

from narwhal.engines import ConnectionPool
from narwhal.sim import DEFAULT_MODEL

SELF = Path(__file__).resolve()
LOGS = RUNS / "logs"
CLIENTS = ("narwhal-pool", "httpx", "httpx-sharded")
INFLIGHT = (1, 16, 64, 256, 512)
MAX_CONNECTIONS = 512
SHARD_CONNECTIONS = 8
BODY = json.dumps(
    {"model": DEFAULT_MODEL, "prompt": "Hello there, engine.", "max_tokens": 1}
).encode()
HEADERS = [(b"content-type", b"application/json")]

# ---------------------------------------------------------------------------- worker


@asynccontextmanager
async def open_client(kind: str, host: str, port: int) -> AsyncIterator[Callable[[], Any]]:
    """A zero-argument coroutine function that sends one request and returns its status."""
    if kind == "narwhal-pool":
        pool = ConnectionPool(
            host,
            port,
            max_connections=MAX_CONNECTIONS,
            connect_timeout_s=10.0,
            pool_timeout_s=120.0,
        )

        async def send_pool() -> int:
            async with pool.request(b"POST", b"/v1/completions", HEADERS, BODY) as response:
                await response.aread(1 << 20)
                return response.status

        async with pool:
            yield send_pool
        return

    url = f"http://{host}:{port}/v1/completions"
    headers = {"content-type": "application/json"}
    timeout = httpx.Timeout(120.0)
    if kind == "httpx":
        limits = httpx.Limits(
            max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_CONNECTIONS
        )
        clients = [httpx.AsyncClient(limits=limits, timeout=timeout)]
    elif kind == "httpx-sharded":
        limits = httpx.Limits(
            max_connections=SHARD_CONNECTIONS, max_keepalive_connections=SHARD_CONNECTIONS
        )
        clients = [
            httpx.AsyncClient(limits=limits, timeout=timeout)
            for _ in range(MAX_CONNECTIONS // SHARD_CONNECTIONS)
        ]
    else:
        raise ValueError(f"unknown client {kind!r}")
    rotation = itertools.cycle(clients)

    async def send_httpx() -> int:
        response = await next(rotation).post(url, content=BODY, headers=headers)
        return response.status_code

    try:
        yield send_httpx
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            for client in clients:
                await client.aclose()


async def worker_main(
    kind: str, host: str, port: int, inflight: int, warmup_s: float, window_s: float, sim_pid: int
) -> dict[str, Json]:
    start = trio.current_time() + warmup_s
    stop = start + window_s
    latencies: list[float] = []
    completed = 0
    errors: list[str] = []
    cpu: dict[str, dict[str, float]] = {}

    def sample() -> dict[str, float]:
        busy, interrupts = machine_cpu_seconds()
        return {
            "client": cpu_seconds(os.getpid()),
            "sim": cpu_seconds(sim_pid),
            "machine": busy,
            "machine_irq": interrupts,
        }

    async with open_client(kind, host, port) as send:

        async def loop() -> None:
            nonlocal completed
            while True:
                t0 = trio.current_time()
                try:
                    status = await send()
                except Exception as exc:  # any failure is counted; the loop goes on
                    if len(errors) < 5:
                        errors.append(f"{type(exc).__name__}: {exc}"[:300])
                    await trio.sleep(0.01)
                    continue
                t1 = trio.current_time()
                if status != 200:
                    if len(errors) < 5:
                        errors.append(f"HTTP {status}")
                    continue
                if start <= t1 <= stop:
                    completed += 1
                    latencies.append(1000 * (t1 - t0))

        async with trio.open_nursery() as nursery:
            for _ in range(inflight):
                nursery.start_soon(loop)
            await trio.sleep_until(start)
            cpu["start"] = sample()
            await trio.sleep_until(stop)
            cpu["stop"] = sample()
            nursery.cancel_scope.cancel()
    delta = {k: round(cpu["stop"][k] - cpu["start"][k], 3) for k in cpu["stop"]}
    return {
        "client": kind,
        "inflight": inflight,
        "window_s": window_s,
        "completed": completed,
        "errors": errors,
        "latency_ms": summarize(latencies),
        "cpu_s": delta,
    }


# ---------------------------------------------------------------------------- orchestration


@attrs.frozen
class Plan:
    reps: int
    inflight: tuple[int, ...]
    clients: tuple[str, ...]
    warmup_s: float
    window_s: float
    settle_s: float
    quiet_give_up_s: float
    attempts: int
    quick: bool

    def to_json(self) -> dict[str, Json]:
        return {
            "reps": self.reps,
            "inflight": list(self.inflight),
            "clients": list(self.clients),
            "warmup_s": self.warmup_s,
            "window_s": self.window_s,
            "settle_s": self.settle_s,
            "guard_max_other_cores": GUARD_CORES,
            "quiet_give_up_s": self.quiet_give_up_s,
            "attempts_per_cell": self.attempts,
            "quick": self.quick,
            "max_connections": MAX_CONNECTIONS,
            "shard_connections": SHARD_CONNECTIONS,
            "shards": MAX_CONNECTIONS // SHARD_CONNECTIONS,
            "request_body": json.loads(BODY),
        }


def make_plan(*, quick: bool, reps: int | None) -> Plan:
    return Plan(
        reps=reps if reps is not None else (1 if quick else 3),
        inflight=INFLIGHT,
        clients=CLIENTS,
        warmup_s=1.0 if quick else 2.0,
        window_s=2.0 if quick else 5.0,
        settle_s=0.5,
        quiet_give_up_s=5.0 if quick else 10.0,
        attempts=2,
        quick=quick,
    )


def cell_metrics(raw: Mapping[str, Any]) -> dict[str, Json]:
    completed = int(raw["completed"])
    cpu = raw["cpu_s"]
    window = float(raw["window_s"])
    ours = float(cpu["client"]) + float(cpu["sim"])
    return {
        "completed": completed,
        "requests_per_s": round(completed / window, 1),
        "client_cpu_ms_per_request": rounded(1000 * cpu["client"] / completed)
        if completed
        else None,
        "client_cpu_share": round(cpu["client"] / window, 3),
        "sim_cpu_share": round(cpu["sim"] / window, 3),
        "other_cpu_share": round(
            max(0.0, float(cpu["machine"]) - float(cpu["machine_irq"]) - ours) / window, 3
        ),
        "irq_cpu_share": round(float(cpu["machine_irq"]) / window, 3),
        "latency_ms": raw["latency_ms"],
        "errors": raw["errors"],
    }


def median_of(cells: Sequence[Mapping[str, Json]]) -> dict[str, Json]:
    out: dict[str, Json] = {"reps": len(cells)}
    for key in (
        "client_cpu_ms_per_request",
        "requests_per_s",
        "client_cpu_share",
        "sim_cpu_share",
        "other_cpu_share",
    ):
        out[key] = rounded(median([c.get(key) for c in cells]))
    values = [c.get("client_cpu_ms_per_request") for c in cells]
    present = [v for v in values if isinstance(v, int | float)]
    out["client_cpu_ms_per_request_min"] = min(present) if present else None
    out["client_cpu_ms_per_request_max"] = max(present) if present else None
    for q in ("p50", "p99"):
        out[f"latency_{q}_ms"] = rounded(
            median([c["latency_ms"].get(q) for c in cells if isinstance(c["latency_ms"], dict)])
        )
    out["errors"] = sum(len(c["errors"]) for c in cells if isinstance(c.get("errors"), list))
    return out


def flatness(summary: Sequence[Mapping[str, Json]]) -> dict[str, Json]:
    """Per client: CPU per request at the highest in-flight level over the lowest >1."""
    out: dict[str, Json] = {}
    for client in CLIENTS:
        rows = {r["inflight"]: r for r in summary if r["client"] == client}
        if not rows:
            continue
        series = {str(k): rows[k]["client_cpu_ms_per_request"] for k in sorted(rows)}
        lo = rows.get(16, {}).get("client_cpu_ms_per_request")
        hi = rows.get(512, {}).get("client_cpu_ms_per_request")
        out[client] = {
            "cpu_ms_per_request": series,
            "ratio_512_over_16": round(hi / lo, 2)
            if isinstance(lo, int | float) and isinstance(hi, int | float) and lo
            else None,
        }
    return out


async def cell_once(
    procs: harness.Procs,
    plan: Plan,
    client: str,
    host: str,
    port: str,
    inflight: int,
    sim_pid: int,
) -> dict[str, Json]:
    argv = [sys.executable, str(SELF), "--worker", client]
    argv += ["--host", host, "--port", port, "--inflight", str(inflight)]
    argv += ["--warmup", str(plan.warmup_s), "--window", str(plan.window_s)]
    argv += ["--sim-pid", str(sim_pid)]
    out = await procs.run("client", argv, within_s=plan.warmup_s + plan.window_s + 120)
    return cell_metrics(json.loads(out))


async def run(plan: Plan, stem: str) -> dict[str, Json]:
    document: dict[str, Json] = {
        "benchmark": "transport",
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "versions": versions(["narwhal", "trio", "h11", "httpx", "httpcore", "anyio"]),
        "git": git_revision(),
        "config": plan.to_json(),
        "load_average_before": load_average(),
    }
    cells: dict[tuple[str, int], list[dict[str, Json]]] = {}
    async with harness.Procs(LOGS / "transport") as procs:
        ((url,),) = await harness.start_fleet(procs, engines=1, zero=True)
        sim = procs.find("sim0")
        host, port = url.removeprefix("http://").rsplit(":", 1)
        document["config"]["engine"] = "python -m narwhal.sim --port 0 --engines 1 --zero"
        for rep in range(plan.reps):
            for inflight in plan.inflight:
                for client in rotated(plan.clients, rep):
                    await trio.sleep(plan.settle_s)
                    print(
                        f"rep {rep + 1}/{plan.reps} inflight={inflight:<3} {client:13}",
                        end=" ",
                        flush=True,
                    )
                    cell = await measure_guarded(
                        partial(cell_once, procs, plan, client, host, port, inflight, sim.pid),
                        attempts=plan.attempts,
                        max_other_cores=GUARD_CORES,
                        quiet_give_up_s=plan.quiet_give_up_s,
                    )
                    cells.setdefault((client, inflight), []).append(cell)
                    print(
                        f"{cell['requests_per_s']:8.1f} req/s, "
                        f"client {cell['client_cpu_ms_per_request']} ms/req, "
                        f"other {cell['other_cpu_share']}",
                        flush=True,
                    )
    document["load_average_after"] = load_average()
    document["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
    summary = []
    for (client, inflight), reps in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        row: dict[str, Json] = {"client": client, "inflight": inflight}
        row.update(median_of(reps))
        summary.append(row)
    document["summary"] = summary
    document["flatness"] = flatness(summary)
    document["disturbance"] = disturbance([c for reps in cells.values() for c in reps])
    document["repetitions"] = [
        {"client": c, "inflight": i, "reps": reps} for (c, i), reps in cells.items()
    ]
    benchkit.publish(RUNS / f"{stem}.json", document, plot=plot)
    return document


_COLORS = {"narwhal-pool": "#1f77b4", "httpx": "#d62728", "httpx-sharded": "#2ca02c"}


def plot(document: Json, path: Path) -> None:
    """Client CPU per request and requests/s by requests in flight, per client."""
    plt = benchkit.pyplot()
    summary: Sequence[Mapping[str, Json]] = document["summary"]
    machine_info = document["machine"]
    fig, (ax_cpu, ax_rate) = plt.subplots(1, 2, figsize=(12, 4.8))
    for client in CLIENTS:
        rows = sorted((r for r in summary if r["client"] == client), key=lambda r: r["inflight"])
        if not rows:
            continue
        xs = [r["inflight"] for r in rows]
        ys = [r["client_cpu_ms_per_request"] for r in rows]
        lo = [y - r["client_cpu_ms_per_request_min"] for y, r in zip(ys, rows, strict=True)]
        hi = [r["client_cpu_ms_per_request_max"] - y for y, r in zip(ys, rows, strict=True)]
        color = _COLORS[client]
        ax_cpu.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=client, color=color)
        for x, y in zip(xs, ys, strict=True):
            ax_cpu.annotate(
                f"{y:.3g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7
            )
        ax_rate.plot(xs, [r["requests_per_s"] for r in rows], marker="o", label=client, color=color)
    for ax in (ax_cpu, ax_rate):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(list(INFLIGHT), [str(i) for i in INFLIGHT])
        ax.set_xlabel("requests in flight")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax_cpu.set_title("client CPU ms per request (median, bars: min-max of reps)", fontsize=10)
    ax_rate.set_title("requests/s (engine and client share 2 cores)", fontsize=10)
    assert isinstance(machine_info, dict)
    fig.suptitle(
        f"Engine transport vs a zero-latency sim engine "
        f"({machine_info['cpu_model']}, {machine_info['cores']} cores)",
        fontsize=11,
    )
    benchkit.save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="short windows, one repetition")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3; quick 1)")
    p.add_argument("--out", default=None, help="output stem under runs/bench/")
    p.add_argument("--replot", action="store_true", help="redraw the PNG from the stem's JSON")
    # Internal: one measurement cell in this process.
    p.add_argument("--worker", choices=CLIENTS, help=argparse.SUPPRESS)
    p.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--inflight", type=int, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=float, help=argparse.SUPPRESS)
    p.add_argument("--window", type=float, help=argparse.SUPPRESS)
    p.add_argument("--sim-pid", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        result = trio.run(
            partial(
                worker_main,
                args.worker,
                args.host,
                args.port,
                args.inflight,
                args.warmup,
                args.window,
                args.sim_pid,
            )
        )
        print(json.dumps(result), flush=True)
        return 0
    stem = args.out or ("transport-quick" if args.quick else "transport")
    if args.replot:
        return benchkit.show(RUNS / f"{stem}.json", replot=plot)

    async def measure() -> int:
        document = await run(make_plan(quick=args.quick, reps=args.reps), stem)
        print(json.dumps({"flatness": document["flatness"]}, indent=1))
        return 0

    return trio.run(harness.run_guarded, measure)


if __name__ == "__main__":
    raise SystemExit(main())
