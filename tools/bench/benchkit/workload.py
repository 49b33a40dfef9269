"""The goodput benchmark's workload: Azure 2023 trace requests arranged in phases.

Pure functions (numpy, no I/O except `load_trace`). Times are *model* seconds, the
simulator's own clock at speed 1; the load generator divides them by the speed factor.

A workload is a list of `Phase` specs turned into `Request`s by `build`:

* every phase draws real requests (arrival gaps and lengths) from one or two traces,
  starting at a seeded random offset into each trace;
* its rate is a fraction of the fleet's capacity *for that phase's mix* (`capacity`);
* arrivals keep the trace's own burst structure: the trace clock is warped so that its
  mean rate follows the target rate curve (a constant, or a sinusoid), instead of being
  replaced by a Poisson process;
* lengths are clipped to the engine's context: ``max_tokens <= max_output`` and
  ``prompt + max_tokens < max_model_len``.

The capacity model (`split_capacity`, `best_split`) is the simulator's latency law
(`narwhal.sim.SimTiming`) in closed form; see `split_capacity` for the derivation.
"""

from __future__ import annotations

import csv
import datetime as dt
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import attrs
import numpy as np
import numpy.typing as npt

from narwhal.sim import SimTiming

Source = Literal["conv", "code"]
TRACE_FILES: dict[Source, str] = {
    "conv": "AzureLLMInferenceTrace_conv.csv",
    "code": "AzureLLMInferenceTrace_code.csv",
}
# Conversation prompts at least this long make the "long-prompt conv" part of a mix.
LONG_PROMPT = 2048
# Conversation answers at least this long make the "long-answer conv" part of a mix (a
# third of the conversation trace).
LONG_OUTPUT = 256

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


class TraceError(Exception):
    """The trace directory or a trace file is missing or unreadable."""


@attrs.frozen
class Trace:
    """One trace: arrival offsets (s from its first request) and token lengths."""

    name: str
    t: FloatArray
    prompt: IntArray
    output: IntArray

    @property
    def duration_s(self) -> float:
        return float(self.t[-1] - self.t[0]) if len(self.t) > 1 else 0.0

    @property
    def rate(self) -> float:
        return (len(self.t) - 1) / self.duration_s if self.duration_s > 0 else 0.0

    def subset(self, mask: npt.NDArray[np.bool_], name: str) -> Trace:
        t = self.t[mask]
        if len(t) < 2:
            raise TraceError(f"{self.name}: fewer than 2 requests qualify for {name!r}")
        return Trace(name, t - t[0], self.prompt[mask], self.output[mask])


def _parse_ts(text: str) -> float:
    day, _, clock = text.strip().partition(" ")
    h, m, s = clock.split(":")
    base = dt.datetime.fromisoformat(day).replace(tzinfo=dt.UTC).timestamp()
    return base + int(h) * 3600 + int(m) * 60 + float(s)


def load_trace(directory: Path, source: Source) -> Trace:
    """Read one Azure 2023 trace (TIMESTAMP, ContextTokens, GeneratedTokens)."""
    path = directory / TRACE_FILES[source]
    if not path.is_file():
        raise TraceError(
            f"trace file {path} not found; pass --traces DIR (the directory holding "
            f"{TRACE_FILES['conv']} and {TRACE_FILES['code']})"
        )
    ts: list[float] = []
    prompt: list[int] = []
    output: list[int] = []
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        try:
            for row in reader:
                ts.append(_parse_ts(row["TIMESTAMP"]))
                prompt.append(int(row["ContextTokens"]))
                output.append(int(row["GeneratedTokens"]))
        except (KeyError, ValueError) as exc:
            raise TraceError(f"{path}:{reader.line_num}: unreadable row ({exc})") from None
    if len(ts) < 2:
        raise TraceError(f"{path} has {len(ts)} rows; need at least 2")
    order = np.argsort(np.array(ts), kind="stable")
    t = np.array(ts)[order]
    return Trace(
        source,
        t - t[0],
        np.array(prompt, dtype=np.int64)[order],
        np.array(output, dtype=np.int64)[order],
    )


# ----------------------------------------------------------------------------- lengths


@attrs.frozen
class Limits:
    max_model_len: int = 8192
    # The longest output replayed. Azure conv tops out at 1000; code has a few up to 1899.
    # 1024 keeps every conv request whole and bounds the legitimate life of a request at
    # 1024 x TPOT SLO, which bounds the harness's drain time.
    max_output: int = 1024


