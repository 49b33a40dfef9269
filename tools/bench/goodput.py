"""The goodput benchmark (issue 8 part 1): one phased Azure-trace workload, replayed open
loop against each router configuration on a fresh simulated fleet of 8 Llama-3-8B-class
engines; SLO attainment and goodput over OFFERED requests, per phase and over time.

    .venv/bin/python tools/bench/goodput.py --quick            # ~1 min of model time per run
    .venv/bin/python tools/bench/goodput.py                    # the full workload
    .venv/bin/python tools/bench/goodput.py --quick --configs narwhal-static-4p4d,vllm-router-4p4d

Writes runs/bench/goodput.json and runs/bench/goodput.png; logs and raw per-request rows
go to runs/tmp/goodput/<run>/ (not committed). See docs/benchmarks.md.

Configurations (`CONFIGURATIONS`): Narwhal at every static split 1P7D..7P1D with the
controller disabled and `admission: open` (the best of them in hindsight is the bar);
Narwhal with open admission at the default split (4P4D); vllm-router 0.1.x in vLLM P/D mode
(round robin) at the best static split and at 4P4D; and Narwhal with predictive admission
and/or the role controller, which need features that are not on main yet: they are listed
with ``"status": "skipped"`` until `FEATURES` says the feature is there (or
``--assume-feature NAME`` forces them to run).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import benchkit
import httpx
import trio
from benchkit import Json, attainment as gm, harness, workload as gw

from narwhal.sim import SimTiming

ENGINES = 8
DEFAULT_SPLIT = 4  # prefill engines of the "default" split: even, what an operator starts with

# Features that some configurations need and that are being built on other branches.
# THE LEAD'S HOOK: set a feature to True once it is on main (or pass --assume-feature).
#   predictive_admission: `serving.admission: "predictive"` prices requests (issue 5)
#   controller:           `controller.enabled: true` moves engines between roles (issue 7)
FEATURES: dict[str, bool] = {"predictive_admission": True, "controller": True}


Prepare = Callable[[list[str], list[str], Path], Awaitable[dict[str, dict[str, Any]]]]


@attrs.frozen
class Configuration:
    name: str
    router: harness.Router
    # Prefill engines of the (initial) split; "best" = the hindsight-best static split.
    split: int | str
    admission: str = "open"
    controller: bool = False
    requires: tuple[str, ...] = ()
    # Reuse another configuration's run when it would be the identical experiment.
    alias_of: str | None = None
    note: str = ""
    # Extra Narwhal config sections merged into the generated file (the lead's knobs).
    narwhal_extra: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    # vllm-router's --policy in P/D mode (prefill and decode both).
    policy: str = "round_robin"
    # THE LEAD'S HOOK for per-run preparation on the fresh fleet, before the router starts
    # (e.g. run narwhal-profile against these engines at this speed): called with the
    # engine URLs, their roles and the run directory; returns more config sections.
    prepare: Prepare | None = None


# A profile store measured on an earlier fleet of this invocation (or --profiles): every
# fleet the benchmark starts is the same simulator build with the same timing law and the
# same engine ids, so one measurement serves them all once the URLs are rewritten.
_REUSE: dict[str, Path] = {}


def reuse_profiles(source: Path, urls: list[str], out: Path) -> None:
    """Copy a profile store measured on an identical fleet, pointing each engine id at
    this fleet's URL (engine ids are positional: e0..e7)."""
    store = json.loads(source.read_text())
    for index, url in enumerate(urls):
        store["engines"][f"e{index}"]["url"] = url
    store["reused_from"] = str(source)
    out.write_text(json.dumps(store, indent=2))


def use_profiles(store: Path) -> None:
    """Reuse `store` (measured on an identical fleet) for every predictive run."""
    _REUSE["store"] = store


async def profile_fleet(
    urls: list[str], roles: list[str], run_dir: Path
) -> dict[str, dict[str, Any]]:
    """Profile this run's fresh fleet with narwhal-profile, at the run's speed.

    Predictions must describe the engines as they run here (slow motion included), so
    the first predictive run of an invocation measures its own fleet, as an operator
    would after deploying it; later runs (identical fleets) reuse that store with their
    URLs (`reuse_profiles`). The sweep is bounded (a few prompt sizes, engines four at a
    time) and its log is kept. Its decode batches reach 192 (the simulator runs up to
    max_num_seqs 256) and 70 % of the KV cache: the controller only moves to a split whose
    projected decode point lies inside the measured domain (manual 7.3), and the
    decode-heavy phase keeps ~650 streams in flight, over 160 per engine at 4P4D.
    """
    out = run_dir / "profiles.json"
    if "store" in _REUSE:
        reuse_profiles(_REUSE["store"], urls, out)
        return {"profiles": {"path": str(out)}}
    config = harness.narwhal_config(
        urls,
        roles,
        port=0,
        speed=1.0,
        admission="open",
        controller=False,
        ttft_slo_s=1.0,
        tpot_slo_s=1.0,
        socket_path=str(run_dir / "profile.sock"),
    )
    config_path = run_dir / "profile-config.json"
    config_path.write_text(json.dumps(config, indent=2))
    argv = [
        sys.executable, "-m", "narwhal.cli.profile", "--config", str(config_path),
        "--out", str(out), "--parallel", "4", "--prefill-sizes", "64,512,1024,2048,4096,7000",
        "--prefill-repeats", "2", "--decode-active", "1,8,32,96,192", "--decode-contexts",
        "512,1536", "--kv-budget", "0.7", "--decode-gaps", "16", "--handoff-sizes", "256,2048,6000",
        "--handoff-repeats", "2", "--budget-s", "900", "--quiet",
    ]  # fmt: skip
    with (run_dir / "profile.log").open("wb") as log:
        await trio.run_process(argv, stdout=log, stderr=subprocess.STDOUT)
    _REUSE["store"] = out
    return {"profiles": {"path": str(out)}}


