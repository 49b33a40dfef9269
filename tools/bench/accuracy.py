"""Prediction accuracy (issue 8 part 3): predictive admission's projected TTFT against the
TTFT each admitted request then had, at a few offered loads.

    .venv/bin/python tools/bench/accuracy.py                 # ~5 min on a shared 2-core box
    .venv/bin/python tools/bench/accuracy.py --replot        # redraw the PNG from the JSON

One run: a fresh simulated fleet (4 engines by default, the capacity model's best split for
the mix), profiled with narwhal-profile exactly as the goodput benchmark profiles its fleets
(`goodput.profile_fleet`), then Narwhal with `serving.admission: predictive` (controller
off) in front of it, and an open-loop replay of Azure 2023 trace requests
(`goodput_workload.build`: real arrival gaps and lengths) at each load level in turn
(default 0.3, 0.6, 0.9 of the best split's capacity), through the goodput load generator.

Narwhal logs, per request, the projected TTFT of the path its first attempt took (as priced
at admission) and the TTFT it observed (arrival to the first token relayed to the client);
this script reads those log lines and summarises the admitted, served requests per level:
n, MAPE, absolute error p50/p90/p99, relative error p90, bias (mean of projected - observed),
split into prompts inside and outside the profile's measured domain, and by prompt size in
the bands admission learns its projection error in (`narwhal.admission.error_band`), with
each band's p90 overrun (observed - projected, what admission adds) and p90 ratio
(observed / projected).

Times are model time (the simulator's clock at speed 1: wall x speed), in ms. Writes
runs/bench/accuracy.json and runs/bench/accuracy.png; logs, the generated configs and the
profile go to runs/tmp/accuracy/<timestamp>/ (git-ignored).

    .venv/bin/python tools/bench/accuracy.py --workload cached   # ~1 min

The cached workload (issue 33) measures the cached-prefill law itself, which pricing by
cached tokens rests on: one simulated vLLM engine with prefix caching on (and
``cached_tokens`` reported), profiled with narwhal-profile, then the prompts of the
`benchkit.sessions` workload (shared system prompts, multi-turn sessions whose every turn
extends the last) sent one at a time as one-token completions. Each prompt's observed
time is set against the profile's price with its cached prefix
(`narwhal.admission.cached_prefill_s` at the engine's ``cached_tokens``) and without it
(the curve at the whole prompt, what Narwhal priced before), by the share of the prompt
that was cached. Writes runs/bench/accuracy-cached.json. The router-side number (Narwhal's
projected TTFT against the observed, as the default workload measures it, on this
workload) waits for the router to price by the cached tokens it knows of.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Sequence
from functools import partial
from pathlib import Path

import attrs
import benchkit
import goodput
import httpx
import numpy as np
import trio
from benchkit import Json, attainment as gm, harness, sessions, workload as gw

from narwhal.admission import band_label, cached_prefill_s, error_band
from narwhal.config import load_config
from narwhal.probe import SweepPlan, profile_fleet
from narwhal.profiles import PrefillModel, ProfileStore, save_profiles
from narwhal.sim import SimTiming

OUT = benchkit.RUNS / "accuracy.json"
CACHED_OUT = benchkit.RUNS / "accuracy-cached.json"
ROUTED_OUT = benchkit.RUNS / "accuracy-routed.json"


# ------------------------------------------------------------------------- log analysis


@attrs.frozen
class Prediction:
    """One admitted, served request: its projection and what it got (wall seconds)."""

    arrival: float  # wall clock (epoch s): the log line's time minus the request's duration
    projected_s: float
    observed_s: float
    in_domain: bool | None
    prompt_tokens: int | None
    attempts: int
    prefill_s: float | None = None  # arrival to the prefill leg's answer
    wait_s: float | None = None  # the part of the projection that was load


def request_lines(lines: Iterable[str]) -> list[dict[str, Json]]:
    """The "request finished" entries of a Narwhal JSON log; other lines are skipped."""
    out = []
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("event") == "request":
            out.append(entry)
    return out


def predictions(entries: Iterable[dict[str, Json]]) -> list[Prediction]:
    """Requests with both a projection and an observed first token, by arrival."""
    out = []
    for e in entries:
        projected, observed = e.get("projected_ttft_s"), e.get("observed_ttft_s")
        if projected is None or observed is None:
            continue
        out.append(
            Prediction(
                arrival=float(e["ts"]) - float(e["duration_s"]),
                projected_s=float(projected),
                observed_s=float(observed),
                in_domain=e.get("projected_in_domain"),
                prompt_tokens=e.get("prompt_tokens"),
                attempts=int(e.get("attempts") or 1),
                prefill_s=e.get("prefill_s"),
                wait_s=e.get("projected_wait_s"),
            )
        )
    out.sort(key=lambda p: p.arrival)
    return out


def error_stats(projected: Sequence[float], observed: Sequence[float]) -> dict[str, Json]:
    """Accuracy of projections against observations (same unit in, ms out).

    MAPE = mean |projected - observed| / observed; the absolute error's p50/p90/p99; the
    p90 of the relative error |projected - observed| / observed; bias = mean signed error
    projected - observed (positive: the prediction was pessimistic); the p90 of the
    overrun observed - projected and of the ratio observed / projected (what admission
    would allow for as seconds added, and as a factor).
    """
    if not projected:
        return {"n": 0}
    p = np.asarray(projected, dtype=float)
    o = np.asarray(observed, dtype=float)
    signed = p - o
    absolute = np.abs(signed)
    relative = absolute / o
    a50, a90, a99 = np.percentile(absolute, [50, 90, 99]) * 1000
    return {
        "n": len(p),
        "mape": round(float(relative.mean()), 4),
        "abs_error_ms": {"p50": round(a50, 2), "p90": round(a90, 2), "p99": round(a99, 2)},
        "rel_error_p90": round(float(np.percentile(relative, 90)), 4),
        "bias_ms": round(float(signed.mean()) * 1000, 2),
        "bias_rel": round(float((signed / o).mean()), 4),
        "overrun_ms_p90": round(float(np.percentile(-signed, 90)) * 1000, 2),
        "ratio_p90": round(float(np.percentile(o / p, 90)), 3) if (p > 0).all() else None,
        "projected_ms": benchkit.summarize(list(p * 1000), digits=2),
        "observed_ms": benchkit.summarize(list(o * 1000), digits=2),
    }


def level_of(t: float, bounds: Sequence[tuple[str, float, float]]) -> str | None:
    for name, start, end in bounds:
        if start <= t < end:
            return name
    return None


def by_level(
    preds: Sequence[Prediction],
    bounds: Sequence[tuple[str, float, float]],
    *,
    t0_wall: float,
    speed: float,
) -> dict[str, list[Prediction]]:
    """Each prediction in the level its arrival fell in, in model time from `t0_wall`."""
    out: dict[str, list[Prediction]] = {name: [] for name, _, _ in bounds}
    for p in preds:
        level = level_of((p.arrival - t0_wall) * speed, bounds)
        if level is not None:
            out[level].append(p)
    return out


def summarize_level(preds: Sequence[Prediction], speed: float) -> dict[str, Json]:
    """Error statistics in model time, overall, first attempts only, and by domain."""

    def stats(sel: Sequence[Prediction]) -> dict[str, Json]:
        return error_stats(
            [p.projected_s * speed for p in sel], [p.observed_s * speed for p in sel]
        )

    def by_size(sel: Sequence[Prediction]) -> dict[str, Json]:
        bands: dict[int, list[Prediction]] = {}
        for p in sel:
            if p.prompt_tokens is not None:
                bands.setdefault(error_band(p.prompt_tokens), []).append(p)
        return {band_label(b): stats(bands[b]) for b in sorted(bands)}

    split = [p for p in preds if p.prefill_s is not None]
    idle = [p for p in preds if p.wait_s == 0]
    return {
        "all": stats(preds),
        "first_attempt": stats([p for p in preds if p.attempts == 1]),
        "in_domain": stats([p for p in preds if p.in_domain is True]),
        "out_of_domain": stats([p for p in preds if p.in_domain is False]),
        # Admission allows for the overrun of every recent request on a path with
        # backlog, and for that of requests of the same size on one without.
        "backlog": stats([p for p in preds if p.wait_s]),
        "no_backlog": stats(idle),
        "by_prompt_tokens": by_size(preds),
        "by_prompt_tokens_no_backlog": by_size(idle),
        # Where the observed time went: until the prefill leg answered (queueing in the
        # router and on the engine included), and after it (handoff, first decode step,
        # relay), which the projection prices as the handoff estimate plus one step.
        "observed_prefill_ms": benchkit.summarize(
            [p.prefill_s * speed * 1000 for p in split if p.prefill_s is not None], digits=2
        ),
        "observed_after_prefill_ms": benchkit.summarize(
            [(p.observed_s - p.prefill_s) * speed * 1000 for p in split if p.prefill_s is not None],
            digits=2,
        ),
    }


# ------------------------------------------------------------------- the cached workload


@attrs.frozen
class CachedSample:
    """One prompt of the cached workload: its tokens, the engine's cached_tokens, and
    its one-token completion's round trip (wall seconds)."""

    prompt_tokens: int
    cached_tokens: int
    observed_s: float