def clip_lengths(prompt: IntArray, output: IntArray, limits: Limits) -> tuple[IntArray, IntArray]:
    out = np.clip(output, 1, limits.max_output)
    # The simulator (like vLLM) rejects prompt + max_tokens > max_model_len.
    inp = np.clip(prompt, 1, limits.max_model_len - 1 - out)
    return inp.astype(np.int64), out.astype(np.int64)


# ------------------------------------------------------------------------ capacity model


@attrs.frozen
class Slo:
    ttft_s: float = 0.5
    tpot_s: float = 0.05


@attrs.frozen
class PoolCapacity:
    prefill_per_engine: float  # requests/s one prefill engine completes at saturation
    decode_per_engine: float  # requests/s one decode engine completes at the batch below
    decode_batch: int
    decode_step_s: float


def prefill_work_s(timing: SimTiming, prompt: IntArray) -> FloatArray:
    """Engine-seconds of prefill per request when the engine is saturated.

    Chunked prefill packs ``chunk_tokens`` per step, so the step base cost is shared by
    the tokens of a full chunk: ``b·n + c·n² + base·n/chunk``.
    """
    n = prompt.astype(np.float64)
    return (
        timing.prefill_token_s * n
        + timing.prefill_quad_s * n * n
        + timing.step_base_s * n / timing.chunk_tokens
    )


def pool_capacity(
    timing: SimTiming,
    prompt: IntArray,
    output: IntArray,
    slo: Slo,
    *,
    tpot_headroom: float = 0.8,
    kv_headroom: float = 0.9,
) -> PoolCapacity:
    """Per-engine saturation throughput of each phase for one mix of requests.

    Decode: B resident requests with mean context ``prompt + output/2`` make a step of
    ``t0 + α·B·ctx + β·B`` (the law) producing B tokens, so a decode engine completes
    ``B / (E[output]·step)`` requests/s (Little). B is the largest batch that keeps the
    step within ``tpot_headroom`` x the TPOT SLO, ``max_num_seqs`` and ``kv_headroom`` of
    the KV capacity (a request holds up to prompt + output tokens).
    Prefill: ``1 / E[prefill_work_s]``.
    """
    ctx = float(np.mean(prompt + output / 2.0))
    peak = float(np.mean(prompt + output))
    mean_out = float(np.mean(output))
    batch = 0
    step = timing.decode_step_s(0, 1)
    for b in range(1, timing.max_num_seqs + 1):
        s = timing.decode_step_s(round(b * ctx), b)
        if s > tpot_headroom * slo.tpot_s or b * peak > kv_headroom * timing.kv_capacity_tokens:
            break
        batch, step = b, s
    batch = max(batch, 1)
    return PoolCapacity(
        prefill_per_engine=1.0 / float(np.mean(prefill_work_s(timing, prompt))),
        decode_per_engine=batch / (mean_out * step),
        decode_batch=batch,
        decode_step_s=step,
    )


def split_capacity(cap: PoolCapacity, prefill: int, decode: int) -> float:
    """Requests/s a disaggregated split sustains: the slower pool sets it."""
    return min(prefill * cap.prefill_per_engine, decode * cap.decode_per_engine)


def best_split(cap: PoolCapacity, engines: int) -> tuple[int, float]:
    """(prefill engines, capacity) of the best static split for this mix."""
    best = max(range(1, engines), key=lambda p: (split_capacity(cap, p, engines - p), -p))
    return best, split_capacity(cap, best, engines - best)


# ------------------------------------------------------------------------------ phases


@attrs.frozen
class Phase:
    """One phase of the workload.

    ``mix`` gives each source's share of requests at the phase's start and ``mix_end`` at
    its end (linear drift between them; None: constant). ``load`` is the mean offered rate
    as a fraction of the best static split's capacity for the current mix; with
    ``swing`` > 0 the rate follows ``load·(1 + swing·sin(2πt/period_s))``.
    ``long_conv`` replaces the conv part by conv requests with prompts >= LONG_PROMPT,
    ``long_output`` by conv requests with answers >= LONG_OUTPUT.
    """

    name: str
    duration_s: float
    load: float
    mix: tuple[tuple[Source, float], ...]
    mix_end: tuple[tuple[Source, float], ...] | None = None
    swing: float = 0.0
    period_s: float = 60.0
    long_conv: bool = False
    long_output: bool = False

    def share(self, source: Source, frac: float) -> float:
        start = dict(self.mix).get(source, 0.0)
        if self.mix_end is None:
            return start
        return start + (dict(self.mix_end).get(source, 0.0) - start) * frac


@attrs.frozen
class Request:
    t: float  # model seconds from the workload's start
    phase: str
    source: str
    prompt: int
    output: int


