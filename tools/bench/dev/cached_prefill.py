"""How a prefill's time splits between cached and new tokens, on one engine (real or
simulated): the input of a prefill law that prices only what the engine must compute.

    .venv/bin/python tools/bench/dev/cached_prefill.py --url http://127.0.0.1:8190 \\
        --model tiny --name vllm-cpu [--sizes 96,192,384,640] [--reps 5]

For each size (in words; the result's prompt_tokens says how many tokens), a fresh
prompt (a prefix no request sent before) is timed cold, then the
same prompt again (its full blocks cached), then the prompt with new text after a cached
prefix of the size. Each request is a completion with max_tokens 1 and
`prompt_tokens_details` read back when the engine reports them, so its latency is the
prefill and one decode step. Medians of --reps fresh prompts per size. Writes
runs/bench/cached-prefill-NAME.json. Only loopback URLs: the engine is one the caller
started (say the real tier's, or `narwhal-sim --enable-prefix-caching`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchkit, one folder up
from benchkit import RUNS, Json, write_json
from benchkit._facts import git_revision, load_average, machine

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
]


def text(words_wanted: int, seed: str) -> str:
    """`words_wanted` words of text no other prompt starts with."""
    words = [f"{seed}"] + [WORDS[(i * 7 + len(seed)) % len(WORDS)] for i in range(words_wanted)]
    return " ".join(words)


def timed(client: httpx.Client, model: str, prompt: str) -> tuple[float, int, int | None]:
    start = time.perf_counter()
    answer = client.post(
        "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1}
    )
    elapsed = time.perf_counter() - start
    answer.raise_for_status()
    usage = answer.json()["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return elapsed, usage["prompt_tokens"], details.get("cached_tokens")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--sizes", default="96,192,384,640")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    host = urlparse(args.url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"--url {args.url}: only a loopback engine is measured")
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict[str, Json] = {}
    with httpx.Client(base_url=args.url, timeout=300) as client:
        timed(client, args.model, text(64, "warmup"))
        for size in sizes:
            cells: dict[str, list[float]] = {"cold": [], "cached": [], "cached_prefix_new_tail": []}
            seen: dict[str, list[int | None]] = {key: [] for key in cells}
            prompt_tokens = 0
            for _ in range(args.reps):
                seed = uuid.uuid4().hex
                prompt = text(size, seed)
                for key, body in (
                    ("cold", prompt),
                    ("cached", prompt),
                    ("cached_prefix_new_tail", prompt + " " + text(64, uuid.uuid4().hex)),
                ):
                    elapsed, prompt_tokens_now, cached = timed(client, args.model, body)
                    cells[key].append(elapsed)
                    seen[key].append(cached)
                    if key == "cold":
                        prompt_tokens = prompt_tokens_now
            results[str(size)] = {
                "prompt_tokens": prompt_tokens,
                **{f"{key}_ms": round(statistics.median(v) * 1e3, 2) for key, v in cells.items()},
                "cached_tokens": {key: v[-1] for key, v in seen.items()},
            }
            print(size, results[str(size)], flush=True)
    out = RUNS / f"cached-prefill-{args.name}.json"
    write_json(
        out,
        {
            "benchmark": "cached-prefill",
            "machine": machine(),
            "git": git_revision(),
            "load_average": load_average(),
            "config": {"url": args.url, "model": args.model, "sizes": sizes, "reps": args.reps},
            "results": results,
        },
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
