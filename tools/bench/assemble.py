"""What assembling a non-streaming answer from its event stream costs, by answer length.

    .venv/bin/python tools/bench/assemble.py [--code NAME=DIR ...] [--reps 5]

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
import subprocess
from pathlib import Path

from benchkit import REPO, RUNS, Json, git_revision, machine, python, write_json

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


def parse_code(text: str) -> tuple[str, Path]:
    name, sep, directory = text.partition("=")
    if not sep or not name or not directory:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {text!r}")
    return name, Path(directory)


def measure(tree: Path, reps: int) -> dict[str, float]:
    proc = subprocess.run(
        [python(), "-c", _CHILD, str(tree), json.dumps(SIZES), str(reps)],
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, float] = json.loads(proc.stdout)
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
    trees = [("current", REPO), *args.code]
    document: Json = {
        "benchmark": "assemble",
        "machine": machine(),
        "git": git_revision(),
        "config": {"sizes": list(SIZES), "reps": args.reps},
        "results": {name: measure(tree, args.reps) for name, tree in trees},
    }
    write_json(args.out, document)
    print(table(document))
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
