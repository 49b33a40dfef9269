"""The processes of a benchmark run: simulated fleets, Narwhal, vllm-router, the load
generator, and a sampler of router and engine state.

Owns: starting each of them on 127.0.0.1 and waiting until it answers, the config a
trace benchmark gives Narwhal, vllm-router's own venv, and the trace replay (the load
generator in replay mode beside the sampler, with the CPU every process used).
Invariants: every child is started through a `Procs` and stopped by its PID (SIGTERM,
then SIGKILL after a grace period) when the `async with` ends, whatever went wrong;
`run_guarded` turns SIGINT, SIGTERM and SIGHUP into a cancellation, so that exit runs
for them too. A child listed in `Procs(affinity=...)` runs only on its CPUs from exec on.
Errors: a child that exits or stays silent during start-up raises RuntimeError naming it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import attrs
import httpx
import trio

from ._cpu import machine_cpu_seconds, tree_cpu_seconds
from ._facts import BENCH, REPO, TMP, Json

MODEL = "sim-llama-3-8b"
# serving.max_connections for the trace benchmarks' fleets, sized as manual 4.1 asks, from
# the measured in-flight load: the long-answer decode-heavy phase keeps ~650 requests in
# flight on 8 engines (answers of 256+ tokens for tens of seconds of wall time), and at
# the default 512 the gate refused ~6 % of that phase, requests the engines then had room
# for (8 x max_num_seqs 256 sequences). Predictive admission still bounds what is admitted.
MAX_CONNECTIONS = 1024
VLLM_ROUTER_VENV = TMP / "venv-vllm-router"
VLLM_ROUTER_REQUIREMENT = "vllm-router>=0.1,<0.2"

Router = Literal["narwhal", "vllm-router"]


def free_port() -> int:
    """A loopback port that was free a moment ago (the benchmark owns the box's loopback)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Procs:
    """The children of one run, stopped in reverse order (routers before their fleet) when
    the `async with` ends.

    Each child's stdout (unless piped) and stderr go to `logs/<name>.log`. `niceness` is
    given to every child (negative: ahead of other work; needs root, best effort);
    `affinity` maps a name to the CPUs its child may use (a name also covers its
    numbered instances: "sim" pins sim0 and sim1).
    """

    def __init__(
        self,
        logs: Path,
        niceness: int = 0,
        *,
        affinity: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        self.logs = logs
        self.niceness = niceness
        self.affinity = {name: tuple(cpus) for name, cpus in (affinity or {}).items()}
        self.started: list[tuple[str, trio.Process]] = []

    async def __aenter__(self) -> Procs:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop_all()

    def _preexec(self, name: str) -> Callable[[], None] | None:
        cpus = self.affinity.get(name, self.affinity.get(name.rstrip("0123456789")))
        niceness = self.niceness
        if cpus is None and not niceness:
            return None

        def in_child() -> None:
            # Before exec, so every thread the child starts inherits both.
            if cpus is not None:
                os.sched_setaffinity(0, cpus)
            if niceness:
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, 0, niceness)

        return in_child

    async def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        stdout_pipe: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> trio.Process:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = (self.logs / f"{name}.log").open("wb")
        try:
            proc = await trio.lowlevel.open_process(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if stdout_pipe else log,
                stderr=log,
                start_new_session=True,
                cwd=str(REPO),
                env=dict(env) if env is not None else None,
                preexec_fn=self._preexec(name),
            )
        finally:
            log.close()
        self.started.append((name, proc))
        return proc

    async def run(self, name: str, argv: Sequence[str], *, within_s: float) -> bytes:
        """A short-lived child (one load generator cell): its stdout once it exits 0."""
        with trio.fail_after(within_s):
            done = await trio.run_process(
                list(argv),
                stdin=subprocess.DEVNULL,
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                cwd=str(REPO),
                preexec_fn=self._preexec(name),
            )
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed ({done.returncode}): {done.stderr.decode()[-2000:]}")
        return bytes(done.stdout)

    def find(self, name: str) -> trio.Process:
        """The child started last under `name`."""
        return next(p for n, p in reversed(self.started) if n == name)

    def cpu(self) -> dict[str, float | None]:
        """CPU seconds of every child so far, its own children included (a Narwhal's
        workers); None: it has exited."""
        out: dict[str, float | None] = {}
        for name, proc in self.started:
            try:
                out[name] = tree_cpu_seconds(proc.pid)
            except OSError:
                out[name] = None
        return out

    async def stop(self, proc: trio.Process, grace_s: float = 10.0) -> None:
        with trio.CancelScope(shield=True):
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
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
    """The first `count` stdout lines of a child, or RuntimeError if it exits first."""
    assert proc.stdout is not None
    buf = b""
    with trio.fail_after(within_s):
        while buf.count(b"\n") < count:
            chunk = await proc.stdout.receive_some(4096)
            if not chunk:
                raise RuntimeError(f"process {proc.pid} exited before printing {count} lines")
            buf += chunk
    return buf.decode().splitlines()[:count]


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
                await trio.sleep(0.1)


# ---------------------------------------------------------------------------- the fleet


async def start_fleet(
    procs: Procs,
    *,
    engines: int,
    sim_procs: int = 1,
    speed: float | None = None,
    model: str | None = None,
    seed: int | None = None,
    zero: bool = False,
    extra_args: Sequence[str] = (),
) -> list[list[str]]:
    """Start `engines` simulated engines in `sim_procs` processes (sim0, sim1, ...); the
    engines' URLs per process. `zero`: instant engines (SimTiming.zero); `extra_args`: more
    narwhal-sim options."""
    sizes = [engines // sim_procs + (1 if i < engines % sim_procs else 0) for i in range(sim_procs)]
    groups: list[list[str]] = []
    for i, size in enumerate(sizes):
        argv = [sys.executable, "-m", "narwhal.sim", "--port", "0", "--engines", str(size)]
        if speed is not None:
            argv += ["--speed", str(speed)]
        if model is not None:
            argv += ["--model", model]
        if seed is not None:
            argv += ["--seed", str(seed + 100 * i)]
        if zero:
            argv.append("--zero")
        argv += extra_args
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


# ---------------------------------------------------------------------------- the routers


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
    """Narwhal's config for a trace benchmark's run. Every duration is model time divided
    by the speed, so the router's timers mean what they mean on a real fleet; the SLOs
    likewise."""

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


async def start_etcd(procs: Procs, directory: Path) -> str:
    """A one-member etcd (Debian's etcd-server) on free loopback ports, its data in
    `directory`; its client URL once it answers."""
    binary = shutil.which("etcd")
    if binary is None:
        raise RuntimeError("etcd is not on PATH: apt-get install etcd-server")
    client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    argv = [
        binary,
        "--name=bench",
        f"--data-dir={directory / 'etcd'}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=bench={peer}",
        # The replicas write their loads many times a second: keep the history short
        # (docs/operations.md#several-replicas).
        "--auto-compaction-mode=periodic",
        "--auto-compaction-retention=10m",
    ]
    proc = await procs.start("etcd", argv)
    await wait_http_ok(client + "/health", 30.0, proc)
    return client


def admin_url(config: Mapping[str, Any]) -> str:
    """Where the Narwhal `config` serves /narwhal/state and /metrics."""
    return f"http://127.0.0.1:{config['admin']['port']}"


async def start_narwhal(
    procs: Procs,
    config: Mapping[str, Any],
    directory: Path,
    *,
    name: str = "narwhal",
    pythonpath: Path | None = None,
    script: Path | None = None,
) -> str:
    """`narwhal serve` on `config` (written to directory/<name>.json); its client URL once
    /health answers. `pythonpath`: run the narwhal package found there instead (-P keeps
    this checkout from shadowing it). `script`: a script that takes the daemon's
    arguments, in place of `-m narwhal`."""
    path = directory / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2))
    entry = [str(script)] if script is not None else ["-m", "narwhal"]
    argv = [sys.executable, *entry, "serve", "--config", str(path)]
    env = None
    if pythonpath is not None:
        argv[1:1] = ["-P"]
        env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    proc = await procs.start(name, argv, env=env)
    url = f"http://127.0.0.1:{config['listen']['port']}"
    await wait_http_ok(url + "/health", 60.0, proc)
    return url


