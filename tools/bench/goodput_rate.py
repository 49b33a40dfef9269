"""Goodput as DistServe defines it (issue 8 part 1): the highest request rate at which a
router still meets the SLO attainment target, here 90 % of OFFERED requests passing.

    .venv/bin/python tools/bench/goodput_rate.py --quick          # the shifting phases
    .venv/bin/python tools/bench/goodput_rate.py --quick --phases stationary --converged \\
        --out runs/bench/goodput-rate-stationary.json

goodput.py replays the workload at one offered load and reports passing / offered. That
ratio cannot show a router serving more traffic than another: at a load every split can
carry, all of them pass nearly everything. This benchmark replays the same phases with
every phase's load multiplied by a rate from the `--rates` grid. Each configuration
starts at `--start` (x1, the goodput workload's own loads) and walks the grid, up after
a run whose attainment over the selected phases met the target and down after one that
missed it, until a met and a missed rate are adjacent; its goodput is interpolated
linearly between the two (DistServe §5: "the maximum request rate that can be served
adhering to the SLO attainment goal"). The ratio of Narwhal-full's goodput to the best
static split's is the issue's "goodput of the best static split" comparison.

The default phases are the shifting ones (decode_heavy, prefill_heavy, drift): the
overload phase is past capacity by construction and has no rate to find, and the
stationary control is a separate sweep (`--phases stationary --converged`: narwhal-full
starts at the phase's best split, as after converging in the drift before it).
Configurations default to narwhal-full and the static splits whose capacity-model
goodput is within KEEP_WITHIN of the best static split's (`--all-splits` runs every split);
`vllm-router-best` runs at the split with the best capacity-model goodput.

Writes runs/bench/goodput-rate.json and .png; logs and raw rows go to
runs/tmp/goodput-rate/<stamp>/x<rate>/<configuration>/ (not committed).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
import benchkit
import goodput
from benchkit import Json, harness, workload as gw

from narwhal.sim import SimTiming

DEFAULT_PHASES = "decode_heavy,prefill_heavy,drift"
DEFAULT_RATES = "0.5,0.75,1.0,1.25,1.5,1.75,2.0,2.5"
TARGET = 0.9
# Static splits whose modelled goodput is at least this fraction of the best split's run.
KEEP_WITHIN = 0.75
CONTROLLED = "narwhal-full"


# ------------------------------------------------------------------------- pure pieces


def scaled(phases: Sequence[gw.Phase], rate: float) -> list[gw.Phase]:
    """The phases with every offered load multiplied by `rate`."""
    return [attrs.evolve(p, load=p.load * rate) for p in phases]


def modelled_attainment(
    prefill: int, phases: Sequence[gw.Phase], capacities: Sequence[gw.MixCapacity], rate: float
) -> float:
    """The capacity model's fluid attainment of a static split at `rate`: each phase
    serves what it is offered up to the split's capacity for the phase's (start) mix."""
    offered = served = 0.0
    for phase, c in zip(phases, capacities, strict=True):
        cap = gw.PoolCapacity(c.prefill_per_engine, c.decode_per_engine, c.decode_batch, 0.0)
        split = gw.split_capacity(cap, prefill, goodput.ENGINES - prefill)
        want = rate * phase.load * c.capacity * phase.duration_s
        offered += want
        served += min(want, split * phase.duration_s)
    return served / offered if offered > 0 else 1.0


def modelled_goodput(
    prefill: int,
    phases: Sequence[gw.Phase],
    capacities: Sequence[gw.MixCapacity],
    target: float = TARGET,
) -> float:
    """The largest rate multiplier at which the fluid model meets `target` (bisection:
    fluid attainment only falls as the rate rises)."""
    lo, hi = 0.0, 16.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if mid > 0 and modelled_attainment(prefill, phases, capacities, mid) >= target:
            lo = mid
        else:
            hi = mid
    return lo


def kept_splits(modelled: dict[int, float], within: float) -> list[int]:
    """Static splits (prefill engines) whose modelled goodput (`modelled_goodput` per
    split) is within `within` of the best split's."""
    best = max(modelled.values())
    return [p for p, r in modelled.items() if r >= within * best]


