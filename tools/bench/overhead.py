"""Router overhead: direct-to-engine vs through Narwhal vs through vllm-router.

    .venv/bin/python tools/bench/overhead.py [--quick] [--pin] [--reps N] [--targets ...]

Writes runs/bench/overhead.json and runs/bench/overhead.png (--pin: overhead-pinned.*,
--quick: *-quick.*; --replot redraws the PNG from the JSON).

By default every process may run on every CPU, so on a small box a router's CPU competes
with the simulator's and the load generator's, and added latency includes that contention.
With --pin the routers get the last CPU to themselves and everything else shares the
others (the same CPUs for every target), as in production, where a router never shares
cores with its engines.

What "added TTFT" at 64 and 512 streams measures: the zero-latency fleet is CPU-bound
there, and in a closed loop whose bottleneck is the fleet, latency is concurrency / fleet
throughput (Little's law), so the difference mixes the router's own time with what its CPU
use costs the fleet. Pinning takes the second part out but changes the box: the fleet and
the load generator share the other CPUs (one, on a 2-CPU box, so everything is slower), and
both routers' CPU per chunk rose when pinned (docs/benchmarks.md). Pinned, "direct" is
also slightly handicapped: its load generator runs the P/D protocol itself (two requests
per stream) on the fleet's CPU, where through a router it sends one. The alternating
concurrency-1 probe is the one cell where nothing is saturated.

Setup, all on loopback, each part in its own process:
- fleet: `python -m narwhal.sim --engines 2 --zero` (engine 0 prefill, engine 1 decode,
  vLLM dialect; zero latency law, every scheduler step still takes 1 ms);
- Narwhal: `python -m narwhal serve` with the two engines in P/D roles;
- vllm-router (PyPI `vllm-router`, installed by this script into its own venv under
  runs/tmp/, never committed): `--vllm-pd-disaggregation --policy round_robin` in
  front of the same two engines. If it cannot be installed or started, its cells are
  skipped and the JSON says why;
- load: tools/bench/loadgen.py (raw h11 + trio sockets), one process per cell. "direct"
  means the load generator runs the same vLLM P/D protocol itself (prefill leg, then the
  decode leg with the prefill's kv_transfer_params), so router minus direct is exactly
  what the router adds.

Cells: {non-streaming, streaming} x {1, 64, 512 concurrent closed-loop clients} x
targets, repeated --reps times; targets are interleaved inside every (mode, concurrency)
group and their order rotates with each repetition, so slow drifts of this shared box
hit every target alike. Each statistic is the median over repetitions. CPU is the
utime+stime delta of /proc/<pid>/stat over the measurement window, all threads.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import benchkit
import httpx
import trio
from benchkit import (
    GUARD_CORES,
    RUNS,
    Json,
    disturbance,
    git_revision,
    harness,
    load_average,
    machine,
    measure_guarded,
    median,
    rotated,
    rounded,
    versions,
)
from benchkit.harness import Procs, free_port
from prometheus_client.parser import text_string_to_metric_families

from narwhal.sim import DEFAULT_MODEL as MODEL

PROMPT = "Summarise the plot of a short story about a lighthouse keeper and a whale."
LOGS = RUNS / "logs"
ROUTERS = ("narwhal", "vllm-router")
ALL_TARGETS = ("direct", "narwhal", "vllm-router")
# Targets run only when named: narwhal-lean is Narwhal's app on the h11 server prototype
# of tools/bench/dev/lean_server.py (docs/design.md#http-server).
EXTRA_TARGETS = ("narwhal-lean",)
# `--workers N`: Narwhal with serving.workers = N (N >= 2), target narwhal-wN; its CPU
# is the daemon's (the decision core's) and its workers' together.
WORKERS_TARGET = re.compile(r"narwhal-w([2-9]|[1-9][0-9]+)")
LEAN_SERVER = Path(__file__).parent / "dev" / "lean_server.py"
MODES = ("non-stream", "stream")

# Goals from issue 8 part 2; the thresholds are fixed here, before any measurement.
GOAL_ADDED_TTFT_P50_MS = 1.0
GOAL_ADDED_TTFT_AT = 64
# "Flat" CPU per request from 64 to 512 streams: at most 25% more per request at 512.
GOAL_FLAT_RATIO = 1.25


@attrs.frozen
class Timing:
    warmup_s: float
    window_s: float
    drain_s: float


@attrs.frozen
class Plan:
    reps: int
    concurrency: tuple[int, ...]
    targets: tuple[str, ...]
    timing: Mapping[int, Timing]
    max_tokens: Mapping[str, int]
    settle_s: float
    probe_window_s: float
    probe_slice_s: float
    quiet_give_up_s: float
    attempts: int
    quick: bool
    # CPUs per process name (--pin), or None: every process may run on every CPU.
    pinning: Mapping[str, tuple[int, ...]] | None = None

    def to_json(self) -> dict[str, Json]:
        return {
            "reps": self.reps,
            "concurrency": list(self.concurrency),
            "targets": list(self.targets),
            "timing": {
                str(c): {"warmup_s": t.warmup_s, "window_s": t.window_s, "drain_s": t.drain_s}
                for c, t in self.timing.items()
            },
            "max_tokens": dict(self.max_tokens),
            "settle_s": self.settle_s,
            "alternating_c1_window_s": self.probe_window_s,
            "alternating_c1_slice_s": self.probe_slice_s,
            "guard_max_other_cores": GUARD_CORES,
            "quiet_give_up_s": self.quiet_give_up_s,
            "attempts_per_cell": self.attempts,
            "quick": self.quick,
            "pinning": (
                {name: list(cpus) for name, cpus in self.pinning.items()}
                if self.pinning is not None
                else None
            ),
        }


def pinning_for(cpus: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """The routers on the last CPU alone; the fleet, the load generator and this driver
    share the others. Every target then gets the same CPUs for the engines and the load,
    and a router gets a CPU of its own, as it would in production."""
    ordered = sorted(set(cpus))
    if len(ordered) < 2:
        raise ValueError(f"--pin needs at least 2 CPUs; this process may use {ordered}")
    router, rest = (ordered[-1],), tuple(ordered[:-1])
    return {
        "narwhal": router,
        "narwhal-lean": router,
        "vllm-router": router,
        "sim": rest,
        "loadgen": rest,
        "driver": rest,
    }


def make_plan(
    *,
    quick: bool,
    reps: int | None,
    targets: Sequence[str],
    pinning: Mapping[str, tuple[int, ...]] | None = None,
) -> Plan:
    if quick:
        timing = {
            1: Timing(0.5, 2.0, 5.0),
            64: Timing(1.0, 3.0, 10.0),
            512: Timing(3.0, 5.0, 20.0),
        }
    else:
        # At 512 streams one stream takes seconds on this box, so the warm-up must
        # cover a few rounds before the closed loop is in a steady state.
        timing = {
            1: Timing(1.0, 5.0, 5.0),
            64: Timing(2.0, 6.0, 10.0),
            512: Timing(6.0, 10.0, 30.0),
        }
    return Plan(
        reps=reps if reps is not None else (1 if quick else 3),
        concurrency=(1, 64, 512),
        targets=tuple(targets),
        timing=timing,
        max_tokens={"non-stream": 4, "stream": 32},
        settle_s=0.5,
        probe_window_s=8.0 if quick else 24.0,
        probe_slice_s=0.5,
        quiet_give_up_s=5.0 if quick else 10.0,
        attempts=2,
        quick=quick,
        pinning=pinning,
    )


def request_body(mode: str, plan: Plan) -> dict[str, Json]:
    return {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": plan.max_tokens[mode],
        "stream": mode == "stream",
    }


def narwhal_config(
    prefill_url: str, decode_url: str, port: int, admin_port: int | None = None
) -> dict[str, Json]:
    """Defaults except what a benchmark on a bare loopback fleet needs.

    - admission "open": predictive admission prices against measured profiles, which a
      zero-latency simulator does not have; open is the no-admission path;
    - max_connections 1024: the default 512 is also the retained-request ceiling, and a
      512-client closed loop can briefly hold 513 when a client's next request arrives
      before the previous handler has unwound; that would measure refusals instead;
    - first_token_timeout_s 60: at 512 zero-latency streams this 2-core box is saturated
      and TTFT reaches seconds (CPU queueing, not engine time); the default 2.5 s would
      end those streams with first_token_timeout error events, which is not the path
      being measured (vllm-router has no such deadline by default).
    - the per-client limits at the global ones: every benchmark client comes from
      127.0.0.1, as clients behind a proxy do, and the configuration reference says to
      raise them there;
    Everything else (tokenisation via /tokenize, per-request logging at info, metrics)
    is Narwhal's default behaviour and is part of what is measured. /metrics is on the
    admin listener, at `admin_port` (default: a free port).
    """
    return {
        "engines": [
            {"id": "p0", "url": prefill_url, "role": "prefill", "model": MODEL},
            {"id": "d0", "url": decode_url, "role": "decode", "model": MODEL},
        ],
        "listen": {"host": "127.0.0.1", "port": port, "max_open_connections_per_client": 4096},
        "admin": {"host": "127.0.0.1", "port": free_port() if admin_port is None else admin_port},
        "ctl": {"socket": str(LOGS / "narwhal.sock")},
        "serving": {
            "admission": "open",
            "max_connections": 1024,
            "max_pending_bodies_per_client": 1024 + 256,  # the retained-request ceiling
        },
        "engine": {"first_token_timeout_s": 60.0},
    }


# ---------------------------------------------------------------------------- aggregation


def cell_metrics(raw: Mapping[str, Any], *, stream: bool, tokens: int) -> dict[str, Json]:
    """Derived numbers of one cell (one target, mode, concurrency and repetition).

    `tokens` is max_tokens: every stream delivers exactly that many (no stop strings),
    so CPU per token is comparable across targets even when an engine that is written
    to slowly packs several tokens into one SSE chunk.
    """
    completed = int(raw["completed"])
    cpu = raw["cpu_s"]
    window = float(raw["window_s"])
    ours = sum(float(cpu.get(k, 0.0)) for k in ("router", "sim", "loadgen"))
    out: dict[str, Json] = {
        "completed": completed,
        "errors": int(raw["errors"]),
        "requests_per_s": round(completed / window, 2),
        "latency_ms": raw["latency_ms"],
        "ttft_ms": raw["ttft_ms"] if stream else None,
        "chunks": int(raw["events"]) if stream else None,
        "chunks_per_stream": round(raw["events"] / completed, 2) if stream and completed else None,
        "cpu_s": dict(cpu),
        "cpu_share": {k: round(float(v) / window, 3) for k, v in cpu.items()},
        **_others(cpu, window, ours),
        "sim_cpu_ms_per_request": rounded(1000 * cpu["sim"] / completed) if completed else None,
        **_router_cpu(
            cpu.get("router"),
            completed,
            raw["events"],
            stream=stream,
            tokens=tokens,
            core_s=cpu.get("router/core"),
        ),
    }
    if raw.get("error_samples"):
        out["error_samples"] = list(raw["error_samples"])
    if raw.get("drain_cut"):
        out["drain_cut"] = True
    return out


def _others(cpu: Mapping[str, float], window: float, ours: float) -> dict[str, Json]:
    """Cores used by processes that are not part of this benchmark (other users of the
    box), and by interrupt handling (loopback TCP), during the window."""
    interrupts = float(cpu.get("machine_irq", 0.0))
    machine = float(cpu.get("machine", ours))
    return {
        "other_cpu_share": round(max(0.0, machine - interrupts - ours) / window, 3),
        "irq_cpu_share": round(interrupts / window, 3),
    }


def _router_cpu(
    router_s: float | None,
    completed: int,
    events: int,
    *,
    stream: bool,
    tokens: int,
    core_s: float | None = None,
) -> dict[str, Json]:
    """The router's CPU per request, per streamed chunk and per token (None: no router);
    `core_s`: its main process's own share (a Narwhal with workers: the decision core's,
    the one part that does not grow with the workers)."""
    out: dict[str, Json] = dict.fromkeys(
        (
            "router_cpu_ms_per_request",
            "router_cpu_us_per_chunk",
            "router_cpu_us_per_token",
            "router_core_cpu_ms_per_request",
        )
    )
    if router_s is not None and completed:
        out["router_cpu_ms_per_request"] = rounded(1000 * router_s / completed)
        if stream and events:
            out["router_cpu_us_per_chunk"] = rounded(1e6 * router_s / events, 1)
            out["router_cpu_us_per_token"] = rounded(1e6 * router_s / (completed * tokens), 1)
    if core_s is not None and completed:
        out["router_core_cpu_ms_per_request"] = rounded(1000 * core_s / completed)
    return out


def _p(summary: Json, key: str) -> float | None:
    if isinstance(summary, dict):
        value = summary.get(key)
        if isinstance(value, int | float):
            return float(value)
    return None


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def add_differences(reps: Sequence[Mapping[str, dict[str, Json]]], stream: bool) -> None:
    """Per repetition: router minus direct at the same concurrency (TTFT for streams,
    latency for non-streaming requests), p50 and p99. Mutates the router cells."""
    for rep in reps:
        direct = rep.get("direct")
        if direct is None:
            continue
        metric = "ttft_ms" if stream else "latency_ms"
        for target, cell in rep.items():
            if target == "direct":
                continue
            cell["added_" + metric] = {
                q: rounded(_diff(_p(cell[metric], q), _p(direct[metric], q)))
                for q in ("p50", "p99")
            }


_MEDIAN_KEYS = (
    "requests_per_s",
    "router_cpu_ms_per_request",
    "router_cpu_us_per_chunk",
    "router_cpu_us_per_token",
    "router_core_cpu_ms_per_request",
    "sim_cpu_ms_per_request",
    "chunks_per_stream",
    "other_cpu_share",
    "irq_cpu_share",
    "router_loop_lag_mean_ms",
)


def median_of(cells: Sequence[Mapping[str, Json]]) -> dict[str, Json]:
    """Median over repetitions of each headline number of one (mode, concurrency, target)."""
    out: dict[str, Json] = {"reps": len(cells)}
    for key in _MEDIAN_KEYS:
        values = [c.get(key) for c in cells]
        out[key] = rounded(median([v if isinstance(v, int | float) else None for v in values]))
    for metric in ("latency_ms", "ttft_ms", "added_latency_ms", "added_ttft_ms"):
        for q in ("p50", "p99"):
            values = [_p(c.get(metric), q) for c in cells]
            out[f"{metric.removesuffix('_ms')}_{q}_ms"] = rounded(median(values))
    out["errors"] = sum(int(c["errors"]) for c in cells if isinstance(c.get("errors"), int))
    out["completed_total"] = sum(
        int(c["completed"]) for c in cells if isinstance(c.get("completed"), int)
    )
    for share in ("router", "sim", "loadgen"):
        values = [_share(c, share) for c in cells]
        out[f"{share}_cpu_share"] = rounded(median(values))
    return out


def _share(cell: Mapping[str, Json], name: str) -> float | None:
    shares = cell.get("cpu_share")
    if isinstance(shares, dict):
        value = shares.get(name)
        if isinstance(value, int | float):
            return float(value)
    return None


def evaluate_goals(summary: Sequence[Mapping[str, Json]]) -> dict[str, Json]:
    def row(mode: str, conc: int, target: str) -> Mapping[str, Json] | None:
        for r in summary:
            if r["mode"] == mode and r["concurrency"] == conc and r["target"] == target:
                return r
        return None

    goals: dict[str, Json] = {}
    extra = _extra_targets(summary)
    for target in (*ROUTERS, *extra):
        stream = row("stream", GOAL_ADDED_TTFT_AT, target)
        added = stream.get("added_ttft_p50_ms") if stream else None
        flat: dict[str, Json] = {}
        for mode, key in (
            ("non-stream", "router_cpu_ms_per_request"),
            ("stream", "router_cpu_ms_per_request"),
        ):
            lo, hi = row(mode, 64, target), row(mode, 512, target)
            a = lo.get(key) if lo else None
            b = hi.get(key) if hi else None
            ratio = (
                round(b / a, 3)
                if isinstance(a, int | float) and isinstance(b, int | float) and a
                else None
            )
            flat[mode] = {
                "at_64": a,
                "at_512": b,
                "ratio_512_over_64": ratio,
                "met": None if ratio is None else ratio <= GOAL_FLAT_RATIO,
            }
        goals[target] = {
            "added_ttft_p50_ms_at_64": added,
            "added_ttft_goal_ms": GOAL_ADDED_TTFT_P50_MS,
            "added_ttft_met": (added < GOAL_ADDED_TTFT_P50_MS)
            if isinstance(added, int | float)
            else None,
            "flat_cpu_goal_max_ratio": GOAL_FLAT_RATIO,
            "flat_cpu": flat,
        }
    return goals


def _extra_targets(summary: Sequence[Mapping[str, Json]]) -> list[str]:
    """The targets of `summary` beyond ALL_TARGETS, in the order they first appear."""
    seen = dict.fromkeys(str(r["target"]) for r in summary)
    return [t for t in seen if t not in ALL_TARGETS]


# ---------------------------------------------------------------------------- running


@attrs.define
class Endpoints:
    prefill: tuple[str, int]
    decode: tuple[str, int]
    sim_pid: int
    routers: dict[str, tuple[tuple[str, int], trio.Process]] = attrs.Factory(dict)
    # Narwhal's admin listener (/metrics), once it runs.
    narwhal_admin: tuple[str, int] | None = None


def _host_port(url: str) -> tuple[str, int]:
    hostport = url.removeprefix("http://").rstrip("/")
    host, port = hostport.rsplit(":", 1)
    return host, int(port)


def _url(address: tuple[str, int]) -> str:
    return f"http://{address[0]}:{address[1]}"


def _router(endpoints: Endpoints, target: str) -> tuple[tuple[str, int], trio.Process]:
    address, proc = endpoints.routers[target]
    if proc.returncode is not None:
        raise RuntimeError(f"{target} (pid {proc.pid}) exited with {proc.returncode}")
    return address, proc


async def run_cell(
    procs: Procs,
    plan: Plan,
    endpoints: Endpoints,
    target: str,
    mode: str,
    conc: int,
) -> dict[str, Any]:
    timing = plan.timing[conc]
    spec: dict[str, Json] = {
        "concurrency": conc,
        "body": request_body(mode, plan),
        "warmup_s": timing.warmup_s,
        "window_s": timing.window_s,
        "drain_s": timing.drain_s,
    }
    watch: dict[str, Json] = {"sim": endpoints.sim_pid}
    if target == "direct":
        spec.update(mode="direct", prefill=list(endpoints.prefill), decode=list(endpoints.decode))
    else:
        (host, port), proc = _router(endpoints, target)
        spec.update(mode="router", target=[host, port])
        watch["router"] = proc.pid
    spec["watch"] = watch
    limit = timing.warmup_s + timing.window_s + timing.drain_s + 60
    return await _loadgen(procs, spec, within_s=limit)


async def cell_once(
    procs: Procs, plan: Plan, endpoints: Endpoints, target: str, mode: str, conc: int
) -> dict[str, Json]:
    lag_before = await loop_lag(endpoints, target)
    raw = await run_cell(procs, plan, endpoints, target, mode, conc)
    cell = cell_metrics(raw, stream=mode == "stream", tokens=plan.max_tokens[mode])
    lag_after = await loop_lag(endpoints, target)
    if lag_before is not None and lag_after is not None and lag_after[1] > lag_before[1]:
        # Mean lag of Narwhal's event-loop probes over the cell (warm-up, window, drain):
        # how long each await on a request's path waited for the loop.
        mean = (lag_after[0] - lag_before[0]) / (lag_after[1] - lag_before[1])
        cell["router_loop_lag_mean_ms"] = rounded(1000 * mean, 3)
    return cell


async def loop_lag(endpoints: Endpoints, target: str) -> tuple[float, float] | None:
    """(sum, count) of Narwhal's narwhal_event_loop_lag_seconds; None for other targets
    or when the scrape fails."""
    if target != "narwhal" or endpoints.narwhal_admin is None:
        return None
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            text = (await client.get(_url(endpoints.narwhal_admin) + "/metrics")).text
    except httpx.HTTPError:
        return None
    for family in text_string_to_metric_families(text):
        if family.name == "narwhal_event_loop_lag_seconds":
            values = {s.name.rsplit("_", 1)[1]: s.value for s in family.samples}
            return values["sum"], values["count"]
    return None


async def alternating_once(
    procs: Procs, plan: Plan, endpoints: Endpoints, targets: Sequence[str], mode: str
) -> dict[str, Json]:
    """Concurrency 1, all targets alternating in short slices within one window."""
    spec: dict[str, Json] = {
        "mode": "alternate",
        "body": request_body(mode, plan),
        "warmup_s": 1.0,
        "window_s": plan.probe_window_s,
        "slice_s": plan.probe_slice_s,
        "targets": {},
        "watch": {"sim": endpoints.sim_pid},
    }
    for target in targets:
        if target == "direct":
            spec["targets"]["direct"] = {
                "prefill": list(endpoints.prefill),
                "decode": list(endpoints.decode),
            }
        else:
            (host, port), proc = _router(endpoints, target)
            spec["targets"][target] = {"target": [host, port]}
            spec["watch"][target] = proc.pid
    raw = await _loadgen(procs, spec, within_s=plan.probe_window_s + 60)
    return alternating_metrics(raw, stream=mode == "stream", tokens=plan.max_tokens[mode])


def alternating_metrics(raw: Mapping[str, Any], *, stream: bool, tokens: int) -> dict[str, Json]:
    """Per target metrics of one alternating probe, plus its disturbance."""
    cpu = raw["cpu_s"]
    # A "<name>/core" entry is a part of <name>'s, not more CPU.
    ours = sum(float(v) for k, v in cpu.items() if not k.startswith("machine") and "/" not in k)
    out: dict[str, Json] = {"cpu_s": dict(cpu), **_others(cpu, float(raw["window_s"]), ours)}
    direct = raw["targets"].get("direct")
    for name, t in raw["targets"].items():
        completed = int(t["completed"])
        cell: dict[str, Json] = {
            "completed": completed,
            "errors": int(t["errors"]),
            "active_s": t["active_s"],
            "requests_per_s": round(completed / t["active_s"], 2) if t["active_s"] else None,
            "latency_ms": t["latency_ms"],
            "ttft_ms": t["ttft_ms"] if stream else None,
            "chunks_per_stream": round(t["events"] / completed, 2)
            if stream and completed
            else None,
            **_router_cpu(
                cpu.get(name),
                completed,
                t["events"],
                stream=stream,
                tokens=tokens,
                core_s=cpu.get(f"{name}/core"),
            ),
        }
        if t.get("error_samples"):
            cell["error_samples"] = t["error_samples"]
        if direct is not None and name != "direct":
            metric = "ttft_ms" if stream else "latency_ms"
            cell["added_" + metric] = {
                q: rounded(_diff(_p(t[metric], q), _p(direct[metric], q))) for q in ("p50", "p99")
            }
        out[name] = cell
    return out


async def _loadgen(procs: Procs, spec: Mapping[str, Json], *, within_s: float) -> dict[str, Any]:
    argv = [sys.executable, str(benchkit.BENCH / "loadgen.py"), json.dumps(spec)]
    result: dict[str, Any] = json.loads(await procs.run("loadgen", argv, within_s=within_s))
    return result


async def start_fleet(procs: Procs) -> Endpoints:
    (urls,) = await harness.start_fleet(procs, engines=2, zero=True)
    prefill, decode = (_host_port(u) for u in urls)
    return Endpoints(prefill=prefill, decode=decode, sim_pid=procs.find("sim0").pid)


async def start_narwhal(procs: Procs, endpoints: Endpoints) -> dict[str, Json]:
    port = free_port()
    config = narwhal_config(_url(endpoints.prefill), _url(endpoints.decode), port)
    await harness.start_narwhal(procs, config, LOGS)
    endpoints.routers["narwhal"] = (("127.0.0.1", port), procs.find("narwhal"))
    endpoints.narwhal_admin = ("127.0.0.1", int(config["admin"]["port"]))
    return config


async def start_narwhal_workers(procs: Procs, endpoints: Endpoints, target: str) -> None:
    """Narwhal with serving.workers from `target` (narwhal-wN), on its own ports."""
    match = WORKERS_TARGET.fullmatch(target)
    assert match is not None
    port = free_port()
    config = narwhal_config(_url(endpoints.prefill), _url(endpoints.decode), port)
    config["ctl"] = {"socket": str(LOGS / f"{target}.sock")}
    serving = config["serving"]
    assert isinstance(serving, dict)
    serving["workers"] = int(match.group(1))
    await harness.start_narwhal(procs, config, LOGS, name=target)
    endpoints.routers[target] = (("127.0.0.1", port), procs.find(target))


async def start_narwhal_lean(procs: Procs, endpoints: Endpoints) -> None:
    """Narwhal with the lean h11 server in place of hypercorn, on its own ports."""
    port = free_port()
    config = narwhal_config(_url(endpoints.prefill), _url(endpoints.decode), port)
    config["ctl"] = {"socket": str(LOGS / "narwhal-lean.sock")}
    await harness.start_narwhal(procs, config, LOGS, name="narwhal-lean", script=LEAN_SERVER)
    endpoints.routers["narwhal-lean"] = (("127.0.0.1", port), procs.find("narwhal-lean"))


async def start_vllm_router(procs: Procs, endpoints: Endpoints, exe: Path) -> list[str]:
    port = free_port()
    urls = [_url(endpoints.prefill), _url(endpoints.decode)]
    _, argv = await harness.start_vllm_router(procs, exe, urls, ["prefill", "decode"], port=port)
    endpoints.routers["vllm-router"] = (("127.0.0.1", port), procs.find("vllm-router"))
    return argv


async def run(plan: Plan, out_stem: str) -> dict[str, Json]:
    LOGS.mkdir(parents=True, exist_ok=True)
    started = datetime.now(UTC)
    peer = await harness.install_vllm_router() if "vllm-router" in plan.targets else None
    targets = [t for t in plan.targets if t != "vllm-router" or (peer and peer.status == "ok")]
    document: dict[str, Json] = {
        "benchmark": "overhead",
        "started": started.isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "versions": versions(["narwhal", "trio", "h11", "hypercorn", "httpx", "numpy"]),
        "git": git_revision(),
        "load_average_before": load_average(),
    }
    cells: dict[tuple[str, int], list[dict[str, dict[str, Json]]]] = {}
    probes: dict[str, list[dict[str, Json]]] = {}
    if plan.pinning is not None:
        os.sched_setaffinity(0, plan.pinning["driver"])
    async with Procs(LOGS, affinity=plan.pinning) as procs:
        endpoints = await start_fleet(procs)
        narwhal_cfg = await start_narwhal(procs, endpoints) if "narwhal" in targets else None
        if "narwhal-lean" in targets:
            await start_narwhal_lean(procs, endpoints)
        for target in targets:
            if WORKERS_TARGET.fullmatch(target):
                await start_narwhal_workers(procs, endpoints, target)
        vllm_argv: list[str] | None = None
        if "vllm-router" in targets and peer is not None:
            exe = harness.vllm_router_binary(peer.venv)
            try:
                assert exe is not None
                vllm_argv = await start_vllm_router(procs, endpoints, exe)
            except (AssertionError, RuntimeError, trio.TooSlowError) as exc:
                peer.status = "skipped"
                peer.note = f"vllm-router did not start: {exc!r} (see runs/bench/logs)"
                targets.remove("vllm-router")
        if peer is not None:
            document["vllm_router"] = peer.to_json()
            if peer.version:
                assert isinstance(document["versions"], dict)
                document["versions"]["vllm-router"] = peer.version
        document["config"] = {
            "plan": plan.to_json(),
            "targets_run": list(targets),
            "fleet": "python -m narwhal.sim --port 0 --engines 2 --zero "
            "(engine 0 prefill, engine 1 decode, vLLM dialect)",
            "request_bodies": {m: request_body(m, plan) for m in MODES},
            "narwhal_config": narwhal_cfg,
            "vllm_router_argv": ([Path(vllm_argv[0]).name, *vllm_argv[1:]] if vllm_argv else None),
        }
        for rep in range(plan.reps):
            for mode in MODES:
                for conc in plan.concurrency:
                    group: dict[str, dict[str, Json]] = {}
                    for target in rotated(targets, rep):
                        print(
                            f"rep {rep + 1}/{plan.reps} {mode:10} c={conc:<3} {target:11}",
                            end=" ",
                            flush=True,
                        )
                        await trio.sleep(plan.settle_s)
                        cell = await measure_guarded(
                            partial(cell_once, procs, plan, endpoints, target, mode, conc),
                            attempts=plan.attempts,
                            max_other_cores=GUARD_CORES,
                            quiet_give_up_s=plan.quiet_give_up_s,
                        )
                        group[target] = cell
                        print(_progress(cell), flush=True)
                    cells.setdefault((mode, conc), []).append(group)
            for mode in MODES:
                print(f"rep {rep + 1}/{plan.reps} {mode:10} c=1 alternating", end=" ", flush=True)
                probe = await measure_guarded(
                    partial(alternating_once, procs, plan, endpoints, targets, mode),
                    attempts=plan.attempts,
                    max_other_cores=GUARD_CORES,
                    quiet_give_up_s=plan.quiet_give_up_s,
                )
                probes.setdefault(mode, []).append(probe)
                print(_probe_progress(probe), flush=True)
        document["load_average_after"] = load_average()
    summary: list[dict[str, Json]] = []
    detail: list[dict[str, Json]] = []
    for (mode, conc), reps in cells.items():
        add_differences(reps, mode == "stream")
        for target in targets:
            per_rep = [rep[target] for rep in reps if target in rep]
            row: dict[str, Json] = {"mode": mode, "concurrency": conc, "target": target}
            row.update(median_of(per_rep))
            summary.append(row)
            detail.append({"mode": mode, "concurrency": conc, "target": target, "reps": per_rep})
    document["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
    document["summary"] = summary
    document["goals"] = evaluate_goals(summary)
    document["alternating_c1"] = {
        "method": "one client at concurrency 1 switching target every "
        f"{plan.probe_slice_s}s round-robin for {plan.probe_window_s}s, so every target "
        "sees the same disturbance; median over repetitions",
        "summary": [
            {"mode": mode, "target": target, **median_of([p[target] for p in reps])}
            for mode, reps in probes.items()
            for target in targets
        ],
        "repetitions": [{"mode": mode, "reps": reps} for mode, reps in probes.items()],
    }
    document["disturbance"] = disturbance(
        [c for rep in detail for c in rep["reps"]] + [p for reps in probes.values() for p in reps]
    )
    document["repetitions"] = detail
    benchkit.publish(RUNS / f"{out_stem}.json", document, plot=plot)
    return document


def _progress(cell: Mapping[str, Json]) -> str:
    parts = [f"{cell['requests_per_s']:8.1f} req/s"]
    if cell.get("router_cpu_ms_per_request") is not None:
        parts.append(f"router {cell['router_cpu_ms_per_request']:.3f} ms/req")
    if cell.get("router_cpu_us_per_chunk") is not None:
        parts.append(f"{cell['router_cpu_us_per_chunk']:.0f} us/chunk")
    ttft = cell.get("ttft_ms")
    if isinstance(ttft, dict) and ttft.get("p50") is not None:
        parts.append(f"ttft p50 {ttft['p50']:.2f} ms")
    lat = cell.get("latency_ms")
    if isinstance(lat, dict) and lat.get("p50") is not None:
        parts.append(f"lat p50 {lat['p50']:.2f} ms")
    if cell.get("errors"):
        parts.append(f"errors {cell['errors']}")
    return ", ".join(parts)


def _probe_progress(probe: Mapping[str, Json]) -> str:
    parts = []
    for name, cell in probe.items():
        if not isinstance(cell, dict) or "completed" not in cell:
            continue
        metric = cell.get("ttft_ms") or cell.get("latency_ms")
        p50 = metric.get("p50") if isinstance(metric, dict) else None
        parts.append(f"{name} p50 {p50} ms n={cell['completed']}")
    parts.append(f"other {probe.get('other_cpu_share')}")
    return ", ".join(parts)


def _title(document: Mapping[str, Json]) -> str:
    m = document["machine"]
    assert isinstance(m, dict)
    config = document.get("config")
    plan = config.get("plan") if isinstance(config, dict) else None
    pinned = isinstance(plan, dict) and plan.get("pinning") is not None
    where = ", router on its own CPU" if pinned else ""
    return f"Router overhead, zero-latency sim, 1P+1D{where} ({m['cpu_model']}, {m['cores']} cores)"


# ---------------------------------------------------------------------------- plot


_COLORS = {
    "direct": "#7f7f7f",
    "narwhal": "#1f77b4",
    "vllm-router": "#ff7f0e",
    "narwhal-lean": "#2ca02c",
}
# narwhal-w2, narwhal-w4, ...: shades apart from one process's blue.
_WORKER_COLORS = ("#9467bd", "#8c564b", "#e377c2", "#17becf")


def _color(target: str) -> str | None:
    if target in _COLORS:
        return _COLORS[target]
    match = WORKERS_TARGET.fullmatch(target)
    if match is None:
        return None
    return _WORKER_COLORS[int(match.group(1)) % len(_WORKER_COLORS)]


def plot(document: Json, path: Path) -> None:
    """Throughput, router CPU and added TTFT per concurrency, median of repetitions."""
    plt = benchkit.pyplot()
    summary: Sequence[Mapping[str, Json]] = document["summary"]
    alternating: Sequence[Mapping[str, Json]] = document["alternating_c1"]["summary"]
    concs = sorted({int(r["concurrency"]) for r in summary})
    targets = [t for t in ALL_TARGETS if any(r["target"] == t for r in summary)]
    targets += _extra_targets(summary)

    def values(mode: str, target: str, key: str) -> list[float]:
        out = []
        for c in concs:
            v = next(
                (
                    r.get(key)
                    for r in summary
                    if r["mode"] == mode and r["concurrency"] == c and r["target"] == target
                ),
                None,
            )
            out.append(float(v) if isinstance(v, int | float) else float("nan"))
        return out

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    panels = [
        (axes[0][0], "non-stream", "requests_per_s", targets, "non-streaming requests/s", False),
        (
            axes[0][1],
            "non-stream",
            "router_cpu_ms_per_request",
            [t for t in targets if t != "direct"],
            "router CPU ms per request (non-streaming)",
            False,
        ),
        (
            axes[1][0],
            "stream",
            "router_cpu_us_per_chunk",
            [t for t in targets if t != "direct"],
            "router CPU µs per streamed chunk",
            False,
        ),
    ]
    width = 0.8 / max(1, len(targets))
    for ax, mode, key, shown, label, log in panels:
        for i, target in enumerate(shown):
            xs = [j + (i - (len(shown) - 1) / 2) * width for j in range(len(concs))]
            ys = values(mode, target, key)
            bars = ax.bar(xs, ys, width, label=target, color=_color(target))
            ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.set_xticks(range(len(concs)), [str(c) for c in concs])
        ax.set_xlabel("concurrent clients")
        ax.set_title(label, fontsize=10)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    ax = axes[1][1]
    routers = [t for t in targets if t != "direct"]
    bar = 0.8 / len(routers)
    for i, target in enumerate(routers):
        xs = [j + (i - (len(routers) - 1) / 2) * bar for j in range(len(concs))]
        p50 = values("stream", target, "added_ttft_p50_ms")
        p99 = values("stream", target, "added_ttft_p99_ms")
        color = _color(target)
        bars = ax.bar(xs, p50, bar, label=f"{target} p50", color=color)
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.scatter(xs, p99, marker="_", s=300, color=color, label=f"{target} p99")
        probe = next(
            (r for r in alternating if r["mode"] == "stream" and r["target"] == target), None
        )
        value = probe.get("added_ttft_p50_ms") if probe else None
        if isinstance(value, int | float) and 1 in concs:
            x = xs[concs.index(1)]
            ax.scatter([x], [value], marker="*", s=120, color="black", zorder=3)
            ax.annotate(
                f"{value:.2f}", (x, value), textcoords="offset points", xytext=(6, -3), fontsize=7
            )
    if alternating:
        ax.scatter([], [], marker="*", color="black", label="c=1 alternating probe p50")
    ax.axhline(GOAL_ADDED_TTFT_P50_MS, color="green", linestyle="--", linewidth=1)
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xticks(range(len(concs)), [str(c) for c in concs])
    ax.set_xlabel("concurrent streams")
    ax.set_title("added TTFT vs direct, ms (bar p50, tick p99; dashed: 1 ms goal)", fontsize=10)
    ax.legend(fontsize=8)
    fig.suptitle(_title(document) + "\nmedian of repetitions", fontsize=11)
    benchkit.save_figure(fig, path)


# ---------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="short windows, one repetition")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3; quick 1)")
    p.add_argument(
        "--targets",
        default=",".join(ALL_TARGETS),
        help="comma-separated subset of: " + ", ".join((*ALL_TARGETS, *EXTRA_TARGETS)),
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="run the routers on a CPU of their own (the last one), the fleet and the load "
        "on the others; default output stem overhead-pinned",
    )
    p.add_argument(
        "--workers",
        default="",
        help="comma-separated serving.workers values >= 2: each adds target narwhal-wN",
    )
    p.add_argument("--out", default=None, help="output stem under runs/bench/")
    p.add_argument("--replot", action="store_true", help="redraw the PNG from the stem's JSON")
    args = p.parse_args(argv)
    suffix = ("-pinned" if args.pin else "") + ("-quick" if args.quick else "")
    stem = args.out or f"overhead{suffix}"
    if args.replot:
        return benchkit.show(RUNS / f"{stem}.json", replot=plot)
    targets = [t for t in args.targets.split(",") if t]
    targets += [f"narwhal-w{n.strip()}" for n in args.workers.split(",") if n.strip()]
    unknown = sorted(
        t for t in set(targets) - {*ALL_TARGETS, *EXTRA_TARGETS} if not WORKERS_TARGET.fullmatch(t)
    )
    if unknown:
        p.error(f"unknown target(s): {', '.join(unknown)}")
    try:
        pinning = pinning_for(sorted(os.sched_getaffinity(0))) if args.pin else None
    except ValueError as exc:
        p.error(str(exc))
    plan = make_plan(quick=args.quick, reps=args.reps, targets=targets, pinning=pinning)

    async def measure() -> int:
        document = await run(plan, stem)
        print(json.dumps({"summary": document["summary"], "goals": document["goals"]}, indent=1))
        return 0

    return trio.run(harness.run_guarded, measure)


if __name__ == "__main__":
    raise SystemExit(main())