def controller_timing(phase_model_s: float, speed: float) -> dict[str, Any]:
    """The controller's clocks scaled to the workload's phases.

    The benchmark compresses hours of traffic into phases of `phase_model_s`; the
    controller's windows (defaults sized for minutes-long phases: a 120 s demand window,
    a 60 s evidence span) are compressed by the same factor, relative to a 300 s phase,
    then converted to wall time like every other duration. Documented in the results.
    """
    k = phase_model_s / 300.0

    def wall(model_s: float) -> float:
        return round(model_s * k / speed, 6)

    return {
        "monitor_interval_s": wall(1.0),
        "thresholds": {"cooldown_s": wall(10.0)},
        "reactive": {
            "window_s": wall(120.0),
            "step_s": wall(5.0),
            "evidence_span_s": wall(60.0),
            "evidence_max_span_s": wall(120.0),
        },
    }


def with_controller_timing(cfg: Configuration, phase_model_s: float, speed: float) -> Configuration:
    """`cfg` with its controller enabled on `controller_timing`'s clocks (unchanged when
    the configuration has no controller)."""
    if not cfg.controller:
        return cfg
    extra = {
        **cfg.narwhal_extra,
        "controller": {"enabled": True, **controller_timing(phase_model_s, speed)},
    }
    return attrs.evolve(cfg, narwhal_extra=extra)


def with_narwhal_extra(cfg: Configuration, extra: dict[str, dict[str, Any]]) -> Configuration:
    """`cfg` with `extra`'s sections (--narwhal-extra) merged over its own, key by key; a
    vllm-router configuration is unchanged."""
    if not extra or cfg.router != "narwhal":
        return cfg
    merged = dict(cfg.narwhal_extra)
    for section, values in extra.items():
        merged[section] = {**merged.get(section, {}), **values}
    return attrs.evolve(cfg, narwhal_extra=merged)