def cached_share_band(sample: CachedSample) -> str:
    return share_band(sample.prompt_tokens, sample.cached_tokens)


def law_accuracy(samples: Sequence[CachedSample], model: PrefillModel, speed: float) -> Json:
    """The cached-prefill law's error on `samples` (`error_stats`, model time), next to
    the error of pricing every prompt whole; overall, inside the profile's measured
    domain, and by the share of the prompt that was cached."""

    def stats(sel: Sequence[CachedSample]) -> dict[str, Json]:
        observed = [s.observed_s * speed for s in sel]
        return {
            "law": error_stats(
                [cached_prefill_s(model, s.prompt_tokens, s.cached_tokens) * speed for s in sel],
                observed,
            ),
            "uncached_price": error_stats(
                [model.prefill_s(s.prompt_tokens) * speed for s in sel], observed
            ),
        }

    bands: dict[str, list[CachedSample]] = {"none": [], "under_half": [], "half_or_more": []}
    for s in samples:
        bands[cached_share_band(s)].append(s)
    tokens = sum(s.prompt_tokens for s in samples)
    return {
        "n": len(samples),
        "cached_token_share": round(sum(s.cached_tokens for s in samples) / tokens, 4)
        if tokens
        else None,
        "all": stats(samples),
        "in_domain": stats([s for s in samples if model.in_domain(s.prompt_tokens)]),
        "by_cached_share": {name: stats(sel) for name, sel in bands.items()},
    }