def crossing(points: Sequence[Sequence[float]], target: float = TARGET) -> Json:
    """DistServe's goodput from a sweep of (rate multiplier, attainment, offered req/s)
    points: where attainment falls through `target`, linearly interpolated between the
    last rate that meets it and the first that does not.

    `kind` says how far to trust it: "interpolated"; "at_least" (every rate run met the
    target: the goodput is the highest rate or more); "below" (even the lowest rate
    missed it: the goodput is under that rate); None without points.
    """
    pts = sorted((float(p[0]), float(p[1]), float(p[2])) for p in points)
    if not pts:
        return {"rate": None, "per_s": None, "kind": None}
    if pts[0][1] < target:
        return {"rate": pts[0][0], "per_s": pts[0][2], "kind": "below"}
    for (r0, a0, s0), (r1, a1, s1) in itertools.pairwise(pts):
        if a1 < target:
            f = (a0 - target) / (a0 - a1)
            return {
                "rate": round(r0 + f * (r1 - r0), 4),
                "per_s": round(s0 + f * (s1 - s0), 2),
                "kind": "interpolated",
            }
    return {"rate": pts[-1][0], "per_s": pts[-1][2], "kind": "at_least"}


def outcomes(sweep: Sequence[Json], target: float) -> list[tuple[float, bool | None]]:
    """(rate, met the target) of each run so far, in run order; None: the run failed."""
    return [(r["rate"], r["attainment"] >= target if r["status"] == "ran" else None) for r in sweep]


def next_rate(
    rates: Sequence[float], runs: Sequence[tuple[float, bool | None]], start: float
) -> float | None:
    """The next rate of one configuration's sweep, or None when it is done.

    It starts at `start` and walks the grid one step at a time: up after a run that met
    the target, down after one that missed, so it stops once a met and a missed rate are
    adjacent (attainment falls as the rate rises), at either end of the grid, or after a
    run that failed outright (no point: the reason is in the results).
    """
    if not runs:
        return start
    met = [ok for _, ok in runs]
    if None in met or (True in met and False in met):
        return None
    i = list(rates).index(runs[-1][0]) + (1 if met[-1] else -1)
    return rates[i] if 0 <= i < len(rates) else None


def initial_splits(
    chosen: Sequence[goodput.Configuration], modelled: dict[int, float], *, converged: bool
) -> dict[str, int]:
    """Each configuration's (initial) prefill engines.

    A "best" split (vllm-router-best) is the one with the best modelled goodput: the sweep
    has no hindsight until it ends, and each configuration's rates depend on its own
    outcomes. With `converged`, a configuration with a controller starts there too, as a
    controller that has settled would be: the stationary control judges whether it then
    holds still, not how fast it gets there from the default split.
    """
    best = max(modelled, key=lambda p: modelled[p])
    return {
        cfg.name: best if cfg.split == "best" or (converged and cfg.controller) else int(cfg.split)
        for cfg in chosen
    }


def compare(ours: Json, bar: Json) -> Json:
    """Our goodput over the bar's, and whether that is exact or a bound."""
    if ours["rate"] is None or bar["rate"] is None:
        return {"ratio": None, "kind": None}
    ratio = round(ours["rate"] / bar["rate"], 3)
    kinds = (ours["kind"], bar["kind"])
    if kinds == ("interpolated", "interpolated"):
        kind = "estimate"
    elif ours["kind"] == "at_least" and bar["kind"] != "at_least":
        kind = "at_least"  # ours is a floor, the bar's is exact or an upper bound
    elif bar["kind"] == "at_least" and ours["kind"] != "at_least":
        kind = "at_most"
    else:
        kind = "unknown"
    return {"ratio": ratio, "kind": kind}