def json_sections(text: str) -> dict[str, dict[str, Any]]:
    """--narwhal-extra's value: a JSON object of config sections, each an object."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise argparse.ArgumentTypeError('must be an object of sections, e.g. {"cache": {...}}')
    return value


def _static(p: int) -> Configuration:
    # The bar for the controller: everything Narwhal-full does except moving roles, so
    # the comparison isolates the controller (open admission has its own row).
    return Configuration(
        f"narwhal-static-{p}p{ENGINES - p}d",
        "narwhal",
        p,
        admission="predictive",
        requires=("predictive_admission",),
        note="controller disabled, predictive admission",
        prepare=profile_fleet,
    )


CONFIGURATIONS: list[Configuration] = [
    *(_static(p) for p in range(1, ENGINES)),
    Configuration(
        "narwhal-open",
        "narwhal",
        DEFAULT_SPLIT,
        note="open admission at the default split, controller disabled: Narwhal as a "
        "plain P/D router",
    ),
    Configuration(
        "vllm-router-best",
        "vllm-router",
        "best",
        note="vllm-router round robin at the hindsight-best static split",
    ),
    Configuration("vllm-router-4p4d", "vllm-router", 4, note="vllm-router round robin, naive 4P4D"),
    # Placeholders until the features land (the lead enables them through FEATURES).
    Configuration(
        "narwhal-full",
        "narwhal",
        DEFAULT_SPLIT,
        admission="predictive",
        controller=True,
        requires=("predictive_admission", "controller"),
        note="predictive admission + role controller, starting at the default split",
        prepare=profile_fleet,
    ),
    Configuration(
        "narwhal-predictive",
        "narwhal",
        DEFAULT_SPLIT,
        admission="predictive",
        requires=("predictive_admission",),
        note="predictive admission only, static default split",
        prepare=profile_fleet,
    ),
    Configuration(
        "narwhal-controller",
        "narwhal",
        DEFAULT_SPLIT,
        controller=True,
        requires=("controller",),
        note="role controller only (open admission), starting at the default split",
    ),
]
STATIC_NAMES = [c.name for c in CONFIGURATIONS if c.name.startswith("narwhal-static-")]


# ------------------------------------------------------------------------------ facts


def versions(vllm_router_venv: Path) -> Json:
    """Package versions, the commit and vllm-router's version (None: not installed)."""
    vr = None
    python = vllm_router_venv / "bin" / "python"
    if python.exists():
        out = subprocess.run(
            [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-router'))"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        vr = out.stdout.strip() or None
    git = benchkit.git_revision()
    return {
        **benchkit.versions(["narwhal"]),
        "narwhal_commit": git["commit"],
        "narwhal_dirty": git["dirty"],
        "vllm_router": vr,
        **benchkit.versions(["trio", "h11", "httpx", "hypercorn", "numpy"]),
    }


# -------------------------------------------------------------------------------- runs


@attrs.frozen
class Settings:
    speed: float
    sim_procs: int
    seed: int
    slo: gw.Slo
    window_s: float
    sample_every_s: float
    ttft_timeout_s: float
    total_timeout_s: float
    vllm_router_venv: Path
    out_dir: Path  # per-run logs and raw rows
    niceness: int = 0  # of every process started (negative: ahead of other work)
    # Keep Narwhal's per-request log lines (projected vs observed TTFT, engines, attempts)
    # in the run directory: diagnosis, at some router CPU.
    request_log: bool = False
    # The fleet: engines, and more narwhal-sim options (prefix caching, block size).
    engines: int = ENGINES
    sim_args: tuple[str, ...] = ()
    # Narwhal replicas on one etcd (its `cluster` section), the load spread over them by
    # the load generator in turn: a simple balancer.
    replicas: int = 1
    # SIGKILL the leading replica at this model time (replicas > 1): the requests lost
    # and how long until another leads (`failover`).
    kill_leader_at_s: float | None = None


def split_label(p: int, engines: int = ENGINES) -> str:
    return f"{p}P{engines - p}D"


async def run_one(
    cfg: Configuration,
    prefill: int,
    requests: Sequence[gw.Request],
    bounds: Sequence[tuple[str, float, float]],
    settings: Settings,
    *,
    prompts: Sequence[str] | None = None,
) -> Json:
    """One configuration on a fresh fleet: returns its result document. `prompts`: the
    requests' prompt texts, sent instead of `prompt` token ids of one repeated token."""
    run_dir = settings.out_dir / cfg.name
    run_dir.mkdir(parents=True, exist_ok=True)
    speed = settings.speed
    duration = bounds[-1][2]
    started = time.monotonic()
    async with harness.Procs(run_dir, settings.niceness) as procs:
        groups = await harness.start_fleet(
            procs,
            engines=settings.engines,
            sim_procs=settings.sim_procs,
            speed=speed,
            model=harness.MODEL,
            seed=settings.seed,
            extra_args=settings.sim_args,
        )
        urls, roles = harness.assign_roles(groups, prefill)
        port = harness.free_port()
        narwhal_url: str | None = None
        if cfg.router == "narwhal":
            extra = dict(cfg.narwhal_extra)
            if cfg.prepare is not None:
                extra.update(await cfg.prepare(urls, roles, run_dir))
            if settings.request_log:
                extra["log"] = {"level": "info"}
            if settings.replicas > 1:
                endpoint = await harness.start_etcd(procs, run_dir)
                extra["cluster"] = {**extra.get("cluster", {}), "endpoints": [endpoint]}
            targets: list[str] = []
            admins: list[str] = []
            for replica in range(settings.replicas):
                if settings.replicas > 1:
                    extra["cluster"] = {**extra["cluster"], "replica_id": f"r{replica}"}
                config = harness.narwhal_config(
                    urls,
                    roles,
                    port=port if replica == 0 else harness.free_port(),
                    speed=speed,
                    admission=cfg.admission,
                    controller=cfg.controller,
                    ttft_slo_s=settings.slo.ttft_s,
                    tpot_slo_s=settings.slo.tpot_s,
                    socket_path=str(run_dir / f"narwhal-{replica}.sock"),
                    extra=extra,
                )
                name = "narwhal" if replica == 0 else f"narwhal-{replica}"
                targets.append(await harness.start_narwhal(procs, config, run_dir, name=name))
                admins.append(harness.admin_url(config))
                if replica == 0:
                    narwhal_url = harness.admin_url(config)
            url = ",".join(targets)
        else:
            exe = harness.vllm_router_binary(settings.vllm_router_venv)
            if exe is None:
                raise RuntimeError(
                    f"vllm-router is not installed in {settings.vllm_router_venv}; "
                    "run: bash tools/bench/install_vllm_router.sh"
                )
            options = ["--request-timeout-secs", str(max(1, round(600.0 / speed)))]
            options += ["--log-level", "warning"]
            url, _ = await harness.start_vllm_router(
                procs, exe, urls, roles, port=port, options=options, policy=cfg.policy
            )
        for target in url.split(","):
            warm = await harness.warm_up(target)
            if any(s != 200 for s in warm):
                raise RuntimeError(f"warm-up requests through {target} answered {warm}")
        kill: dict[str, float] | None = None
        watch = Failover()
        if settings.kill_leader_at_s is not None and cfg.router == "narwhal":
            leader = await leading_replica(admins)
            # The sampler reads a replica that survives.
            narwhal_url = admins[(leader + 1) % len(admins)]
            name = "narwhal" if leader == 0 else f"narwhal-{leader}"
            pid = next(proc.pid for n, proc in procs.started if n == name)
            kill = {"pid": pid, "at_s": settings.kill_leader_at_s}
            watch = Failover(leader, [a for i, a in enumerate(admins) if i != leader])
        sampler = harness.Sampler(urls, roles, narwhal_url, speed, settings.sample_every_s)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch.run)
            run = await harness.replay(
                procs,
                url,
                [
                    (r.t, r.prompt if prompts is None else prompts[i], r.output)
                    for i, r in enumerate(requests)
                ],
                speed=speed,
                duration_s=duration,
                run_dir=run_dir,
                sampler=sampler,
                ttft_timeout_s=settings.ttft_timeout_s,
                total_timeout_s=settings.total_timeout_s,
                kill=kill,
            )
            nursery.cancel_scope.cancel()
    samples = gm.samples_from([(r.t, r.phase, r.source) for r in requests], run.rows, speed)
    slo = settings.slo
    return {
        "status": "ran",
        "router": cfg.router,
        "replicas": settings.replicas,
        "split": split_label(prefill, settings.engines),
        "admission": cfg.admission,
        "controller": cfg.controller,
        "note": cfg.note,
        "wall_s": round(time.monotonic() - started, 1),
        "phases": gm.phase_table(samples, bounds, slo.ttft_s, slo.tpot_s),
        "over_time": gm.windows(samples, duration, settings.window_s, slo.ttft_s, slo.tpot_s),
        "pools": pool_series(sampler.samples),
        "role_changes": role_changes(sampler.samples),
        "controller_decisions": sampler.decisions,
        "final_controller": sampler.final_controller,
        "faithfulness": harness.faithfulness(run, sampler),
        "engines": [
            {"role": role, "legs": e["requests"], "preemptions": e["preemptions"]}
            for role, e in zip(roles, sampler.final_engines, strict=False)
        ],
        "loadgen": {
            k: run.loadgen[k]
            for k in ("cpu_ms_per_request", "cpu_us_per_chunk", "cpu_share", "chunks")
        },
        **({} if kill is None else {"failover": watch.summary(run, speed)}),
    }


async def leading_replica(admins: Sequence[str]) -> int:
    """The index of the replica whose /narwhal/state says it leads (waits up to 10 s)."""
    async with httpx.AsyncClient(timeout=2.0) as client:
        with trio.fail_after(10.0):
            while True:
                for i, admin in enumerate(admins):
                    state = (await client.get(admin + "/narwhal/state")).json()
                    if state["cluster"]["leading"]:
                        return i
                await trio.sleep(0.1)


@attrs.define
class Failover:
    """Polls the surviving replicas' /narwhal/state every 50 ms (wall) for the first one
    to lead after the kill, and sorts the load generator's rows by the replica they went
    to: what a replica's `kill -9` loses, and how long the fleet goes without a
    controller."""

    killed: int = -1
    survivors: list[str] = attrs.Factory(list)
    # (epoch s, whether any survivor leads) per poll
    polls: list[tuple[float, bool]] = attrs.Factory(list)

    async def run(self) -> None:
        if not self.survivors:
            return
        async with httpx.AsyncClient(timeout=1.0) as client:
            while True:
                leads = False
                for admin in self.survivors:
                    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                        state = (await client.get(admin + "/narwhal/state")).json()
                        leads = leads or bool(state["cluster"]["leading"])
                self.polls.append((time.time(), leads))
                await trio.sleep(0.05)

    def summary(self, run: harness.Replayed, speed: float) -> Json:
        killed_at = run.loadgen.get("killed_at_s")
        epoch = run.loadgen.get("killed_at_epoch")
        if killed_at is None or epoch is None:
            return {"killed": None}
        led = next((t for t, leads in self.polls if t > epoch and leads), None)
        # The rows: [index, lateness, status, outcome, ttft, tpot, tokens, end_s, target].
        failed: Counter[str] = Counter()
        in_flight = lost = other_failed = 0
        for row in run.rows:
            outcome, end_s, target = row[3], row[7], row[8]
            if target == self.killed and float(end_s) >= float(killed_at):
                in_flight += 1
                lost += outcome not in ("ok", "refused")
            elif outcome not in ("ok", "refused"):
                other_failed += 1
                failed[str(outcome)] += 1
        return {
            "killed": self.killed,
            "killed_at_model_s": round(float(killed_at) * speed, 3),
            "leader_after_s": None if led is None else round(led - float(epoch), 3),
            "on_killed_replica_unfinished_at_kill": in_flight,
            "on_killed_replica_failed": lost,
            "elsewhere_failed": other_failed,
            "elsewhere_failures": dict(failed),
            # Replicas the balancer stopped sending to (refused connections): the killed one.
            "replicas_marked_down": run.loadgen.get("targets_down"),
        }


PRUNE_BELOW = 0.6
QUICK_SCALE = 0.05


def modelled_fit(prefill: int, capacities: Sequence[gw.MixCapacity]) -> float:
    """The best, over phases, of this split's modelled capacity relative to the phase's
    best split (1.0: it is the best split for some phase)."""
    fits = []
    for c in capacities:
        cap = gw.PoolCapacity(c.prefill_per_engine, c.decode_per_engine, c.decode_batch, 0.0)
        fits.append(gw.split_capacity(cap, prefill, ENGINES - prefill) / c.capacity)
    return max(fits, default=1.0)


def role_changes(samples: Sequence[Json]) -> int:
    """Engines whose role differs from the previous sample, summed (the controller's flips)."""
    flips = 0
    for before, after in itertools.pairwise(samples):
        flips += sum(a != b for a, b in zip(before["roles"], after["roles"], strict=False))
    return flips


def pool_series(samples: Sequence[Json]) -> Json:
    """Split and pool loads over time (sum over each pool's engines)."""
    out: dict[str, list[Any]] = {
        k: []
        for k in (
            "t",
            "prefill_engines",
            "prefill_running",
            "prefill_waiting",
            "decode_running",
            "decode_waiting",
            "decode_kv_usage",
            *(f"projected_{k}" for k in harness.PROJECTED),
        )
    }
    for s in samples:
        roles = s["roles"]
        pre = [e for e, r in zip(s["engines"], roles, strict=False) if r == "prefill" and e]
        dec = [e for e, r in zip(s["engines"], roles, strict=False) if r == "decode" and e]
        out["t"].append(s["t"])
        out["prefill_engines"].append(sum(r == "prefill" for r in roles))
        out["prefill_running"].append(sum(e[0] for e in pre))
        out["prefill_waiting"].append(sum(e[1] for e in pre))
        out["decode_running"].append(sum(e[0] for e in dec))
        out["decode_waiting"].append(sum(e[1] for e in dec))
        out["decode_kv_usage"].append(round(sum(e[2] for e in dec) / len(dec), 3) if dec else None)
        projected = s.get("projected") or [None] * len(harness.PROJECTED)
        for key, value in zip(harness.PROJECTED, projected, strict=True):
            out[f"projected_{key}"].append(value)
    return out


# ---------------------------------------------------------------------------- summary


def summary(results: dict[str, Json], phases: Sequence[str]) -> Json:
    """The bar (best static split in hindsight, overall and per phase) and every run's
    goodput relative to it."""
    ran = [n for n in STATIC_NAMES if results.get(n, {}).get("status") == "ran"]
    if not ran:
        return {"best_static": None}
    phase_results = {n: results[n]["phases"] for n in ran}
    per_phase = {p: gm.hindsight_best(phase_results, ran, key=p) for p in phases}
    best = gm.hindsight_best(phase_results, ran)
    if best is None:
        return {"best_static": None}
    bar = results[best]["phases"]
    rel: dict[str, Json] = {}
    for name, res in results.items():
        if res.get("status") != "ran":
            continue
        row = {}
        for p in [*phases, "all"]:
            ours = res["phases"][p]["goodput_per_s"]
            ref = bar[p]["goodput_per_s"]
            row[p] = round(ours / ref, 3) if ref else None
        rel[name] = row
    oracle = sum(
        phase_results[winner][p]["passing"] for p in phases if (winner := per_phase[p]) is not None
    )
    return {
        "best_static": best,
        "best_static_per_phase": per_phase,
        # Upper bound for a controller: the best static split of each phase, switched
        # instantly and for free at phase boundaries (§4.5 baseline 3).
        "per_phase_oracle_passing": oracle,
        "best_static_passing": bar["all"]["passing"],
        "goodput_vs_best_static": rel,
    }


# ------------------------------------------------------------------------------ table


def markdown(doc: Json) -> str:
    """Per-phase attainment (goodput req/s) of every configuration, as a Markdown table."""
    phases = [b[0] for b in doc["workload"]["phase_bounds"]]
    best = doc["summary"].get("best_static")
    lines = [
        "| configuration | split | " + " | ".join(phases) + " | all | p90 TTFT / TPOT ms |",
        "|---|---|" + "---|" * (len(phases) + 2),
    ]
    for name, res in doc["configurations"].items():
        if res.get("status") != "ran":
            reason = res.get("reason", res.get("status", ""))
            lines.append(f"| {name} | {res.get('split', '')} | {reason} |" + " |" * len(phases))
            continue
        cells = []
        for p in [*phases, "all"]:
            r = res["phases"][p]
            att = r["attainment"]
            cells.append("–" if att is None else f"{att:.0%} ({r['goodput_per_s']:.0f})")
        whole = res["phases"]["all"]
        lat = f"{whole['ttft_ms'].get('p90', '–')} / {whole['tpot_ms'].get('p90', '–')}"
        label = f"**{name}**" if name == best else name
        alias = f" (= {res['alias_of']})" if res.get("alias_of") else ""
        lines.append(f"| {label}{alias} | {res['split']} | " + " | ".join(cells) + f" | {lat} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------- plot


def plot(doc: Json, path: Path) -> None:
    plt = benchkit.pyplot()
    results = doc["configurations"]
    bounds = doc["workload"]["phase_bounds"]
    best = doc["summary"].get("best_static")
    end_t = bounds[-1][2] if bounds else 0.0
    fig, (ax1, ax2, ax3) = plt.subplots(
        3, 1, figsize=(12, 10), sharex=True, gridspec_kw={"height_ratios": [3, 1.3, 1.3]}
    )
    for name, res in results.items():
        if res.get("status") != "ran":
            continue
        ot = res["over_time"]
        static = name.startswith("narwhal-static-")
        style: dict[str, Any] = {"linewidth": 1.0, "alpha": 0.45, "linestyle": ":"}
        if not static or name == best:
            style = {"linewidth": 2.0, "alpha": 0.95}
        label = name + (" (best static)" if name == best else "")
        ys = [a if a is not None else float("nan") for a in ot["attainment"]]
        ax1.plot(
            [*ot["t"], end_t],
            [*ys, ys[-1] if ys else float("nan")],
            label=label,
            drawstyle="steps-post",
            **style,
        )
        pools = res["pools"]
        if pools["t"] and (not static or name == best):
            ax2.plot(pools["t"], pools["prefill_engines"], drawstyle="steps-post", label=name)
    first = next((r for r in results.values() if r.get("status") == "ran"), None)
    if first is not None:
        ot = first["over_time"]
        ax3.bar(
            ot["t"],
            [o / ot["window_s"] for o in ot["offered"]],
            width=ot["window_s"],
            align="edge",
            color="0.6",
        )
    for ax in (ax1, ax2, ax3):
        for _name, start, _end in bounds:
            ax.axvline(start, color="0.5", linewidth=0.6)
    for name, start, end in bounds:
        ax1.text((start + end) / 2, 1.03, name, ha="center", fontsize=8)
    slo = doc["config"]["slo"]
    ax1.axhline(0.9, color="k", linewidth=0.6, linestyle="--")
    ax1.set_ylim(0, 1.08)
    ax1.set_ylabel("SLO attainment\n(over offered)")
    ax1.set_title(
        f"Goodput benchmark: TTFT ≤ {slo['ttft_s'] * 1000:.0f} ms and TPOT ≤ "
        f"{slo['tpot_s'] * 1000:.0f} ms, {doc['config']['window_s']:.0f} s windows "
        f"(model time; sim speed {doc['config']['speed']})",
        fontsize=10,
        pad=18,
    )
    ax1.legend(fontsize=7, ncol=3, loc="lower left")
    ax2.set_ylabel("prefill engines\n(controller split)")
    ax2.set_ylim(0, ENGINES)
    ax2.legend(fontsize=7, ncol=3, loc="upper left")
    ax3.set_ylabel("offered req/s")
    ax3.set_xlabel("model time (s)")
    ax3.set_xlim(0, end_t * 1.01)
    benchkit.save_figure(fig, path)


# ------------------------------------------------------------------------------- main


def fleet_arguments(p: argparse.ArgumentParser) -> None:
    """The options of every benchmark that replays the traces on fresh fleets (this one,
    goodput_rate.py and overload.py): traces, fleet, SLOs, peer and profiles."""
    p.add_argument(
        "--traces",
        type=Path,
        default=benchkit.REPO.parent / "shared" / "traces" / "azure2023",
        help="directory of the Azure 2023 traces (default ../shared/traces/azure2023)",
    )
    p.add_argument("--speed", type=float, default=0.25, help="simulator speed (slow motion)")
    p.add_argument("--sim-procs", type=int, default=2, help="simulator processes")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--niceness",
        type=int,
        default=-5,
        help="nice value of the fleet, router and load generator (default -5: ahead of "
        "other work on a shared machine)",
    )
    p.add_argument("--ttft-slo-s", type=float, default=0.5)
    p.add_argument("--tpot-slo-s", type=float, default=0.05)
    p.add_argument("--assume-feature", action="append", default=[], choices=sorted(FEATURES))
    p.add_argument("--vllm-router-venv", type=Path, default=harness.VLLM_ROUTER_VENV)
    p.add_argument(
        "--profiles",
        type=Path,
        default=None,
        help="a profile store measured on an identical fleet (same --speed) to reuse "
        "instead of profiling the first predictive run's fleet",
    )


def common_arguments(p: argparse.ArgumentParser, *, out: Path) -> None:
    """The options goodput.py shares with goodput_rate.py (workload, fleet, SLOs, output)."""
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"phases x {QUICK_SCALE} and hopeless static splits pruned",
    )
    p.add_argument("--scale", type=float, default=None, help="phase length factor (overrides)")
    fleet_arguments(p)
    p.add_argument(
        "--streams",
        type=int,
        default=1,
        help="independent runs of each trace superposed (1: the trace's own bursts, time-"
        "compressed; more: a bigger population of independent users, smoother)",
    )
    p.add_argument("--overload", type=float, default=1.75, help="overload phase x capacity")
    p.add_argument("--window-s", type=float, default=None, help="attainment window (model s)")
    p.add_argument("--all-splits", action="store_true", help="also run the pruned static splits")
    p.add_argument(
        "--narwhal-extra",
        type=json_sections,
        default={},
        metavar="JSON",
        help="config sections merged into every Narwhal run's generated config, e.g. "
        '\'{"cache": {"affinity": 0}}\'',
    )
    p.add_argument("--out", type=Path, default=out)
    p.add_argument("--replot", action="store_true", help="redraw the PNG from --out's JSON")
    p.add_argument("--table", action="store_true", help="print --out's results as Markdown")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_arguments(p, out=benchkit.RUNS / "goodput.json")
    p.add_argument("--phases", default="all", help="comma-separated phase names, or 'all'")
    p.add_argument("--configs", default="all", help="comma-separated names, or 'all'")
    p.add_argument("--rerun-aliases", action="store_true")
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="Narwhal replicas on one etcd (Debian's etcd-server), the load spread over "
        "them in turn",
    )
    p.add_argument(
        "--kill-leader-at",
        type=float,
        default=None,
        metavar="MODEL_S",
        help="with --replicas > 1: SIGKILL the leading replica at this model time; the "
        "result's `failover` says what it lost and when another led",
    )
    return p.parse_args(argv)


