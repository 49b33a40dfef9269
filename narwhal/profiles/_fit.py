"""Least-squares fitting with non-negative coefficients, for the latency models.

Every coefficient of the latency laws is a physical cost (a fixed step cost, a cost per
token, per token squared, per resident KV token, per active request), so a negative
estimate is always noise: with a handful of points and 5 % step noise, an unconstrained
quadratic easily comes out with c < 0, which would predict shorter prefills for longer
prompts beyond the measured range. The fit is therefore non-negative least squares.

With at most three coefficients the exact NNLS solution is found by enumeration: the
optimum is the ordinary least-squares solution on its support (the set of coefficients
that are not pinned at zero), so solving every support and keeping the best feasible one
is exact and needs nothing beyond numpy.

`robust_lstsq` adds outlier rejection. On a busy host a whole measurement window can be
disturbed (another process holds the CPU for a few hundred ms; a simulator that falls
behind its timeline then runs its next steps short to catch up), so one operating
point's median can sit 20 % off while every other point is within a few percent. A point
that the other points predict worse than both 10 % and three times the median
leave-one-out error is dropped, one at a time, at most a quarter of the points, always
keeping more points than coefficients; sets of fewer than 2k+1 points (k coefficients)
are fitted as they are.

Rows are weighted by 1/observation: the router cares about relative error (an admission
decision on a 10 ms prefill is as sensitive to 10 % as one on a 300 ms prefill), and an
unweighted fit would spend all its freedom on the longest prompts.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

Matrix = npt.NDArray[np.float64]


_OUTLIER_MIN = 0.10
_OUTLIER_FACTOR = 3.0


class FitError(ValueError):
    """Not enough usable samples to fit a model."""


def nonnegative_lstsq(design: Matrix, observed: Matrix, *, relative: bool = True) -> Matrix:
    """Coefficients x >= 0 minimising ||W (design·x - observed)||², W = diag(1/observed)."""
    rows, cols = design.shape
    if rows < 1 or observed.shape != (rows,):
        raise FitError(f"need observations for {rows} rows, got shape {observed.shape}")
    if relative:
        if np.any(observed <= 0):
            raise FitError("relative weighting needs positive observations")
        weights = 1.0 / observed
    else:
        weights = np.ones(rows)
    a = design * weights[:, None]
    y = observed * weights
    best: Matrix | None = None
    best_cost = np.inf
    for size in range(cols, 0, -1):
        for support in itertools.combinations(range(cols), size):
            idx = list(support)
            solution, *_ = np.linalg.lstsq(a[:, idx], y, rcond=None)
            if np.any(solution < 0):
                continue
            x = np.zeros(cols)
            x[idx] = solution
            cost = float(np.sum((a @ x - y) ** 2))
            # Prefer the larger support on ties, so that an exact fit keeps every term.
            if best is None or cost < best_cost * (1.0 - 1e-12):
                best, best_cost = x, cost
    if best is None:
        # Only reachable if every column is useless; the all-zero model is then optimal.
        best = np.zeros(cols)
    return best


def robust_lstsq(design: Matrix, observed: Matrix) -> Matrix:
    """`nonnegative_lstsq` (relative) after dropping disturbed points.

    A disturbed point is judged by how badly the *other* points predict it (leave-one-out):
    an in-sample residual cannot see a point with leverage, since the fit bends to it (one
    bad 64-request point simply zeroes the per-request term).
    """
    rows, cols = design.shape
    keep = np.ones(rows, dtype=bool)
    if rows < 2 * cols + 1:
        # Too few points to tell a disturbed one from a real bend in the curve.
        return nonnegative_lstsq(design, observed)
    for _ in range(rows // 4):
        idx = np.flatnonzero(keep)
        if len(idx) <= cols + 1:
            break
        errors = np.empty(len(idx))
        for j, i in enumerate(idx):
            rest = idx[idx != i]
            coeffs = nonnegative_lstsq(design[rest], observed[rest])
            errors[j] = abs(float(design[i] @ coeffs) - observed[i]) / observed[i]
        worst = int(np.argmax(errors))
        if errors[worst] <= max(_OUTLIER_MIN, _OUTLIER_FACTOR * float(np.median(errors))):
            break
        keep[idx[worst]] = False
    return nonnegative_lstsq(design[keep], observed[keep])


def relative_residuals(predicted: Sequence[float], observed: Sequence[float]) -> Matrix:
    """|predicted - observed| / observed for every positive observation."""
    p = np.asarray(predicted, dtype=np.float64)
    o = np.asarray(observed, dtype=np.float64)
    keep = o > 0
    out: Matrix = np.abs(p[keep] - o[keep]) / o[keep]
    return out


def quantile(values: Sequence[float] | Matrix, q: float) -> float:
    """A conservative quantile: the smallest sample at or above the q-th position.

    With few samples a p99 is the maximum, never an interpolation below it.
    """
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        raise FitError("no samples")
    return float(np.quantile(arr, q, method="higher"))