def standard_phases(*, scale: float = 1.0, overload: float = 1.75) -> list[Phase]:
    """The benchmark's phases (controllers-and-traces.md §4.4, adapted to the Azure traces).

    decode_heavy  long-answer conv alone (answers >= LONG_OUTPUT; in/out ~2.5) at 0.7 C
    prefill_heavy code 75 % + long-prompt conv 25 % at 0.5 C
    overload      the prefill-heavy mix at `overload` x C
    drift         conv -> code linearly, rate 0.5 C x (1 ± 0.4 sin)
    stationary    code alone at 0.5 C: the drift's end point held still, so a controller
                  that has converged must not move (the no-harm control).

    C is the best static split's saturation capacity for the mix (`pool_capacity`). The
    code trace's bursts (its per-second prefill demand reaches 4x its mean at the replay's
    time compression) put code-heavy phases past the TTFT SLO well below saturation, so
    they run at 0.5 C; conversation is smooth enough for 0.7 C.

    Durations are model seconds x `scale` (the full workload is 23 min; --quick is 0.05).
    """
    long_mix: tuple[tuple[Source, float], ...] = (("code", 0.75), ("conv", 0.25))
    return [
        Phase("decode_heavy", 300.0 * scale, 0.7, (("conv", 1.0),), long_output=True),
        Phase("prefill_heavy", 300.0 * scale, 0.5, long_mix, long_conv=True),
        Phase("overload", 120.0 * scale, overload, long_mix, long_conv=True),
        Phase(
            "drift",
            360.0 * scale,
            0.5,
            (("conv", 1.0), ("code", 0.0)),
            mix_end=(("conv", 0.0), ("code", 1.0)),
            swing=0.4,
            period_s=120.0 * scale,
        ),
        Phase("stationary", 300.0 * scale, 0.5, (("code", 1.0),)),
    ]


def overload_phases(*, scale: float = 1.0, load: float = 2.0) -> list[Phase]:
    """Issue 5's overload benchmark: a warm-up at 0.5 C, then `load` x C (model s x scale)."""
    long_mix: tuple[tuple[Source, float], ...] = (("code", 0.75), ("conv", 0.25))
    return [
        Phase("warmup", 60.0 * scale, 0.5, long_mix, long_conv=True),
        Phase("overload", 300.0 * scale, load, long_mix, long_conv=True),
    ]


@attrs.frozen
class MixCapacity:
    """The capacity model's answer for one phase (at its start and end mix)."""

    phase: str
    best_prefill: int
    capacity: float  # requests/s of the best split, at the phase's start mix
    capacity_end: float
    prefill_per_engine: float
    decode_per_engine: float
    decode_batch: int


def _source_arrays(
    traces: dict[Source, Trace], source: Source, phase: Phase, limits: Limits
) -> Trace:
    trace = traces[source]
    if source == "conv" and phase.long_conv:
        trace = trace.subset(trace.prompt >= LONG_PROMPT, "conv_long")
    if source == "conv" and phase.long_output:
        trace = trace.subset(trace.output >= LONG_OUTPUT, "conv_long_output")
    inp, out = clip_lengths(trace.prompt, trace.output, limits)
    return Trace(trace.name, trace.t, inp, out)


def _mix_capacity(
    parts: Sequence[tuple[Trace, float]], timing: SimTiming, slo: Slo, engines: int
) -> tuple[int, float, PoolCapacity]:
    """Best split of a weighted mix, from the whole traces' length distributions."""
    prompts: list[IntArray] = []
    outputs: list[IntArray] = []
    # A weighted sample: each source contributes in proportion to its share.
    total = 4000
    for trace, weight in parts:
        k = round(total * weight)
        if k <= 0:
            continue
        idx = np.linspace(0, len(trace.prompt) - 1, k).astype(np.int64)
        prompts.append(trace.prompt[idx])
        outputs.append(trace.output[idx])
    cap = pool_capacity(timing, np.concatenate(prompts), np.concatenate(outputs), slo)
    p, c = best_split(cap, engines)
    return p, c, cap


def _warp(trace_t: FloatArray, trace_rate: float, rate: FloatArray, dt_s: float) -> FloatArray:
    """Map trace arrival offsets to workload time so the mean rate follows `rate`.

    The trace's own clock runs at ``rate(t)/trace_rate`` of ours: cumulative trace time
    ``T(t) = ∫ rate/trace_rate``; an arrival at trace offset τ lands at ``T⁻¹(τ)``.
    """
    cum = np.concatenate(([0.0], np.cumsum(rate) * dt_s / trace_rate))
    grid = np.arange(len(cum)) * dt_s
    keep = trace_t <= cum[-1]
    out: FloatArray = np.interp(trace_t[keep], cum, grid)
    return out