def phases_from(args: argparse.Namespace, spec: str) -> tuple[list[gw.Phase], float]:
    """The standard phases named by `spec` ('all' or comma-separated), at the scale the
    arguments ask for, and that scale."""
    scale = args.scale if args.scale is not None else (QUICK_SCALE if args.quick else 1.0)
    phases = gw.standard_phases(scale=scale, overload=args.overload)
    if spec != "all":
        wanted = spec.split(",")
        unknown = sorted(set(wanted) - {p.name for p in phases})
        if unknown:
            raise SystemExit(f"goodput: unknown phase(s) {unknown}")
        phases = [p for p in phases if p.name in wanted]
    return phases, scale


def settings_from(args: argparse.Namespace, slo: gw.Slo, window_s: float, kind: str) -> Settings:
    """Run settings from the common arguments; logs go to runs/tmp/<kind>/<stamp>/.
    Also registers `--profiles` for reuse by every predictive run (`use_profiles`)."""
    if args.profiles is not None:
        use_profiles(args.profiles)
    return Settings(
        speed=args.speed,
        sim_procs=args.sim_procs,
        seed=args.seed,
        slo=slo,
        window_s=window_s,
        sample_every_s=2.0,
        ttft_timeout_s=15.0,
        total_timeout_s=90.0,
        vllm_router_venv=args.vllm_router_venv,
        out_dir=benchkit.TMP / kind / time.strftime("%Y%m%d-%H%M%S"),
        niceness=args.niceness,
    )


