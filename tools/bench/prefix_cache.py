"""The prefix-structured workload through Narwhal, on a simulated fleet with prefix
caching off, then on with Narwhal blind to it, then cache-aware (`CONFIGS`): the
engines' cache hit rate, the clients' TTFT and its attainment of --ttft-slo-s.

    .venv/bin/python tools/bench/prefix_cache.py --sessions 60

Each configuration gets a fresh fleet (`--engines`, half prefill, half decode, vLLM
engines with `--block-size`) and a fresh Narwhal with open admission and the
configuration's `cache` section, and replays the same `benchkit.sessions` workload open
loop. TTFT is measured
at the client, streamed, and reported in model seconds (wall x speed). The hit rate is
the engines' own count (`/_sim/state` prefix_cache: prompt tokens found / looked up), per
role: a decode engine also caches the prompts whose KV it pulled.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import benchkit
import httpx
import numpy as np
import trio
from benchkit import harness, sessions, workload as gw

DEFAULT_OUT = benchkit.RUNS / "prefix-cache.json"
DEFAULT_TRACES = benchkit.REPO.parent / "shared" / "traces" / "azure2023"


async def send(
    client: httpx.AsyncClient, url: str, r: sessions.SessionRequest, speed: float
) -> float | None:
    """The request's TTFT in model seconds, None if it failed."""
    body = {
        "model": harness.MODEL,
        "prompt": r.prompt,
        "max_tokens": r.max_tokens,
        "stream": True,
    }
    start = time.monotonic()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return None
        async for line in resp.aiter_lines():
            if line.startswith("data: {") and '"text"' in line:
                return (time.monotonic() - start) * speed
    return None


# Narwhal's `cache` section per configuration: blind is placement as it was before
# cache-aware serving (no index, no credit, no local prefill).
BLIND = {"approximate_ttl_s": 0, "affinity": 0.0, "local_prefill_share": 1.0}
CONFIGS: tuple[tuple[str, bool, dict[str, float]], ...] = (
    ("cache-off", False, BLIND),
    ("cache-on-blind", True, BLIND),
    ("cache-on-affinity-1", True, {"affinity": 1.0, "local_prefill_share": 1.0}),
    ("cache-on-affinity-1-local", True, {"affinity": 1.0, "local_prefill_share": 0.9}),
)


