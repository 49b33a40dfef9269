"""Issue 5's overload benchmark: offered load at 2x the fleet's capacity, attainment of
ADMITTED requests beside attainment of OFFERED requests, `predictive` vs `open` admission.

    .venv/bin/python tools/bench/overload.py --quick
    .venv/bin/python tools/bench/overload.py --load 2.0

The workload is the goodput benchmark's prefill-heavy mix (Azure code 75 % + long-prompt
conversation 25 %): a warm-up at 0.5 C, then `--load` x C, where C is the capacity model's
best static split for that mix (tools/bench/goodput_workload.py). The fleet is that split
(8 simulated engines, controller disabled), fresh for each configuration. Writes
runs/bench/overload.json. `predictive` is skipped as "not available yet" until
goodput.FEATURES["predictive_admission"] is True (or --assume-feature predictive_admission).

Issue 5's bar: under this load, admitted requests keep >= 95 % TTFT-SLO attainment with
`predictive` while `open` collapses; both numbers are reported for both configurations.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import attrs
import benchkit
import goodput
import trio
from benchkit import Json, harness, workload as gw

from narwhal.sim import SimTiming

CONFIGURATIONS = [
    goodput.Configuration(
        "predictive",
        "narwhal",
        "model",
        admission="predictive",
        requires=("predictive_admission",),
        note="serving.admission predictive, controller disabled",
        prepare=goodput.profile_fleet,
    ),
    goodput.Configuration(
        "open", "narwhal", "model", note="serving.admission open, controller disabled"
    ),
]
QUICK_SCALE = 0.1
# Issue 5: admitted requests keep >= 95 % TTFT-SLO attainment under 2x overload.
ADMITTED_TTFT_GOAL = 0.95


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"phases x {QUICK_SCALE}")
    p.add_argument("--scale", type=float, default=None, help="phase length factor (overrides)")
    p.add_argument("--load", type=float, default=2.0, help="overload x capacity")
    goodput.fleet_arguments(p)
    p.add_argument("--configs", default="all", help="comma-separated names, or 'all'")
    p.add_argument(
        "--request-log",
        action="store_true",
        help="keep Narwhal's per-request log lines in the run directory (diagnosis)",
    )
    p.add_argument("--out", type=Path, default=benchkit.RUNS / "overload.json")
    return p.parse_args(argv)


def verdict(res: Json) -> Json:
    over = res["phases"]["overload"]
    return {
        "offered": over["offered"],
        "admitted": over["admitted"],
        "refused": over["refused"],
        "attainment_offered": over["attainment"],
        "attainment_admitted": over["admitted_attainment"],
        "ttft_attainment_offered": over["ttft_attainment"],
        "ttft_attainment_admitted": over["admitted_ttft_attainment"],
        "goodput_per_s": over["goodput_per_s"],
        "meets_issue5_admitted_ttft_goal": (over["admitted_ttft_attainment"] or 0.0)
        >= ADMITTED_TTFT_GOAL,
    }


async def run_all(args: argparse.Namespace) -> int:
    try:
        traces = goodput.load_traces(args.traces)
    except gw.TraceError as exc:
        print(f"overload: {exc}", file=sys.stderr)
        return 2
    slo = gw.Slo(args.ttft_slo_s, args.tpot_slo_s)
    scale = args.scale if args.scale is not None else (QUICK_SCALE if args.quick else 1.0)
    phases = gw.overload_phases(scale=scale, load=args.load)
    timing = SimTiming()
    requests, capacities = gw.build(
        phases, traces, timing=timing, engines=goodput.ENGINES, slo=slo, seed=args.seed
    )
    bounds = gw.phase_bounds(phases)
    prefill = capacities[-1].best_prefill
    window_s = 3.0 if args.quick else 10.0
    settings = attrs.evolve(
        goodput.settings_from(args, slo, window_s, "overload"), request_log=args.request_log
    )
    features = goodput.features_from(args)
    results: dict[str, Json] = {}
    started = time.monotonic()
    wanted = None if args.configs == "all" else set(args.configs.split(","))
    unknown = (wanted or set()) - {c.name for c in CONFIGURATIONS}
    if unknown:
        print(f"overload: unknown --configs {sorted(unknown)}", file=sys.stderr)
        return 2
    for cfg in CONFIGURATIONS:
        if wanted is not None and cfg.name not in wanted:
            continue
        skipped = goodput.unavailable(cfg, features, "overload")
        if skipped is not None:
            results[cfg.name] = skipped
            continue
        print(f"overload: {cfg.name}: {goodput.split_label(prefill)} ...", flush=True)
        try:
            res = await goodput.run_one(cfg, prefill, requests, bounds, settings)
        except Exception as exc:
            results[cfg.name] = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
            print(f"overload: {cfg.name}: FAILED: {exc}", file=sys.stderr, flush=True)
            continue
        res["verdict"] = verdict(res)
        results[cfg.name] = res
        print(f"overload: {cfg.name}: {json.dumps(res['verdict'])}", flush=True)
    doc = {
        **goodput.result_head("overload", started, args.vllm_router_venv),
        "config": {
            "quick": args.quick,
            "scale": scale,
            "load": args.load,
            "engines": goodput.ENGINES,
            "split": goodput.split_label(prefill),
            "speed": args.speed,
            "sim_procs": args.sim_procs,
            "niceness": args.niceness,
            "seed": args.seed,
            "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
            "admitted_ttft_goal": ADMITTED_TTFT_GOAL,
            "profiles": str(args.profiles)
            if args.profiles is not None
            else "measured on the predictive run's fleet",
            "client_timeouts_s": {
                "ttft": settings.ttft_timeout_s,
                "total": settings.total_timeout_s,
            },
            "features": features,
        },
        "workload": {
            "traces": str(args.traces),
            "requests": len(requests),
            "phases": [attrs.asdict(p) for p in phases],
            "phase_bounds": bounds,
            "capacity_model": [attrs.asdict(c) for c in capacities],
        },
        "configurations": results,
        "side_by_side": {
            name: r["verdict"] for name, r in results.items() if r.get("status") == "ran"
        },
    }
    benchkit.publish(args.out, doc, indent=1)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return trio.run(harness.run_guarded, partial(run_all, parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