def config_facts(args: argparse.Namespace, settings: Settings, scale: float) -> Json:
    """The `config` section of a result document."""
    return {
        "quick": args.quick,
        "scale": scale,
        "engines": ENGINES,
        "speed": args.speed,
        "sim_procs": args.sim_procs,
        "niceness": args.niceness,
        "seed": args.seed,
        "slo": {"ttft_s": settings.slo.ttft_s, "tpot_s": settings.slo.tpot_s, "percentile": 0.9},
        "window_s": settings.window_s,
        "client_timeouts_s": {
            "ttft": settings.ttft_timeout_s,
            "total": settings.total_timeout_s,
        },
        "features": features_from(args),
        "narwhal_extra": args.narwhal_extra,
        "profiles": str(args.profiles)
        if args.profiles is not None
        else "measured on the first predictive run's fleet, reused by the later ones",
        "timing": attrs.asdict(SimTiming()),
    }


def load_traces(directory: Path) -> dict[gw.Source, gw.Trace]:
    sources: tuple[gw.Source, ...] = ("conv", "code")
    return {s: gw.load_trace(directory, s) for s in sources}


def workload_facts(
    args: argparse.Namespace,
    requests: Sequence[gw.Request],
    phases: Sequence[gw.Phase],
    capacities: Sequence[gw.MixCapacity],
) -> Json:
    """The `workload` section of a result document."""
    return {
        "traces": str(args.traces),
        "streams": args.streams,
        "requests": len(requests),
        "phases": [attrs.asdict(p) for p in phases],
        "phase_bounds": gw.phase_bounds(phases),
        "capacity_model": [attrs.asdict(c) for c in capacities],
        "offered_tokens": {
            "prompt": sum(r.prompt for r in requests),
            "output": sum(r.output for r in requests),
        },
    }