def summary(sweeps: dict[str, Json], target: float) -> Json:
    """Each configuration's goodput, the best static split's, and narwhal-full against it."""
    goodputs: dict[str, Json] = {}
    # The same crossing phase by phase (a phase's attainment at each rate of the whole
    # sweep; a phase that still met the target when the whole run fell below it has
    # only a floor: "at_least").
    per_phase: dict[str, Json] = {}
    for name, sweep in sweeps.items():
        ran = [r for r in sweep if r["status"] == "ran"]
        goodputs[name] = crossing(
            [(r["rate"], r["attainment"], r["offered_per_s"]) for r in ran], target
        )
        phases = ran[0]["phases"] if ran else {}
        per_phase[name] = {
            p: crossing(
                [
                    (r["rate"], r["phases"][p]["attainment"], r["phases"][p]["offered_per_s"])
                    for r in ran
                    if r["phases"][p]["attainment"] is not None
                ],
                target,
            )
            for p in phases
        }
    statics = {
        n: g for n, g in goodputs.items() if n in goodput.STATIC_NAMES and g["rate"] is not None
    }
    best = max(statics, key=lambda n: statics[n]["rate"], default=None)
    out: Json = {
        "target": target,
        "goodput": goodputs,
        "goodput_per_phase": per_phase,
        "best_static": best,
    }
    if best is not None and CONTROLLED in goodputs:
        out["narwhal_full_vs_best_static"] = compare(goodputs[CONTROLLED], goodputs[best])
    return out


# ------------------------------------------------------------------------------- runs


def compact(rate: float, result: Json, bounds: Sequence[tuple[str, float, float]]) -> Json:
    """What the sweep keeps of one run (goodput.py's document, minus the big series)."""
    if result.get("status") != "ran":
        return {"rate": rate, "status": result.get("status"), "reason": result.get("reason")}
    whole = result["phases"]["all"]
    return {
        "rate": rate,
        "status": "ran",
        "split": result["split"],
        "attainment": whole["attainment"],
        "offered": whole["offered"],
        "offered_per_s": whole["offered_per_s"],
        "passing": whole["passing"],
        "refused": whole["refused"],
        "phases": {
            name: {
                k: result["phases"][name][k]
                for k in ("offered", "offered_per_s", "passing", "attainment")
            }
            for name, _, _ in bounds
        },
        "ttft_ms_p90": whole["ttft_ms"].get("p90"),
        "tpot_ms_p90": whole["tpot_ms"].get("p90"),
        "role_changes": result["role_changes"],
        "split_over_time": {
            "t": result["pools"]["t"],
            "prefill_engines": result["pools"]["prefill_engines"],
        },
        "over_time": result["over_time"],
        # Each change of the controller's verdict (why it moved, or which gate held it):
        # what explains a controller's goodput.
        "controller_decisions": result["controller_decisions"],
        "wall_s": result["wall_s"],
        "faithfulness": result["faithfulness"],
    }


