"""The latency models of one engine (and of one ordered engine pair), and their fits.

All times are wall-clock seconds as a client of the engine observes them: a prefill
sample is the round trip of a one-token request on an idle engine, so the fitted constant
term includes the engine's HTTP and tokenisation overhead, which the router's prefill leg
pays too. Predictions are never negative: coefficients are fitted non-negative (`_fit`)
and token counts below zero are treated as zero.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, TypeVar

import attrs
import numpy as np

from ._fit import FitError, Matrix, quantile, relative_residuals, robust_lstsq

Quantile = Literal["p50", "p99"]


def _finite_nonnegative(_inst: object, attr: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{attr.name} is {value!r}; must be finite and >= 0")


def _positive_finite(_inst: object, attr: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{attr.name} is {value!r}; must be finite and > 0")


def _nonnegative_int(_inst: object, attr: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise ValueError(f"{attr.name} is {value!r}; must be >= 0")


@attrs.frozen(kw_only=True)
class PrefillModel:
    """Prefill latency ``a + b·n + c·n²`` (seconds) for an n-token prompt on an idle engine.

    ``min_tokens``/``max_tokens`` is the measured domain. The fit's quality is two
    separate things (see `_quality`): ``residual_*`` is model error, over the ``points``
    measured sizes (each size's median time against the prediction), and ``spread_*`` is
    the repeats' own scatter around their size's median.
    """

    a_s: float = attrs.field(validator=_finite_nonnegative)
    b_s_per_token: float = attrs.field(validator=_finite_nonnegative)
    c_s_per_token2: float = attrs.field(validator=_finite_nonnegative)
    min_tokens: int = attrs.field(validator=_nonnegative_int)
    max_tokens: int = attrs.field(validator=_nonnegative_int)
    samples: int = attrs.field(default=0, validator=_nonnegative_int)
    residual_p50: float = attrs.field(default=0.0, validator=_finite_nonnegative)
    residual_p90: float = attrs.field(default=0.0, validator=_finite_nonnegative)
    residual_max: float = attrs.field(default=0.0, validator=_finite_nonnegative)
    # 0: a store written before the residuals were model error (see `_quality`).
    points: int = attrs.field(default=0, validator=_nonnegative_int)
    spread_p50: float = attrs.field(default=0.0, validator=_finite_nonnegative)
    spread_p90: float = attrs.field(default=0.0, validator=_finite_nonnegative)
    spread_max: float = attrs.field(default=0.0, validator=_finite_nonnegative)
    # Seconds per cached prompt token that a cached prefix does not save (tokenising,
    # hashing and carrying the whole prompt), fitted on the cached-prefill points
    # (`narwhal.probe._cached`); 0 before they are measured: the law alone.
    cached_token_s: float = attrs.field(default=0.0, validator=_finite_nonnegative)

    @max_tokens.validator
    def _check_domain(self, attr: attrs.Attribute[int], value: int) -> None:
        if value < self.min_tokens:
            raise ValueError(f"max_tokens is {value}; must be >= min_tokens={self.min_tokens}")

    def prefill_s(self, n: float) -> float:
        n = max(0.0, float(n))
        return self.a_s + self.b_s_per_token * n + self.c_s_per_token2 * n * n

    def in_domain(self, n: float) -> bool:
        return self.min_tokens <= n <= self.max_tokens


def fit_prefill(
    samples: Sequence[tuple[int, float]], *, groups: Sequence[object] | None = None
) -> PrefillModel:
    """Fit `PrefillModel` to (prompt tokens, seconds) samples.

    The repeats of one size (``groups`` labels each sample, e.g. with the size the sweep
    aimed at, since text prompts of one target land on slightly different token counts;
    by default samples group by exact token count) are reduced to their median tokens and
    median time before fitting, so a stray GC pause or scheduler hiccup in one repeat does
    not bend the curve. The residuals are taken over those medians (what the curve was
    fitted to: model error) and the spread over every sample against its own size's median.
    """
    labels = list(groups) if groups is not None else [n for n, _ in samples]
    if len(labels) != len(samples):
        raise ValueError(f"{len(samples)} samples but {len(labels)} group labels")
    clean: list[tuple[int, float]] = []
    by_group: dict[object, list[tuple[int, float]]] = {}
    for (n, t), label in zip(samples, labels, strict=True):
        if n >= 0 and math.isfinite(t) and t > 0:
            clean.append((int(n), float(t)))
            by_group.setdefault(label, []).append((int(n), float(t)))
    if not clean:
        raise FitError("no usable prefill samples")
    groups_by_size = sorted(
        (
            (float(np.median([n for n, _ in g])), float(np.median([t for _, t in g]))),
            [t for _, t in g],
        )
        for g in by_group.values()
    )
    medians = [m for m, _ in groups_by_size]
    sizes = np.array([n for n, _ in medians], dtype=np.float64)
    times = np.array([t for _, t in medians], dtype=np.float64)
    design = np.column_stack([np.ones_like(sizes), sizes, sizes * sizes])
    # Fewer distinct sizes than coefficients would make the fit underdetermined; NNLS
    # still answers (it picks a support), which is the best the data allows.
    a, b, c = (float(v) for v in robust_lstsq(design, times))
    model = PrefillModel(
        a_s=a,
        b_s_per_token=b,
        c_s_per_token2=c,
        min_tokens=min(n for n, _ in clean),
        max_tokens=max(n for n, _ in clean),
        samples=len(clean),
    )
    residual = _summary(
        relative_residuals([model.prefill_s(n) for n, _ in medians], [t for _, t in medians])
    )
    spread = _summary(
        relative_residuals(
            [t for _, repeats in groups_by_size for t in repeats],
            [median for (_, median), repeats in groups_by_size for _ in repeats],
        )
    )
    return _with_quality(model, len(medians), residual, spread)


_Model = TypeVar("_Model", "PrefillModel", "DecodeModel")


def _with_quality(
    model: _Model,
    points: int,
    residual: tuple[float, float, float],
    spread: tuple[float, float, float],
) -> _Model:
    """`model` with its fit's quality: model error and measurement spread, each as
    (p50, p90, max), over `points` measured points (`_quality`)."""
    return attrs.evolve(
        model,
        points=points,
        residual_p50=residual[0],
        residual_p90=residual[1],
        residual_max=residual[2],
        spread_p50=spread[0],
        spread_p90=spread[1],
        spread_max=spread[2],
    )


def with_worst_fit(model: _Model, fitted: Sequence[_Model]) -> _Model:
    """`model` (made from `fitted`, as the mean profile is) with the worst of their fits'
    quality: the largest residuals and spreads, the fewest points (0, a store that
    predates model error, if any of them has it)."""
    return _with_quality(
        model,
        min(m.points for m in fitted),
        (
            max(m.residual_p50 for m in fitted),
            max(m.residual_p90 for m in fitted),
            max(m.residual_max for m in fitted),
        ),
        (
            max(m.spread_p50 for m in fitted),
            max(m.spread_p90 for m in fitted),
            max(m.spread_max for m in fitted),
        ),
    )


def _summary(values: Matrix) -> tuple[float, float, float]:
    """(p50, p90, max); zeros when there is nothing to summarise."""
    if values.size == 0:
        return 0.0, 0.0, 0.0
    return quantile(values, 0.5), quantile(values, 0.9), float(np.max(values))


@attrs.frozen(kw_only=True)
class DecodeModel:
    """Decode token interval ``t0 + α·kv + β·active`` (seconds).

    ``kv_tokens`` is the KV resident in the decode batch and ``active`` the number of
    requests decoding: two separate inputs, because a batch of many short requests and one
    of few long ones cost differently. ``idle_floor_s`` is the measured zero-contention
    interval (one request, the shortest context of the sweep). ``residual_*`` is model
    error over the ``points`` measured operating points (each point's median gap against
    the prediction); ``spread_*`` is the gaps' own scatter around their point's median
    (see `_quality`). ``samples`` counts the gaps.

    The measured domain is the box ``1 <= active <= max_active``, ``0 <= kv <= max_kv``:
    the low corner is anchored by the idle-floor measurement, so only the upper edges are
    extrapolation. ``min_active``/``min_kv_tokens`` record the smallest measured point.
    """

    t0_s: float = attrs.field(validator=_finite_nonnegative)
    kv_s_per_token: float = attrs.field(validator=_finite_nonnegative)
    active_s_per_request: float = attrs.field(validator=_finite_nonnegative)
    idle_floor_s: float = attrs.field(validator=_finite_nonnegative)
    min_active: int = attrs.field(validator=_nonnegative_int)
    max_active: int = attrs.field(validator=_nonnegative_int)
    min_kv_tokens: int = attrs.field(validator=_nonnegative_int)
    max_kv_tokens: int = attrs.field(validator=_nonnegative_int)
    samples: int = attrs.field(default=0, validator=_nonnegative_int)
    residual_p50: float = attrs.field(default=0.0, validator=_finite_nonnegative)
    residual_p90: float = attrs.field(default=0.0, validator=_finite_nonnegative)
    residual_max: float = attrs.field(default=0.0, validator=_finite_nonnegative)
    # 0: a store written before the residuals were model error (see `_quality`).
    points: int = attrs.field(default=0, validator=_nonnegative_int)
    spread_p50: float = attrs.field(default=0.0, validator=_finite_nonnegative)
    spread_p90: float = attrs.field(default=0.0, validator=_finite_nonnegative)
    spread_max: float = attrs.field(default=0.0, validator=_finite_nonnegative)

    @max_active.validator
    def _check_active(self, attr: attrs.Attribute[int], value: int) -> None:
        if value < self.min_active:
            raise ValueError(f"max_active is {value}; must be >= min_active={self.min_active}")

    @max_kv_tokens.validator
    def _check_kv(self, attr: attrs.Attribute[int], value: int) -> None:
        if value < self.min_kv_tokens:
            raise ValueError(
                f"max_kv_tokens is {value}; must be >= min_kv_tokens={self.min_kv_tokens}"
            )

    def interval_s(self, active: float, kv_tokens: float) -> float:
        active = max(0.0, float(active))
        kv_tokens = max(0.0, float(kv_tokens))
        return self.t0_s + self.kv_s_per_token * kv_tokens + self.active_s_per_request * active

    def in_domain(self, active: float, kv_tokens: float) -> bool:
        """Inside the measured batches (from one request), or the idle point (nothing
        resident), which the idle floor measures."""
        if active <= 0 and kv_tokens <= 0:
            return True
        return 1 <= active <= self.max_active and 0 <= kv_tokens <= self.max_kv_tokens


@attrs.frozen
class DecodePoint:
    """One measured decode operating point: the median gap at (active, kv_tokens)."""

    active: int
    kv_tokens: int
    interval_s: float
    # Every individual gap of the window, for the spread around the median.
    gaps: tuple[float, ...] = ()


def fit_decode(points: Sequence[DecodePoint], *, idle_floor_s: float | None = None) -> DecodeModel:
    """Fit `DecodeModel` to measured points (non-negative, relative least squares).

    ``idle_floor_s`` is the measured zero-contention interval; without it the floor is the
    fitted interval at one request and the smallest measured KV.
    """
    usable = [
        p
        for p in points
        if p.active >= 1 and p.kv_tokens >= 0 and math.isfinite(p.interval_s) and p.interval_s > 0
    ]
    if not usable:
        raise FitError("no usable decode points")
    active = np.array([p.active for p in usable], dtype=np.float64)
    kv = np.array([p.kv_tokens for p in usable], dtype=np.float64)
    observed = np.array([p.interval_s for p in usable], dtype=np.float64)
    design = np.column_stack([np.ones_like(kv), kv, active])
    t0, alpha, beta = (float(v) for v in robust_lstsq(design, observed))
    min_kv = int(kv.min())
    floor = idle_floor_s
    if floor is None or not (math.isfinite(floor) and floor > 0):
        floor = t0 + alpha * min_kv + beta
    model = DecodeModel(
        t0_s=t0,
        kv_s_per_token=alpha,
        active_s_per_request=beta,
        idle_floor_s=floor,
        min_active=int(active.min()),
        max_active=int(active.max()),
        min_kv_tokens=min_kv,
        max_kv_tokens=int(kv.max()),
        samples=sum(max(1, len(p.gaps)) for p in usable),
    )
    # Model error is each point's median against the prediction: the medians are what the
    # model was fitted to and what it is asked for. Taken over every gap instead, it mixed
    # in the gaps' own jitter (a client that reads two token events in one go sees a
    # near-zero gap: 100 %), so a good fit read as a p90 of 30-80 %. That jitter is the
    # spread, reported apart. Both are relative to the expected value (the prediction, the
    # median), never to a gap, which can be near zero.
    residual = _summary(
        relative_residuals(
            [p.interval_s for p in usable],
            [model.interval_s(p.active, p.kv_tokens) for p in usable],
        )
    )
    spread = _summary(
        relative_residuals(
            [g for p in usable for g in p.gaps], [p.interval_s for p in usable for _ in p.gaps]
        )
    )
    return _with_quality(model, len(usable), residual, spread)


@attrs.frozen(kw_only=True)
class HandoffBucket:
    """Crossed-handoff timings for one context size.

    ``p50_s``/``p99_s``: from the prefill response to the first decode token (KV transfer
    plus the first decode step plus HTTP); what a P/D path adds on top of the prefill.
    ``first_token_p50_s``/``p99_s``: from opening the decode request to its first token,
    the span ``engine.first_token_timeout_s`` bounds. They coincide for vLLM, whose
    decode leg starts as soon as the prefill answers; for SGLang the legs run concurrently and the
    first-token span includes the prefill.
    """

    tokens: int = attrs.field(validator=_nonnegative_int)
    min_tokens: int = attrs.field(validator=_nonnegative_int)
    max_tokens: int = attrs.field(validator=_nonnegative_int)
    samples: int = attrs.field(validator=_nonnegative_int)
    p50_s: float = attrs.field(validator=_finite_nonnegative)
    p99_s: float = attrs.field(validator=_finite_nonnegative)
    first_token_p50_s: float = attrs.field(validator=_finite_nonnegative)
    first_token_p99_s: float = attrs.field(validator=_finite_nonnegative)


@attrs.frozen(kw_only=True)
class HandoffSample:
    tokens: int
    handoff_s: float
    first_token_s: float


@attrs.frozen(kw_only=True)
class HandoffProfile:
    """Crossed prefill→decode timings for one ordered pair (prefill engine, decode engine).

    Lookups interpolate linearly in prompt tokens between buckets (KV transfer is linear
    in the prompt) and clamp to the end buckets outside the measured range.
    """

    prefill: str
    decode: str
    buckets: tuple[HandoffBucket, ...] = attrs.field()

    @buckets.validator
    def _check_buckets(
        self, attr: attrs.Attribute[object], value: tuple[HandoffBucket, ...]
    ) -> None:
        if not value:
            raise ValueError("buckets is empty; a handoff profile needs at least one bucket")
        tokens = [b.tokens for b in value]
        if tokens != sorted(tokens) or len(set(tokens)) != len(tokens):
            raise ValueError(f"bucket tokens {tokens} must be strictly increasing")

    def _lookup(self, tokens: float, field: str) -> float:
        xs = [float(b.tokens) for b in self.buckets]
        ys = [float(getattr(b, field)) for b in self.buckets]
        return float(np.interp(max(0.0, float(tokens)), xs, ys))

    def p50_s(self, tokens: float) -> float:
        return self._lookup(tokens, "p50_s")

    def p99_s(self, tokens: float) -> float:
        return self._lookup(tokens, "p99_s")

    def quantile_s(self, tokens: float, q: Quantile) -> float:
        return self.p99_s(tokens) if q == "p99" else self.p50_s(tokens)

    def first_token_p99_s(self, tokens: float) -> float:
        return self._lookup(tokens, "first_token_p99_s")

    @property
    def max_p99_s(self) -> float:
        return max(b.p99_s for b in self.buckets)

    @property
    def max_first_token_p99_s(self) -> float:
        return max(b.first_token_p99_s for b in self.buckets)

    @property
    def min_tokens(self) -> int:
        return self.buckets[0].min_tokens

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1].max_tokens

    def in_domain(self, tokens: float) -> bool:
        return self.min_tokens <= tokens <= self.max_tokens


def handoff_profile(
    prefill: str, decode: str, samples_by_bucket: Sequence[Sequence[HandoffSample]]
) -> HandoffProfile:
    """Summarise crossed-handoff samples, one sequence per context-size bucket."""
    buckets: list[HandoffBucket] = []
    for group in samples_by_bucket:
        ok = [
            s
            for s in group
            if math.isfinite(s.handoff_s)
            and s.handoff_s >= 0
            and math.isfinite(s.first_token_s)
            and s.first_token_s >= 0
        ]
        if not ok:
            continue
        tokens = [s.tokens for s in ok]
        handoffs = [s.handoff_s for s in ok]
        firsts = [s.first_token_s for s in ok]
        buckets.append(
            HandoffBucket(
                tokens=int(np.median(tokens)),
                min_tokens=min(tokens),
                max_tokens=max(tokens),
                samples=len(ok),
                p50_s=quantile(handoffs, 0.5),
                p99_s=quantile(handoffs, 0.99),
                first_token_p50_s=quantile(firsts, 0.5),
                first_token_p99_s=quantile(firsts, 0.99),
            )
        )
    buckets.sort(key=lambda b: b.tokens)
    # Two buckets whose medians coincide (tiny prompts) carry the same information.
    merged: list[HandoffBucket] = []
    for b in buckets:
        if merged and merged[-1].tokens == b.tokens:
            prev = merged[-1]
            merged[-1] = attrs.evolve(
                prev,
                min_tokens=min(prev.min_tokens, b.min_tokens),
                max_tokens=max(prev.max_tokens, b.max_tokens),
                samples=prev.samples + b.samples,
                p50_s=max(prev.p50_s, b.p50_s),
                p99_s=max(prev.p99_s, b.p99_s),
                first_token_p50_s=max(prev.first_token_p50_s, b.first_token_p50_s),
                first_token_p99_s=max(prev.first_token_p99_s, b.first_token_p99_s),
            )
        else:
            merged.append(b)
    if not merged:
        raise FitError(f"no usable handoff samples for {prefill} -> {decode}")
    return HandoffProfile(prefill=prefill, decode=decode, buckets=tuple(merged))


@attrs.frozen(kw_only=True)
class CachedPoint:
    """One prompt of `tokens` tokens whose first `cached` the engine held in its prefix
    cache: its prefill seconds (median of the repeats) and what the cached-prefill law
    (`narwhal.admission.cached_prefill_s` on the engine's prefill model) predicted."""

    tokens: int = attrs.field(validator=_nonnegative_int)
    cached: int = attrs.field(validator=_nonnegative_int)
    seconds: float = attrs.field(validator=_finite_nonnegative)
    predicted_s: float = attrs.field(validator=_finite_nonnegative)


@attrs.frozen(kw_only=True)
class CachedPrefill:
    """What narwhal-profile measured of an engine's prefix cache (narwhal.probe._cached).

    ``seen``: a prompt sent twice was served faster the second time (or the engine's
    ``usage.prompt_tokens_details.cached_tokens`` said it hit); False records an engine
    with no prefix cache, and then there are no points. ``probe_tokens``, ``cold_s`` and
    ``warm_s`` are that repeated prompt and its two times. ``points`` are prompts whose
    leading blocks repeat a prompt just sent, and ``residual_*`` the law's relative error
    on them, |predicted - measured| / measured (p90 is the largest with ten points or
    fewer). ``cached_source`` says how each point's cached tokens were known.
    """

    seen: bool
    block_size: int = attrs.field(default=0, validator=_nonnegative_int)
    cached_source: str = ""
    probe_tokens: int = attrs.field(default=0, validator=_nonnegative_int)
    cold_s: float = attrs.field(default=0.0, validator=_finite_nonnegative)
    warm_s: float = attrs.field(default=0.0, validator=_finite_nonnegative)
    points: tuple[CachedPoint, ...] = ()
    residual_p50: float = attrs.field(default=0.0, validator=_finite_nonnegative)
    residual_p90: float = attrs.field(default=0.0, validator=_finite_nonnegative)
    residual_max: float = attrs.field(default=0.0, validator=_finite_nonnegative)


def cached_prefill(
    *,
    block_size: int,
    cached_source: str,
    probe_tokens: int,
    cold_s: float,
    warm_s: float,
    points: Sequence[CachedPoint],
) -> CachedPrefill:
    """A seen prefix cache with the law's residuals over `points`."""
    p50, p90, worst = _summary(
        relative_residuals([p.predicted_s for p in points], [p.seconds for p in points])
    )
    return CachedPrefill(
        seen=True,
        block_size=block_size,
        cached_source=cached_source,
        probe_tokens=probe_tokens,
        cold_s=cold_s,
        warm_s=warm_s,
        points=tuple(points),
        residual_p50=p50,
        residual_p90=p90,
        residual_max=worst,
    )


KV_CONNECTOR = ("", "present", "none")


def _kv_connector(_inst: object, attr: attrs.Attribute[str], value: str) -> None:
    if value not in KV_CONNECTOR:
        raise ValueError(f"{attr.name} is {value!r}; must be 'present', 'none' or ''")


def build_identity(
    *, dialect: str, version: str, build: str = "", model: str, max_model_len: int
) -> str:
    """An engine's build identity: what a profile is only valid for.

    ``version`` is the engine's ``/version`` answer (SGLang: ``/get_server_info``), ``build``
    any build string the engine reports beside it (empty for stock vLLM). Engines that
    agree on all of these run the same code on the same model and context limit.
    """
    extra = f" [{build}]" if build else ""
    return f"{dialect} {version}{extra} model={model} max_model_len={max_model_len}"


@attrs.frozen(kw_only=True)
class EngineProfile:
    """Everything measured about one engine.

    ``build`` is the engine's build identity (engine version and build, model,
    max_model_len): a profile measured on another build is stale.
    """

    id: str
    url: str
    dialect: str
    model: str
    build: str
    max_model_len: int = attrs.field(validator=_nonnegative_int)
    kv_capacity_tokens: int = attrs.field(validator=_nonnegative_int)
    prefill: PrefillModel
    decode: DecodeModel
    chars_per_token: float = attrs.field(validator=_positive_finite)
    # Where kv_capacity_tokens came from, e.g. "vllm:cache_config_info".
    kv_capacity_source: str = ""
    # Requests the engine runs at once (vLLM --max-num-seqs, SGLang
    # --max-running-requests); 0 when unknown. The role controller bounds a decode
    # engine's projected batch by it, as by serving.decode_concurrency.
    max_num_seqs: int = attrs.field(default=0, validator=_nonnegative_int)
    max_num_seqs_source: str = ""
    # How the prefill and decode models were obtained when not the usual way (an idle
    # engine's own plain requests); "" for that usual way. An SGLang prefill or decode
    # server only serves requests in bootstrap pairs, so one of its models includes its
    # partner's work or is its partner's (see narwhal.probe's sweep).
    prefill_source: str = ""
    decode_source: str = ""
    # What the engine's answer to the router's prefill leg said of its KV connector:
    # "present" (it answered with kv_transfer_params), "none" (kv_transfer_params: null:
    # it can hand no KV over, so no crossed pair includes it; an aggregate engine) or ""
    # (not known: an SGLang engine, which pairs by bootstrap rooms, or an older store).
    kv_connector: str = attrs.field(default="", validator=_kv_connector)
    # How the engine's prefix cache follows the cached-prefill law (None: not measured,
    # an older store or an SGLang prefill/decode server).
    cached: CachedPrefill | None = None
