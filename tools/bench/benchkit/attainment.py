"""SLO attainment and goodput over offered requests (pure; no I/O).

A request *passes* when it finished (outcome ``ok``), its TTFT is within the TTFT SLO and
its TPOT (mean gap after the first token) within the TPOT SLO. Attainment is passing /
OFFERED: refusals (429), errors, truncations and client timeouts count as misses, as do
violations (DistServe; the "drop to win" guard of controllers-and-traces.md §4.3).
Goodput is passing requests per second of the phase (model time). Admitted attainment
(passing / not refused) and TTFT-only attainment are reported beside it, for issue 5.

All times here are model seconds: wall-clock measurements are multiplied by the speed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from ._facts import Json
from ._stats import summarize

# Result row written by loadgen.py in replay mode.
INDEX, LATENESS, STATUS, OUTCOME, TTFT, TPOT, TOKENS, END = range(8)


@attrs.frozen
class Sample:
    """One offered request with its outcome, in model seconds."""

    t: float
    phase: str
    source: str
    outcome: str
    ttft: float | None
    tpot: float | None
    tokens: int

    @property
    def refused(self) -> bool:
        return self.outcome == "refused"


def samples_from(
    requests: Sequence[tuple[float, str, str]], rows: Iterable[Sequence[Any]], speed: float
) -> list[Sample]:
    """Join the workload ``(t, phase, source)`` with the load generator's rows.

    A request the load generator never reported (it should not happen) counts as a miss
    with outcome ``missing``.
    """
    by_index = {int(r[INDEX]): r for r in rows}
    out = []
    for i, (t, phase, source) in enumerate(requests):
        row = by_index.get(i)
        if row is None:
            out.append(Sample(t, phase, source, "missing", None, None, 0))
            continue
        ttft = None if row[TTFT] is None else float(row[TTFT]) * speed
        tpot = None if row[TPOT] is None else float(row[TPOT]) * speed
        out.append(Sample(t, phase, source, str(row[OUTCOME]), ttft, tpot, int(row[TOKENS])))
    return out


def passes(s: Sample, ttft_slo: float, tpot_slo: float) -> bool:
    if s.outcome != "ok" or s.ttft is None or s.ttft > ttft_slo:
        return False
    return s.tpot is None or s.tpot <= tpot_slo


def ttft_passes(s: Sample, ttft_slo: float) -> bool:
    return s.outcome == "ok" and s.ttft is not None and s.ttft <= ttft_slo


def _ratio(num: int, den: int) -> float | None:
    return round(num / den, 4) if den else None


def group_stats(
    samples: Sequence[Sample], duration_s: float, ttft_slo: float, tpot_slo: float
) -> Json:
    """Attainment, goodput and latency summaries of one group (a phase or the whole run)."""
    offered = len(samples)
    passing = sum(passes(s, ttft_slo, tpot_slo) for s in samples)
    refused = sum(s.refused for s in samples)
    admitted = offered - refused
    ttft_ok = sum(ttft_passes(s, ttft_slo) for s in samples)
    ttft_ok_admitted = sum(ttft_passes(s, ttft_slo) for s in samples if not s.refused)
    outcomes = Counter(s.outcome for s in samples)
    return {
        "offered": offered,
        "offered_per_s": round(offered / duration_s, 2) if duration_s > 0 else None,
        "passing": passing,
        "attainment": _ratio(passing, offered),
        "goodput_per_s": round(passing / duration_s, 2) if duration_s > 0 else None,
        "admitted": admitted,
        "refused": refused,
        "admitted_attainment": _ratio(passing, admitted),
        "ttft_attainment": _ratio(ttft_ok, offered),
        "admitted_ttft_attainment": _ratio(ttft_ok_admitted, admitted),
        "outcomes": dict(sorted(outcomes.items())),
        "ttft_ms": summarize(
            [s.ttft for s in samples if s.ttft is not None], scale=1000.0, digits=1, with_max=True
        ),
        "tpot_ms": summarize(
            [s.tpot for s in samples if s.tpot is not None], scale=1000.0, digits=2, with_max=True
        ),
    }


def phase_table(
    samples: Sequence[Sample],
    bounds: Sequence[tuple[str, float, float]],
    ttft_slo: float,
    tpot_slo: float,
) -> Json:
    """Per-phase stats (phases by the request's offered time) plus ``all``."""
    out: dict[str, Json] = {}
    for name, start, end in bounds:
        group = [s for s in samples if s.phase == name]
        out[name] = group_stats(group, end - start, ttft_slo, tpot_slo)
    total = bounds[-1][2] - bounds[0][1] if bounds else 0.0
    out["all"] = group_stats(samples, total, ttft_slo, tpot_slo)
    return out


def windows(
    samples: Sequence[Sample], total_s: float, window_s: float, ttft_slo: float, tpot_slo: float
) -> Json:
    """Attainment over time: per window of offered time, offered / passing / attainment."""
    n = max(1, math.ceil(total_s / window_s))
    offered = [0] * n
    passing = [0] * n
    for s in samples:
        k = min(n - 1, max(0, int(s.t // window_s)))
        offered[k] += 1
        passing[k] += passes(s, ttft_slo, tpot_slo)
    return {
        "window_s": window_s,
        "t": [round(k * window_s, 3) for k in range(n)],
        "offered": offered,
        "passing": passing,
        "attainment": [_ratio(p, o) for p, o in zip(passing, offered, strict=True)],
    }


def hindsight_best(results: dict[str, Json], names: Sequence[str], key: str = "all") -> str | None:
    """The configuration among `names` with the highest goodput on `key` (ties: attainment,
    then name)."""
    scored = [
        (r[key]["goodput_per_s"] or 0.0, r[key]["attainment"] or 0.0, n)
        for n in names
        if (r := results.get(n)) is not None and key in r
    ]
    if not scored:
        return None
    return max(scored, key=lambda x: (x[0], x[1], [-ord(c) for c in x[2]]))[2]
