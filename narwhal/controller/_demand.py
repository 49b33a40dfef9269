"""Offered demand (docs/design.md#evidence-gate, #reactive-parameters): a sliding-window estimator
fed arrival events, the arrival-evidence window that gates D-to-P consolidation, and the demand the
projections price. Pure data structures: no trio, no I/O; time is always passed in.

Demand is *offered* demand: every arrival counts, admitted or refused, because a
predictive-admission refusal is demand the fleet failed to serve (docs/design.md#evidence-gate:
refusals count toward offered demand while the evidence window accumulates). Each arrival carries
its prompt tokens and its expected output tokens (the request's output budget, or a prediction of
it).

Two horizons are kept: the short one is `reactive.evidence_span_s` (the rising-demand
test's short horizon) and the long one `reactive.window_s` (the demand-estimation
window). An estimate's rate divides the arrivals in the horizon by the horizon, or by
the time since the estimator started when that is shorter, so the first minutes are not
diluted by time nobody observed.

Prefill work is priced when an arrival is recorded, with the mean profile current at
that time (`set_pricer`); a profile reload re-prices the retained events. Pricing at
record time keeps each monitor pass O(1) instead of O(arrivals in the window).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import attrs

from ..config import Reactive
from ._load import DecodeDemand, PrefillDemand

# Prefill seconds of a prompt of n tokens whose first k are cached (the mean profile's
# `narwhal.admission.cached_prefill_s`).
Pricer = Callable[[int, int], float]


@attrs.frozen
class Arrival:
    """One offered request."""

    time: float
    prompt_tokens: int
    output_tokens: int
    admitted: bool = True
    # The prompt's leading tokens an engine held cached when it was offered.
    cached_tokens: int = 0
    # The arrivals it stands for: a replica of N behind an even balancer sees one in N
    # of the fleet's (`ControlLink.arrival_weight`). It is still one sample.
    weight: int = 1


@attrs.frozen
class DemandEstimate:
    """Offered demand over one horizon at one instant."""

    horizon_s: float
    span_s: float  # time the rate is averaged over: min(horizon, time since start)
    arrivals: int
    refused: int
    prompt_tokens_mean: float
    output_tokens_mean: float
    kv_per_stream: float  # token-weighted mean KV of a decoding stream
    prefill_s_mean: float  # mean-profile prefill time of the offered prompts, E[s]
    prefill_s_sq_mean: float  # E[s²]
    priced: bool  # every arrival in the horizon was priced with a profile
    # Arrivals this replica saw (`arrivals` counts each as the `weight` it stands for):
    # what the evidence gates count. All of them for one replica.
    samples: int = attrs.field(
        default=attrs.Factory(lambda self: self.arrivals, takes_self=True), kw_only=True
    )

    @property
    def rate(self) -> float:
        """Offered requests per second (raw, before `demand_floor`)."""
        return self.arrivals / self.span_s if self.span_s > 0 else 0.0

    def floored_rate(self, demand_floor: float) -> float:
        """docs/design.md#reactive-parameters `demand_floor`: the minimum accepted demand signal, in
        requests/s."""
        return max(self.rate, demand_floor)

    def prefill_work(self, demand_floor: float) -> float:
        """Engine-seconds of prefill per second at the floored rate."""
        return self.floored_rate(demand_floor) * self.prefill_s_mean

    def decode_token_rate(self, demand_floor: float) -> float:
        """Output tokens per second at the floored rate (the decode demand)."""
        return self.floored_rate(demand_floor) * self.output_tokens_mean


def empty_estimate(horizon_s: float) -> DemandEstimate:
    return DemandEstimate(horizon_s, 0.0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, priced=True)


class _Horizon:
    """Running sums over the arrivals of one horizon."""

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self.events: deque[tuple[Arrival, float, bool]] = deque()
        self.clear_sums()

    def clear_sums(self) -> None:
        self.count = 0
        self.samples = 0
        self.refused = 0
        self.unpriced = 0
        self.prompt = 0.0
        self.output = 0.0
        self.kv_weighted = 0.0
        self.service = 0.0
        self.service_sq = 0.0

    def _add(self, arrival: Arrival, service: float, priced: bool, sign: int) -> None:
        self.samples += sign
        self.unpriced += sign * (not priced)
        sign *= arrival.weight
        self.count += sign
        self.refused += sign * (not arrival.admitted)
        self.prompt += sign * arrival.prompt_tokens
        self.output += sign * arrival.output_tokens
        out = arrival.output_tokens
        self.kv_weighted += sign * out * (arrival.prompt_tokens + out / 2.0)
        self.service += sign * service
        self.service_sq += sign * service * service

    def push(self, arrival: Arrival, service: float, priced: bool) -> None:
        self.events.append((arrival, service, priced))
        self._add(arrival, service, priced, 1)

    def prune(self, now: float) -> None:
        horizon_start = now - self.horizon_s
        while self.events and self.events[0][0].time < horizon_start:
            arrival, service, priced = self.events.popleft()
            self._add(arrival, service, priced, -1)
        if not self.events:
            self.clear_sums()  # no float drift survives an empty window

    def reprice(self, price: Pricer | None) -> None:
        old = list(self.events)
        self.events.clear()
        self.clear_sums()
        for arrival, _, _ in old:
            service, priced = _price(price, arrival)
            self.push(arrival, service, priced)

    def estimate(self, now: float, started_at: float) -> DemandEstimate:
        span = max(0.0, min(self.horizon_s, now - started_at))
        n = self.count
        if n <= 0:
            return attrs.evolve(empty_estimate(self.horizon_s), span_s=span)
        return DemandEstimate(
            horizon_s=self.horizon_s,
            span_s=span,
            arrivals=n,
            refused=self.refused,
            prompt_tokens_mean=max(0.0, self.prompt / n),
            output_tokens_mean=max(0.0, self.output / n),
            kv_per_stream=max(0.0, self.kv_weighted / self.output) if self.output > 0 else 0.0,
            prefill_s_mean=max(0.0, self.service / n),
            prefill_s_sq_mean=max(0.0, self.service_sq / n),
            priced=self.unpriced == 0,
            samples=self.samples,
        )


def _price(price: Pricer | None, arrival: Arrival) -> tuple[float, bool]:
    if price is None:
        return 0.0, False
    return max(0.0, price(arrival.prompt_tokens, arrival.cached_tokens)), True


class DemandEstimator:
    """Offered demand over the short and long horizons, fed one arrival at a time.

    `total` counts every arrival ever recorded; the evidence window remembers the total
    at its last reset so it can count the samples since then without keeping events.
    """

    def __init__(
        self,
        *,
        short_s: float,
        long_s: float,
        started_at: float,
        price: Pricer | None = None,
    ) -> None:
        self.started_at = started_at
        self._price = price
        self._short = _Horizon(short_s)
        self._long = _Horizon(long_s)
        self.total = 0
        self.refused_total = 0

    @classmethod
    def from_config(
        cls, reactive: Reactive, *, started_at: float, price: Pricer | None = None
    ) -> DemandEstimator:
        return cls(
            short_s=reactive.evidence_span_s,
            long_s=reactive.window_s,
            started_at=started_at,
            price=price,
        )

    def reconfigure(self, reactive: Reactive) -> None:
        """New horizons after a reload; events older than the new long horizon are lost
        at the next prune, shorter horizons shed them now."""
        for horizon, length in (
            (self._short, reactive.evidence_span_s),
            (self._long, reactive.window_s),
        ):
            horizon.horizon_s = length

    def set_pricer(self, price: Pricer | None) -> None:
        """Use a new mean-profile prefill price (a profile reload) for every retained
        arrival and every new one."""
        self._price = price
        self._short.reprice(price)
        self._long.reprice(price)

    def record(self, arrival: Arrival) -> None:
        service, priced = _price(self._price, arrival)
        self.total += 1
        self.refused_total += not arrival.admitted
        self._short.push(arrival, service, priced)
        self._long.push(arrival, service, priced)

    def estimates(self, now: float) -> tuple[DemandEstimate, DemandEstimate]:
        """(short, long) at `now`."""
        self._short.prune(now)
        self._long.prune(now)
        return (
            self._short.estimate(now, self.started_at),
            self._long.estimate(now, self.started_at),
        )


# --- the evidence window (docs/design.md#evidence-gate) --------------------------------


@attrs.frozen
class EvidenceWindow:
    """Controller state: when the arrival-evidence window last (re)opened, and the
    estimator's arrival total at that moment."""

    opened_at: float
    arrivals_at_open: int = 0