def vllm_router_binary(venv: Path = VLLM_ROUTER_VENV) -> Path | None:
    exe = venv / "bin" / "vllm-router"
    return exe if exe.exists() else None


@attrs.define
class Peer:
    """vllm-router for a benchmark that compares: installed and started, or skipped (why)."""

    status: str  # "ok" | "skipped"
    venv: Path = VLLM_ROUTER_VENV
    version: str | None = None
    note: str | None = None
    install_s: float | None = None

    def to_json(self) -> dict[str, Json]:
        return {
            "status": self.status,
            "requirement": VLLM_ROUTER_REQUIREMENT,
            "version": self.version,
            "venv": str(self.venv.relative_to(REPO)),
            "note": self.note,
            "install_s": self.install_s,
        }


async def install_vllm_router(venv: Path = VLLM_ROUTER_VENV) -> Peer:
    """vllm-router in its own venv (what tools/bench/install_vllm_router.sh does), reused
    when it is already there; skipped, saying why, when it cannot be installed."""
    python = venv / "bin" / "python"
    started = time.monotonic()

    async def run(argv: Sequence[str], within_s: float) -> str:
        with trio.fail_after(within_s):
            done = await trio.run_process(list(argv), capture_stdout=True, capture_stderr=True)
        return bytes(done.stdout).decode().strip()

    try:
        if vllm_router_binary(venv) is None:
            await trio.to_thread.run_sync(partial(shutil.rmtree, venv, ignore_errors=True))
            await run([sys.executable, "-m", "venv", str(venv)], 120)
            await run(
                [str(python), "-m", "pip", "install", "--quiet", VLLM_ROUTER_REQUIREMENT], 600
            )
        version = await run(
            [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-router'))"],
            60,
        )
    except (OSError, subprocess.CalledProcessError, trio.TooSlowError) as exc:
        detail = ""
        if isinstance(exc, subprocess.CalledProcessError):
            stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else str(exc.stderr)
            detail = ": " + stderr.strip()[-500:]
        note = f"vllm-router could not be installed ({exc!r}){detail}"
        return Peer("skipped", venv, note=note)
    return Peer("ok", venv, version=version, install_s=round(time.monotonic() - started, 1))


async def start_vllm_router(
    procs: Procs,
    exe: Path,
    urls: Sequence[str],
    roles: Sequence[str],
    *,
    port: int,
    options: Sequence[str] = (),
    policy: str = "round_robin",
) -> tuple[str, list[str]]:
    """vllm-router `--vllm-pd-disaggregation --policy POLICY` in front of the engines
    (plus `options`); its URL once /health answers, and its command line."""
    argv = [
        str(exe),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--vllm-pd-disaggregation",
        "--policy",
        policy,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        *options,
    ]
    for url, role in zip(urls, roles, strict=True):
        argv += ["--prefill", url] if role == "prefill" else ["--decode", url]
    proc = await procs.start("vllm-router", argv)
    url = f"http://127.0.0.1:{port}"
    await wait_http_ok(url + "/health", 120.0, proc)
    return url, argv


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


# ---------------------------------------------------------------------------- observing


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


# ---------------------------------------------------------------------------- trace replay


@attrs.frozen
class Replayed:
    """What one open-loop replay measured (wall seconds; CPU per child over the replay)."""

    rows: list[list[Json]]  # loadgen.py's per-request rows, by index
    loadgen: dict[str, Json]  # the load generator's own stats
    wall_s: float
    cpu_s: dict[str, float]
    busy_s: float  # every process on the machine
    launched: float  # wall clock (epoch s) as the load generator started


async def replay(
    procs: Procs,
    url: str,
    requests: Sequence[tuple[float, int | str, int]],
    *,
    speed: float,
    duration_s: float,
    run_dir: Path,
    sampler: Sampler,
    ttft_timeout_s: float,
    total_timeout_s: float,
    kill: Mapping[str, float] | None = None,
) -> Replayed:
    """Replay `requests` ((model time, prompt tokens or text, max_tokens)) through `url` with
    loadgen.py in replay mode, the sampler polling meanwhile, then read its final state.
    Its input and raw rows stay in `run_dir` (workload.json, results.jsonl, loadgen.json).
    `kill`: {"pid", "at_s"}, a process the load generator SIGKILLs at that model time."""
    workload, rows_file, stats_file = (
        run_dir / name for name in ("workload.json", "results.jsonl", "loadgen.json")
    )
    workload.write_text(json.dumps({"requests": [list(r) for r in requests]}))
    spec = {
        "mode": "replay",
        "url": url,
        "workload": str(workload),
        "speed": speed,
        "model": MODEL,
        "out": str(rows_file),
        "stats": str(stats_file),
        "ttft_timeout_s": ttft_timeout_s,
        "total_timeout_s": total_timeout_s,
    }
    if kill is not None:
        spec["kill"] = dict(kill)
    # The replay cannot outlive its last arrival plus the client timeout.
    hard_limit = (duration_s + total_timeout_s) / speed + 60.0
    cpu0, busy0, wall0 = procs.cpu(), machine_cpu_seconds()[0], trio.current_time()
    launched = time.time()  # every request Narwhal logs after this is the workload's
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sampler.run, wall0 + 0.5)
        argv = [sys.executable, str(BENCH / "loadgen.py"), json.dumps(spec)]
        loadgen = await procs.start("loadgen", argv)
        with trio.move_on_after(hard_limit) as limit:
            await loadgen.wait()
        nursery.cancel_scope.cancel()
    if limit.cancelled_caught:
        raise RuntimeError(f"the load generator ran past its {hard_limit:.0f} s limit")
    if loadgen.returncode != 0:
        raise RuntimeError(f"the load generator exited with {loadgen.returncode}")
    wall = trio.current_time() - wall0
    cpu1, busy = procs.cpu(), machine_cpu_seconds()[0] - busy0
    await sampler.final()
    return Replayed(
        rows=[json.loads(line) for line in rows_file.read_text().splitlines() if line],
        loadgen=json.loads(stats_file.read_text()),
        wall_s=wall,
        cpu_s={k: v - (cpu0.get(k) or 0.0) for k, v in cpu1.items() if v is not None},
        busy_s=busy,
        launched=launched,
    )


