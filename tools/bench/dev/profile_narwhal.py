"""Where Narwhal's CPU goes on the overhead benchmark's path, and what config changes buy.

    .venv/bin/python tools/bench/dev/profile_narwhal.py --mode stream --concurrency 64 \\
        [--variant NAME=KEY=VALUE[,KEY=VALUE...] ...] [--reps 3] [--py-spy]

Starts the overhead benchmark's setup (zero-latency P/D simulator pair, Narwhal with the
same config) once per variant, then runs the overhead load generator against each
variant in turn, interleaved and repeated, printing Narwhal's CPU per request, per
chunk and per token, and TTFT. `default` (the overhead config) is always a variant;
`--variant notok=engine.tokenize=false` adds one with that setting changed;
`--code base=DIR` adds one that runs the narwhal package found in DIR (say an extracted
`git archive REV narwhal`) with the default config, to compare code revisions the same way.

With --py-spy, py-spy (`pip install py-spy` into .venv) samples the router while it
holds the GIL during the first repetition, and the samples are grouped by where the
CPU goes: hypercorn (HTTP server side), the engine transport, Narwhal's request flow,
the trio scheduler, JSON, metrics, logging. Raw samples go to runs/bench/profiles/
(not committed).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchkit, one folder up
import overhead
from benchkit import GUARD_CORES, RUNS, harness, median, rotated, wait_quiet
from codetree import parse_code

PROFILES = RUNS / "profiles"
_FRAME = re.compile(r"(.*) \((.*):(\d+)\)$")

# Checked from the sampled leaf towards the root; the first match takes the sample.
CATEGORIES: list[tuple[str, Callable[[str], bool]]] = [
    ("logging", lambda p: p.startswith("logging/") or p.endswith("narwhal/_logging.py")),
    (
        "prometheus metrics",
        lambda p: p.startswith(("prometheus_client/", "narwhal/metrics/")),
    ),
    ("json encode/decode", lambda p: p.startswith("json/")),
    ("engine transport (ConnectionPool, HTTP/1.1 client)", lambda p: p.endswith("_transport.py")),
    ("SSE scanning", lambda p: p.endswith("narwhal/engines/_sse.py")),
    (
        "hypercorn (HTTP server, h11 server side, ASGI)",
        lambda p: p.startswith("hypercorn/") or p.endswith("narwhal/serving/_server.py"),
    ),
    (
        "narwhal request flow (with the trio scopes it opens)",
        lambda p: p.startswith("narwhal/") and not p.startswith(("narwhal/cli", "narwhal/__")),
    ),
]
SCHEDULER = "trio scheduler and epoll (no application frame)"
INCLUSIVE = (
    "count_tokens",
    "ClientChannel.send_json",
    "ClientChannel.send_chunk",
    "TCPServer._read_data",
    "HTTPStream._send_closed",
    "Logger.info",
    "format_date_time",
)


def classify(raw_lines: Sequence[str]) -> dict[str, Any]:
    """Group py-spy `--format raw` samples (folded stacks) by category."""
    categories: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw_lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = []
        for frame in stack.split(";"):
            m = _FRAME.match(frame)
            frames.append((m.group(1), m.group(2)) if m else (frame, ""))
        label = SCHEDULER
        for _, path in reversed(frames):
            hit = next((name for name, match in CATEGORIES if match(path)), None)
            if hit is not None:
                label = hit
                break
        categories[label] += n
        names = {name for name, _ in frames}
        for fn in INCLUSIVE:
            if fn in names:
                inclusive[fn] += n
    share = (lambda v: round(100 * v / total, 1)) if total else (lambda v: 0.0)
    return {
        "samples": total,
        "percent_by_category": {k: share(v) for k, v in categories.most_common()},
        "percent_inclusive": {k: share(inclusive[k]) for k in INCLUSIVE},
    }


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    name, _, settings = text.partition("=")
    if not name or not settings:
        raise argparse.ArgumentTypeError(f"expected NAME=KEY=VALUE[,...], got {text!r}")
    patch: dict[str, Any] = {}
    for item in settings.split(","):
        key, _, value = item.partition("=")
        section, _, field = key.partition(".")
        if not field:
            raise argparse.ArgumentTypeError(f"expected section.field=value, got {item!r}")
        patch.setdefault(section, {})[field] = _value(value)
    return name, patch


def _value(text: str) -> Any:
    """A JSON literal (false, 2.5, "x") or, failing that, the text as a string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