async def sweep_all(args: argparse.Namespace) -> int:
    try:
        traces = goodput.load_traces(args.traces)
    except gw.TraceError as exc:
        print(f"goodput-rate: {exc}", file=sys.stderr)
        return 2
    slo = gw.Slo(args.ttft_slo_s, args.tpot_slo_s)
    base, scale = goodput.phases_from(args, args.phases)
    rates = sorted({float(r) for r in args.rates.split(",")})
    if not rates or rates[0] <= 0:
        raise SystemExit(f"goodput-rate: --rates must be positive, got {args.rates!r}")
    start = min(rates, key=lambda r: abs(r - args.start))
    bounds = gw.phase_bounds(base)
    phase_model_s = min(end - start for _, start, end in bounds)
    window_s = args.window_s or (3.0 if args.quick else 10.0)
    settings = goodput.settings_from(args, slo, window_s, "goodput-rate")
    features = goodput.features_from(args)

    def build(rate: float) -> tuple[list[gw.Request], list[gw.MixCapacity]]:
        return gw.build(
            scaled(base, rate),
            traces,
            timing=SimTiming(),
            engines=goodput.ENGINES,
            slo=slo,
            seed=args.seed,
            streams=args.streams,
        )

    base_requests, capacities = build(1.0)
    fluid = {
        p: modelled_goodput(p, base, capacities, args.target) for p in range(1, goodput.ENGINES)
    }
    modelled = {p: round(r, 3) for p, r in fluid.items()}
    if args.configs != "auto":
        chosen = goodput.select(args.configs)
    else:
        splits = list(fluid) if args.all_splits else kept_splits(fluid, KEEP_WITHIN)
        names = [f"narwhal-static-{p}p{goodput.ENGINES - p}d" for p in splits]
        chosen = goodput.select(",".join([CONTROLLED, *names]))
    for cfg in chosen:
        if goodput.unavailable(cfg, features, "goodput-rate") is not None:
            raise SystemExit(f"goodput-rate: {cfg.name} cannot run here")
    print(f"goodput-rate: modelled goodput (rate multiplier) per split: {modelled}", flush=True)
    prefills = initial_splits(chosen, modelled, converged=args.converged)
    sweeps: dict[str, list[Json]] = {cfg.name: [] for cfg in chosen}
    started = time.monotonic()
    builds: dict[float, list[gw.Request]] = {1.0: base_requests}

    def document() -> Json:
        return {
            **goodput.result_head("goodput-rate", started, args.vllm_router_venv),
            "config": {
                **goodput.config_facts(args, settings, scale),
                "rates": rates,
                "start": start,
                "target": args.target,
                "converged": args.converged,
            },
            "workload": goodput.workload_facts(args, base_requests, base, capacities),
            "modelled_goodput": modelled,
            "sweeps": sweeps,
            "summary": summary(sweeps, args.target),
        }

    # Rounds: every unfinished configuration runs its next rate, so the configurations
    # share the box's conditions as the sweep goes on.
    while True:
        plan = [
            (cfg, rate)
            for cfg in chosen
            if (rate := next_rate(rates, outcomes(sweeps[cfg.name], args.target), start))
            is not None
        ]
        if not plan:
            break
        for cfg, rate in plan:
            if rate not in builds:
                builds[rate] = build(rate)[0]
            requests = builds[rate]
            at = attrs.evolve(settings, out_dir=settings.out_dir / f"x{rate:g}")
            print(f"goodput-rate: x{rate:g} {cfg.name} ({len(requests)} requests) ...", flush=True)
            run_cfg = goodput.with_controller_timing(cfg, phase_model_s, args.speed)
            run_cfg = goodput.with_narwhal_extra(run_cfg, args.narwhal_extra)
            try:
                result = await goodput.run_one(run_cfg, prefills[cfg.name], requests, bounds, at)
            except Exception as exc:
                result = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
                print(f"goodput-rate: {cfg.name}: FAILED: {exc}", file=sys.stderr, flush=True)
            row = compact(rate, result, bounds)
            sweeps[cfg.name].append(row)
            print(
                f"goodput-rate: x{rate:g} {cfg.name}: attainment {row.get('attainment')} "
                f"(wall {row.get('wall_s')} s)",
                flush=True,
            )
            harness.warn_if_starved(f"goodput-rate: x{rate:g} {cfg.name}", row.get("faithfulness"))
            # Written after every run, so an interrupted sweep keeps what it measured.
            benchkit.write_json(args.out, document(), indent=1)
    benchkit.publish(args.out, document(), plot=plot, indent=1)
    return 0


# ------------------------------------------------------------------------ table, plot


def markdown(doc: Json) -> str:
    """Attainment at each rate and the goodput of every configuration, as Markdown."""
    return rate_table(doc, doc["summary"]["best_static"])


