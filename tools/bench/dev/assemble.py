"""What assembling a non-streaming answer from its event stream costs, by answer length.

    .venv/bin/python tools/bench/dev/assemble.py [--code NAME=DIR ...] [--reps 5]

The router streams a non-streaming request's decode leg and rebuilds the engine's JSON
answer from the chunks (`narwhal.engines._assemble`). This times `ResponseAssembler` alone
(no sockets) on completions with token ids and chat answers of 1,000 to 16,000 one-token
chunks: a cost per chunk that stays flat as the answer grows is linear assembly.
`--code NAME=DIR` times the narwhal package found in DIR as well (say an extracted
`git archive REV narwhal`), each tree in a process of its own. Writes
runs/bench/assemble.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchkit, one folder up
from benchkit import RUNS, Json
from codetree import compare, in_child, parse_code

SIZES = (1_000, 4_000, 16_000)

# Runs in a child process with the tree under test first on sys.path.
_CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from narwhal.engines._assemble import ResponseAssembler
sizes, reps = json.loads(sys.argv[2]), int(sys.argv[3])

def completion(i, n):
    return {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [
        {"index": 0, "text": f"tok{i} ", "token_ids": [i],
         "finish_reason": "length" if i == n - 1 else None}]}

def chat(i, n):
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m", "choices": [
        {"index": 0, "delta": {"content": f"tok{i} "},
         "finish_reason": "length" if i == n - 1 else None}]}

out = {}
for kind, make in (("completions", completion), ("chat", chat)):
    for n in sizes:
        chunks = [make(i, n) for i in range(n)]
        best = float("inf")
        for _ in range(reps):
            assembler = ResponseAssembler(kind, "vllm")
            start = time.perf_counter()
            for chunk in chunks:
                assembler.add(chunk)
            assembler.result()
            best = min(best, time.perf_counter() - start)
        out[f"{kind}/{n}"] = best
print(json.dumps(out))
"""


def measure(tree: Path, reps: int) -> dict[str, float]:
    result: dict[str, float] = in_child(_CHILD, tree, json.dumps(SIZES), str(reps))
    return result


def table(document: Json) -> str:
    lines = [
        "| code | answer | chunks | ms (best of reps) | µs per chunk |",
        "|---|---|---:|---:|---:|",
    ]
    for name, cells in document["results"].items():
        for key, seconds in cells.items():
            kind, n = key.split("/")
            per_chunk = seconds / int(n) * 1e6
            lines.append(f"| {name} | {kind} | {n} | {seconds * 1e3:.1f} | {per_chunk:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--code", type=parse_code, action="append", default=[])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path, default=RUNS / "assemble.json")
    args = p.parse_args(argv)
    config = {"sizes": list(SIZES), "reps": args.reps}
    document = compare("assemble", config, partial(measure, reps=args.reps), args.code, args.out)
    print(table(document))
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
