"""Prompt counting: router CPU per request with engine.tokenizer_path (a local count) against
the /tokenize round trip, and the local count alone by prompt size.

    .venv/bin/python tools/bench/dev/local_tokens.py --tokenizer MODEL_DIR [--requests N] [--reps N]

Writes runs/bench/local_tokens.json. MODEL_DIR is a folder with tokenizer.json and a chat
template (tools/engines/tiny_model.py builds one; a large-vocabulary model's counts cost
more, which the in-process part shows for whatever folder is given).

- `router`: one zero-latency simulated vLLM engine (`python -m narwhal.sim --zero`) and
  `narwhal serve` in processes of their own; per cell, `--requests` sequential
  non-streaming completions (max_tokens 1) of a fixed prompt, and the router's CPU
  (utime+stime) over them, with `tokenize` (the default, /tokenize) or `local`
  (engine.tokenizer_path). Cells alternate; numbers are medians over `--reps`.
- `count`: `LocalTokenizer.count` in this process, per prompt size and for a chat.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchkit, one folder up
from benchkit import RUNS, Json, cpu_seconds, git_revision, machine, versions, write_json
from benchkit.harness import Procs, admin_url, free_port, start_fleet, start_narwhal

from narwhal.sim import DEFAULT_MODEL
from narwhal.tokenizer import load_tokenizer

LOGS = RUNS / "logs" / "local_tokens"
PROMPT = "def count(prompt):\n    return len(tokenizer.encode(prompt))  # about 60 tokens\n" * 3
SIZES = (200, 2_000, 20_000, 200_000)


def config(url: str, mode: str, tokenizer: Path, directory: Path) -> dict[str, Any]:
    engine: dict[str, Any] = {"first_token_timeout_s": 10.0}
    if mode == "local":
        engine["tokenizer_path"] = str(tokenizer)
    return {
        "engines": [{"id": "e0", "url": url, "role": "both", "model": DEFAULT_MODEL}],
        "listen": {"host": "127.0.0.1", "port": free_port()},
        "admin": {"host": "127.0.0.1", "port": free_port()},
        "ctl": {"socket": str(directory / f"{mode}.sock")},
        "log": {"level": "warning"},
        "serving": {"admission": "open"},
        "controller": {"enabled": False},
        "profiles": {"path": str(directory / "no-profiles.json")},
        "engine": engine,
    }


async def cell(procs: Procs, url: str, mode: str, args: argparse.Namespace) -> Json:
    document = config(url, mode, args.tokenizer, LOGS)
    base = await start_narwhal(procs, document, LOGS, name=f"narwhal-{mode}")
    proc = procs.find(f"narwhal-{mode}")
    body = {"model": DEFAULT_MODEL, "prompt": PROMPT, "max_tokens": 1}
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        for _ in range(20):
            (await client.post("/v1/completions", json=body)).raise_for_status()
        before = cpu_seconds(proc.pid)
        started = time.perf_counter()
        for _ in range(args.requests):
            (await client.post("/v1/completions", json=body)).raise_for_status()
        wall = time.perf_counter() - started
        used = cpu_seconds(proc.pid) - before
        state = (await client.get(admin_url(document) + "/narwhal/state")).json()
    await procs.stop(proc)
    return {
        "mode": mode,
        "router_cpu_ms_per_request": round(1000 * used / args.requests, 4),
        "latency_ms_per_request": round(1000 * wall / args.requests, 4),
        "token_counts": state["requests"]["token_counts"],
    }


def count_costs(folder: Path) -> dict[str, Json]:
    tokenizer, problem = load_tokenizer(str(folder))
    if tokenizer is None:
        raise SystemExit(f"--tokenizer: {problem}")
    words = PROMPT * (1 + max(SIZES) // len(PROMPT))
    out: dict[str, Json] = {}
    for size in SIZES:
        body = {"prompt": words[:size]}
        out[f"completion_{size}_chars_us"] = _per_call_us(
            lambda b=body: tokenizer.count("completions", b, {"vllm"})
        )
    chat: dict[str, object] = {
        "messages": [
            {"role": "system", "content": "You answer in Python only."},
            {"role": "user", "content": PROMPT},
        ]
    }
    out["chat_2_messages_us"] = _per_call_us(lambda: tokenizer.count("chat", chat, {"vllm"}))
    return out


def _per_call_us(call: Any) -> float:
    call()
    rounds = []
    for _ in range(5):
        n, started = 0, time.perf_counter()
        while time.perf_counter() - started < 0.2:
            call()
            n += 1
        rounds.append((time.perf_counter() - started) / n)
    return round(1e6 * statistics.median(rounds), 2)


async def main_async(args: argparse.Namespace) -> None:
    LOGS.mkdir(parents=True, exist_ok=True)
    cells: list[Json] = []
    async with Procs(LOGS) as procs:
        ((url,),) = await start_fleet(procs, engines=1, zero=True)
        for rep in range(args.reps):
            order = ("tokenize", "local") if rep % 2 == 0 else ("local", "tokenize")
            for mode in order:
                result = await cell(procs, url, mode, args)
                print(result, flush=True)
                cells.append(result)
    summary: dict[str, Json] = {}
    for mode in ("tokenize", "local"):
        mine = [c for c in cells if isinstance(c, dict) and c["mode"] == mode]
        for key in ("router_cpu_ms_per_request", "latency_ms_per_request"):
            values = [float(c[key]) for c in mine if isinstance(c[key], int | float)]
            summary[f"{mode}_{key}"] = round(statistics.median(values), 4)
    document: dict[str, Json] = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "tokenizer": str(args.tokenizer),
        "requests_per_cell": args.requests,
        "prompt_chars": len(PROMPT),
        "summary": summary,
        "local_count_cost": count_costs(args.tokenizer),
        "cells": cells,
        "machine": machine(),
        "versions": versions(["narwhal", "tokenizers", "jinja2", "trio", "h11"]),
        "git": git_revision(),
    }
    path = RUNS / "local_tokens.json"
    write_json(path, document)
    print(document["summary"], document["local_count_cost"], f"wrote {path}", sep="\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="model folder")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=4)
    trio.run(main_async, parser.parse_args())


if __name__ == "__main__":
    main()