def rate_table(doc: Json, bold: str | None) -> str:
    """`markdown` for any sweep document (`sweeps`, `summary.goodput`, `config.rates`),
    with the configuration `bold` in bold."""
    rates = doc["config"]["rates"]
    s = doc["summary"]
    lines = [
        "| configuration | "
        + " | ".join(f"x{r:g}" for r in rates)
        + " | goodput (x rate) | goodput req/s |",
        "|---|" + "---:|" * (len(rates) + 2),
    ]
    for name, sweep in doc["sweeps"].items():
        by_rate = {r["rate"]: r for r in sweep}
        cells = []
        for r in rates:
            row = by_rate.get(r)
            if row is None:
                cells.append("")
            elif row["status"] != "ran":
                cells.append(str(row["status"]))
            else:
                cells.append(f"{row['attainment']:.1%}")
        g = s["goodput"][name]
        mark = {"at_least": ">= ", "below": "< "}.get(g["kind"] or "", "")
        label = f"**{name}**" if name == bold else name
        rate = "–" if g["rate"] is None else f"{mark}{g['rate']:.2f}"
        per_s = "–" if g["per_s"] is None else f"{mark}{g['per_s']:.1f}"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {rate} | {per_s} |")
    return "\n".join(lines)


def plot(doc: Json, path: Path) -> None:
    plt = benchkit.pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    s = doc["summary"]
    lowest = 1.0
    for name, sweep in doc["sweeps"].items():
        ran = sorted((r for r in sweep if r["status"] == "ran"), key=lambda r: r["rate"])
        if not ran:
            continue
        lowest = min(lowest, *(r["attainment"] for r in ran))
        strong = name == CONTROLLED or name == s["best_static"]
        ax.plot(
            [r["offered_per_s"] for r in ran],
            [r["attainment"] for r in ran],
            marker="o",
            linewidth=2.0 if strong else 1.0,
            alpha=0.95 if strong else 0.5,
            label=name + (" (best static)" if name == s["best_static"] else ""),
        )
        g = s["goodput"][name]
        if g["kind"] == "interpolated":
            ax.axvline(g["per_s"], linewidth=0.6, alpha=0.6, color=ax.lines[-1].get_color())
    ax.axhline(doc["config"]["target"], color="k", linewidth=0.6, linestyle="--")
    slo = doc["config"]["slo"]
    phases = ", ".join(p["name"] for p in doc["workload"]["phases"])
    ax.set_title(
        f"Goodput (DistServe): attainment vs offered rate; {phases}; TTFT ≤ "
        f"{slo['ttft_s'] * 1000:.0f} ms, TPOT ≤ {slo['tpot_s'] * 1000:.0f} ms",
        fontsize=9,
    )
    ax.set_xlabel("offered requests/s (model time)")
    ax.set_ylabel("SLO attainment over offered")
    ax.set_ylim(max(0.0, lowest - 0.1), 1.02)
    ax.legend(fontsize=8)
    benchkit.save_figure(fig, path)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    goodput.common_arguments(p, out=benchkit.RUNS / "goodput-rate.json")
    p.add_argument("--phases", default=DEFAULT_PHASES, help="comma-separated phase names")
    p.add_argument(
        "--configs",
        default="auto",
        help="comma-separated names, or 'auto': narwhal-full and the static splits the "
        "capacity model keeps",
    )
    p.add_argument("--rates", default=DEFAULT_RATES, help="load multipliers to sweep")
    p.add_argument(
        "--start", type=float, default=1.0, help="first rate of every sweep (nearest in --rates)"
    )
    p.add_argument("--target", type=float, default=TARGET, help="attainment target")
    p.add_argument(
        "--converged",
        action="store_true",
        help="start controller configurations at the capacity model's best split (the "
        "stationary control: does a settled controller hold still?)",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return goodput.show_or_run(parse_args(argv), sweep_all, plot, markdown)


if __name__ == "__main__":
    sys.exit(main())
