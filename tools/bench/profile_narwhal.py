"""Where Narwhal's CPU goes on the overhead benchmark's path, and what config changes buy.

    .venv/bin/python tools/bench/profile_narwhal.py --mode stream --concurrency 64 \\
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
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import overhead
from benchkit import RUNS, Processes, free_port, median, wait_quiet, wait_ready

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
    "Flow._count_tokens",
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


def parse_code(text: str) -> tuple[str, Path]:
    name, _, directory = text.partition("=")
    if not name or not (Path(directory) / "narwhal" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"expected NAME=DIR with DIR/narwhal/, got {text!r}")
    return name, Path(directory).resolve()


def _value(text: str) -> Any:
    """A JSON literal (false, 2.5, "x") or, failing that, the text as a string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


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
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if args.py_spy and spy is None:
        p.error("py-spy is not installed in this venv: .venv/bin/pip install py-spy")
    plan = overhead.make_plan(quick=False, reps=args.reps, targets=["narwhal"])
    timing = plan.timing[args.concurrency]
    logs = RUNS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    PROFILES.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    with Processes() as procs:
        endpoints = overhead.start_fleet(procs, logs)
        routers = {}
        for name, patch in variants.items():
            port = free_port()
            config = overhead.narwhal_config(
                f"http://{endpoints.prefill[0]}:{endpoints.prefill[1]}",
                f"http://{endpoints.decode[0]}:{endpoints.decode[1]}",
                port,
            )
            config["ctl"] = {"socket": str(logs / f"profile-{name}.sock")}
            for section, fields in patch.items():
                config.setdefault(section, {}).update(fields)
            path = logs / f"profile-{name}.json"
            path.write_text(json.dumps(config, indent=2))
            err = open(logs / f"profile-{name}.log", "wb")  # noqa: SIM115
            argv = [sys.executable, "-m", "narwhal", "serve", "--config", str(path)]
            env = None
            if name in sources:
                # -P: the benchmark's cwd (this checkout) must not shadow PYTHONPATH.
                argv[1:1] = ["-P"]
                env = {**os.environ, "PYTHONPATH": str(sources[name])}
            proc = procs.start(name, argv, stderr=err, env=env)
            wait_ready(proc, "127.0.0.1", port, "/health", timeout_s=60)
            routers[name] = (("127.0.0.1", port), proc)
        for rep in range(args.reps):
            for name in overhead.rotated(list(variants), rep):
                endpoints.routers = {"narwhal": routers[name]}
                wait_quiet(max_busy_cores=overhead.GUARD_CORES, give_up_s=10)
                sampler = None
                out = PROFILES / f"{name}-{args.mode}-{args.concurrency}.txt"
                if args.py_spy and rep == 0 and spy is not None:
                    sampler = subprocess.Popen(
                        [
                            spy,
                            "record",
                            "--pid",
                            str(routers[name][1].pid),
                            "--gil",
                            "--rate",
                            "400",
                            "--duration",
                            str(int(timing.warmup_s + timing.window_s)),
                            "--format",
                            "raw",
                            "--output",
                            str(out),
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                cell = overhead.cell_once(
                    procs, plan, endpoints, "narwhal", args.mode, args.concurrency
                )
                if sampler is not None:
                    sampler.wait(timeout=120)
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
    report: dict[str, Any] = {"mode": args.mode, "concurrency": args.concurrency, "variants": {}}
    for name, cells in results.items():
        report["variants"][name] = {
            "patch": variants[name],
            "router_cpu_ms_per_request": median([c["router_cpu_ms_per_request"] for c in cells]),
            "router_cpu_us_per_chunk": median([c["router_cpu_us_per_chunk"] for c in cells]),
            "ttft_p50_ms": median([(c["ttft_ms"] or {}).get("p50") for c in cells]),
            "latency_p50_ms": median([c["latency_ms"]["p50"] for c in cells]),
            "requests_per_s": median([c["requests_per_s"] for c in cells]),
            "other_cpu_share": median([c["other_cpu_share"] for c in cells]),
            "profile": next((c["profile"] for c in cells if "profile" in c), None),
        }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
