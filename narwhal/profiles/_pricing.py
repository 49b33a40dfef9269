"""Pure pricing helpers on top of the profiles: projected TTFT and decode correction.

Backlog is given in seconds, not tokens: prefill cost is quadratic per request, so the
cost of a queue depends on how its tokens are split between requests. The caller prices
its queue with `backlog_s` (sum of per-request predictions) or its own bookkeeping.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

import attrs

from ..config import Reactive
from ._models import DecodeModel, EngineProfile, HandoffProfile, Quantile


@attrs.frozen
class Projection:
    """A projected time and whether every input was inside its measured domain."""

    seconds: float
    in_domain: bool
    prefill_s: float = 0.0
    backlog_s: float = 0.0
    handoff_s: float = 0.0


def backlog_s(profile: EngineProfile, queued_prompt_tokens: Iterable[int]) -> float:
    """Predicted prefill work of the requests ahead, one prediction per request."""
    return sum(profile.prefill.prefill_s(n) for n in queued_prompt_tokens)


def projected_ttft_s(
    profile: EngineProfile,
    *,
    prompt_tokens: int,
    backlog_s: float = 0.0,
    handoff: HandoffProfile | None = None,
    quantile: Quantile = "p50",
) -> Projection:
    """TTFT of a prefill path: backlog ahead + this prefill + the crossed handoff.

    ``handoff`` None prices an aggregate path (the prefill engine decodes too; its first
    token comes with the prefill). ``quantile`` picks the handoff's p50 or p99; the prefill
    term is always the fitted expectation (its residual spread is on the model).
    ``in_domain`` is false when the prompt is outside the measured prefill domain or, with
    a handoff, outside that pair's measured context range.
    """
    backlog = backlog_s if math.isfinite(backlog_s) and backlog_s > 0 else 0.0
    prefill = profile.prefill.prefill_s(prompt_tokens)
    in_domain = profile.prefill.in_domain(prompt_tokens)
    transfer = 0.0
    if handoff is not None:
        transfer = handoff.quantile_s(prompt_tokens, quantile)
        in_domain = in_domain and handoff.in_domain(prompt_tokens)
    return Projection(
        seconds=backlog + prefill + transfer,
        in_domain=in_domain,
        prefill_s=prefill,
        backlog_s=backlog,
        handoff_s=transfer,
    )


def projected_interval_s(
    decode: DecodeModel, *, active: int, kv_tokens: int, correction: float = 1.0
) -> Projection:
    """Decode token interval at (active, kv_tokens), scaled by the live correction."""
    seconds = decode.interval_s(active, kv_tokens) * correction
    return Projection(seconds=seconds, in_domain=decode.in_domain(active, kv_tokens))


def _check_bounds(inst: DecodeCorrection, attr: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{attr.name} is {value!r}; must be finite and > 0")


@attrs.frozen(kw_only=True)
class DecodeCorrection:
    """The bounded live/profile decode correction (docs/design.md#pool-load, #reactive-parameters).

    A pure value: `update` returns the next state. Rules, applied in order:

    1. A window's usable samples are the observed decode gaps that are finite and positive
       and whose predicted interval is finite and positive.
    2. A window with fewer than ``min_samples`` usable gaps leaves the correction unchanged.
    3. The window's ratio is the median of observed/predicted over its usable gaps (the
       median, so one stall does not swing the correction).
    4. ``alpha`` of that ratio is applied: ``value ← (1 − alpha)·value + alpha·ratio``.
    5. The result is clamped to ``[min_value, max_value]``.
    """

    value: float = 1.0
    min_value: float = attrs.field(default=0.5, validator=_check_bounds)
    max_value: float = attrs.field(default=2.0, validator=_check_bounds)
    alpha: float = 0.2
    min_samples: int = 8
    windows: int = 0

    def __attrs_post_init__(self) -> None:
        if self.max_value < self.min_value:
            raise ValueError(
                f"max_value is {self.max_value}; must be >= min_value={self.min_value}"
            )
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha is {self.alpha!r}; must be in (0, 1]")
        if self.min_samples < 1:
            raise ValueError(f"min_samples is {self.min_samples!r}; must be >= 1")
        clamped = min(self.max_value, max(self.min_value, self.value))
        if clamped != self.value:
            object.__setattr__(self, "value", clamped)

    @classmethod
    def from_config(cls, reactive: Reactive) -> DecodeCorrection:
        return cls(
            min_value=reactive.decode_correction_min,
            max_value=reactive.decode_correction_max,
            alpha=reactive.decode_correction_alpha,
            min_samples=reactive.decode_correction_min_samples,
        )

    def update(
        self, gaps: Sequence[float], predicted_s: float | Sequence[float]
    ) -> DecodeCorrection:
        """The correction after one observation window of decode gaps.

        ``predicted_s`` is the profile's interval for the window (one number) or for each
        gap (the batch can change within a window).
        """
        if isinstance(predicted_s, int | float):
            predictions: Sequence[float] = [float(predicted_s)] * len(gaps)
        else:
            predictions = predicted_s
            if len(predictions) != len(gaps):
                raise ValueError(
                    f"{len(gaps)} gaps but {len(predictions)} predictions; give one per gap"
                )
        ratios = [
            g / p
            for g, p in zip(gaps, predictions, strict=True)
            if math.isfinite(g) and g > 0 and math.isfinite(p) and p > 0
        ]
        if len(ratios) < self.min_samples:
            return self
        return self._blended(statistics.median(ratios))

    def update_median(self, median_s: float, samples: int, predicted_s: float) -> DecodeCorrection:
        """`update` for a window summarised beforehand, with one prediction for all of
        it: `samples` usable gaps (rule 1: finite and positive) whose median is
        `median_s`. Dividing by one positive number keeps the gaps' order, so the median
        of their ratios to it (rule 3) is their median over it (for an even count, to
        the last bit of rounding)."""
        if not (math.isfinite(predicted_s) and predicted_s > 0) or samples < self.min_samples:
            return self
        return self._blended(median_s / predicted_s)

    def _blended(self, ratio: float) -> DecodeCorrection:
        blended = (1.0 - self.alpha) * self.value + self.alpha * ratio
        return attrs.evolve(self, value=blended, windows=self.windows + 1)

    def idle_floor_s(self, decode: DecodeModel) -> float:
        """The corrected idle floor: the profile's zero-contention interval × correction."""
        return corrected_idle_floor_s(decode, self)


def corrected_idle_floor_s(decode: DecodeModel, correction: DecodeCorrection) -> float:
    return decode.idle_floor_s * correction.value


def decode_load(observed_interval_s: float, corrected_floor_s: float, tpot_s: float) -> float:
    """Decode load (docs/design.md#pool-load): the interval above the corrected floor over the TPOT
    budget left by the floor, at least 0; the raw interval/target ratio when the floor
    itself reaches the target."""
    if tpot_s <= 0:
        raise ValueError(f"tpot_s is {tpot_s!r}; must be > 0")
    if corrected_floor_s >= tpot_s:
        return max(0.0, observed_interval_s / tpot_s)
    return max(0.0, (observed_interval_s - corrected_floor_s) / (tpot_s - corrected_floor_s))
