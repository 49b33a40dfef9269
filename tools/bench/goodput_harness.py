"""Processes of one benchmark run: a fresh simulated fleet, a router, the load generator,
and a sampler of router and engine state. Shared by goodput.py and overload.py.

Everything listens on 127.0.0.1. Every process started here is stopped by its PID
(SIGTERM, then SIGKILL after a grace period) in a `finally`, whatever went wrong.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import httpx
import trio

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TICKS = os.sysconf("SC_CLK_TCK")
MODEL = "sim-llama-3-8b"
# serving.max_connections for the benchmark fleets, sized as manual 4.1 asks, from the
# measured in-flight load: the long-answer decode-heavy phase keeps ~650 requests in
# flight on 8 engines (answers of 256+ tokens for tens of seconds of wall time), and at
# the default 512 the gate refused ~6 % of that phase, requests the engines then had room
# for (8 x max_num_seqs 256 sequences). Predictive admission still bounds what is admitted.
MAX_CONNECTIONS = 1024

Router = Literal["narwhal", "vllm-router"]


def cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS


def system_busy_seconds() -> float:
    """CPU seconds all processes on the machine have used (every core), from /proc/stat."""
    with open("/proc/stat", encoding="ascii") as fh:
        fields = fh.readline().split()[1:]
    # user nice system idle iowait irq softirq steal ...: busy is everything but idle+iowait.
    values = [int(v) for v in fields]
    return (sum(values) - values[3] - values[4]) / TICKS


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Procs:
    """Child processes of one run, stopped in reverse order by `stop_all`."""

    def __init__(self, logs: Path, niceness: int = 0) -> None:
        self.logs = logs
        self.niceness = niceness
        self.started: list[tuple[str, trio.Process]] = []

    async def start(
        self, name: str, argv: Sequence[str], *, stdout_pipe: bool = False
    ) -> trio.Process:
        log = (self.logs / f"{name}.log").open("wb")
        try:
            proc = await trio.lowlevel.open_process(
                list(argv),
                stdout=subprocess.PIPE if stdout_pipe else log,
                stderr=log,
                start_new_session=True,
                cwd=str(REPO),
            )
        finally:
            log.close()
        self.started.append((name, proc))
        if self.niceness:
            # Ahead of unrelated work on a shared box (needs root for < 0; best effort).
            try:
                os.setpriority(os.PRIO_PROCESS, proc.pid, self.niceness)
            except OSError:
                pass
        return proc

    def cpu(self) -> dict[str, float | None]:
        return {name: cpu_seconds(p.pid) for name, p in self.started}

    async def stop(self, proc: trio.Process, grace_s: float = 10.0) -> None:
        with trio.CancelScope(shield=True):
            if proc.returncode is None:
                try:
                    proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
                with trio.move_on_after(grace_s):
                    await proc.wait()
                if proc.returncode is None:
                    proc.kill()
                    with trio.move_on_after(5.0):
                        await proc.wait()

    async def stop_all(self) -> None:
        for _, proc in reversed(self.started):
            await self.stop(proc)


async def read_lines(proc: trio.Process, count: int, within_s: float) -> list[str]:
    assert proc.stdout is not None
    buf = b""
    with trio.fail_after(within_s):
        while buf.count(b"\n") < count:
            chunk = await proc.stdout.receive_some(4096)
            if not chunk:
                raise RuntimeError(f"process {proc.pid} exited before printing {count} lines")
            buf += chunk
    return buf.decode().splitlines()[:count]


async def start_fleet(
    procs: Procs, *, engines: int, sim_procs: int, speed: float, seed: int
) -> list[list[str]]:
    """Start `engines` simulated engines in `sim_procs` processes; URLs per process."""
    sizes = [engines // sim_procs + (1 if i < engines % sim_procs else 0) for i in range(sim_procs)]
    groups: list[list[str]] = []
    for i, size in enumerate(sizes):
        argv = [
            sys.executable,
            "-m",
            "narwhal.sim",
            "--port",
            "0",
            "--engines",
            str(size),
            "--speed",
            str(speed),
            "--model",
            MODEL,
            "--seed",
            str(seed + 100 * i),
        ]
        proc = await procs.start(f"sim{i}", argv, stdout_pipe=True)
        groups.append(await read_lines(proc, size, 30.0))
    return groups


def assign_roles(groups: Sequence[Sequence[str]], prefill: int) -> tuple[list[str], list[str]]:
    """(urls, roles) with each pool spread evenly over the sim processes.

    Decode engines stream every token and so cost their process far more CPU than prefill
    engines; one process must not carry the whole decode pool.
    """
    total = sum(len(g) for g in groups)
    if not 0 <= prefill <= total:
        raise ValueError(f"prefill is {prefill}; must be within 0..{total}")
    # Deal the prefill roles round robin over the processes that still have engines.
    quota = [0] * len(groups)
    k = 0
    while sum(quota) < prefill:
        i = k % len(groups)
        if quota[i] < len(groups[i]):
            quota[i] += 1
        k += 1
    urls: list[str] = []
    roles: list[str] = []
    for group, q in zip(groups, quota, strict=True):
        for j, url in enumerate(group):
            urls.append(url)
            roles.append("prefill" if j < q else "decode")
    return urls, roles


def narwhal_config(
    urls: Sequence[str],
    roles: Sequence[str],
    *,
    port: int,
    speed: float,
    admission: str,
    controller: bool,
    ttft_slo_s: float,
    tpot_slo_s: float,
    socket_path: str,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Narwhal's config for a run. Every duration is model time divided by the speed, so
    the router's timers mean what they mean on a real fleet; the SLOs likewise."""

    def wall(model_s: float) -> float:
        return round(model_s / speed, 6)

    config: dict[str, Any] = {
        "engines": [
            {"id": f"e{i}", "url": url, "dialect": "vllm", "role": role, "model": MODEL}
            for i, (url, role) in enumerate(zip(urls, roles, strict=True))
        ],
        "listen": {"host": "127.0.0.1", "port": port},
        # /narwhal/state, which the sampler reads, is served there (`admin_url`).
        "admin": {"host": "127.0.0.1", "port": 0 if port == 0 else free_port()},
        "ctl": {"socket": socket_path},
        "log": {"level": "warning"},
        "slo": {"ttft_s": wall(ttft_slo_s), "tpot_s": wall(tpot_slo_s)},
        "serving": {
            "admission": admission,
            "max_connections": MAX_CONNECTIONS,
            "request_timeout_s": wall(600.0),
            "prefill_timeout_s": wall(120.0),
        },
        "engine": {
            "first_token_timeout_s": wall(2.5),
            "decode_read_timeout_s": wall(60.0),
        },
        "controller": {"enabled": controller},
    }
    for section, values in (extra or {}).items():
        config.setdefault(section, {}).update(values)
    return config