def build(
    phases: Sequence[Phase],
    traces: dict[Source, Trace],
    *,
    timing: SimTiming,
    engines: int = 8,
    slo: Slo | None = None,
    limits: Limits | None = None,
    seed: int = 0,
    streams: int = 1,
) -> tuple[list[Request], list[MixCapacity]]:
    """The requests of a whole workload (sorted by time) and each phase's capacity.

    `streams` independent runs of each trace are superposed (1: one run, time-compressed
    by the whole factor, which keeps the trace's burst shape at the compressed scale).
    """
    if streams < 1:
        raise ValueError(f"streams is {streams}; must be >= 1")
    slo = slo or Slo()
    limits = limits or Limits()
    rng = np.random.default_rng(seed)
    requests: list[Request] = []
    capacities: list[MixCapacity] = []
    start = 0.0
    dt_s = 0.01
    for phase in phases:
        sources = sorted({s for s, _ in phase.mix} | {s for s, _ in (phase.mix_end or ())})
        arrays = {s: _source_arrays(traces, s, phase, limits) for s in sources}
        grid = np.arange(0.0, phase.duration_s, dt_s)
        frac = grid / phase.duration_s
        # Capacity along the phase: the mix moves linearly, so sample it at 11 points.
        points = np.linspace(0.0, 1.0, 11 if phase.mix_end is not None else 1)
        caps = []
        first: tuple[int, float, PoolCapacity] | None = None
        for f in points:
            parts = [(arrays[s], phase.share(s, float(f))) for s in sources]
            best = _mix_capacity(parts, timing, slo, engines)
            first = first or best
            caps.append(best[1])
        assert first is not None
        cap_t = np.interp(frac, points, np.array(caps)) if len(caps) > 1 else caps[0]
        rate = phase.load * cap_t * np.ones_like(grid)
        if phase.swing:
            rate = rate * (1.0 + phase.swing * np.sin(2 * math.pi * grid / phase.period_s))
        for source in sources:
            share = np.array([phase.share(source, float(f)) for f in frac])
            if not share.any():
                continue
            trace = arrays[source]
            # The phase's request count for this source, as `streams` runs of consecutive
            # trace requests, each from its own seeded start: a fleet this much bigger than
            # the one traced serves many such streams at once. Each run's own clock is
            # stretched so its mean rate matches its share of the target, which keeps its
            # bursts and lulls in place.
            total = round(float(np.sum(rate * share) * dt_s))
            counts = [total // streams + (1 if i < total % streams else 0) for i in range(streams)]
            for count in counts:
                if count < 1:
                    continue
                if count + 1 >= len(trace.t):
                    trace = tile(trace, math.ceil((count + 2) / len(trace.t)) + 1)
                lo = int(rng.integers(0, len(trace.t) - count - 1))
                window = trace.t[lo : lo + count + 1] - trace.t[lo]
                span = float(window[-1])
                local_rate = count / span if span > 0 else float(count)
                at = _warp(window[:count], local_rate, rate * share * count / total, dt_s)
                requests.extend(
                    Request(
                        t=round(start + float(a), 6),
                        phase=phase.name,
                        source=trace.name,
                        prompt=int(trace.prompt[lo + k]),
                        output=int(trace.output[lo + k]),
                    )
                    for k, a in enumerate(at)
                    if float(a) < phase.duration_s
                )
        _, c0, pc = first
        capacities.append(
            MixCapacity(
                phase=phase.name,
                best_prefill=first[0],
                capacity=round(c0, 2),
                capacity_end=round(caps[-1], 2),
                prefill_per_engine=round(pc.prefill_per_engine, 2),
                decode_per_engine=round(pc.decode_per_engine, 2),
                decode_batch=pc.decode_batch,
            )
        )
        start += phase.duration_s
    requests.sort(key=lambda r: (r.t, r.phase, r.source))
    return requests, capacities


def tile(trace: Trace, copies: int) -> Trace:
    """The trace replayed `copies` times back to back (one mean gap between copies)."""
    period = trace.duration_s + 1.0 / trace.rate
    t = np.concatenate([trace.t + k * period for k in range(copies)])
    return Trace(trace.name, t, np.tile(trace.prompt, copies), np.tile(trace.output, copies))


def phase_bounds(phases: Sequence[Phase]) -> list[tuple[str, float, float]]:
    out = []
    start = 0.0
    for p in phases:
        out.append((p.name, start, start + p.duration_s))
        start += p.duration_s
    return out
