"""Replay a recorded or synthetic trace through Narwhal's role controller, advisory style,
and report what the controller would have done. Bounded; writes JSON under runs/.

    T=/work/shared/traces/azure2023
    .venv/bin/python tools/replay.py --trace $T/AzureLLMInferenceTrace_conv.csv \\
        --trace $T/AzureLLMInferenceTrace_code.csv --speed 4
    .venv/bin/python tools/replay.py --synthetic 600:30:300:100,600:8:2500:20 --profile scenario

What runs: the pure decision core (`narwhal.controller.decide`) in simulated time, one
pass per `controller.monitor_interval_s`, over a fluid model of the fleet
(`narwhal.controller.FluidFleet`: FCFS prefill servers, time-stepped decode batches on
the profile's latency law, measurement noise). No engine, socket or clock is involved,
so an hour of trace replays in seconds.

Two modes:
* default: every move the controller decides is applied to the *simulated* fleet, so the
  report shows the split trajectory the controller would have produced (the real fleet
  is never touched; this is what advisory mode is for);
* ``--static``: `controller.advisory` is set, the simulated roles never change, and the
  report lists the proposals the controller would have recorded against the fixed split
  (what `/narwhal/state` shows on a production fleet in advisory mode).

Traces: CSV with TIMESTAMP, ContextTokens, GeneratedTokens (the Azure LLM inference 2023
format). Several ``--trace`` files are replayed one after another (a mix shift), each
starting when the previous ends; ``--speed`` divides inter-arrival times (more load).
Synthetic phases are ``seconds:rate:prompt_tokens:output_tokens`` (Poisson arrivals,
exponential lengths), comma-separated. The generated-token count of a recorded request
stands in for its expected output tokens.

Fleet: ``--engines N --prefill K`` (default N/2 prefill engines), or the engines and
roles of ``--config`` (engines with role ``both`` take no work in the fluid model).

Profiles: ``sim`` is the simulator's H100 Llama-3-8B law; ``scenario`` is the slower
engine the controller's scenario tests use. A measured profile store can replace these
once `narwhal.profiles` lands (any object with the `narwhal.controller.Profile` members).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import math
import pathlib
import sys
import time
from collections import Counter
from typing import Any

import attrs

from narwhal.config import Config, Slo, load_config_file
from narwhal.controller import (
    AffineDecode,
    FluidFleet,
    FluidRequest,
    FluidRun,
    Phase,
    QuadraticPrefill,
    StaticProfile,
    Step,
    run_fluid,
    synthetic_trace,
)
from narwhal.controller._snapshot import Role

REPO = pathlib.Path(__file__).resolve().parents[1]
PROFILES = {
    "sim": StaticProfile(),
    "scenario": StaticProfile(
        prefill=QuadraticPrefill(a=0.02, b=1.5e-4, c=3e-9),
        decode=AffineDecode(
            t0=0.01, per_kv=2e-7, per_seq=8e-4, max_active=1024, max_kv_tokens=2_000_000
        ),
        kv_capacity_tokens=2_000_000,
    ),
}
MAX_PROPOSALS = 2000  # retained proposal records in the report


def _timestamp(text: str) -> float:
    # "2023-11-16 18:17:03.9799600": seven fractional digits, more than fromisoformat takes
    main, _, frac = text.strip().partition(".")
    base = dt.datetime.strptime(main, "%Y-%m-%d %H:%M:%S").replace(tzinfo=dt.UTC)
    return base.timestamp() + (float(f"0.{frac}") if frac else 0.0)


def read_trace(
    paths: list[str], *, speed: float, max_requests: int, max_prompt: int
) -> list[FluidRequest]:
    """The CSV traces back to back, times from 0, inter-arrivals divided by `speed`."""
    out: list[FluidRequest] = []
    offset = 0.0
    for path in paths:
        rows: list[tuple[float, int, int]] = []
        with open(path, newline="") as fh:
            for row in csv.DictReader(fh):
                rows.append(
                    (
                        _timestamp(row["TIMESTAMP"]),
                        int(row["ContextTokens"]),
                        int(row["GeneratedTokens"]),
                    )
                )
                if len(out) + len(rows) >= max_requests:
                    break
        if not rows:
            continue
        rows.sort()
        first = rows[0][0]
        for t, prompt, output in rows:
            out.append(
                FluidRequest(
                    offset + (t - first) / speed,
                    max(1, min(prompt, max_prompt)),
                    max(1, output),
                )
            )
        offset = out[-1].time + 1.0 / speed
        if len(out) >= max_requests:
            break
    return out


def parse_phases(spec: str) -> list[Phase]:
    phases = []
    for part in spec.split(","):
        seconds, rate, prompt, output = (float(x) for x in part.split(":"))
        phases.append(Phase(seconds, rate, prompt, output, name=part))
    return phases


def _split_name(split: tuple[int, int]) -> str:
    return f"{split[0]}P:{split[1]}D"


def _num(value: float, digits: int = 4) -> float | None:
    return round(value, digits) if math.isfinite(value) else None


def report(
    run: FluidRun,
    *,
    cfg: Config,
    source: dict[str, object],
    duration: float,
    requests: int,
    initial: tuple[int, int],
    static: bool,
    wall_s: float,
) -> dict[str, object]:
    interval = cfg.controller.monitor_interval_s
    time_in_split: dict[str, float] = {}
    gates: Counter[str] = Counter()
    results: Counter[str] = Counter()
    callers: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    proposals: list[dict[str, object]] = []
    timeline: list[dict[str, object]] = []
    previous: tuple[object, ...] | None = None
    last_sample = -math.inf
    split = initial
    for step in run.steps:
        d = step.decision
        name = _split_name(split)
        time_in_split[name] = time_in_split.get(name, 0.0) + interval
        split = step.split
        if d.caller == "none":
            continue
        callers[d.caller] += 1
        results[d.result] += 1
        reasons[d.reason] += 1
        gates[d.gate or "none"] += 1
        key = (d.caller, d.result, d.reason, d.gate, d.proposed)
        if d.proposed != d.current and key != previous and len(proposals) < MAX_PROPOSALS:
            proposals.append(
                {
                    "time": round(step.time, 1),
                    "caller": d.caller,
                    "current": _split_name((d.current.prefill, d.current.decode)),
                    "proposed": _split_name((d.proposed.prefill, d.proposed.decode)),
                    "result": d.result,
                    "reason": d.reason,
                    "gate": d.gate,
                    "detail": d.detail,
                }
            )
        previous = key
        if step.time - last_sample >= 60.0:
            last_sample = step.time
            cur = d.loads.current
            timeline.append(
                {
                    "time": round(step.time, 1),
                    "split": _split_name(step.split),
                    "prefill_load": _num(cur.prefill_load) if cur else None,
                    "decode_load": _num(cur.decode_load) if cur else None,
                    "measured_prefill": _num(d.loads.measured_prefill),
                    "measured_decode": _num(d.loads.measured_decode),
                    "evidence": "closed" if d.evidence.closed else "open",
                    "gate": d.gate,
                }
            )
    ttft, tpot = cfg.slo.ttft_s, cfg.slo.tpot_s
    minutes = []
    for start in range(0, math.ceil(duration), 60):
        att = run.attainment(float(start), start + 60.0, ttft, tpot)
        minutes.append(_num(att, 3))
    overall = run.attainment(0.0, duration, ttft, tpot)
    directions = Counter(move.direction for _, move in run.flips)
    return {
        "tool": "tools/replay.py",
        "mode": "static (advisory on fixed roles)" if static else "applied to the simulated fleet",
        "source": source,
        "duration_s": duration,
        "requests": requests,
        "completed": len(run.fleet.outcomes),
        "wall_s": round(wall_s, 2),
        "slo": {"ttft_s": ttft, "tpot_s": tpot},
        "controller": attrs.asdict(cfg.controller),
        "initial_split": _split_name(initial),
        "final_split": _split_name(run.fleet.split()),
        "summary": {
            "flips": len(run.flips),
            "flips_by_direction": dict(directions),
            "time_in_split_s": dict(sorted(time_in_split.items(), key=lambda kv: -kv[1])),
            "evaluations_by_caller": dict(callers),
            "results": dict(results),
            "reasons": dict(reasons),
            "gates": dict(gates.most_common()),
            "slo_attainment": _num(overall, 4),
        },
        "flips": [
            {"time": round(t, 1), "engine": m.engine, "from": m.from_role, "to": m.to_role}
            for t, m in run.flips
        ],
        "proposals": proposals,
        "timeline": timeline,
        "attainment_per_minute": minutes,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--trace", action="append", default=[], help="CSV trace (repeatable)")
    ap.add_argument("--synthetic", help="phases seconds:rate:prompt:output,...")
    ap.add_argument("--config", help="Narwhal config file (controller, slo, engines)")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=None, help="initial prefill engines")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="sim")
    ap.add_argument("--ttft", type=float, help="TTFT target (overrides the config)")
    ap.add_argument("--tpot", type=float, help="TPOT target (overrides the config)")
    ap.add_argument("--speed", type=float, default=1.0, help="divide inter-arrival times")
    ap.add_argument("--static", action="store_true", help="advisory: never change roles")
    ap.add_argument("--max-requests", type=int, default=100_000)
    ap.add_argument("--max-seconds", type=float, default=4 * 3600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dt", type=float, default=0.5, help="decode time step of the model")
    ap.add_argument("--out", help="output JSON (default runs/replay/<name>.json)")
    args = ap.parse_args(argv)
    if bool(args.trace) == bool(args.synthetic):
        ap.error("give --trace (one or more) or --synthetic, not both")

    cfg = load_config_file(args.config) if args.config else Config()
    if args.ttft or args.tpot:
        cfg = attrs.evolve(
            cfg,
            slo=Slo(
                ttft_s=args.ttft or cfg.slo.ttft_s,
                tpot_s=args.tpot or cfg.slo.tpot_s,
                percentile=cfg.slo.percentile,
            ),
        )
    if args.static:
        cfg = attrs.evolve(cfg, controller=attrs.evolve(cfg.controller, advisory=True))
    ids: list[str] | None = None
    roles: list[Role]
    if cfg.engines:
        roles = [spec.role for spec in cfg.engines]
        ids = [spec.id for spec in cfg.engines]
    else:
        prefill = args.prefill if args.prefill is not None else args.engines // 2
        if not 1 <= prefill < args.engines:
            ap.error("--prefill must leave at least one engine of each role")
        pre: list[Role] = ["prefill"]
        dec: list[Role] = ["decode"]
        roles = pre * prefill + dec * (args.engines - prefill)
    profile = PROFILES[args.profile]

    if args.trace:
        requests = read_trace(
            args.trace,
            speed=args.speed,
            max_requests=args.max_requests,
            max_prompt=profile.prefill.max_tokens,
        )
        source: dict[str, object] = {"traces": args.trace, "speed": args.speed}
        name = "+".join(pathlib.Path(p).stem for p in args.trace)
    else:
        phases = parse_phases(args.synthetic)
        requests = synthetic_trace(phases, seed=args.seed)[: args.max_requests]
        source = {"synthetic": args.synthetic, "seed": args.seed}
        name = "synthetic"
    if not requests:
        print("replay: the trace holds no requests", file=sys.stderr)
        return 1
    duration = min(args.max_seconds, requests[-1].time + 1.0)
    requests = [r for r in requests if r.time < duration]

    fleet = FluidFleet(roles, profile, dt=args.dt, noise_sigma=0.05, seed=args.seed, ids=ids)
    initial = fleet.split()
    started = time.monotonic()
    last_print = [0.0]

    def progress(step: Step) -> None:
        if step.time - last_print[0] >= 600.0:
            last_print[0] = step.time
            print(f"  t={step.time:7.0f}s split {_split_name(step.split)}", file=sys.stderr)

    run = run_fluid(requests, fleet, cfg, until=duration, on_step=progress)
    out = report(
        run,
        cfg=cfg,
        source={**source, "profile": args.profile},
        duration=duration,
        requests=len(requests),
        initial=initial,
        static=args.static,
        wall_s=time.monotonic() - started,
    )
    path = pathlib.Path(args.out) if args.out else REPO / "runs" / "replay" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, allow_nan=False) + "\n")
    summary: Any = out["summary"]
    print(
        f"replay: {len(requests)} requests over {duration:.0f} s; "
        f"{summary['flips']} flips; split {out['initial_split']} -> {out['final_split']}; "
        f"SLO attainment {summary['slo_attainment']}; wrote {path}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