async def measure(
    args: argparse.Namespace, variants: dict[str, dict[str, Any]], sources: dict[str, Path]
) -> dict[str, list[dict[str, Any]]]:
    """Every variant's router on one fleet, measured in turn, repetition by repetition."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent))
    plan = overhead.make_plan(quick=False, reps=args.reps, targets=["narwhal"])
    timing = plan.timing[args.concurrency]
    logs = RUNS / "logs"
    PROFILES.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    async with harness.Procs(logs) as procs:
        endpoints = await overhead.start_fleet(procs)
        routers = {}
        for name, patch in variants.items():
            port = harness.free_port()
            config = overhead.narwhal_config(
                overhead._url(endpoints.prefill), overhead._url(endpoints.decode), port
            )
            config["ctl"] = {"socket": str(logs / f"profile-{name}.sock")}
            for section, fields in patch.items():
                config.setdefault(section, {}).update(fields)
            process = f"profile-{name}"
            await harness.start_narwhal(
                procs, config, logs, name=process, pythonpath=sources.get(name)
            )
            routers[name] = (("127.0.0.1", port), procs.find(process))
        for rep in range(args.reps):
            for name in rotated(list(variants), rep):
                endpoints.routers = {"narwhal": routers[name]}
                await wait_quiet(max_busy_cores=GUARD_CORES, give_up_s=10)
                out = PROFILES / f"{name}-{args.mode}-{args.concurrency}.txt"
                cell: dict[str, Any] = {}
                async with trio.open_nursery() as nursery:
                    if args.py_spy and rep == 0 and spy is not None:
                        argv = [spy, "record", "--pid", str(routers[name][1].pid), "--gil"]
                        argv += ["--rate", "400", "--format", "raw", "--output", str(out)]
                        argv += ["--duration", str(int(timing.warmup_s + timing.window_s))]
                        nursery.start_soon(
                            partial(trio.run_process, argv, capture_stdout=True, check=False)
                        )
                    cell = await overhead.cell_once(
                        procs, plan, endpoints, "narwhal", args.mode, args.concurrency
                    )
                if args.py_spy and rep == 0:
                    cell["profile"] = classify(out.read_text().splitlines())
                results[name].append(cell)
                ttft = cell["ttft_ms"] or {}
                print(
                    f"rep {rep + 1} {name:12} {cell['requests_per_s']:7.1f}/s "
                    f"router {cell['router_cpu_ms_per_request']} ms/req "
                    f"{cell['router_cpu_us_per_chunk']} us/chunk "
                    f"ttft p50 {ttft.get('p50')} errors {cell['errors']} "
                    f"other {cell['other_cpu_share']}",
                    flush=True,
                )
    return results


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--mode", choices=overhead.MODES, default="stream")
    p.add_argument("--concurrency", type=int, choices=(1, 64, 512), default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variant", type=parse_variant, action="append", default=[])
    p.add_argument("--code", type=parse_code, action="append", default=[])
    p.add_argument("--py-spy", action="store_true", help="sample the router in repetition 1")
    args = p.parse_args(argv)
    variants: dict[str, dict[str, Any]] = {"default": {}}
    variants.update(args.variant)
    sources: dict[str, Path] = dict(args.code)
    variants.update((name, {}) for name in sources)
    if args.py_spy and shutil.which("py-spy", path=str(Path(sys.executable).parent)) is None:
        p.error("py-spy is not installed in this venv: .venv/bin/pip install py-spy")

    async def run() -> int:
        results = await measure(args, variants, sources)
        report: dict[str, Any] = {
            "mode": args.mode,
            "concurrency": args.concurrency,
            "variants": {},
        }
        for name, cells in results.items():
            report["variants"][name] = {
                "patch": variants[name],
                "router_cpu_ms_per_request": median(
                    [c["router_cpu_ms_per_request"] for c in cells]
                ),
                "router_cpu_us_per_chunk": median([c["router_cpu_us_per_chunk"] for c in cells]),
                "ttft_p50_ms": median([(c["ttft_ms"] or {}).get("p50") for c in cells]),
                "latency_p50_ms": median([c["latency_ms"]["p50"] for c in cells]),
                "requests_per_s": median([c["requests_per_s"] for c in cells]),
                "other_cpu_share": median([c["other_cpu_share"] for c in cells]),
                "profile": next((c["profile"] for c in cells if "profile" in c), None),
            }
        print(json.dumps(report, indent=1))
        return 0

    return trio.run(harness.run_guarded, run)


if __name__ == "__main__":
    raise SystemExit(main())
