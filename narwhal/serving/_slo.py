"""SLO attainment as the router sees it (no I/O).

DistServe's measure: of the requests offered, the share served within both targets
(TTFT within slo.ttft_s, TPOT within slo.tpot_s). A request Narwhal refused counts as
a miss, as docs/design.md#evidence-gate has predictive-admission refusals count, and so does one
that failed on the engines' side or ran out of time. A request whose failure was the client's own (a
malformed body, an unknown model, a client that left, no valid API key) was never offered service,
and is not counted. A served request whose first token the router did not see (a non-streaming
engine request, kept for the few requests a stream cannot answer) is `unmeasured`: neither a hit nor
a miss; one output token has no TPOT to miss.

`SloTally` keeps the counts over the last `window_s` seconds in whole one-second buckets
(so the window spans up to one second more), and its memory is bounded by the window,
not by the request rate.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Literal

import attrs

from .._codes import ErrorCode

SloResult = Literal["met", "missed", "refused", "unmeasured"]
RESULTS: tuple[SloResult, ...] = ("met", "missed", "refused", "unmeasured")

# Outcomes that are the client's doing: not offered service, so not counted. An engine's
# 4xx (`engine_rejected_request`) judged the request, not the service.
_CLIENT_OUTCOMES = frozenset(
    {
        "client_disconnected",
        ErrorCode.INVALID_JSON,
        ErrorCode.INVALID_REQUEST,
        ErrorCode.NOT_FOUND,
        ErrorCode.MISSING_API_KEY,
        ErrorCode.INVALID_API_KEY,
        ErrorCode.REQUEST_TOO_LARGE,
        ErrorCode.BODY_TIMEOUT,
        ErrorCode.PENDING_BODIES_PER_CLIENT,
        ErrorCode.CONTEXT_LENGTH_EXCEEDED,
        ErrorCode.ENGINE_REJECTED_REQUEST,
    }
)
# Narwhal answered without serving: admission, queue, ceiling, drain and degraded refusals.
_REFUSALS = frozenset(
    {
        ErrorCode.TTFT_BUDGET,
        ErrorCode.PROMPT_EXCEEDS_TTFT_TARGET,
        ErrorCode.NO_PRICED_PATH,
        ErrorCode.NO_PROFILE,
        ErrorCode.QUEUE_FULL,
        ErrorCode.QUEUE_TIMEOUT,
        ErrorCode.RETAINED_CEILING,
        ErrorCode.SHUTTING_DOWN,
        ErrorCode.DEGRADED,
    }
)


def slo_result(
    outcome: str,
    *,
    ttft_s: float | None,
    tpot_s: float | None,
    ttft_target_s: float,
    tpot_target_s: float,
) -> SloResult | None:
    """How one finished request counts; None when it does not count at all."""
    if outcome in _CLIENT_OUTCOMES:
        return None
    if outcome in _REFUSALS:
        return "refused"
    if outcome != "ok":
        return "missed"
    if ttft_s is None:
        return "unmeasured"
    if ttft_s > ttft_target_s or (tpot_s is not None and tpot_s > tpot_target_s):
        return "missed"
    return "met"


def attainment(counts: dict[SloResult, int]) -> float | None:
    """met / (met + missed + refused); None when nothing counted."""
    judged = counts["met"] + counts["missed"] + counts["refused"]
    return counts["met"] / judged if judged else None


@attrs.define
class SloTally:
    window_s: float
    # [second, met, missed, refused, unmeasured], oldest first.
    _buckets: deque[list[int]] = attrs.Factory(deque)

    def record(self, result: SloResult, now: float) -> None:
        second = math.floor(now)
        if not self._buckets or self._buckets[-1][0] != second:
            self._buckets.append([second, 0, 0, 0, 0])
        self._buckets[-1][1 + RESULTS.index(result)] += 1
        self._expire(now)

    def counts(self, now: float) -> dict[SloResult, int]:
        self._expire(now)
        totals = [0, 0, 0, 0]
        for bucket in self._buckets:
            for i in range(4):
                totals[i] += bucket[1 + i]
        return dict(zip(RESULTS, totals, strict=True))

    def attainment(self, now: float) -> float | None:
        return attainment(self.counts(now))

    def _expire(self, now: float) -> None:
        oldest = math.floor(now - self.window_s)
        while self._buckets and self._buckets[0][0] < oldest:
            self._buckets.popleft()
