"""What scanning a relayed engine stream costs per read, by chunk shape.

    .venv/bin/python tools/bench/dev/sse_scan.py [--code NAME=DIR ...] [--reps 5]

A relayed stream is read one engine event per read when the router keeps up, several
when it falls behind. This times `SseScanner.feed` alone (no sockets) on vLLM-shaped
completions and chat chunks, one and eight events per read, and, where the tree has it,
the stream meter around it (`narwhal.serving._meter.StreamMeter.feed`), which is what
the relay runs per read. `--code NAME=DIR` times the narwhal package found in DIR as
well (say an extracted `git archive REV narwhal`), each tree in a process of its own.
Writes runs/bench/sse-scan.json.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchkit, one folder up
from benchkit import RUNS, Json
from codetree import compare, in_child, parse_code

READS = 50_000

# Runs in a child process with the tree under test first on sys.path.
_CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from narwhal.engines import SseScanner
try:
    from narwhal.serving._meter import StreamMeter
except ImportError:
    StreamMeter = None
reads, reps = int(sys.argv[2]), int(sys.argv[3])

def event(document):
    return b"data: " + json.dumps(document, separators=(",", ":")).encode() + b"\\n\\n"

completion = event({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
    "choices": [{"index": 0, "text": " the", "logprobs": None, "finish_reason": None,
    "stop_reason": None}], "usage": None})
chat = event({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
    "model": "m", "choices": [{"index": 0, "delta": {"content": " the"}, "logprobs": None,
    "finish_reason": None}]})

out = {}
for name, one in (("completions", completion), ("chat", chat)):
    for per_read in (1, 8):
        chunk = one * per_read
        best = float("inf")
        for _ in range(reps):
            scanner = SseScanner()
            start = time.perf_counter()
            for _ in range(reads):
                scanner.feed(chunk)
            best = min(best, time.perf_counter() - start)
        out[f"scanner/{name}/{per_read}"] = best / reads
        if StreamMeter is None:
            continue
        best = float("inf")
        for _ in range(reps):
            meter = StreamMeter(limit=1 << 30, own_usage=True)
            start = time.perf_counter()
            for i in range(reads):
                meter.feed(chunk, i * 0.001, release=True)
            best = min(best, time.perf_counter() - start)
        out[f"meter/{name}/{per_read}"] = best / reads
print(json.dumps(out))
"""


def measure(tree: Path, reps: int) -> dict[str, float]:
    result: dict[str, float] = in_child(_CHILD, tree, str(READS), str(reps))
    return result


def table(document: Json) -> str:
    lines = ["| code | what | chunk | events per read | µs per read |", "|---|---|---|---:|---:|"]
    for name, cells in document["results"].items():
        for key, seconds in cells.items():
            what, kind, per_read = key.split("/")
            lines.append(f"| {name} | {what} | {kind} | {per_read} | {seconds * 1e6:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--code", type=parse_code, action="append", default=[])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path, default=RUNS / "sse-scan.json")
    args = p.parse_args(argv)
    config = {"reads": READS, "reps": args.reps}
    document = compare("sse-scan", config, partial(measure, reps=args.reps), args.code, args.out)
    print(table(document))
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