def result_head(benchmark: str, started: float, vllm_router_venv: Path) -> Json:
    """The first fields of every trace benchmark's result document (`started`: the
    time.monotonic() when its runs began)."""
    return {
        "benchmark": benchmark,
        "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wall_s": round(time.monotonic() - started, 1),
        "machine": benchkit.machine(),
        "versions": versions(vllm_router_venv),
    }


def show_or_run(
    args: argparse.Namespace,
    run: Callable[[argparse.Namespace], Awaitable[int]],
    plot: Callable[[Json, Path], None],
    markdown: Callable[[Json], str],
) -> int:
    """--replot / --table from --out's JSON, else the benchmark itself."""
    if args.replot or args.table:
        return benchkit.show(
            args.out, replot=plot if args.replot else None, table=markdown if args.table else None
        )
    return trio.run(harness.run_guarded, partial(run, args))


def features_from(args: argparse.Namespace) -> dict[str, bool]:
    return {k: v or k in args.assume_feature for k, v in FEATURES.items()}


def unavailable(cfg: Configuration, features: dict[str, bool], tool: str) -> Json | None:
    """The skipped result of a configuration that needs a feature not enabled, after
    saying so on stdout; None when it can run."""
    missing = [f for f in cfg.requires if not features[f]]
    if not missing:
        return None
    print(f"{tool}: {cfg.name}: skipped (not available yet: {missing})", flush=True)
    return {
        "status": "skipped",
        "reason": f"not available yet: {', '.join(missing)} (enable in "
        f"tools/bench/goodput.py FEATURES or pass --assume-feature)",
        "note": cfg.note,
    }