async def wait_http_ok(url: str, within_s: float, proc: trio.Process) -> None:
    async with httpx.AsyncClient(timeout=2.0) as client:
        with trio.fail_after(within_s):
            while True:
                if proc.returncode is not None:
                    raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
                try:
                    if (await client.get(url)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await trio.sleep(0.2)


def admin_url(config: dict[str, Any]) -> str:
    """Where the Narwhal `config` serves /narwhal/state and /metrics."""
    return f"http://127.0.0.1:{config['admin']['port']}"


async def start_narwhal(procs: Procs, config: dict[str, Any], run_dir: Path) -> str:
    path = run_dir / "narwhal.json"
    path.write_text(json.dumps(config, indent=2))
    proc = await procs.start(
        "narwhal", [sys.executable, "-m", "narwhal", "serve", "--config", str(path)]
    )
    url = f"http://127.0.0.1:{config['listen']['port']}"
    await wait_http_ok(url + "/health", 30.0, proc)
    return url


def vllm_router_binary(venv: Path) -> Path | None:
    exe = venv / "bin" / "vllm-router"
    return exe if exe.exists() else None


async def start_vllm_router(
    procs: Procs,
    exe: Path,
    urls: Sequence[str],
    roles: Sequence[str],
    *,
    port: int,
    speed: float,
) -> str:
    argv = [
        str(exe),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--vllm-pd-disaggregation",
        "--policy",
        "round_robin",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--request-timeout-secs",
        str(max(1, round(600.0 / speed))),
        "--log-level",
        "warning",
    ]
    for url, role in zip(urls, roles, strict=True):
        argv += ["--prefill", url] if role == "prefill" else ["--decode", url]
    proc = await procs.start("vllm-router", argv)
    url = f"http://127.0.0.1:{port}"
    await wait_http_ok(url + "/health", 60.0, proc)
    return url


async def warm_up(url: str, count: int = 4) -> list[int]:
    """A few small streaming requests: the first connections, and a check the path works."""
    body = {
        "model": MODEL,
        "prompt": [791] * 64,
        "max_tokens": 4,
        "stream": True,
    }
    statuses = []
    async with httpx.AsyncClient(timeout=30.0) as client:
        for _ in range(count):
            async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                await resp.aread()
                statuses.append(resp.status_code)
    return statuses


class Sampler:
    """Polls the router's and the engines' state every `every_s` wall seconds."""

    def __init__(
        self,
        engine_urls: Sequence[str],
        roles: Sequence[str],
        narwhal_url: str | None,
        speed: float,
        every_s: float,
    ) -> None:
        self.engine_urls = list(engine_urls)
        self.static_roles = list(roles)
        self.narwhal_url = narwhal_url
        self.speed = speed
        self.every_s = every_s
        self.samples: list[dict[str, Any]] = []
        self.final_engines: list[dict[str, Any]] = []
        # The controller's verdicts as they changed (why a move happened or was held),
        # and its whole /narwhal/state section at the end.
        self.decisions: list[dict[str, Any]] = []
        self.final_controller: dict[str, Any] | None = None
        self.errors = 0

    async def _engine(self, client: httpx.AsyncClient, url: str) -> dict[str, Any] | None:
        try:
            doc: dict[str, Any] = (await client.get(url + "/_sim/state?outcomes=0")).json()
        except (httpx.HTTPError, ValueError):
            self.errors += 1
            return None
        return doc

    async def run(self, t0: float) -> None:
        async with httpx.AsyncClient(timeout=max(2.0, self.every_s)) as client:
            while True:
                now = trio.current_time()
                roles = self.static_roles
                projected = None
                if self.narwhal_url is not None:
                    try:
                        doc = (await client.get(self.narwhal_url + "/narwhal/state")).json()
                        roles = [e["role"] for e in doc["engines"]]
                        self._decision(now - t0, doc.get("controller"))
                        projected = _projected(doc.get("controller"))
                    except (httpx.HTTPError, ValueError, KeyError, TypeError):
                        self.errors += 1
                engines = [await self._engine(client, u) for u in self.engine_urls]
                self.samples.append(
                    {
                        "t": round((now - t0) * self.speed, 3),
                        "roles": roles,
                        "projected": projected,
                        "engines": [
                            None
                            if e is None
                            else [e["running"], e["waiting"] + e["pulling"], e["kv"]["usage"]]
                            for e in engines
                        ],
                    }
                )
                await trio.sleep_until(now + self.every_s)

    def _decision(self, wall_s: float, section: Any) -> None:
        if not isinstance(section, dict) or "reason" not in section:
            return
        split = section.get("split") or {}
        verdict = {key: section.get(key) for key in ("caller", "reason", "result", "gate", "rule")}
        verdict["current"] = split.get("current")
        verdict["proposed"] = split.get("proposed")
        if not self.decisions or {k: self.decisions[-1][k] for k in verdict} != verdict:
            self.decisions.append({"t": round(wall_s * self.speed, 3), **verdict})

    async def final(self) -> None:
        async with httpx.AsyncClient(timeout=5.0) as client:
            if self.narwhal_url is not None:
                try:
                    doc = (await client.get(self.narwhal_url + "/narwhal/state")).json()
                    self.final_controller = doc.get("controller")
                except (httpx.HTTPError, ValueError):
                    self.errors += 1
            for url in self.engine_urls:
                doc = await self._engine(client, url)
                if doc is not None:
                    self.final_engines.append(
                        {
                            "url": url,
                            "steps": doc["steps"],
                            "step_lag_resets": doc["step_lag"]["resets"],
                            "max_step_lag_s": round(doc["step_lag"]["max_s"], 4),
                            "preemptions": doc["counters"].get("preemptions", 0),
                            # Legs served per phase: shows how evenly a router spreads load.
                            "requests": doc["counters"].get("requests", {}),
                        }
                    )


# What the sampler keeps of the controller's projection of the current split: its worst
# SLO ratio, decode load and per-engine decode batch (why it held or moved).
PROJECTED = ("worst", "decode_load", "decode_batch")


def _projected(section: Any) -> list[float | None] | None:
    """The `PROJECTED` fields of the controller's current-split projection, in order."""
    try:
        current = section["loads"]["projected"]["current"]
    except (KeyError, TypeError):
        return None
    if not isinstance(current, dict):
        return None
    return [current.get(k) for k in PROJECTED]


async def run_guarded(main: Callable[[], Awaitable[int]]) -> int:
    """Run `main`; SIGINT or SIGTERM cancels it, so every `finally` stops its processes.

    (A benchmark started in the background has SIGINT ignored; the receiver handles it
    anyway.)
    """
    code = 130
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    print(f"signal {signum}: stopping every process started", file=sys.stderr)
                    nursery.cancel_scope.cancel()
                    return

        nursery.start_soon(watch)
        code = await main()
        nursery.cancel_scope.cancel()
    return code