async def profile_one(url: str, run_dir: Path) -> ProfileStore:
    """narwhal-profile's sweep on the one engine: the prefill curve this workload prices
    with (and the cached-prefill step's own record); decode and handoffs kept small."""
    config = load_config(
        {
            "engines": [{"id": "e0", "url": url, "model": harness.MODEL}],
            "profiles": {"path": str(run_dir / "profiles.json")},
        }
    )
    plan = SweepPlan(
        prefill_sizes=(16, 64, 256, 512, 1024, 2048, 4096, 6000, 7000),
        decode_active=(1,),
        decode_contexts=(256,),
        handoff_sizes=(256,),
        handoff_repeats=1,
        budget_s=600.0,
    )
    store = await profile_fleet(config, plan)
    save_profiles(store, config.profiles.path)
    return store


def session_workload(
    args: argparse.Namespace,
) -> tuple[sessions.SessionParams, list[sessions.SessionRequest]]:
    """The cached and routed workloads' prompts: the first --cached-requests of
    --sessions sessions on the conversation trace's lengths."""
    trace = gw.load_trace(args.traces, "conv")
    params = sessions.SessionParams(sessions=args.sessions, seed=args.seed)
    return params, sessions.build(trace, params)[: args.cached_requests]


def session_facts(params: sessions.SessionParams, requests: list[sessions.SessionRequest]) -> Json:
    return {
        **params.to_json(),
        "trace": "conv",
        "requests": len(requests),
        "shared_fraction": round(sessions.shared_fraction(requests), 4),
    }


async def measure_cached(args: argparse.Namespace, run_dir: Path) -> Json:
    params, requests = session_workload(args)
    speed = args.speed
    started = time.monotonic()
    async with harness.Procs(run_dir, args.niceness) as procs:
        groups = await harness.start_fleet(
            procs,
            engines=1,
            speed=speed,
            model=harness.MODEL,
            seed=args.seed,
            extra_args=["--enable-prefix-caching", "--enable-prompt-tokens-details"],
        )
        url = groups[0][0]
        profile = (await profile_one(url, run_dir)).engines["e0"]
        samples: list[CachedSample] = []
        async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:
            # One at a time, in arrival order: the law prices an idle engine's prefill,
            # and each turn's prefix is then the earlier turn the engine just cached.
            for r in requests:
                body = {"model": harness.MODEL, "prompt": r.prompt, "max_tokens": 1}
                sent = time.monotonic()
                answer = await client.post("/v1/completions", json=body)
                seconds = time.monotonic() - sent
                answer.raise_for_status()
                usage = answer.json()["usage"]
                details = usage.get("prompt_tokens_details") or {}
                samples.append(
                    CachedSample(
                        usage["prompt_tokens"], int(details.get("cached_tokens") or 0), seconds
                    )
                )
    cached = profile.cached
    return {
        "timings": {"total_s": round(time.monotonic() - started, 1)},
        "profile": {
            "prefill": attrs.asdict(profile.prefill),
            "cached": None if cached is None else attrs.asdict(cached),
        },
        "accuracy": law_accuracy(samples, profile.prefill, speed),
        # Every prompt, for other laws to be tried on: [tokens, cached, observed model ms].
        "samples": [
            [s.prompt_tokens, s.cached_tokens, round(s.observed_s * speed * 1000, 3)]
            for s in samples
        ],
        "workload": session_facts(params, requests),
    }