async def run_config(
    name: str,
    cache: bool,
    cache_section: dict[str, float],
    requests: list[sessions.SessionRequest],
    args: argparse.Namespace,
    tmp: Path,
) -> benchkit.Json:
    extra = ["--block-size", str(args.block_size)]
    if cache:
        extra.append("--enable-prefix-caching")
    async with harness.Procs(tmp / name / "logs", args.niceness) as procs:
        groups = await harness.start_fleet(
            procs,
            engines=args.engines,
            speed=args.speed,
            model=harness.MODEL,
            seed=args.seed,
            extra_args=extra,
        )
        urls, roles = harness.assign_roles(groups, args.engines // 2)
        config = harness.narwhal_config(
            urls,
            roles,
            port=harness.free_port(),
            speed=args.speed,
            admission="open",
            controller=False,
            ttft_slo_s=args.ttft_slo_s,
            tpot_slo_s=0.1,
            socket_path=str(tmp / name / "ctl.sock"),
            extra={"cache": cache_section},
        )
        url = await harness.start_narwhal(procs, config, tmp / name)
        ttft: list[float | None] = [None] * len(requests)
        limits = httpx.Limits(max_connections=harness.MAX_CONNECTIONS)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            t0 = trio.current_time()

            async def one(i: int, r: sessions.SessionRequest) -> None:
                await trio.sleep_until(t0 + r.at_s / args.speed)
                ttft[i] = await send(client, url, r, args.speed)

            async with trio.open_nursery() as nursery:
                for i, r in enumerate(requests):
                    nursery.start_soon(one, i, r)
            states = [(await client.get(f"{u}/_sim/state?outcomes=0")).json() for u in urls]
    by_role: dict[str, dict[str, int]] = {}
    for role, state in zip(roles, states, strict=True):
        cell = by_role.setdefault(role, {"queries_tokens": 0, "hits_tokens": 0})
        cell["queries_tokens"] += state["prefix_cache"]["queries_tokens"]
        cell["hits_tokens"] += state["prefix_cache"]["hits_tokens"]
    ok = np.array([t for t in ttft if t is not None])
    first = np.array(
        [t for t, r in zip(ttft, requests, strict=True) if t is not None and r.turn == 0]
    )
    later = np.array(
        [t for t, r in zip(ttft, requests, strict=True) if t is not None and r.turn > 0]
    )

    def pct(a: np.ndarray, q: float) -> float | None:
        return round(float(np.percentile(a, q)), 4) if a.size else None

    return {
        "prefix_caching": cache,
        "narwhal_cache": cache_section,
        "requests": len(requests),
        "failed": len(requests) - int(ok.size),
        "ttft_attainment": round(float((ok <= args.ttft_slo_s).sum()) / len(requests), 4),
        "ttft_s": {"p50": pct(ok, 50), "p90": pct(ok, 90), "mean": round(float(ok.mean()), 4)},
        "ttft_first_turn_s": {"p50": pct(first, 50), "p90": pct(first, 90)},
        "ttft_later_turns_s": {"p50": pct(later, 50), "p90": pct(later, 90)},
        "cache": {
            role: {
                **cell,
                "hit_rate": round(cell["hits_tokens"] / cell["queries_tokens"], 4)
                if cell["queries_tokens"]
                else None,
            }
            for role, cell in by_role.items()
        },
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--speed", type=float, default=10.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--sessions", type=int, default=60)
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--mean-turns", type=float, default=4.0)
    p.add_argument("--think-s", type=float, default=20.0)
    p.add_argument("--sessions-per-s", type=float, default=0.5)
    p.add_argument("--ttft-slo-s", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--niceness", type=int, default=5)
    return p


async def main(args: argparse.Namespace) -> int:
    try:
        trace = gw.load_trace(args.traces, "conv")
    except gw.TraceError as exc:
        print(f"prefix_cache: {exc}", file=sys.stderr)
        return 2
    params = sessions.SessionParams(
        sessions=args.sessions,
        tenants=args.tenants,
        system_tokens=args.system_tokens,
        mean_turns=args.mean_turns,
        think_s=args.think_s,
        sessions_per_s=args.sessions_per_s,
        seed=args.seed,
    )
    requests = sessions.build(trace, params)
    tmp = benchkit.TMP / "prefix-cache" / time.strftime("%Y%m%d-%H%M%S")
    results = {}
    for name, cache, section in CONFIGS:
        results[name] = await run_config(name, cache, section, requests, args, tmp)
        print(name, results[name], flush=True)
    off = results["cache-off"]["ttft_s"]
    document: benchkit.Json = {
        "benchmark": "prefix-cache",
        "revision": benchkit.git_revision(),
        "machine": benchkit.machine(),
        "workload": {
            **params.to_json(),
            "trace": "conv",
            "requests": len(requests),
            "shared_fraction": round(sessions.shared_fraction(requests), 4),
        },
        "fleet": {
            "engines": args.engines,
            "prefill": args.engines // 2,
            "speed": args.speed,
            "block_size": args.block_size,
            "admission": "open",
        },
        "configs": results,
        "summary": {
            name: {
                f"ttft_{q}_ratio_over_off": round(r["ttft_s"][q] / off[q], 4)
                if r["ttft_s"][q] and off[q]
                else None
                for q in ("p50", "p90")
            }
            | {"ttft_attainment": r["ttft_attainment"]}
            for name, r in results.items()
        },
    }
    benchkit.publish(args.out, document)
    return 0


if __name__ == "__main__":
    arguments = parser().parse_args()
    sys.exit(trio.run(harness.run_guarded, lambda: main(arguments)))
