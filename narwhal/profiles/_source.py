"""The loaded profiles as the router prices with them.

`FleetProfiles` wraps a `ProfileCheck` (only usable profiles are ever returned) plus the
live decode corrections. Its members match, structurally, what predictive admission
(`prefill_curve`, `decode_curve`, `handoff_s`, `decode_correction`,
`kv_capacity_tokens`) and the role controller (`profile`, `mean_profile`) read, so
neither needs to import this package.
No trio and no I/O; the corrections are replaced, never mutated, on each update.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from ._models import DecodeModel, EngineProfile, PrefillModel, Quantile
from ._pricing import DecodeCorrection
from ._quality import PoorFit, poor_fits
from ._store import ProfileCheck


class FleetProfiles:
    def __init__(
        self,
        check: ProfileCheck,
        *,
        correction: DecodeCorrection | None = None,
        quantile: Quantile = "p50",
    ) -> None:
        self.check = check
        self.quantile: Quantile = quantile
        self._template = correction or DecodeCorrection()
        self._corrections: dict[str, DecodeCorrection] = {}

    def __repr__(self) -> str:
        return (
            f"<FleetProfiles {len(self.check.usable)}/{len(self.check.configured)} usable, "
            f"{len(self.check.messages)} problem(s)>"
        )

    # -- per engine ------------------------------------------------------------------------
    def profile(self, engine_id: str) -> EngineProfile | None:
        return self.check.profile(engine_id)

    def mean_profile(self) -> EngineProfile | None:
        return self.check.mean_profile()

    def prefill_curve(self, engine_id: str) -> PrefillModel | None:
        profile = self.check.profile(engine_id)
        return profile.prefill if profile is not None else None

    def decode_curve(self, engine_id: str) -> DecodeModel | None:
        profile = self.check.profile(engine_id)
        return profile.decode if profile is not None else None

    def chars_per_token(self, dialect: str) -> float | None:
        """Characters per token the sweep measured on engines of this dialect, if any."""
        store = self.check.store
        return None if store is None else store.chars_per_token.get(dialect)

    def kv_capacity_tokens(self, engine_id: str) -> int | None:
        """The engine's KV cache in tokens, as its profile read it; None if unknown."""
        profile = self.check.profile(engine_id)
        return profile.kv_capacity_tokens or None if profile is not None else None

    # -- handoff ---------------------------------------------------------------------------
    def handoff_s(self, prompt_tokens: int) -> float:
        """The fleet's crossed-handoff estimate for a prompt: the mean, over every pair of
        usable engines, of the pair's `quantile` (pricing happens before the decode engine
        is chosen). 0 when no pair was measured."""
        store = self.check.store
        if store is None:
            return 0.0
        usable = self.check.usable
        values = [
            handoff.quantile_s(prompt_tokens, self.quantile)
            for (p, d), handoff in store.handoffs.items()
            if p in usable and d in usable
        ]
        return sum(values) / len(values) if values else 0.0

    # -- live decode correction (docs/design.md#pool-load, #reactive-parameters) ---------
    def decode_correction(self, engine_id: str) -> float:
        return self.correction(engine_id).value

    def correction(self, engine_id: str) -> DecodeCorrection:
        return self._corrections.get(engine_id, self._template)

    def poor_fits(self) -> list[PoorFit]:
        """The usable profiles' fits that miss their own measurements (`_quality`), by
        engine id: used all the same, and reported."""
        return [
            fit
            for engine_id in sorted(self.check.usable)
            if (profile := self.profile(engine_id)) is not None
            for fit in poor_fits(profile)
        ]

    def carry_corrections(self, previous: FleetProfiles, engine_ids: Iterable[str]) -> list[str]:
        """Keep what `previous` learnt of these engines' decode speed (a reload of the
        same engines), where the decode model it corrects is unchanged; within this
        source's bounds, which a reload may have moved. Returns the engines carried."""
        carried = []
        for engine_id in engine_ids:
            learnt = previous._corrections.get(engine_id)
            model = self.decode_curve(engine_id)
            if learnt is None or model is None or model != previous.decode_curve(engine_id):
                continue
            self._corrections[engine_id] = attrs.evolve(
                self._template, value=learnt.value, windows=learnt.windows
            )
            carried.append(engine_id)
        return carried

    def forget(self, engine_ids: Iterable[str]) -> None:
        """These engines were replaced (same id, another engine): their profiles and
        corrections describe the engine that was there before."""
        gone = frozenset(engine_ids)
        for engine_id in gone:
            self._corrections.pop(engine_id, None)
        if gone & self.check.usable:
            self.check = attrs.evolve(self.check, usable=self.check.usable - gone)

    def observe_decode(
        self, engine_id: str, median_s: float, samples: int, predicted_s: float
    ) -> DecodeCorrection:
        """Apply one observation window of the engine's decode gaps, summarised: the
        median of its `samples` usable gaps, all predicted at `predicted_s`
        (`DecodeCorrection.update_median`)."""
        updated = self.correction(engine_id).update_median(median_s, samples, predicted_s)
        self._corrections[engine_id] = updated
        return updated

    def corrected_idle_floor_s(self, engine_id: str) -> float | None:
        decode = self.decode_curve(engine_id)
        if decode is None:
            return None
        return decode.idle_floor_s * self.decode_correction(engine_id)