def share_band(prompt_tokens: int, cached_tokens: int) -> str:
    share = cached_tokens / prompt_tokens if prompt_tokens else 0.0
    if share == 0:
        return "none"
    return "under_half" if share < 0.5 else "half_or_more"


async def measure_routed(args: argparse.Namespace, run_dir: Path) -> Json:
    """The sessions workload through Narwhal on a profiled 1P1D pair whose engines cache
    prefixes, one streamed request at a time: the TTFT Narwhal projected for each (priced
    by the tokens it knew cached, `cached_tokens` on its log line) against the TTFT it
    then observed, by the share of the prompt priced as cached."""
    params, requests = session_workload(args)
    speed = args.speed
    started = time.monotonic()
    async with harness.Procs(run_dir, args.niceness) as procs:
        groups = await harness.start_fleet(
            procs,
            engines=2,
            speed=speed,
            model=harness.MODEL,
            seed=args.seed,
            extra_args=["--enable-prefix-caching"],
        )
        urls, roles = harness.assign_roles(groups, 1)
        extra = await goodput.profile_fleet(urls, roles, run_dir)
        extra["log"] = {"level": "info"}  # the per-request lines are the measurement
        config = harness.narwhal_config(
            urls,
            roles,
            port=harness.free_port(),
            speed=speed,
            admission="predictive",
            controller=False,
            ttft_slo_s=args.ttft_slo_s * 20,  # every prompt admitted: accuracy, not refusals
            tpot_slo_s=args.tpot_slo_s,
            socket_path=str(run_dir / "narwhal.sock"),
            extra=extra,
        )
        url = await harness.start_narwhal(procs, config, run_dir)
        async with httpx.AsyncClient(timeout=120.0) as client:
            for r in requests:
                body = {
                    "model": harness.MODEL,
                    "prompt": r.prompt,
                    "max_tokens": 2,
                    "stream": True,
                }
                async with client.stream("POST", f"{url}/v1/completions", json=body) as answer:
                    await answer.aread()
    entries = request_lines((run_dir / "narwhal.log").read_text().splitlines())
    served = projected_and_observed(entries)
    bands: dict[str, list[dict[str, Json]]] = {"none": [], "under_half": [], "half_or_more": []}
    for e in served:
        bands[share_band(int(e["prompt_tokens"]), int(e.get("cached_tokens") or 0))].append(e)
    return {
        "timings": {"total_s": round(time.monotonic() - started, 1)},
        "sent": len(requests),
        "served": len(served),
        "local_prefills": sum(1 for e in served if e.get("prefill_engine") is None),
        "accuracy": {
            **by_path(served, speed),
            "by_cached_share": {name: path_stats(sel, speed) for name, sel in bands.items()},
        },
        "workload": session_facts(params, requests),
    }


def projected_and_observed(entries: Iterable[dict[str, Json]]) -> list[dict[str, Json]]:
    """The request lines with both a projected and an observed TTFT."""
    return [
        e
        for e in entries
        if e.get("projected_ttft_s") is not None and e.get("observed_ttft_s") is not None
    ]


def path_stats(sel: Sequence[dict[str, Json]], speed: float) -> dict[str, Json]:
    """`error_stats` of request lines, in model time."""
    return error_stats(
        [float(e["projected_ttft_s"]) * speed for e in sel],
        [float(e["observed_ttft_s"]) * speed for e in sel],
    )


def by_path(served: Sequence[dict[str, Json]], speed: float) -> dict[str, Json]:
    """Projection accuracy of all requests, of those through a prefill engine ("pair"),
    and of those a decode engine prefilled itself ("local_prefill")."""
    return {
        "all": path_stats(served, speed),
        "pair": path_stats([e for e in served if e.get("prefill_engine") is not None], speed),
        "local_prefill": path_stats([e for e in served if e.get("prefill_engine") is None], speed),
    }


