"""A paper model of serving.workers at W = 1-16, from what overhead.py measured.

    .venv/bin/python tools/bench/workers_model.py [--from overhead-workers-quick]

A 2-core box cannot show the plane's scaling (the fleet and the load generator need
about 1.2 of its cores), so this extrapolates from the costs one run measured, and says
which assumptions carry it. Writes runs/bench/workers-model.json and prints its tables.

Inputs, from the overhead JSON's streamed cells of target narwhal-wN (median over the
concurrencies given by --concurrency): the router's CPU per streamed chunk (the decision
core's and every worker's together), the decision core's own CPU per request, and the
chunks per stream. Derived:

- the decision core's CPU per request, `core_ms`; it serves every worker, so the host's
  request rate is at most 1000 / core_ms;
- a worker's CPU per relayed chunk, `worker_us`: the rest of the router's CPU per
  request, divided by the chunks a stream had (at the benchmark's 32 tokens a stream;
  longer streams spread a worker's per-request work over more chunks, so this is
  pessimistic for them);
- the host's capacity with W workers, each on its own core and the core on one more:
  chunks/s = min(W * 1e6 / worker_us, tokens_per_request * 1000 / core_ms).

Assumptions: workers share nothing but the core (each has its own sockets, pools and
event loop), so their capacity adds up; the core's work per request does not grow with
W (its messages per request are the same whichever worker sends them); one streamed
chunk per generated token (vLLM's streams carry one token a chunk when nothing batches
them). None of this is measured here beyond W = 2; the 0.85 * W goal needs a host with
W + 3 free cores.

The fleet a host serves: decode engines of `engine_tokens_per_s` each, by default
1,513 tokens/s (Splitwise's profile of Llama-2-70B on H100: batch 64 at 42.3 ms a step,
../shared/perf/splitwise-sim/perf_model.csv).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from benchkit import RUNS, Json, write_json

# Splitwise's perf model: llama2-70b, h100-80gb, batch 64, prompt 512: 42.3 ms a step.
ENGINE_TOKENS_PER_S = round(64 / 0.0423)
WORKER_COUNTS = (1, 2, 4, 8, 12, 16)
TOKENS_PER_REQUEST = (32, 256, 1024)


def measured(
    document: Mapping[str, Any], target: str, concurrency: Sequence[int]
) -> dict[str, float]:
    """The streamed cells' medians the model starts from."""
    cells = [
        cell
        for cell in document["summary"]
        if cell["target"] == target
        and cell["mode"] == "stream"
        and cell["concurrency"] in concurrency
    ]
    if not cells:
        raise SystemExit(f"no streamed cells of {target} at {list(concurrency)} in the JSON")

    def median(key: str) -> float:
        values = [float(c[key]) for c in cells if c.get(key) is not None]
        if not values:
            raise SystemExit(f"{target}'s cells have no {key} (measured before it was recorded?)")
        return statistics.median(values)

    chunks = median("chunks_per_stream")
    total_ms = median("router_cpu_us_per_chunk") * chunks / 1000
    core_ms = round(median("router_core_cpu_ms_per_request"), 3)
    return {
        "router_cpu_us_per_chunk": median("router_cpu_us_per_chunk"),
        "chunks_per_stream": chunks,
        "router_cpu_ms_per_request": round(total_ms, 3),
        "core_ms_per_request": core_ms,
        "worker_us_per_chunk": round(1000 * (total_ms - core_ms) / chunks, 1),
    }


def capacity(inputs: Mapping[str, float], workers: int, tokens: int) -> dict[str, Json]:
    """One host's capacity with `workers` worker processes, for streams of `tokens`."""
    relay = workers * 1e6 / inputs["worker_us_per_chunk"]
    core = tokens * 1000 / inputs["core_ms_per_request"]
    chunks = min(relay, core)
    return {
        "workers": workers,
        "tokens_per_request": tokens,
        "cores": workers + 1,
        "chunks_per_s": round(chunks),
        "requests_per_s": round(chunks / tokens, 1),
        "bound": "workers" if relay <= core else "decision core",
        "core_cpu_share": round(chunks / tokens * inputs["core_ms_per_request"] / 1000, 2),
    }


def model(inputs: Mapping[str, float], engine_tokens_per_s: float) -> dict[str, Json]:
    rows = [capacity(inputs, w, t) for t in TOKENS_PER_REQUEST for w in WORKER_COUNTS]
    for row in rows:
        chunks = row["chunks_per_s"]
        assert isinstance(chunks, int)
        row["decode_engines"] = round(chunks / engine_tokens_per_s, 1)
    return {
        "inputs": dict(inputs),
        "engine_tokens_per_s": engine_tokens_per_s,
        "capacity": rows,
        "per_worker_core": {
            "chunks_per_s": round(1e6 / inputs["worker_us_per_chunk"]),
            "decode_engines": round(1e6 / inputs["worker_us_per_chunk"] / engine_tokens_per_s, 2),
        },
    }


def table(result: Mapping[str, Any]) -> str:
    head = [
        "| W | cores | tokens/request | chunks/s | requests/s | bound | core CPU |"
        " decode engines |",
        "|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    rows = [
        f"| {row['workers']} | {row['cores']} | {row['tokens_per_request']} |"
        f" {row['chunks_per_s']:,} | {row['requests_per_s']:,} | {row['bound']} |"
        f" {row['core_cpu_share']:.2f} | {row['decode_engines']} |"
        for row in result["capacity"]
    ]
    return "\n".join([*head, *rows])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--from", dest="source", default="overhead-workers-quick")
    p.add_argument("--target", default="narwhal-w2")
    p.add_argument("--concurrency", default="64,512", help="the cells' concurrencies")
    p.add_argument("--engine-tokens-per-s", type=float, default=ENGINE_TOKENS_PER_S)
    p.add_argument("--out", default="workers-model")
    args = p.parse_args(argv)
    source = RUNS / f"{args.source}.json"
    document = json.loads(source.read_text())
    concurrency = [int(c) for c in args.concurrency.split(",")]
    inputs = measured(document, args.target, concurrency)
    result: dict[str, Json] = {
        "benchmark": "workers-model",
        "source": str(source.relative_to(RUNS.parent.parent)),
        "source_git": document.get("git"),
        "target": args.target,
        "concurrency": concurrency,
        **model(inputs, args.engine_tokens_per_s),
    }
    write_json(RUNS / f"{args.out}.json", result)
    print(json.dumps(result["inputs"], indent=1))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
