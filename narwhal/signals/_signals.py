"""The signals the request path sends to the engines' judges, and their vocabulary.

Owns
  `DecodeGaps` (one streamed decode leg's token intervals, summarised), the
  `LegObserver` protocol (told every engine leg's outcome; recovery implements it) and
  the `RouterLag` protocol (whether the router's own event loop explains a deadline;
  serving's `LoopLag` implements it).

Invariants
  Records are frozen. Protocol methods are called on the request path: implementations
  are quick and never block.

See
  serving's request path (the sender), recovery (the leg observer), the role controller
  (`ServingSignals`).
"""

from __future__ import annotations

from typing import Protocol

import attrs

from .._errors import EngineFailed
from ..fleet import EngineState


@attrs.frozen
class DecodeGaps:
    """A streamed decode leg's token intervals and the engine's load while they were
    measured, summarised once as the stream ends for all that judge them: the role
    controller (the median interval), the live decode correction (`positive` and
    `positive_median_s`) and a latency residual against the decode profile (recovery).

    The gaps are from the first token on (the KV wait and the prefill come before it),
    at most the stream's first 256, rescaled to tokens when events carried several. The
    load is the router's view of the engine at each read that brought them
    (`EngineLoad.decode_active`, `decode_tokens`), weighted by the gaps each read gave:
    its mean and its heaviest.

    The correction counts only positive gaps (`DecodeCorrection`, rule 1): two reads at
    one clock reading give gaps of zero, which the median of all the gaps keeps. With
    none positive, `positive_median_s` is 0 and no correction takes the window."""

    count: int
    median_s: float
    positive: int
    positive_median_s: float
    mean_active: float
    mean_kv_tokens: float
    max_active: int
    max_kv_tokens: int


class LegObserver(Protocol):
    """Told the outcome of every engine leg; recovery implements it (breakers,
    quarantine, latency residuals). Must not block: it runs on the request path.

    `contended` is true when another leg shared the engine at any moment of this one:
    its duration then includes work the profile does not price. `gaps` summarises a
    streamed leg's token intervals (the summary the serving signals got), None when it
    had none or when they are not the engine's alone (see `_GapLoad`)."""

    def leg_ok(
        self,
        engine: EngineState,
        phase: str,
        duration_s: float,
        *,
        prompt_tokens: int = 0,
        contended: bool = False,
        gaps: DecodeGaps | None = None,
    ) -> None: ...

    def leg_failed(self, engine: EngineState, phase: str, failure: EngineFailed) -> None: ...


class RouterLag(Protocol):
    """The router's own event-loop lag, as evidence about time is judged: a deadline
    that expired while the loop was starved says nothing about the engine."""

    def starved(self, deadline_s: float, *, since: float | None = None) -> float | None:
        """The loop's worst lag while a deadline of `deadline_s` ran until now (or since
        `since`), if it was enough for the router alone to have spent it; else None."""

    def excuse(self, deadline_s: float, *, since: float | None = None) -> str | None:
        """Why a deadline of `deadline_s` that expired just now (or a duration measured
        from `since`) is not held against an engine; None when it is."""
