"""Summary statistics of raw samples: what a result keeps instead of the samples.

Owns: percentiles (numpy's linear interpolation everywhere), the median over
repetitions, rounding that passes None through.
Invariants: no function keeps or returns the raw samples; an empty input gives None
values (or `{"n": 0}` for the `with_max` shape), never an exception.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np

from ._facts import Json


def summarize(
    samples: Sequence[float], *, digits: int = 3, scale: float = 1.0, with_max: bool = False
) -> dict[str, Json]:
    """n, p50, p90, p99 and mean of raw samples (times `scale`, rounded to `digits`).

    `with_max` adds the maximum and, for no samples, gives `{"n": 0}` instead of None
    values: the shape of the trace benchmarks' latency summaries.
    """
    if not samples:
        if with_max:
            return {"n": 0}
        return {"n": 0, "p50": None, "p90": None, "p99": None, "mean": None}
    values = np.asarray(samples, dtype=np.float64) * scale
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    out: dict[str, Json] = {
        "n": len(values),
        "p50": round(float(p50), digits),
        "p90": round(float(p90), digits),
        "p99": round(float(p99), digits),
        "mean": round(float(values.mean()), digits),
    }
    if with_max:
        out["max"] = round(float(values.max()), digits)
    return out


def median(values: Sequence[float | None]) -> float | None:
    """Median of the repetitions that produced a value; None when none did."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return float(np.median(present))


def mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)