def request_log_summary(path: Path, speed: float) -> dict[str, Json]:
    """What a Narwhal request log (log level info) says of a run, every request line
    (warm-ups included): outcomes, projection
    accuracy by path (`by_path`) and the share of the served prompt tokens Narwhal
    priced as cached (`cached_tokens`) and the engines found cached
    (`engine_cached_tokens`, vLLM's --enable-prompt-tokens-details; over the lines that
    have it)."""
    entries = request_lines(path.read_text().splitlines())
    outcomes: dict[str, int] = {}
    for e in entries:
        outcome = str(e.get("outcome"))
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    ok = [e for e in entries if e.get("outcome") == "ok" and e.get("prompt_tokens")]

    def share(key: str) -> float | None:
        counted = [e for e in ok if e.get(key) is not None]
        prompt = sum(int(e["prompt_tokens"]) for e in counted)
        cached = sum(int(e[key]) for e in counted)
        return round(cached / prompt, 4) if prompt else None

    return {
        "outcomes": outcomes,
        "accuracy": by_path(projected_and_observed(entries), speed),
        "cached_share": {
            "narwhal": share("cached_tokens"),
            "engine": share("engine_cached_tokens"),
        },
    }


def routed_table(doc: Json) -> str:
    """The README table of the routed sessions workload: projected against observed."""
    acc = doc["result"]["accuracy"]
    lines = [
        "| requests | n | MAPE | rel err p90 | bias ms | observed TTFT p50 / p90 ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    rows = [("all", acc["all"]), ("through the pair", acc["pair"])]
    rows.append(("prefilled on the decode engine", acc["local_prefill"]))
    rows += [(f"priced cached: {name}", cell) for name, cell in acc["by_cached_share"].items()]
    for name, a in rows:
        if not a["n"]:
            lines.append(f"| {name} | 0 | | | | |")
            continue
        lines.append(
            f"| {name} | {a['n']} | {_pct(a['mape'])} | {_pct(a['rel_error_p90'])} "
            f"| {a['bias_ms']:+} | {a['observed_ms']['p50']} / {a['observed_ms']['p90']} |"
        )
    return "\n".join(lines)


def cached_table(doc: Json) -> str:
    """The README table of the cached workload: the law against pricing whole prompts."""
    acc = doc["result"]["accuracy"]
    lines = [
        "| prompts | n | law MAPE | law rel err p90 | law bias ms | whole-prompt MAPE "
        "| whole-prompt bias ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    rows = [("all", acc["all"])] + [
        (f"cached share: {name}", cell) for name, cell in acc["by_cached_share"].items()
    ]
    for name, cell in rows:
        law, whole = cell["law"], cell["uncached_price"]
        if not law["n"]:
            lines.append(f"| {name} | 0 | | | | | |")
            continue
        lines.append(
            f"| {name} | {law['n']} | {_pct(law['mape'])} | {_pct(law['rel_error_p90'])} "
            f"| {law['bias_ms']:+} | {_pct(whole['mape'])} | {whole['bias_ms']:+} |"
        )
    return "\n".join(lines)


def routed_config(args: argparse.Namespace) -> Json:
    return {
        **sessions_config(args),
        "engines": "1P1D",
        "sim": "--enable-prefix-caching",
        "narwhal": "predictive admission, cache defaults, slo.ttft_s 20x --ttft-slo-s",
        "sent": "one at a time, arrival order, max_tokens 2, streamed",
    }


def cached_config(args: argparse.Namespace) -> Json:
    return {
        **sessions_config(args),
        "engines": 1,
        "sim": "--enable-prefix-caching --enable-prompt-tokens-details",
        "sent": "one at a time, arrival order, max_tokens 1, non-streaming",
    }


def sessions_config(args: argparse.Namespace) -> Json:
    return {
        "speed": args.speed,
        "sessions": args.sessions,
        "cached_requests": args.cached_requests,
        "seed": args.seed,
        "niceness": args.niceness,
    }


# ------------------------------------------------------------------------------ the run


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", default="0.3,0.6,0.9", help="offered load, x capacity")
    p.add_argument("--level-s", type=float, default=15.0, help="model seconds per level")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--speed", type=float, default=0.25, help="simulator speed (slow motion)")
    p.add_argument("--sim-procs", type=int, default=1)
    p.add_argument("--mix", default="code:0.75,conv:0.25", help="trace shares, source:share")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--niceness", type=int, default=5)
    p.add_argument("--ttft-slo-s", type=float, default=0.5)
    p.add_argument("--tpot-slo-s", type=float, default=0.05)
    p.add_argument(
        "--traces",
        type=Path,
        default=benchkit.REPO.parent / "shared" / "traces" / "azure2023",
        help="directory of the Azure 2023 traces (default ../shared/traces/azure2023)",
    )
    p.add_argument(
        "--profiles",
        type=Path,
        help="reuse this profile store (measured on an identical fleet: same engines, speed)"
        " instead of profiling the fresh fleet",
    )
    p.add_argument(
        "--workload",
        choices=("trace", "cached", "routed"),
        default="trace",
        help="trace: Azure requests through Narwhal (default); cached: the cached-prefill "
        "law on the sessions workload, one caching engine; routed: the sessions workload "
        "through Narwhal on a caching 1P1D pair, projected against observed TTFT",
    )
    p.add_argument("--sessions", type=int, default=60, help="cached workload: sessions")
    p.add_argument("--cached-requests", type=int, default=300, help="cached workload: prompts sent")
    p.add_argument(
        "--out", type=Path, help=f"default {OUT} ({CACHED_OUT} when cached, {ROUTED_OUT} routed)"
    )
    p.add_argument("--replot", action="store_true", help="redraw the PNG from --out")
    return p.parse_args(argv)


def parse_mix(text: str) -> tuple[tuple[gw.Source, float], ...]:
    mix: list[tuple[gw.Source, float]] = []
    for part in text.split(","):
        name, _, share = part.partition(":")
        if name not in gw.TRACE_FILES:
            raise ValueError(f"--mix: unknown trace {name!r}; one of {sorted(gw.TRACE_FILES)}")
        mix.append((name, float(share)))
    return tuple(mix)


def level_name(load: float) -> str:
    return f"load_{load:g}"


async def measure(args: argparse.Namespace, run_dir: Path) -> Json:
    traces = goodput.load_traces(args.traces)
    slo = gw.Slo(args.ttft_slo_s, args.tpot_slo_s)
    mix = parse_mix(args.mix)
    loads = [float(x) for x in args.levels.split(",")]
    phases = [gw.Phase(level_name(x), args.level_s, x, mix) for x in loads]
    requests, capacities = gw.build(
        phases, traces, timing=SimTiming(), engines=args.engines, slo=slo, seed=args.seed
    )
    bounds = gw.phase_bounds(phases)
    prefill = capacities[0].best_prefill
    speed = args.speed
    if args.profiles is not None:
        goodput.use_profiles(args.profiles)
    timings: dict[str, float] = {}
    started = time.monotonic()
    async with harness.Procs(run_dir, args.niceness) as procs:
        groups = await harness.start_fleet(
            procs,
            engines=args.engines,
            sim_procs=args.sim_procs,
            speed=speed,
            model=harness.MODEL,
            seed=args.seed,
        )
        urls, roles = harness.assign_roles(groups, prefill)
        extra = await goodput.profile_fleet(urls, roles, run_dir)
        timings["profile_s"] = round(time.monotonic() - started, 1)
        extra["log"] = {"level": "info"}  # the per-request lines are the measurement
        config = harness.narwhal_config(
            urls,
            roles,
            port=harness.free_port(),
            speed=speed,
            admission="predictive",
            controller=False,
            ttft_slo_s=slo.ttft_s,
            tpot_slo_s=slo.tpot_s,
            socket_path=str(run_dir / "narwhal.sock"),
            extra=extra,
        )
        url = await harness.start_narwhal(procs, config, run_dir)
        warm = await harness.warm_up(url)
        if any(s != 200 for s in warm):
            raise RuntimeError(f"warm-up requests through {url} answered {warm}")
        sampler = harness.Sampler(urls, roles, harness.admin_url(config), speed, 2.0)
        run = await harness.replay(
            procs,
            url,
            [(r.t, r.prompt, r.output) for r in requests],
            speed=speed,
            duration_s=bounds[-1][2],
            run_dir=run_dir,
            sampler=sampler,
            ttft_timeout_s=15.0,
            total_timeout_s=90.0,
        )
    timings["total_s"] = round(time.monotonic() - started, 1)
    entries = request_lines((run_dir / "narwhal.log").read_text().splitlines())
    workload_entries = [
        e for e in entries if float(e["ts"]) - float(e["duration_s"]) >= run.launched
    ]
    preds = predictions(workload_entries)
    # The load generator's clock starts with its first request; Narwhal's arrivals are on
    # the wall clock. The earliest workload arrival anchors one to the other.
    first = min((float(e["ts"]) - float(e["duration_s"]) for e in workload_entries), default=0.0)
    t0_wall = first - requests[0].t / speed
    grouped = by_level(preds, bounds, t0_wall=t0_wall, speed=speed)
    samples = gm.samples_from([(r.t, r.phase, r.source) for r in requests], run.rows, speed)
    levels = []
    for (name, start, end), load, cap in zip(bounds, loads, capacities, strict=True):
        sel = [s for s in samples if s.phase == name]
        outcomes: dict[str, int] = {}
        for s in sel:
            outcomes[s.outcome] = outcomes.get(s.outcome, 0) + 1
        levels.append(
            {
                "level": name,
                "load": load,
                "offered_per_s": round(len(sel) / (end - start), 2),
                "capacity_per_s": cap.capacity,
                "offered": len(sel),
                "client_outcomes": outcomes,
                "client_ttft_ms": benchkit.summarize(
                    [s.ttft * 1000 for s in sel if s.outcome == "ok" and s.ttft is not None],
                    digits=1,
                ),
                "accuracy": summarize_level(grouped[name], speed),
                # The raw pairs for the plot, in model ms (bounded: a few thousand at most).
                "pairs_ms": [
                    [round(p.projected_s * speed * 1000, 2), round(p.observed_s * speed * 1000, 2)]
                    for p in grouped[name]
                ],
            }
        )
    return {
        "split": f"{prefill}P{args.engines - prefill}D",
        "timings": timings,
        "levels": levels,
        "unmatched_predictions": len(preds) - sum(len(v) for v in grouped.values()),
        "narwhal_request_lines": len(workload_entries),
        "faithfulness": {
            **harness.faithfulness(run, sampler),
            "loadgen_cpu_share": run.loadgen["cpu_share"],
        },
        "workload": {
            "traces": str(args.traces),
            "mix": [list(m) for m in mix],
            "requests": len(requests),
            "phase_bounds": bounds,
            "capacity_model": [attrs.asdict(c) for c in capacities],
        },
    }


def table(doc: Json) -> str:
    """The README table."""
    lines = [
        "| load | offered req/s | offered / refused / measured | MAPE | abs err p50 / p90 / p99 ms "
        "| rel err p90 | bias ms | MAPE in / out of domain (n out) | observed TTFT p50 / p90 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lv in doc["result"]["levels"]:
        acc = lv["accuracy"]
        a = acc["all"]
        counts = f"{lv['offered']} / {lv['client_outcomes'].get('refused', 0)} / {a['n']}"
        if not a["n"]:
            lines.append(f"| {lv['load']} | {lv['offered_per_s']} | {counts} | | | | | | |")
            continue
        err = a["abs_error_ms"]
        inside, outside = acc["in_domain"], acc["out_of_domain"]
        lines.append(
            f"| {lv['load']} | {lv['offered_per_s']} | {counts} | {_pct(a['mape'])} "
            f"| {err['p50']} / {err['p90']} / {err['p99']} | {_pct(a['rel_error_p90'])} "
            f"| {a['bias_ms']:+} | {_pct(inside.get('mape'))} / {_pct(outside.get('mape'))} "
            f"({outside['n']}) | {a['observed_ms']['p50']} / {a['observed_ms']['p90']} |"
        )
    return "\n".join([*lines, "", band_table(doc)])


def band_table(doc: Json) -> str:
    """MAPE by prompt size, per level: where the projection's error lies."""
    levels = doc["result"]["levels"]
    head = " | ".join(f"{lv['load']}: n / MAPE / overrun p90 ms / ratio p90" for lv in levels)
    lines = [f"| prompt tokens | {head} |", "|---:|" + "---:|" * len(levels)]
    labels = sorted(
        {b for lv in levels for b in lv["accuracy"].get("by_prompt_tokens", {})},
        key=lambda label: int(label.split("-")[0].rstrip("+")),
    )
    for label in labels:
        cells = []
        for lv in levels:
            a = lv["accuracy"].get("by_prompt_tokens", {}).get(label, {"n": 0})
            cells.append(
                f"{a['n']} / {_pct(a['mape'])} / {a['overrun_ms_p90']} / {a['ratio_p90']}"
                if a["n"]
                else "0"
            )
        lines.append(f"| {label} | {' | '.join(cells)} |")
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.1f} %"


def plot(doc: Json, path: Path) -> None:
    plt = benchkit.pyplot()
    levels = doc["result"]["levels"]
    fig, axes = plt.subplots(1, len(levels) + 1, figsize=(4.2 * (len(levels) + 1), 4.2))
    top = max(
        (max(max(pair) for pair in lv["pairs_ms"]) for lv in levels if lv["pairs_ms"]), default=1.0
    )
    for ax, lv in zip(axes, levels, strict=False):
        pairs = np.asarray(lv["pairs_ms"] or [[np.nan, np.nan]])
        ax.scatter(pairs[:, 0], pairs[:, 1], s=5, alpha=0.4)
        ax.plot([1, top], [1, top], color="k", linewidth=0.7)
        ax.set_xscale("log")
        ax.set_yscale("log")
        a = lv["accuracy"]["all"]
        mape = f"MAPE {a['mape'] * 100:.0f} %" if a["n"] else "no samples"
        ax.set_title(f"{lv['load']} x capacity: n={a['n']}, {mape}", fontsize=9)
        ax.set_xlabel("projected TTFT (ms, model time)")
        ax.set_ylabel("observed TTFT (ms)")
    cdf = axes[-1]
    for lv in levels:
        pairs = np.asarray(lv["pairs_ms"] or [[1.0, 1.0]])
        rel = np.sort(np.abs(pairs[:, 0] - pairs[:, 1]) / pairs[:, 1])
        cdf.plot(rel, np.arange(1, len(rel) + 1) / len(rel), label=f"{lv['load']} x C")
    cdf.set_xscale("symlog", linthresh=0.1)
    cdf.set_xlabel("|projected - observed| / observed")
    cdf.set_ylabel("fraction of served requests")
    cdf.set_title("relative error CDF", fontsize=9)
    cdf.legend(fontsize=8)
    fig.suptitle(
        f"Predictive admission: projected vs observed TTFT ({doc['result']['split']}, "
        f"sim speed {doc['config']['speed']})",
        fontsize=10,
    )
    benchkit.save_figure(fig, path)


def trace_config(args: argparse.Namespace) -> Json:
    return {
        "engines": args.engines,
        "speed": args.speed,
        "sim_procs": args.sim_procs,
        "levels": args.levels,
        "level_model_s": args.level_s,
        "mix": args.mix,
        "seed": args.seed,
        "niceness": args.niceness,
        "slo": {"ttft_s": args.ttft_slo_s, "tpot_s": args.tpot_slo_s},
        "admission": "predictive",
        "controller": False,
        "profile": str(args.profiles)
        if args.profiles is not None
        else "goodput.profile_fleet (narwhal-profile on this run's fleet)",
    }


_WORKLOADS = {
    "trace": ("accuracy", OUT),
    "cached": ("accuracy-cached", CACHED_OUT),
    "routed": ("accuracy-routed", ROUTED_OUT),
}


async def run(args: argparse.Namespace) -> int:
    cached = args.workload == "cached"
    routed = args.workload == "routed"
    name, default_out = _WORKLOADS[args.workload]
    run_dir = benchkit.TMP / name / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    measure_it = measure_cached if cached else measure_routed if routed else measure
    try:
        result = await measure_it(args, run_dir)
    except gw.TraceError as exc:
        print(f"accuracy: {exc}", file=sys.stderr)
        return 2
    doc = {
        "benchmark": name,
        "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": benchkit.machine(),
        "versions": benchkit.versions(["narwhal", "trio", "h11", "hypercorn", "httpx", "numpy"]),
        "git": benchkit.git_revision(),
        "load_average": benchkit.load_average(),
        "config": {
            **(
                cached_config(args)
                if cached
                else routed_config(args)
                if routed
                else trace_config(args)
            ),
            "logs": str(run_dir.relative_to(benchkit.REPO)),
            "units": "model time (wall x speed), ms",
        },
        "result": result,
    }
    if cached or routed:
        benchkit.publish(
            args.out or default_out, doc, table=routed_table if routed else cached_table
        )
    else:
        benchkit.publish(args.out or default_out, doc, plot=plot, table=table)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        _, default_out = _WORKLOADS[args.workload]
        if args.workload == "cached":
            return benchkit.show(args.out or default_out, table=cached_table)
        if args.workload == "routed":
            return benchkit.show(args.out or default_out, table=routed_table)
        return benchkit.show(args.out or default_out, replot=plot, table=table)
    if not args.traces.is_dir():
        print(f"accuracy: {args.traces} is not a directory; pass --traces DIR", file=sys.stderr)
        return 2
    return trio.run(harness.run_guarded, partial(run, args))


if __name__ == "__main__":
    sys.exit(main())
