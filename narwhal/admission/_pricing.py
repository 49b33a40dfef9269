"""Predictive admission: price every prefill path against the TTFT target
(docs/design.md#admission).

Pure: a decision is a function of engine views, their profiles, the prefill backlog each
engine already has, and the request's prompt length. No trio, no I/O.

A prefill path's projected TTFT is

    wait (prefill work already committed to the engine, drained at one second per second)
  + prefill_s(prompt tokens) on that engine's profile
  + the KV handoff estimate for the prompt (disaggregated paths)
  + one decode step on the decode side (the first token after the KV lands)

and, when the decode side has lately been slower than that model (a full decode batch
makes new requests wait for a slot, which no profile prices), the decode engine's recent
first-token lag instead of handoff + step, counted as wait: it comes from load, so it
drains, and it never makes a prompt look too long for the target (`FirstTokenLag`).

The decode engine also needs free KV for the prompt when the handoff lands: an engine
whose KV cache is committed (resident prompts and generated tokens, those of
non-streaming legs estimated from their age since none is seen before the body, plus
prompts placed on it and still in their prefill) admits nothing new until finishing
requests free enough of it. That wait is the overflow divided by the rate at which the engine has
lately released KV (`KvTurnover`), less the prefill time it overlaps with; it is also
load, counted as wait, and the larger of it and the lag is used (both measure the same
queue, seen from the past and from the future).

and the request is admitted when the cheapest path, plus how far recent first tokens ran
over their projections (`ProjectionErrors`: in seconds; on a path with no wait, only those
of prompts about as long that had none), fits in slo.ttft_s × (1 + margin).
When it does not fit, the refusal says why: if even an idle engine would miss the target
the prompt itself is the problem (shorten it or raise the target, no Retry-After, because
waiting will not help); otherwise the backlog is, and Retry-After is the time until the
cheapest path's backlog has drained enough to fit.

Aggregate (single-engine) paths are only offered inside the region the profile measured:
an aggregate engine mixes prefill chunks into its decode steps, so an extrapolated
prediction there is not safe to admit on (docs/design.md#admission).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable, Mapping
from types import MappingProxyType
from typing import Generic, Protocol, TypeVar

import attrs

from .._codes import ErrorCode
from ..fleet import EngineView
from ..placement import Policy


class PrefillCurve(Protocol):
    def prefill_s(self, n: int) -> float: ...

    def in_domain(self, n: int) -> bool: ...


class PrefillLaw(Protocol):
    def prefill_s(self, n: int) -> float: ...


def cached_prefill_s(curve: PrefillLaw, tokens: int, cached: int) -> float:
    """Prefill seconds of a `tokens`-token prompt whose first `cached` tokens the engine
    holds in its prefix cache (docs/design.md#prefix-caching).

    The engine computes only the new tokens, but each of them still attends to the whole
    prompt, so the work is the curve's at `tokens` less its token-dependent part at
    `cached`: ``a + b·(n-k) + c·(n²-k²)`` for the quadratic law, plus what the engine
    still spends on each cached token (``h·k``, `cached_token_s`: it tokenises and
    hashes the whole prompt). Never below the fixed cost ``prefill_s(0)``, never above
    the uncached price. A curve without `cached_token_s` (a profile's `PrefillModel` has
    it) keeps nothing."""
    full = max(0.0, curve.prefill_s(tokens))
    if cached <= 0:
        return full
    kept = min(cached, tokens)
    kept_s: float = getattr(curve, "cached_token_s", 0.0)
    saving = curve.prefill_s(kept) - curve.prefill_s(0) - kept_s * kept
    return min(full, max(curve.prefill_s(0), full - saving, 0.0))


def credited_prefill_s(curve: PrefillLaw, tokens: int, cached: int, credit: float) -> float:
    """Prefill seconds of the prompt less `credit` times what its `cached` prefix saves
    (`cached_prefill_s`): 1 prices it as it is, 0 as if nothing were cached, and above 1
    (cache.affinity, in placement's cost only) favours the cache beyond its worth."""
    full = max(0.0, curve.prefill_s(tokens))
    if not cached or not credit:
        return full
    return full - credit * (full - cached_prefill_s(curve, tokens, cached))


class DecodeCurve(Protocol):
    # Floats: a stream's gaps are judged at the mean load over them.
    def interval_s(self, active: float, kv_tokens: float) -> float: ...

    def in_domain(self, active: int, kv_tokens: int) -> bool: ...


@attrs.frozen
class Priced:
    """One engine with what pricing needs to know about it."""

    view: EngineView
    prefill: PrefillCurve | None
    decode: DecodeCurve | None
    backlog_s: float = 0.0
    # Bounded live/profile ratio of decode intervals (docs/design.md#pool-load); 1.0 = as profiled.
    decode_correction: float = 1.0

    # Recent decode-side first-token latency observed on this engine, decayed.
    first_token_lag_s: float = 0.0
    # The engine's KV cache size (profile) and the tokens/s it has lately freed.
    kv_capacity_tokens: int | None = None
    kv_release_per_s: float = 0.0
    # The leading tokens of this request's prompt the engine holds in its prefix cache.
    cached_tokens: int = 0

    def prefill_s(self, prompt_tokens: int, credit: float = 1.0) -> float:
        """Seconds to prefill the prompt here on an idle engine, with `credit` of what its
        cached prefix saves (`credited_prefill_s`); inf without a prefill profile."""
        if self.prefill is None:
            return math.inf
        return credited_prefill_s(self.prefill, prompt_tokens, self.cached_tokens, credit)

    @property
    def decode_tokens(self) -> float:
        """The KV the engine holds for its decode work: what the router counted (prompts,
        streamed tokens) and what its non-streaming decode legs have made unseen."""
        return self.view.decode_tokens + unstreamed_tokens(
            self.view, self.decode, self.decode_correction
        )

    def kv_ready_s(self, prompt_tokens: int) -> float:
        """Seconds from now until the engine's KV has room for `prompt_tokens` more."""
        capacity = self.kv_capacity_tokens
        if not capacity:
            return 0.0
        overflow = self.decode_tokens + prompt_tokens - capacity * (1.0 - KV_RESERVE)
        if overflow <= 0:
            return 0.0
        rate = max(self.kv_release_per_s, capacity / KV_TURNOVER_CEILING_S)
        return overflow / rate

    def first_step_s(self, prompt_tokens: int) -> float:
        if self.decode is None:
            return 0.0
        view = self.view
        interval = self.decode.interval_s(
            view.decode_active + 1, round(self.decode_tokens) + prompt_tokens
        )
        return max(0.0, interval) * self.decode_correction

    def batch_step_s(self, prompt_tokens: int) -> float:
        """What the engine's decode batch adds to the step a prompt prefilled here rides
        in: its first step with the prompt added, less an idle engine's (whose fixed
        cost the prefill curve already holds). 0 on an engine decoding nothing."""
        if self.decode is None:
            return 0.0
        idle = max(0.0, self.decode.interval_s(1, prompt_tokens)) * self.decode_correction
        return max(0.0, self.first_step_s(prompt_tokens) - idle)

    def decode_side(
        self, prompt_tokens: int, handoff_s: float, first_step_s: float | None = None
    ) -> DecodeSide:
        """This engine's share of a TTFT; `first_step_s` if the caller already has it."""
        if first_step_s is None:
            first_step_s = self.first_step_s(prompt_tokens)
        modelled = handoff_s + first_step_s
        # How much longer than the model the decode side has lately taken to a first token.
        lag = max(0.0, self.first_token_lag_s - modelled)
        return DecodeSide(modelled, lag, self.kv_ready_s(prompt_tokens), self.backlog_s)


@attrs.frozen
class DecodeSide:
    """A decode engine's share of a projected TTFT: `modelled_s` (handoff + first step
    from the profile), `lag_s` (how much slower than that it has lately been),
    `kv_ready_s` (when its KV cache has room for the prompt, from now) and `backlog_s`
    (the prompts it prefills itself, cache.local_prefill_share, booked ahead of it)."""

    modelled_s: float
    lag_s: float
    kv_ready_s: float
    backlog_s: float = 0.0

    def delay_s(self, prefill_done_s: float = 0.0) -> float:
        """Load delay beyond the model for a prompt whose prefill ends `prefill_done_s`
        from now: the KV wait and the engine's own prefills overlap the prefill (chunked
        prefill steps a running prompt's chunks before a newly arrived decode), the lag
        does not."""
        return max(self.lag_s, max(self.kv_ready_s, self.backlog_s) - prefill_done_s)

    @property
    def cost_s(self) -> float:
        return self.modelled_s + self.delay_s()


# Headroom kept out of the KV capacity: vLLM's free-block watermark (1 %) plus the
# partly filled last block of each resident sequence.
KV_RESERVE = 0.02
# With no recent release observed, assume the whole cache turns over in this long: a
# KV-full engine is priced as a finite (refusable, Retry-After-able) wait.
KV_TURNOVER_CEILING_S = 60.0


@attrs.frozen
class PathQuote:
    engine: str
    mode: str  # "disaggregated" or "aggregate"
    wait_s: float
    ttft_s: float
    idle_ttft_s: float
    in_domain: bool


@attrs.frozen
class Verdict:
    admitted: bool
    quote: PathQuote | None
    code: ErrorCode | None = None
    message: str = ""
    retry_after_s: float | None = None
    final: bool = False  # the prompt itself is over the budget: no later retry passes


def _usable(priced: Priced, excluded: frozenset[str], phase: str) -> bool:
    view = priced.view
    blocked = view.prefill_blocked if phase == "prefill" else view.blocked("aggregate")
    return blocked is None and view.id not in excluded and priced.prefill is not None


def quote_paths(
    engines: Iterable[Priced],
    *,
    prompt_tokens: int,
    handoff_s: float,
    excluded: frozenset[str] = frozenset(),
    credit: float = 1.0,
) -> list[PathQuote]:
    """Every prefill path a request could take now, cheapest first (ties by engine id).

    Disaggregated paths go through a prefill-role engine and add the handoff and the
    cheapest decode engine's first step; aggregate paths are "both" engines inside their
    measured region. Each engine's prefill is priced with `credit` of what its cached
    prefix of the prompt saves (`Priced.prefill_s`).
    """
    engines = list(engines)
    decode_side = [
        p
        for p in engines
        if p.view.role == "decode" and p.view.decode_blocked is None and p.view.id not in excluded
    ]
    side = min(
        (p.decode_side(prompt_tokens, handoff_s) for p in decode_side),
        key=lambda d: d.cost_s,
        default=None,
    )
    quotes: list[PathQuote] = []
    for priced in engines:
        role = priced.view.role
        if role == "prefill" and side is not None and _usable(priced, excluded, "prefill"):
            assert priced.prefill is not None
            prefill_s = priced.prefill_s(prompt_tokens, credit)
            own = prefill_s + side.modelled_s
            wait = priced.backlog_s + side.delay_s(priced.backlog_s + prefill_s)
            quotes.append(
                PathQuote(
                    engine=priced.view.id,
                    mode="disaggregated",
                    wait_s=wait,
                    ttft_s=wait + own,
                    idle_ttft_s=own,
                    in_domain=priced.prefill.in_domain(prompt_tokens),
                )
            )
        elif role == "both" and _usable(priced, excluded, "aggregate"):
            assert priced.prefill is not None
            view = priced.view
            in_domain = priced.prefill.in_domain(prompt_tokens) and (
                priced.decode is not None
                and priced.decode.in_domain(
                    view.decode_active + 1, round(priced.decode_tokens) + prompt_tokens
                )
            )
            if not in_domain:
                continue
            own = priced.prefill_s(prompt_tokens, credit) + priced.first_step_s(prompt_tokens)
            quotes.append(
                PathQuote(
                    engine=view.id,
                    mode="aggregate",
                    wait_s=priced.backlog_s,
                    ttft_s=priced.backlog_s + own,
                    idle_ttft_s=own,
                    in_domain=True,
                )
            )
    quotes.sort(key=lambda q: (q.ttft_s, q.engine))
    return quotes


# Served streams whose overrun (observed - projected TTFT) admission remembers, per
# window, and for how long; the fewest a window needs before admission trusts their
# quantile; the largest share of the TTFT budget an overrun may take (a projection off by
# more than that is a broken profile, for health and the operator, not a margin: the
# bound that doubling a projection at the edge of the budget had).
ERROR_WINDOW = 256
ERROR_WINDOW_S = 60.0
ERROR_MIN_SAMPLES = 32
ERROR_BUDGET_SHARE_MAX = 0.5
# Prompt-size bands, doubling from ERROR_BAND_TOKENS: [0, 128), [128, 256), ...,
# [32768, inf).
ERROR_BAND_TOKENS = 128
ERROR_BANDS = 10


def error_band(prompt_tokens: int) -> int:
    """The prompt-size band whose idle projections' error a prompt is judged by."""
    top = prompt_tokens.bit_length() - ERROR_BAND_TOKENS.bit_length() + 1
    return max(0, min(ERROR_BANDS - 1, top))


def band_label(band: int) -> str:
    """A band's prompt sizes as /narwhal/state and the benchmarks name it: "128-255"."""
    low = 0 if band == 0 else ERROR_BAND_TOKENS << (band - 1)
    if band == ERROR_BANDS - 1:
        return f"{low}+"
    return f"{low}-{(ERROR_BAND_TOKENS << band) - 1}"


@attrs.frozen
class Allowance:
    """What admission adds to a path's projection for how far recent first tokens ran
    over theirs: `backlog_s` on a path with any wait, `idle_s` on one with none."""

    backlog_s: float = 0.0
    idle_s: float = 0.0

    def on(self, quote: PathQuote) -> float:
        return self.backlog_s if quote.wait_s > 0 else self.idle_s


NO_ALLOWANCE = Allowance()


@attrs.frozen
class WindowStatistics:
    """One window of recent overruns: its `samples` and the `overrun_s` admission adds."""

    samples: int
    overrun_s: float


@attrs.frozen
class ErrorStatistics:
    """`ProjectionErrors` for /narwhal/state: the quantile its overruns are taken at, the
    window of every recent stream, and one per prompt-size band (by label) of those that
    had no backlog."""

    quantile: float
    backlog: WindowStatistics
    idle: Mapping[str, WindowStatistics]


@attrs.define
class _Window:
    """Recent overruns (time, seconds), bounded in count and age, and their quantile."""

    samples: deque[tuple[float, float]] = attrs.Factory(lambda: deque(maxlen=ERROR_WINDOW))
    overrun_s: float = 0.0

    def expire(self, now: float) -> bool:
        expired = False
        while self.samples and now - self.samples[0][0] > ERROR_WINDOW_S:
            self.samples.popleft()
            expired = True
        return expired

    def update(self, quantile: float, cap_s: float) -> None:
        if len(self.samples) < ERROR_MIN_SAMPLES:
            self.overrun_s = 0.0
            return
        ordered = sorted(overrun for _, overrun in self.samples)
        at = ordered[min(len(ordered) - 1, math.ceil(quantile * len(ordered)) - 1)]
        self.overrun_s = min(cap_s, max(0.0, at))

    def statistics(self) -> WindowStatistics:
        return WindowStatistics(len(self.samples), self.overrun_s)


@attrs.define
class ProjectionErrors:
    """How far first tokens have lately run over their projections, in seconds.

    An unbiased projection admits requests right up to the TTFT budget, and about half
    of those at the edge then miss it: under overload nearly every admitted request is
    at the edge. So admission adds to each projection the `quantile` of observed -
    projected over the last ERROR_WINDOW served streams of the last ERROR_WINDOW_S
    seconds: a request is admitted when it would fit even if it overran as far as that
    share of recent ones did. The quantile is half way from `percentile`
    (slo.percentile) to 1 (0.95 for 0.9): a request at the edge meets its target about
    as often as its allowance covers, and with most admitted requests there, covering
    only slo.percentile left their attainment barely above it (93.7-96.8 % at 0.9 on
    tools/bench/overload.py, 97.1-98.5 % this way). Which streams count depends on the
    path:

    - a path with backlog (any wait): every recent stream. Under load the overrun is
      mostly load's (the queue, the decode batch), which every request on it meets.
    - a path with none: the recent streams that had none either, and whose prompts were
      about as long (`error_band`). What is left on an idle path is the fixed cost of a
      request (HTTP, tokenizing, the relay) and the profile's own error at that size.

    Invariants: the overrun is added, never multiplied: a fixed cost learnt on short
    chats, as a ratio, doubled a long prompt's projection and refused it on an idle
    fleet. Errors learnt on one prompt size never refuse another at zero backlog (a size
    with fewer than ERROR_MIN_SAMPLES such streams adds nothing there). An overrun only
    tightens (at least 0: a pessimistic projection is not loosened) and is at most
    ERROR_BUDGET_SHARE_MAX of `budget_s`; the time bound keeps one bad burst on a quiet
    service from tightening admission long after it. Memory: at most
    (1 + ERROR_BANDS) x ERROR_WINDOW samples.
    """

    percentile: float = 0.9
    budget_s: float = math.inf
    _backlog: _Window = attrs.Factory(_Window)
    _idle: dict[int, _Window] = attrs.Factory(dict)

    @property
    def quantile(self) -> float:
        return (1.0 + self.percentile) / 2.0

    def observe(
        self, prompt_tokens: int, projected_s: float, wait_s: float, observed_s: float, now: float
    ) -> None:
        """A served stream: its projected TTFT, the part of it that was wait (backlog,
        decode lag, KV), and the TTFT it had."""
        if projected_s <= 0 or observed_s <= 0:
            return
        windows = [self._backlog]
        if wait_s <= 0:
            windows.append(self._idle.setdefault(error_band(prompt_tokens), _Window()))
        for window in windows:
            window.samples.append((now, observed_s - projected_s))
            window.expire(now)
            window.update(self.quantile, self._cap_s)
        self._forget_empty()

    def allowance(self, prompt_tokens: int, now: float) -> Allowance:
        """What to add to the projections of a prompt of `prompt_tokens` now."""
        idle = self._idle.get(error_band(prompt_tokens))
        for window in (self._backlog, idle):
            if window is not None and window.expire(now):
                window.update(self.quantile, self._cap_s)
        self._forget_empty()
        return Allowance(self._backlog.overrun_s, 0.0 if idle is None else idle.overrun_s)

    def reconfigure(self, percentile: float, budget_s: float) -> None:
        self.percentile = percentile
        self.budget_s = budget_s
        for window in (self._backlog, *self._idle.values()):
            window.update(self.quantile, self._cap_s)

    def statistics(self, now: float) -> ErrorStatistics:
        for window in (self._backlog, *self._idle.values()):
            if window.expire(now):
                window.update(self.quantile, self._cap_s)
        self._forget_empty()
        return ErrorStatistics(
            self.quantile,
            self._backlog.statistics(),
            {band_label(b): w.statistics() for b, w in sorted(self._idle.items())},
        )

    @property
    def _cap_s(self) -> float:
        return ERROR_BUDGET_SHARE_MAX * self.budget_s

    def _forget_empty(self) -> None:
        for band in [b for b, window in self._idle.items() if not window.samples]:
            del self._idle[band]


def ttft_budget_s(ttft_target_s: float, margin: float) -> float:
    """What a projected TTFT is compared with: slo.ttft_s x (1 + serving.admission_margin)."""
    return ttft_target_s * (1.0 + margin)


def judge(
    quotes: list[PathQuote],
    *,
    prompt_tokens: int,
    ttft_target_s: float,
    margin: float,
    allowance: Allowance = NO_ALLOWANCE,
) -> Verdict:
    """Admit when a path's projection plus its `allowance` (how far recent first tokens
    ran over their projections, `ProjectionErrors`) fits the budget. Whether the prompt
    itself is too long is judged on the idle projection alone."""
    budget = ttft_budget_s(ttft_target_s, margin)
    if not quotes:
        return Verdict(
            False,
            None,
            code=ErrorCode.NO_PRICED_PATH,
            message=(
                f"no prefill path can be priced for a {prompt_tokens}-token prompt: every "
                "available engine lacks a usable profile or (aggregate engines) the prompt "
                "is outside the measured profile region"
            ),
        )
    best = min(quotes, key=lambda q: q.ttft_s + allowance.on(q))
    added = allowance.on(best)
    expected = best.ttft_s + added
    if expected <= budget:
        return Verdict(True, best)
    idle_best = min(q.idle_ttft_s for q in quotes)
    if idle_best > budget:
        return Verdict(
            False,
            best,
            code=ErrorCode.PROMPT_EXCEEDS_TTFT_TARGET,
            message=(
                f"a {prompt_tokens}-token prompt is projected to take {idle_best:.3f}s to its "
                f"first token even on an idle engine, above the TTFT budget {budget:.3f}s "
                f"(slo.ttft_s={ttft_target_s} with serving.admission_margin={margin}); "
                "shorten the prompt or raise the TTFT target"
            ),
            final=True,
        )
    which = (
        "recent first tokens"
        if best.wait_s > 0
        else f"recent first tokens of {band_label(error_band(prompt_tokens))}-token prompts "
        "with no backlog"
    )
    return Verdict(
        False,
        best,
        code=ErrorCode.TTFT_BUDGET,
        message=(
            f"projected time to first token {best.ttft_s:.3f}s"
            + (
                f" ({expected:.3f}s allowing for the {added:.3f}s by which {which} ran "
                "over their projections)"
                if added > 0
                else ""
            )
            + f" exceeds the TTFT budget {budget:.3f}s (slo.ttft_s={ttft_target_s} with "
            f"serving.admission_margin={margin}); {best.wait_s:.3f}s of it is backlog on "
            "the cheapest path"
        ),
        retry_after_s=expected - budget,
    )


def shared_overhead_s(overhead_s: float, prompt_tokens: int, chunk_tokens: int) -> float:
    """The part of a prompt's per-request overhead (`overhead_s`, its profile's zero-token
    cost: about one scheduler step) it does not pay when packed into steps of
    `chunk_tokens` with other queued prompts: a prompt filling a fraction f of a step
    pays f of the step's fixed cost; one of a chunk or more fills its own steps."""
    return max(0.0, overhead_s) * max(0.0, 1.0 - prompt_tokens / chunk_tokens)


# What the per-engine books below are keyed by. The request path keys them by the
# EngineState instance, not its id: a reload that replaces an engine (same id, another
# url) makes a new instance, so what a leg commits, releases and observes lands on the
# engine it ran on, never on its replacement (tests key them by id strings).
K = TypeVar("K", bound=Hashable)


@attrs.define
class BacklogBook(Generic[K]):
    """Prefill work committed to each engine, as a virtual finish time.

    A committed prefill leg of predicted duration d moves the engine's finish time to
    max(finish, now) + d: the engine works through its prefill backlog at one second per
    second whether it batches or not, because prefill is compute bound. When the last leg
    on an engine ends, any prediction error is forgotten by dropping the engine's entry
    (no entry is a finish time of now), so errors do not accumulate, and the book holds
    only engines with legs committed.

    A prompt committed while the engine still has backlog shares its steps: chunked
    prefill packs queued prompts into the same step, so of the step's fixed cost the
    prompt pays only its share of the step's tokens; `shared_s` is the part of its
    predicted duration it then does not pay (`shared_overhead_s`). Charging every queued
    prompt a whole step made a deep queue of short prompts look several times longer
    than the engine took to clear it.

    Legs still running past the finish time are overdue: the engine is slower than its
    profile, or stalled, and its backlog is not zero, whatever the prediction said. Work
    overdue by x is taken to need about x more, so an engine that stopped answering grows
    more expensive by the second instead of looking idle and drawing every request until
    its breaker opens, while the few milliseconds a healthy engine runs late cost about
    that much.

    With other replicas (narwhal.cluster), the engine works through their prefills and
    this replica's as one queue: `fleet_finish` is that queue's finish time, moved by
    this replica's commits and by the work the others say they committed (`heard`).
    Adding each replica's own book instead drains the whole at one second per second per
    replica: with two, it priced a burst's prefill wait at about half of what it was.
    `booked_s` counts the seconds this replica ever committed to each engine, for the
    others to take the difference of. The fleet's queue forgets its error as this
    replica's own book does, once no replica has a leg committed there: when this
    replica's last one ends while the others last said they have none (`others_busy`
    holds the engines where one had), or when the others say so after it.
    """

    finish: dict[K, float] = attrs.Factory(dict)
    committed: dict[K, int] = attrs.Factory(dict)
    fleet_finish: dict[K, float] = attrs.Factory(dict)
    booked_s: dict[K, float] = attrs.Factory(dict)
    others_busy: set[K] = attrs.Factory(set)

    def wait_s(self, engine: K, now: float) -> float:
        finish = self.finish.get(engine, now)
        if finish >= now:
            return finish - now
        return now - finish if self.committed.get(engine, 0) > 0 else 0.0

    def commit(self, engine: K, predicted_s: float, now: float, shared_s: float = 0.0) -> None:
        wait = self.wait_s(engine, now)
        if wait > 0:
            predicted_s -= min(max(0.0, shared_s), predicted_s)
        work = max(0.0, predicted_s)
        self.finish[engine] = now + wait + work
        self.committed[engine] = self.committed.get(engine, 0) + 1
        self.booked_s[engine] = self.booked_s.get(engine, 0.0) + work
        self.heard(engine, work, now)

    def heard(self, engine: K, work_s: float, now: float) -> None:
        """`work_s` more prefill committed to the engine, by this replica or another."""
        self.fleet_finish[engine] = max(self.fleet_finish.get(engine, now), now) + work_s

    def others_say(self, engine: K, busy: bool) -> None:
        """Whether the other replicas, by their last words, have prefill legs committed
        to the engine; none and none of this replica's: the queue is empty."""
        if busy:
            self.others_busy.add(engine)
            return
        self.others_busy.discard(engine)
        if not self.committed.get(engine):
            self.fleet_finish.pop(engine, None)

    def fleet_wait_s(self, engine: K, now: float) -> float:
        """The engine's wait over every replica's commits. Legs still running past the
        queue's finish are overdue, as in `wait_s`; but not past this replica's own
        finish, which the others' work on the engine delays: that overdue time is
        queueing, not a slow engine, and counting it priced three replicas' queues high."""
        finish = self.fleet_finish.get(engine, now)
        if finish >= now:
            return finish - now
        busy = self.committed.get(engine, 0) > 0 or engine in self.others_busy
        return now - finish if busy else 0.0

    def release(self, engine: K) -> None:
        left = self.committed.get(engine, 0) - 1
        if left > 0:
            self.committed[engine] = left
        else:
            self.committed.pop(engine, None)
            self.finish.pop(engine, None)
            if engine not in self.others_busy:
                self.fleet_finish.pop(engine, None)

    def waits(self, now: float) -> Mapping[K, float]:
        return {engine: self.wait_s(engine, now) for engine in self.finish}


@attrs.define
class _Decaying(Generic[K]):
    """A value per engine that decays towards zero with time constant `tau_s` since it
    was last set."""

    tau_s: float = 1.0
    value: dict[K, float] = attrs.Factory(dict)
    at: dict[K, float] = attrs.Factory(dict)

    def current(self, engine: K, now: float) -> float:
        value = self.value.get(engine)
        if value is None:
            return 0.0
        return value * math.exp(-max(0.0, now - self.at[engine]) / self.tau_s)

    def forget(self, engine: K) -> None:
        """Drop the engine's value: it is gone (a reload removed or replaced it)."""
        self.value.pop(engine, None)
        self.at.pop(engine, None)

    def _set(self, engine: K, value: float, now: float) -> None:
        self.value[engine] = value
        self.at[engine] = now


@attrs.define
class FirstTokenLag(_Decaying[K]):
    """Recent decode-side first-token latency per engine: from the decode request to its
    first token (KV pull, a slot in the batch, the first step), for P/D decode legs that
    start after their prefill answered.

    An exponentially weighted mean of the observations (weight `alpha` for the newest),
    decaying towards zero with time constant `tau_s` since the last one: a decode engine
    that stops being slow, or stops being chosen, is forgotten within a few `tau_s`.
    """

    alpha: float = 0.3

    def lag_s(self, engine: K, now: float) -> float:
        return self.current(engine, now)

    def observe(self, engine: K, lag_s: float, now: float) -> None:
        lag_s = max(0.0, lag_s)
        if engine in self.value:
            current = self.current(engine, now)
            lag_s = current + self.alpha * (lag_s - current)
        self._set(engine, lag_s, now)


@attrs.define
class KvTurnover(_Decaying[K]):
    """KV tokens each engine has lately freed per second (decode legs ending, with their
    prompt and generated tokens): an exponentially decayed sum over time constant
    `tau_s`, divided by `tau_s`, so a burst of releases and a quiet spell both fade in
    a few `tau_s`."""

    def observe(self, engine: K, tokens: int, now: float) -> None:
        self._set(engine, self.current(engine, now) + max(0, tokens), now)

    def rate_per_s(self, engine: K, now: float) -> float:
        return self.current(engine, now) / self.tau_s


class ProfileSource(Protocol):
    """Where pricing gets each engine's curves (the profile store, adapted)."""

    def prefill_curve(self, engine_id: str) -> PrefillCurve | None: ...

    def decode_curve(self, engine_id: str) -> DecodeCurve | None: ...

    def handoff_s(self, prompt_tokens: int) -> float: ...

    def decode_correction(self, engine_id: str) -> float: ...

    def kv_capacity_tokens(self, engine_id: str) -> int | None: ...


def unstreamed_tokens(view: EngineView, decode: DecodeCurve | None, correction: float) -> float:
    """`EngineView.unstreamed_tokens` at the engine's decode step: the profile's interval
    at its load, corrected like every decode interval (0 without a decode profile, which
    also leaves no KV capacity to price against)."""
    if not view.unstreamed_age_s or decode is None:
        return 0.0
    step = decode.interval_s(max(1, view.decode_active), view.decode_tokens) * correction
    return view.unstreamed_tokens(step)


_NONE: Mapping[str, float] = MappingProxyType({})
_NO_TOKENS: Mapping[str, int] = MappingProxyType({})


def price_fleet(
    views: Iterable[EngineView],
    source: ProfileSource,
    *,
    backlog_s: Mapping[str, float] = _NONE,
    first_token_lag_s: Mapping[str, float] = _NONE,
    kv_release_per_s: Mapping[str, float] = _NONE,
    cached_tokens: Mapping[str, int] = _NO_TOKENS,
) -> dict[str, Priced]:
    """Price each engine from its view, its profile, its load signals and the prefix of
    the prompt it holds cached (by engine id, read from the books for the engines in the
    fleet now; absent is none)."""
    return {
        view.id: Priced(
            view,
            source.prefill_curve(view.id),
            source.decode_curve(view.id),
            backlog_s.get(view.id, 0.0),
            source.decode_correction(view.id),
            # A first token already overdue is a lower bound on the lag, seen before
            # the token arrives: a decode batch that fills shows here first.
            max(view.first_token_wait_s, first_token_lag_s.get(view.id, 0.0)),
            source.kv_capacity_tokens(view.id),
            kv_release_per_s.get(view.id, 0.0),
            cached_tokens.get(view.id, 0),
        )
        for view in views
    }


def placement_policy(
    priced: Mapping[str, Priced],
    *,
    prompt_tokens: int,
    handoff_s: float,
    ttft_budget_s: float,
    tpot_target_s: float,
    affinity: float = 1.0,
) -> Policy:
    """Placement's projected-SLO filters and costs (docs/design.md#placement), from the same prices.

    A prefill engine complies when its path's projected TTFT fits the budget; a decode
    engine when its projected interval with this request added fits the TPOT target.
    Costs are the projected seconds themselves, so the cheapest compliant engine wins.
    A cached prefix takes `affinity` (cache.affinity) times what it saves off an
    engine's cost, and at most what it saves off its projection: 0 places as if nothing
    were cached, above 1 trades backlog for cache hits.
    """
    first_step = min(
        (p.first_step_s(prompt_tokens) for p in priced.values() if p.view.role == "decode"),
        default=0.0,
    )

    credit = min(1.0, affinity)

    def prefill_seconds(view: EngineView) -> float:
        p = priced[view.id]
        return p.backlog_s + p.prefill_s(prompt_tokens, credit)

    def prefill_cost(view: EngineView) -> float:
        p = priced[view.id]
        return p.backlog_s + p.prefill_s(prompt_tokens, affinity)

    def decode_seconds(view: EngineView) -> float:
        p = priced[view.id]
        return math.inf if p.decode is None else p.first_step_s(prompt_tokens)

    def decode_cost(view: EngineView) -> float:
        # A decode engine that has lately been slow to a first token, or has no KV room
        # for the prompt, costs that delay.
        first = decode_seconds(view)
        if math.isinf(first):
            return first
        return first + priced[view.id].decode_side(prompt_tokens, handoff_s, first).delay_s()

    return Policy(
        prefill_ok=lambda v: prefill_seconds(v) + handoff_s + first_step <= ttft_budget_s,
        decode_ok=lambda v: decode_seconds(v) <= tpot_target_s,
        # Up to 1 the cost is the projection itself: one price per engine.
        prefill_cost=prefill_seconds if affinity <= 1.0 else prefill_cost,
        decode_cost=decode_cost,
    )
