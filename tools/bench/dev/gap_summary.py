"""What a finished decode stream's token gaps cost the request path, per stream.

    .venv/bin/python tools/bench/dev/gap_summary.py [--code NAME=DIR ...] [--streams 2000]

As a streamed decode leg ends, its gaps (up to 256) serve the role controller (the
median interval), the live decode correction (through `ControlLink.decode_gaps`) and a
latency residual (`DecodeGaps`, predicted by recovery at its next pass). This times that
tail alone, no sockets: the summary, the serving signals with a controller and loaded
profiles, and the residual's prediction, for streams of 256 noisy gaps. `--code NAME=DIR`
times the narwhal package found in DIR as well (say an extracted `git archive REV
narwhal`), each tree in a process of its own; trees from before one summary per stream
pass the gap list to `decode_gaps` instead. Writes runs/bench/gap_summary.json.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchkit, one folder up
from benchkit import REPO, RUNS
from codetree import compare, in_child, parse_code

GAPS = 256
REPS = 5

# Runs in a child process with the tree under test first on sys.path; the profile and
# config helpers come from this checkout's tests.
_CHILD = """
import json, random, sys, time
sys.path.insert(0, sys.argv[1])
sys.path.append(sys.argv[2])
import trio
from narwhal.profiles import FleetProfiles, ProfileCheck
from narwhal.serving import ServingContext
from narwhal.serving._meter import GapLoad
from narwhal.supervisor._control import ControlLink, _decode_interval
from tests.profiles.helpers import config_for, store_for

streams, gaps_per_stream, reps = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
urls = {"p0": "http://127.0.0.1:9", "d0": "http://127.0.0.1:10"}

async def main():
    ctx = ServingContext(config_for(urls))
    ctx.profiles = FleetProfiles(
        ProfileCheck(store_for(urls), frozenset(urls), (), tuple(urls))
    )
    link = ControlLink(ctx)
    assert link.controller is not None
    engine = ctx.fleet.get("d0")
    if hasattr(engine, "load"):  # the load ledger: 8 streams holding 20k tokens
        for _ in range(8):
            engine.load.decode(2_500)
    else:
        engine.decode_active, engine.decode_tokens = 8, 20_000
    rng = random.Random(1)
    lists = [
        [0.02 * rng.lognormvariate(0, 0.1) for _ in range(gaps_per_stream)]
        for _ in range(64)
    ]
    loads = []
    for _ in range(64):
        load = GapLoad()
        load.add(engine, gaps_per_stream)
        loads.append(load)
    one_summary = hasattr(GapLoad, "alone")

    def tail(gaps, load):
        if one_summary:
            summary = load.summary(gaps)
            link.decode_gaps(engine, summary)
            leg = summary if load.alone(summary) else None
        else:
            link.decode_gaps(engine, gaps, load.mean(len(gaps)))
            leg = load.summary(gaps)
        return _decode_interval(ctx.profiles, engine, leg)

    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for i in range(streams):
            tail(lists[i % 64], loads[i % 64])
        best = min(best, time.perf_counter() - start)
    print(json.dumps({"us_per_stream": best / streams * 1e6}))

trio.run(main)
"""


def measure(tree: Path, streams: int, reps: int) -> dict[str, float]:
    args = (str(REPO), str(streams), str(GAPS), str(reps))
    result: dict[str, float] = in_child(_CHILD, tree, *args)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--code", type=parse_code, action="append", default=[])
    p.add_argument("--streams", type=int, default=2000)
    p.add_argument("--reps", type=int, default=REPS)
    p.add_argument("--out", type=Path, default=RUNS / "gap_summary.json")
    args = p.parse_args(argv)
    config = {"gaps_per_stream": GAPS, "streams": args.streams, "reps": args.reps}
    timed = partial(measure, streams=args.streams, reps=args.reps)
    document = compare("gap_summary", config, timed, args.code, args.out)
    for name, cells in document["results"].items():
        print(f"{name}: {cells['us_per_stream']:.1f} µs per stream (best of {args.reps})")
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
