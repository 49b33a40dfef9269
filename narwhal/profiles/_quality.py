"""How well a profile's fits match what was measured, and when to say so loudly.

Each phase's model carries two separate measures, as fractions:

* ``residual_p50``/``p90``/``max``: model error. For decode, each measured operating
  point's median token gap against the model's prediction, relative to the prediction;
  for prefill, each measured size's median time against the prediction, relative to the
  median. ``points`` is how many points (sizes) they are taken over, including any the
  fit left out as disturbed (`_fit.robust_lstsq`), so a disturbed measurement shows here;
  with ten points or fewer the p90 is the largest (`_fit.quantile` never interpolates
  below a sample), so one point decides it.
* ``spread_p50``/``p90``/``max``: the measurement's own scatter, whatever the model. For
  decode, |gap − point median| / point median over every gap (a client reading two
  token events in one go sees a near-zero gap: a spread of 1.0); for prefill, the same
  over every repeat of a size. A large spread says the engine (or the host measuring it)
  is jittery; it is not a fault of the fit, which uses the medians.

Stores written before the two were separated (``points`` absent, so 0) hold one
``residual_*`` per phase taken over every gap or repeat: spread and model error mixed,
typically a decode p90 of 30-80 % for a good fit. They load as before and are not judged.

`POOR_FIT_RESIDUAL_P90`: a fit whose model-error p90 is above it is reported by
narwhal-profile, narwhal-check and the daemon when it loads the store. 0.25 because at
that error a request projected at 80 % of its TTFT target (or a decode load of 0.8) can be
at the target (0.8 × 1.25 = 1.0), more than admission's and the role controller's margins
absorb; and it is well above what a good fit shows: on the simulator at speed 1, on a
busy two-core host, model error p50 is 1-3 % with a p90 of 3-4 % for prefill and 12-21 %
for decode (one disturbed point out of eight); held-out real-load accuracy is 4-9 %
(README, Benchmarks).
"""

from __future__ import annotations

from typing import Literal

import attrs

from ._models import DecodeModel, EngineProfile, PrefillModel

POOR_FIT_RESIDUAL_P90 = 0.25

Phase = Literal["prefill", "decode"]

_PREDICTS: dict[Phase, str] = {
    "prefill": "prefill time, which admission's TTFT projections and prefill load are made of",
    "decode": "token interval, which decode load, admission's decode side and the role "
    "controller's split projections are made of",
}


@attrs.frozen
class PoorFit:
    """One phase of one engine whose model-error p90 is above `POOR_FIT_RESIDUAL_P90`."""

    engine: str
    phase: Phase
    residual_p90: float
    residual_max: float
    points: int

    def message(self) -> str:
        return (
            f"engine {self.engine!r}: {self.phase} fit residual p90 "
            f"{100 * self.residual_p90:.1f}% (max {100 * self.residual_max:.1f}% over "
            f"{self.points} measured points) is above {100 * POOR_FIT_RESIDUAL_P90:.0f}%: the "
            f"model misses its own measurements by that much, so this engine's predicted "
            f"{_PREDICTS[self.phase]}, can be that far off (a projection at 80% of a target "
            f"can be a breach); re-run narwhal-profile on a quiet host"
        )


def poor_fits(profile: EngineProfile) -> list[PoorFit]:
    """The phases of `profile` whose fit is poor; none for a store that predates model
    error (``points`` 0)."""
    out: list[PoorFit] = []
    models: tuple[tuple[Phase, PrefillModel | DecodeModel], ...] = (
        ("prefill", profile.prefill),
        ("decode", profile.decode),
    )
    for phase, model in models:
        if model.points > 0 and model.residual_p90 > POOR_FIT_RESIDUAL_P90:
            out.append(
                PoorFit(
                    engine=profile.id,
                    phase=phase,
                    residual_p90=model.residual_p90,
                    residual_max=model.residual_max,
                    points=model.points,
                )
            )
    return out
