"""Goodput on the prefix-heavy sessions workload (issue 33): Narwhal blind to the engines'
prefix caches, Narwhal cache-aware, and vllm-router's P/D policies, side by side in one run.

    .venv/bin/python tools/bench/prefix_goodput.py                # ~14 min on 2 cores
    .venv/bin/python tools/bench/prefix_goodput.py --table        # the committed result

The workload is `benchkit.sessions` (tenants' shared system prompts, multi-turn sessions
whose every turn extends the last, lengths from the Azure conversation trace), sent as
text so the engines' prefix caches and Narwhal's approximate index see the shared
prefixes. A rate multiplier scales the sessions' arrival rate; sessions start for
`--window-s` model seconds, so a higher rate is more sessions over the same window.
Every run is a fresh fleet of `--engines` simulated vLLM engines (`--prefill` of them
prefill) with `--enable-prefix-caching`, and replays the workload open loop through one
router (goodput.py's `run_one`). Attainment is over OFFERED requests at the TTFT and TPOT
SLOs (model time); goodput is goodput_rate.py's: each configuration walks the `--rates`
grid from `--start`, up after a run that met `--target` and down after one that missed,
and its goodput is interpolated between the adjacent met and missed rates.

Configurations (`narwhal_configs`, `peer_config`): narwhal-blind and narwhal-aware are
goodput.py's narwhal-full (predictive admission on a profile of the run's own fleet, the
role controller on the phase-scaled clocks) with the cache section `prefix_cache.BLIND`
and with the defaults. vllm-router runs in `--vllm-pd-disaggregation` mode with each
policy of `--policies` that a probe finds working (starts, and streams text completions
on a 1P1D fleet); all run the first rate, and the `--peer-finalists` best of them go on.

Writes runs/bench/prefix-goodput.json and .png; logs and raw rows go to
runs/tmp/prefix-goodput/<stamp>/ (not committed).

`--request-log` runs Narwhal at log level info and the engines with
--enable-prompt-tokens-details; each Narwhal row then gains `requests`
(`accuracy.request_log_summary`): outcomes, projected against observed TTFT through the
pair and for local prefills, and the prompt tokens Narwhal priced and the engines found
cached.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import accuracy
import attrs
import benchkit
import goodput
import goodput_rate
import httpx
import numpy as np
import trio
from benchkit import Json, harness, sessions, workload as gw
from prefix_cache import BLIND

from narwhal.sim import SimTiming

DEFAULT_OUT = benchkit.RUNS / "prefix-goodput.json"
# vllm-router 0.1.17's --policy choices.
POLICIES = (
    "round_robin",
    "random",
    "power_of_two",
    "cache_aware",
    "consistent_hash",
    "sticky_least_loaded",
    "kv_aware",
)
PEER_PREFIX = "vllm-router-"
BLIND_NAME, AWARE_NAME = "narwhal-blind", "narwhal-aware"
PHASE = "sessions"


# ------------------------------------------------------------------------- pure pieces


def params_at(base: sessions.SessionParams, rate: float, window_s: float) -> sessions.SessionParams:
    """The workload at `rate` x the base arrival rate: sessions start for `window_s` model
    seconds at `rate` x base.sessions_per_s (so at least one session)."""
    per_s = base.sessions_per_s * rate
    return attrs.evolve(base, sessions_per_s=per_s, sessions=max(1, round(per_s * window_s)))


def replayable(
    requests: Sequence[sessions.SessionRequest],
) -> tuple[list[gw.Request], list[str], list[tuple[str, float, float]]]:
    """What goodput.run_one replays: the requests (prompt = its words, the sim's tokens),
    their prompt texts, and the one phase's bounds (to just past the last arrival)."""
    rows = [gw.Request(r.at_s, PHASE, "conv", r.prompt_words, r.max_tokens) for r in requests]
    end = math.floor(max((r.at_s for r in requests), default=0.0)) + 1.0
    return rows, [r.prompt for r in requests], [(PHASE, 0.0, end)]


def finalists(sweeps: dict[str, list[Json]], n: int) -> list[str]:
    """The `n` vllm-router configurations with the best attainment in their first run
    (ties: name); a failed first run ranks last."""
    peers = [name for name in sweeps if name.startswith(PEER_PREFIX) and sweeps[name]]

    def score(name: str) -> tuple[float, str]:
        first = sweeps[name][0]
        return (-(first["attainment"] if first["status"] == "ran" else -1.0), name)

    return sorted(peers, key=score)[:n]


def summary(sweeps: dict[str, list[Json]], target: float) -> Json:
    """Each configuration's goodput (goodput_rate.crossing), the best vllm-router policy,
    and narwhal-aware against narwhal-blind and against that policy."""
    goodputs = {
        name: goodput_rate.crossing(
            [
                (r["rate"], r["attainment"], r["offered_per_s"])
                for r in sweep
                if r["status"] == "ran"
            ],
            target,
        )
        for name, sweep in sweeps.items()
    }
    peers = {
        n: g for n, g in goodputs.items() if n.startswith(PEER_PREFIX) and g["rate"] is not None
    }
    # A bound from below ("below") is worth less than an exact figure at the same rate.
    rank = {"at_least": 2, "interpolated": 1, "below": 0}
    best = max(peers, key=lambda n: (peers[n]["rate"], rank.get(peers[n]["kind"], 0)), default=None)
    out: Json = {"target": target, "goodput": goodputs, "best_peer": best}
    if AWARE_NAME in goodputs and BLIND_NAME in goodputs:
        out["aware_vs_blind"] = goodput_rate.compare(goodputs[AWARE_NAME], goodputs[BLIND_NAME])
    if AWARE_NAME in goodputs and best is not None:
        out["aware_vs_best_peer"] = goodput_rate.compare(goodputs[AWARE_NAME], goodputs[best])
    return out


def narwhal_configs(prefill: int) -> list[goodput.Configuration]:
    """narwhal-full of goodput.py, blind to caches and cache-aware (the defaults)."""
    full = next(c for c in goodput.CONFIGURATIONS if c.name == goodput_rate.CONTROLLED)
    return [
        attrs.evolve(
            full,
            name=BLIND_NAME,
            split=prefill,
            narwhal_extra={"cache": dict(BLIND)},
            note="narwhal-full without cache awareness: no index, no credit, no local prefill",
        ),
        attrs.evolve(
            full,
            name=AWARE_NAME,
            split=prefill,
            note="narwhal-full with the cache section's defaults (approximate index)",
        ),
    ]


def peer_config(policy: str, prefill: int) -> goodput.Configuration:
    return goodput.Configuration(
        PEER_PREFIX + policy,
        "vllm-router",
        prefill,
        policy=policy,
        note=f"vllm-router --vllm-pd-disaggregation --policy {policy}",
    )


# ------------------------------------------------------------------------------- runs


def sim_args(args: argparse.Namespace) -> tuple[str, ...]:
    details = ("--enable-prompt-tokens-details",) if args.request_log else ()
    return ("--enable-prefix-caching", *details, "--block-size", str(args.block_size))


async def probe_policies(args: argparse.Namespace, exe: Path, tmp: Path) -> dict[str, Json]:
    """Which --policy values vllm-router serves P/D with: each started in front of one
    prefill and one decode engine, then three streamed text completions sharing a prefix."""
    prompt = " ".join(["shared"] * 300)
    out: dict[str, Json] = {}
    async with harness.Procs(tmp / "probe", args.niceness) as fleet:
        groups = await harness.start_fleet(
            fleet, engines=2, speed=args.speed, model=harness.MODEL, extra_args=sim_args(args)
        )
        urls, roles = harness.assign_roles(groups, 1)
        for policy in args.policies.split(","):
            async with harness.Procs(tmp / "probe" / policy, args.niceness) as procs:
                try:
                    with trio.fail_after(60):
                        url, _ = await harness.start_vllm_router(
                            procs, exe, urls, roles, port=harness.free_port(), policy=policy
                        )
                        statuses = await _completions(url, [f"{prompt} turn {i}" for i in range(3)])
                except (RuntimeError, OSError, httpx.HTTPError, trio.TooSlowError) as exc:
                    out[policy] = {"works": False, "detail": f"{type(exc).__name__}: {exc}"[:300]}
                    continue
            works = all(s == "text" for s in statuses)
            out[policy] = {"works": works, "detail": ", ".join(statuses)}
            print(f"prefix-goodput: vllm-router --policy {policy}: {out[policy]}", flush=True)
    return out


async def _completions(url: str, prompts: Sequence[str]) -> list[str]:
    """Each prompt's answer: "text" when its stream carried text, else its status."""
    seen = []
    async with httpx.AsyncClient(timeout=30.0) as client:
        for prompt in prompts:
            body = {"model": harness.MODEL, "prompt": prompt, "max_tokens": 4, "stream": True}
            async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                text = (await resp.aread()).decode(errors="replace")
            ok = resp.status_code == 200 and '"text"' in text
            seen.append("text" if ok else f"{resp.status_code}")
    return seen


async def sweep(args: argparse.Namespace) -> int:
    try:
        trace = gw.load_trace(args.traces, "conv")
    except gw.TraceError as exc:
        print(f"prefix-goodput: {exc}", file=sys.stderr)
        return 2
    rates = sorted({float(r) for r in args.rates.split(",")})
    if not rates or rates[0] <= 0:
        raise SystemExit(f"prefix-goodput: --rates must be positive, got {args.rates!r}")
    start = min(rates, key=lambda r: abs(r - args.start))
    slo = gw.Slo(args.ttft_slo_s, args.tpot_slo_s)
    settings = attrs.evolve(
        goodput.settings_from(args, slo, args.window_s / 4, "prefix-goodput"),
        engines=args.engines,
        sim_args=sim_args(args),
        request_log=args.request_log,
    )
    base = sessions.SessionParams(
        tenants=args.tenants,
        system_tokens=args.system_tokens,
        mean_turns=args.mean_turns,
        max_turns=args.max_turns,
        think_s=args.think_s,
        sessions_per_s=args.sessions_per_s,
        seed=args.seed,
    )
    started = time.monotonic()
    chosen = narwhal_configs(args.prefill)
    probe: dict[str, Json] = {}
    exe = harness.vllm_router_binary(args.vllm_router_venv)
    if args.policies and exe is None:
        print("prefix-goodput: no vllm-router; run tools/bench/install_vllm_router.sh", flush=True)
    elif args.policies and exe is not None:
        probe = await probe_policies(args, exe, settings.out_dir)
        chosen += [peer_config(p, args.prefill) for p, r in probe.items() if r["works"]]
    sweeps: dict[str, list[Json]] = {cfg.name: [] for cfg in chosen}
    builds: dict[float, tuple[list[gw.Request], list[str], list[tuple[str, float, float]]]] = {}
    workloads: dict[str, Json] = {}

    def document() -> Json:
        return {
            **goodput.result_head("prefix-goodput", started, args.vllm_router_venv),
            "config": {
                "rates": rates,
                "start": start,
                "target": args.target,
                "window_s": args.window_s,
                "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
                "peer_finalists": args.peer_finalists,
                "seed": args.seed,
                "niceness": args.niceness,
            },
            "fleet": {
                "engines": args.engines,
                "prefill": args.prefill,
                "speed": args.speed,
                "sim_procs": args.sim_procs,
                "dialect": "vllm",
                "sim_args": list(settings.sim_args),
                "timing": attrs.asdict(SimTiming()),
            },
            "workload": {"base": base.to_json(), "trace": "conv", "at_rate": workloads},
            "configurations": {c.name: {"router": c.router, "note": c.note} for c in chosen},
            "vllm_router_policies": probe,
            "sweeps": sweeps,
            "summary": summary(sweeps, args.target),
        }

    first_round = True
    while True:
        plan = [
            (cfg, rate)
            for cfg in chosen
            if (
                rate := goodput_rate.next_rate(
                    rates, goodput_rate.outcomes(sweeps[cfg.name], args.target), start
                )
            )
            is not None
        ]
        if not plan:
            break
        for cfg, rate in plan:
            if rate not in builds:
                requests = sessions.build(trace, params_at(base, rate, args.window_s))
                builds[rate] = replayable(requests)
                words = np.array([r.prompt_words for r in requests])
                workloads[f"{rate:g}"] = {
                    "sessions": params_at(base, rate, args.window_s).sessions,
                    "requests": len(requests),
                    "shared_fraction": round(sessions.shared_fraction(requests), 4),
                    "prompt_tokens": {
                        q: int(np.percentile(words, p)) for q, p in (("p50", 50), ("p90", 90))
                    }
                    | {"mean": round(float(words.mean()), 1)},
                    "duration_s": builds[rate][2][-1][2],
                }
            rows, prompts, bounds = builds[rate]
            run_cfg = goodput.with_controller_timing(cfg, args.window_s, args.speed)
            at = attrs.evolve(settings, out_dir=settings.out_dir / f"x{rate:g}")
            print(f"prefix-goodput: x{rate:g} {cfg.name} ({len(rows)} requests) ...", flush=True)
            try:
                result = await goodput.run_one(
                    run_cfg, args.prefill, rows, bounds, at, prompts=prompts
                )
            except Exception as exc:
                result = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
                print(f"prefix-goodput: {cfg.name}: FAILED: {exc}", file=sys.stderr, flush=True)
            row = goodput_rate.compact(rate, result, bounds)
            log = at.out_dir / cfg.name / "narwhal.log"
            if args.request_log and cfg.router == "narwhal" and log.exists():
                row["requests"] = accuracy.request_log_summary(log, args.speed)
            sweeps[cfg.name].append(row)
            print(
                f"prefix-goodput: x{rate:g} {cfg.name}: attainment {row.get('attainment')} "
                f"(wall {row.get('wall_s')} s)",
                flush=True,
            )
            benchkit.write_json(args.out, document(), indent=1)
        if first_round:
            first_round = False
            keep = set(finalists(sweeps, args.peer_finalists))
            chosen = [c for c in chosen if c.router == "narwhal" or c.name in keep]
    benchkit.publish(args.out, document(), plot=plot, indent=1)
    return 0


# ------------------------------------------------------------------------ table, plot


def markdown(doc: Json) -> str:
    """Attainment at each rate and the goodput of every configuration, as Markdown."""
    return goodput_rate.rate_table(doc, doc["summary"]["best_peer"])


def plot(doc: Json, path: Path) -> None:
    plt = benchkit.pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    s = doc["summary"]
    for name, runs in doc["sweeps"].items():
        ran = sorted((r for r in runs if r["status"] == "ran"), key=lambda r: r["rate"])
        if not ran:
            continue
        strong = not name.startswith(PEER_PREFIX) or name == s["best_peer"]
        ax.plot(
            [r["offered_per_s"] for r in ran],
            [r["attainment"] for r in ran],
            marker="o",
            linewidth=2.0 if strong else 1.0,
            alpha=0.95 if strong else 0.45,
            label=name + (" (best vllm-router policy)" if name == s["best_peer"] else ""),
        )
    ax.axhline(doc["config"]["target"], color="k", linewidth=0.6, linestyle="--")
    slo, fleet = doc["config"]["slo"], doc["fleet"]
    ax.set_title(
        f"Prefix-heavy sessions: attainment vs offered rate; {fleet['prefill']}P"
        f"{fleet['engines'] - fleet['prefill']}D with prefix caching; TTFT ≤ "
        f"{slo['ttft_s'] * 1000:.0f} ms, TPOT ≤ {slo['tpot_s'] * 1000:.0f} ms",
        fontsize=9,
    )
    ax.set_xlabel("offered requests/s (model time)")
    ax.set_ylabel("SLO attainment over offered")
    ax.set_ylim(0.0, 1.02)
    ax.legend(fontsize=8)
    benchkit.save_figure(fig, path)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    goodput.fleet_arguments(p)
    p.set_defaults(speed=0.5, ttft_slo_s=0.4, tpot_slo_s=0.05)
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--prefill", type=int, default=2, help="prefill engines of the split")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--mean-turns", type=float, default=4.0)
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--think-s", type=float, default=2.0, help="mean model s between turns")
    p.add_argument(
        "--sessions-per-s", type=float, default=6.0, help="sessions started per model s at x1"
    )
    p.add_argument("--window-s", type=float, default=10.0, help="model s of session starts")
    p.add_argument("--rates", default="4,6,8,11,14", help="load multipliers")
    p.add_argument("--start", type=float, default=8.0, help="first rate (nearest in --rates)")
    p.add_argument("--target", type=float, default=goodput_rate.TARGET)
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="vllm-router policies to probe and run ('' for none)",
    )
    p.add_argument(
        "--peer-finalists",
        type=int,
        default=1,
        help="vllm-router policies that go on past the first rate (the best there)",
    )
    p.add_argument(
        "--request-log",
        action="store_true",
        help="log Narwhal's requests and the engines' cached tokens; summarise them per row",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--replot", action="store_true", help="redraw the PNG from --out's JSON")
    p.add_argument("--table", action="store_true", help="print --out's results as Markdown")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return goodput.show_or_run(parse_args(argv), sweep, plot, markdown)


if __name__ == "__main__":
    sys.exit(main())