@attrs.frozen
class EvidenceView:
    """The evidence window as the decision sees it at one instant."""

    opened_at: float
    elapsed_s: float
    samples: int  # arrivals in the evidence span since the window opened
    closed: bool
    why: str  # which closing condition held, or what the window still waits for


def evidence_view(
    window: EvidenceWindow,
    *,
    arrivals_total: int,
    short: DemandEstimate,
    now: float,
    reactive: Reactive,
) -> EvidenceView:
    """docs/design.md#evidence-gate: closed when `evidence_span_s` has elapsed with at least
    `evidence_min_arrivals` samples, or when `evidence_max_span_s` has elapsed.

    Once the span has elapsed, the samples in the evidence span since the window opened
    are exactly the short-horizon arrivals (the short horizon is the evidence span);
    before that the window cannot close by the first condition, and the samples are the
    arrivals since it opened.
    """
    elapsed = max(0.0, now - window.opened_at)
    since_open = max(0, arrivals_total - window.arrivals_at_open)
    span_done = elapsed >= reactive.evidence_span_s
    samples = min(short.samples, since_open) if span_done else since_open
    if span_done and samples >= reactive.evidence_min_arrivals:
        return EvidenceView(window.opened_at, elapsed, samples, True, "span elapsed with samples")
    if elapsed >= reactive.evidence_max_span_s:
        return EvidenceView(window.opened_at, elapsed, samples, True, "maximum span elapsed")
    if span_done:
        why = f"{samples} of {reactive.evidence_min_arrivals} samples in the evidence span"
    else:
        why = f"{elapsed:.1f} of {reactive.evidence_span_s:g} s elapsed"
    return EvidenceView(window.opened_at, elapsed, samples, False, why)


