"""The per-phase oracle of goodput_rate sweeps: each phase served by its best static split
at that rate, switched instantly and for free at the phase boundary. No role controller
can do better on the workload, so it bounds what "x the best static split" can reach.

    .venv/bin/python tools/bench/rate_oracle.py runs/bench/goodput-rate.json \\
        runs/bench/goodput-rate-oracle-x1.0.json runs/bench/goodput-rate-oracle-x1.25.json

Each input is a goodput_rate.py result over the same phases and seed; a (configuration,
rate) run in a later file replaces one in an earlier file. A rate gets an oracle only
when every static split in `--splits` ran at it. Writes runs/bench/goodput-rate-oracle.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import benchkit
from benchkit import Json

DEFAULT_SPLITS = "3p5d,4p4d,5p3d,6p2d,7p1d"  # the splits goodput_rate --quick keeps


def runs_by_rate(docs: Sequence[Json]) -> dict[float, dict[str, Json]]:
    """rate -> configuration -> run, later documents winning."""
    out: dict[float, dict[str, Json]] = {}
    for doc in docs:
        for name, sweep in doc["sweeps"].items():
            for run in sweep:
                if run["status"] == "ran":
                    out.setdefault(run["rate"], {})[name] = run
    return out


def oracle(docs: Sequence[Json], splits: Sequence[str]) -> dict[str, Json]:
    """Per rate: the attainment over offered requests when each phase gets the static
    split that passed the largest share of it, and which split that was."""
    names = [f"narwhal-static-{s}" for s in splits]
    out: dict[str, Json] = {}
    for rate, runs in sorted(runs_by_rate(docs).items()):
        if not all(n in runs for n in names):
            continue
        per_phase: dict[str, Json] = {}
        for phase in runs[names[0]]["phases"]:
            best = max(names, key=lambda n: runs[n]["phases"][phase]["passing"])
            row = runs[best]["phases"][phase]
            per_phase[phase] = {
                "split": best,
                "passing": row["passing"],
                "offered": row["offered"],
                "attainment": row["attainment"],
            }
        passing = sum(p["passing"] for p in per_phase.values())
        offered = sum(p["offered"] for p in per_phase.values())
        out[f"{rate:g}"] = {
            "attainment": round(passing / offered, 4),
            "per_phase": per_phase,
            "runs": {n: r["attainment"] for n, r in sorted(runs.items())},
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", type=Path, help="goodput_rate.py result JSON files")
    p.add_argument("--splits", default=DEFAULT_SPLITS, help="static splits the oracle needs")
    p.add_argument("--out", type=Path, default=benchkit.RUNS / "goodput-rate-oracle.json")
    args = p.parse_args(argv)
    docs = [json.loads(path.read_text()) for path in args.inputs]
    result = {
        "benchmark": "goodput-rate per-phase oracle",
        "inputs": [str(path) for path in args.inputs],
        "machine": docs[-1].get("machine"),
        "versions": docs[-1].get("versions"),
        "config": docs[-1].get("config"),
        "oracle": oracle(docs, args.splits.split(",")),
    }
    benchkit.write_json(args.out, result, indent=1)
    for rate, row in result["oracle"].items():
        splits = ", ".join(
            f"{phase} {best['split'].removeprefix('narwhal-static-')}"
            for phase, best in row["per_phase"].items()
        )
        print(f"x{rate}: oracle attainment {row['attainment']:.1%} ({splits})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