# Above this fraction of simulator steps behind their law, a replay measures the box's
# CPU, not the router: two replicas at --speed 0.25 lagged 8-10 % on a slow day and
# priced every first token low, against 0.1-1.3 % in the runs the docs compare.
STARVED_LAG_FRACTION = 0.02


def starved(lagged_step_fraction: float | None) -> str | None:
    """The warning a replay whose simulator lagged that often must carry, or None."""
    if lagged_step_fraction is None or lagged_step_fraction <= STARVED_LAG_FRACTION:
        return None
    return (
        f"the simulator lagged {lagged_step_fraction:.1%} of its steps (above "
        f"{STARVED_LAG_FRACTION:.0%}): the box starved it, so this run measures the CPU, "
        "not the router; rerun on a quieter box or at a lower --speed"
    )


def warn_if_starved(who: str, faithfulness: Json) -> None:
    """Print a run's `starved` warning, if it has one, on stderr under `who`."""
    warning = faithfulness.get("warning") if isinstance(faithfulness, dict) else None
    if warning:
        print(f"{who}: WARNING: {warning}", file=sys.stderr, flush=True)


def faithfulness(run: Replayed, sampler: Sampler) -> dict[str, Json]:
    """Whether the replay measured the simulated fleet's law rather than a starved box:
    simulator steps that fell > 20 ms (wall) behind it, the load generator's lateness,
    every child's CPU share, and what everything else on the machine used meanwhile;
    `warning` when the simulator lagged too often (`starved`)."""
    engines = sampler.final_engines
    steps = sum(e["steps"] for e in engines)
    resets = sum(e["step_lag_resets"] for e in engines)
    ours = run.loadgen["cpu_s"] + sum(run.cpu_s.values())
    fraction = round(resets / steps, 5) if steps else None
    return {
        "warning": starved(fraction),
        "sim_steps": steps,
        "sim_step_lag_resets": resets,
        "sim_lagged_step_fraction": fraction,
        "sim_max_step_lag_ms_wall": max(
            (e["max_step_lag_s"] * 1000 for e in engines), default=None
        ),
        "loadgen_lateness_s_wall": run.loadgen["lateness_s"],
        "cpu_share": {k: round(v / run.wall_s, 3) for k, v in run.cpu_s.items()},
        # Cores used meanwhile by everything else on the machine (this driver included):
        # other sessions' work on a shared box shows up here.
        "other_cpu_share": round(max(0.0, run.busy_s - ours) / run.wall_s, 3),
        "sampler_errors": sampler.errors,
    }


async def run_guarded(main: Callable[[], Awaitable[int]]) -> int:
    """Run `main`; SIGINT, SIGTERM or SIGHUP cancels it, so every `Procs` stops its
    children. (A benchmark started in the background has SIGINT ignored; the receiver
    handles it anyway.)"""
    code = 130
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as sigs:
                async for signum in sigs:
                    print(f"signal {signum}: stopping every process started", file=sys.stderr)
                    nursery.cancel_scope.cancel()
                    return

        nursery.start_soon(watch)
        code = await main()
        nursery.cancel_scope.cancel()
    return code