def select(spec: str) -> list[Configuration]:
    if spec == "all":
        return list(CONFIGURATIONS)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    known = {c.name: c for c in CONFIGURATIONS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"goodput: unknown configuration(s) {unknown}; known: {sorted(known)}")
    return [known[n] for n in names]


async def run_all(args: argparse.Namespace) -> int:
    try:
        traces = load_traces(args.traces)
    except gw.TraceError as exc:
        print(f"goodput: {exc}", file=sys.stderr)
        return 2
    slo = gw.Slo(args.ttft_slo_s, args.tpot_slo_s)
    phases, scale = phases_from(args, args.phases)
    requests, capacities = gw.build(
        phases,
        traces,
        timing=SimTiming(),
        engines=ENGINES,
        slo=slo,
        seed=args.seed,
        streams=args.streams,
    )
    bounds = gw.phase_bounds(phases)
    phase_model_s = min(end - start for _, start, end in bounds)
    window_s = args.window_s or (3.0 if args.quick else 10.0)
    if args.kill_leader_at is not None and args.replicas < 2:
        raise SystemExit("goodput: --kill-leader-at needs --replicas 2 or more")
    settings = attrs.evolve(
        settings_from(args, slo, window_s, "goodput"),
        replicas=args.replicas,
        kill_leader_at_s=args.kill_leader_at,
    )
    features = features_from(args)
    prune = args.quick and not args.all_splits
    chosen = select(args.configs)
    # vllm-router-best needs the static runs' verdict: run it after them.
    chosen.sort(key=lambda c: c.split == "best")
    results: dict[str, Json] = {}
    started = time.monotonic()
    for cfg in chosen:
        skipped = unavailable(cfg, features, "goodput")
        if skipped is not None:
            results[cfg.name] = skipped
            continue
        if prune and cfg.name in STATIC_NAMES:
            fit = modelled_fit(int(cfg.split), capacities)
            if fit < PRUNE_BELOW:
                results[cfg.name] = {
                    "status": "skipped",
                    "reason": f"pruned in --quick: the capacity model gives this split at "
                    f"most {fit:.0%} of the best split's capacity in every phase "
                    f"(< {PRUNE_BELOW:.0%}); --all-splits runs it",
                    "split": split_label(int(cfg.split)),
                }
                print(f"goodput: {cfg.name}: pruned (modelled fit {fit:.0%})", flush=True)
                continue
        alias = cfg.alias_of
        if (
            alias is not None
            and not args.rerun_aliases
            and results.get(alias, {}).get("status") == "ran"
        ):
            results[cfg.name] = {**results[alias], "alias_of": alias, "note": cfg.note}
            print(f"goodput: {cfg.name}: same run as {alias}", flush=True)
            continue
        cfg = with_controller_timing(cfg, phase_model_s, args.speed)
        cfg = with_narwhal_extra(cfg, args.narwhal_extra)
        if cfg.split == "best":
            best = summary(results, [b[0] for b in bounds]).get("best_static")
            if best is not None:
                prefill = int(results[best]["split"].split("P")[0])
            else:
                # No static runs in this invocation: the capacity model's pick for the
                # whole workload's mean mix stands in.
                prefill = max(
                    ((c.best_prefill, c.capacity) for c in capacities), key=lambda x: x[1]
                )[0]
        else:
            prefill = int(cfg.split)
        print(f"goodput: {cfg.name}: {split_label(prefill)} ...", flush=True)
        try:
            results[cfg.name] = await run_one(cfg, prefill, requests, bounds, settings)
        except Exception as exc:
            results[cfg.name] = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
            print(f"goodput: {cfg.name}: FAILED: {exc}", file=sys.stderr, flush=True)
            continue
        r = results[cfg.name]
        print(
            f"goodput: {cfg.name}: attainment {r['phases']['all']['attainment']} "
            f"goodput {r['phases']['all']['goodput_per_s']}/s "
            f"(wall {r['wall_s']} s, lagged steps "
            f"{r['faithfulness']['sim_lagged_step_fraction']})",
            flush=True,
        )
        harness.warn_if_starved(f"goodput: {cfg.name}", r["faithfulness"])
    doc = {
        **result_head("goodput", started, args.vllm_router_venv),
        "config": config_facts(args, settings, scale),
        "workload": workload_facts(args, requests, phases, capacities),
        "configurations": results,
        "summary": summary(results, [b[0] for b in bounds]),
    }
    benchkit.publish(args.out, doc, plot=plot, indent=1)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return show_or_run(parse_args(argv), run_all, plot, markdown)


if __name__ == "__main__":
    sys.exit(main())