def demand_rising(short: DemandEstimate, long: DemandEstimate, reactive: Reactive) -> bool:
    """docs/design.md#evidence-gate: once the short horizon holds `evidence_min_arrivals` samples,
    consolidation pauses while short-horizon decode demand exceeds the long-horizon
    decode demand by more than `demand_rise_tolerance`. Decode demand is the floored
    output-token rate."""
    if short.samples < reactive.evidence_min_arrivals:
        return False
    floor = reactive.demand_floor
    rise = long.decode_token_rate(floor) * (1.0 + reactive.demand_rise_tolerance)
    return short.decode_token_rate(floor) > rise


# --- the demand the projections price -------------------------------------------------


def _larger(
    short: DemandEstimate,
    long: DemandEstimate,
    reactive: Reactive,
    key: Callable[[DemandEstimate], float],
) -> DemandEstimate:
    # The short horizon competes only once it holds enough samples to mean something
    # (the same bar as the rising-demand test); one long prompt in an empty minute is
    # not a demand estimate.
    if short.samples < reactive.evidence_min_arrivals:
        return long
    return short if key(short) > key(long) else long


def pricing_demand(
    short: DemandEstimate, long: DemandEstimate, reactive: Reactive
) -> tuple[PrefillDemand, DecodeDemand]:
    """docs/design.md#evidence-gate: candidate pricing uses the larger demand estimate. "Larger" is
    judged per phase: prefill uses the horizon with more prefill work, decode the horizon with the
    higher output-token rate."""
    floor = reactive.demand_floor
    pre = _larger(short, long, reactive, lambda e: e.prefill_work(floor))
    dec = _larger(short, long, reactive, lambda e: e.decode_token_rate(floor))
    return (
        PrefillDemand(pre.floored_rate(floor), pre.prefill_s_mean, pre.prefill_s_sq_mean),
        DecodeDemand(
            dec.floored_rate(floor),
            dec.output_tokens_mean,
            dec.kv_per_stream,
            dec.prompt_tokens_mean,
        ),
    )
