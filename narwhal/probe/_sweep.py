"""narwhal-profile's measurement sweep: drive every engine directly and fit its models.

What is measured, and how (everything is wall-clock as a client of the engine sees it):

* Identity: ``/version`` (engine version and build), ``/v1/models`` (served model,
  ``max_model_len``; ``/tokenize`` when the card lacks it), KV capacity from
  ``vllm:cache_config_info`` (num_gpu_blocks × block_size) or SGLang's
  ``/get_server_info`` (max_total_num_tokens); failing both, estimated from
  ``kv_cache_usage_perc`` while the decode sweep holds a known number of tokens.
* chars/token: ``/tokenize`` on calibration texts of the sweep's own generator,
  Σ characters / Σ tokens (the engine's count, BOS included, as a prompt is charged).
* Prefill: plain non-streaming completions with ``max_tokens: 1`` on an otherwise idle
  engine (prompts up to 1024 tokens get three times the repeats: they are cheap and the
  noisiest relative to their length), timed from sending the request to the end of the
  response; the prompt length is the response's ``usage.prompt_tokens``. Plain requests
  (not the router's P leg with ``kv_transfer_params.do_remote_decode``) because the
  compute is the same and a P leg would leave its KV leased on the engine for the lease
  time, filling the cache and skewing the decode sweep that follows. The sample therefore
  includes the engine's HTTP and tokenisation overhead, as the router's prefill leg does.
* Decode: for each (active requests B, context L) point, B−1 streamed "load" requests are
  opened and left unread, then one streamed probe request; once the probe's prefill is
  done every request is decoding, and the probe's inter-token gaps (SSE arrival times)
  are the engine's decode step at that batch. Active requests and resident KV are read
  from ``/metrics`` right after the window (running requests, KV usage × capacity).
  Loads are cancelled (connection closed, so the engine aborts them) and the engine is
  waited on until idle before the next point. A point whose KV would pass
  ``SweepPlan.kv_budget`` of the cache is skipped, and so is one the engine will not run
  at once (its ``max_num_seqs`` or free KV below the point: the running count settles
  while loads still wait, for ``SweepPlan.decode_cap_stall_s``), with every larger one.
  With the KV capacity known (so the point fit the KV budget), that running count is
  the engine's ``max_num_seqs`` and the profile records it, unless the engine published
  its own (SGLang's ``/get_server_info`` ``max_running_requests``).
  The default batches reach 256, vLLM's usual ``max_num_seqs``: the role controller only
  moves to a split whose decode batches lie inside the measured domain.
  A point whose probe brings too few gaps (the engine sent its tokens in a few bursts,
  as a CPU-starved vLLM API server does) is measured again, at most twice, and then
  skipped; the fit takes the points measured.
* Cached prefill (engines that serve prefill, not SGLang prefill/decode servers): right
  after the prefill fit, whether the engine keeps a prefix cache and how its prefill of a
  prompt whose leading blocks it holds follows `narwhal.admission.cached_prefill_s` on
  the fitted curve (`narwhal.probe._cached`): a repeated prompt, then a few (n, cached)
  points, ``SweepPlan.cached_repeats`` times each (0: not measured). On narwhal-sim with
  its default law that is 26 requests (and as many /tokenize), about 2 s at speed 1.
* KV connector: each vLLM engine gets the router's P leg once; one that answers with
  ``kv_transfer_params: null`` has no KV connector (an aggregate engine): it is
  profiled on itself alone and joins no crossed pair (`kv_connectors`).
* Crossed handoff: for every ordered pair (i, j), i ≠ j (every pair when there is one
  engine: (i, i)), of engines that can hand KV over, the router's P leg on i and its
  decode leg on j, across context sizes up to max_model_len; timed from the prefill
  response to the first decode token, and from opening the decode request to the first
  token. A fleet without such a pair (every engine aggregate) stores no handoff.

SGLang servers launched as prefill or decode (configured role ``prefill``/``decode``)
answer only bootstrap pairs, each request paired with the first engine of the other role
(`EngineClient.partner`), and are measured one at a time whatever ``--parallel`` says, as
a pair loads two engines. A prefill server's curve is its leg's round trip, which includes
the bootstrap handshake and the KV transfer to the decode partner: it is stored as
measured, and says so in ``prefill_source``. Its decode model cannot be measured (a
prefill server never decodes): it is the partner's, and ``decode_source`` says so. A
decode server's decode points are its own steps (the gaps after the first token); its
prefill model is its prefill partner's (a decode server computes no prompt). Crossed
pairs are only prefill -> decode (`crossed_pairs`). An engine whose reported
``disaggregation_mode`` is not its configured role fails the sweep.

Every loop is bounded in count; the whole sweep is bounded by ``SweepPlan.budget_s`` and
every request by ``SweepPlan.request_timeout_s``.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import random
import statistics
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import attrs
import trio

from .. import __version__
from ..config import Config
from ..profiles import (
    CachedPrefill,
    DecodeModel,
    DecodePoint,
    EngineProfile,
    FitError,
    HandoffProfile,
    HandoffSample,
    MeasuredFacts,
    PrefillModel,
    ProfileStore,
    crossed_pairs,
    fit_decode,
    fit_prefill,
    handoff_profile,
)
from ._cached import cached_summary, measure_cached_prefill, requests as cached_requests
from ._client import (
    EngineClient,
    Identity,
    KvConnector,
    ProbeError,
    crossed_handoff,
    kv_connectors,
    mode_mismatch,
)
from ._texts import TextMaker

Progress = Callable[[str], None]
T = TypeVar("T")

# Gaps of a decode point that must at least be measured for its median to count.
_MIN_GAPS = 4
# Further tries of a decode point whose probe gave fewer (`TooFewGaps`).
_GAP_RETRIES = 2
_IDLE_WAIT_S = 30.0
_IDLE_POLL_S = 0.01
_CAP_POLL_S = 0.05
_SHORT_PROMPT = 1024


def _positive_ints(
    _inst: object, attr: attrs.Attribute[Any], value: tuple[int, ...] | None
) -> None:
    if value is None:
        return
    if not value or any(not isinstance(v, int) or v < 1 for v in value):
        raise ValueError(f"{attr.name} is {value!r}; must be positive integers")


def _positive(_inst: object, attr: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{attr.name} is {value!r}; must be a positive number")


def _fraction(_inst: object, attr: attrs.Attribute[float], value: float) -> None:
    if not (isinstance(value, int | float) and 0 < value <= 1):
        raise ValueError(f"{attr.name} is {value!r}; must be in (0, 1]")


def _non_negative_int(_inst: object, attr: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise ValueError(f"{attr.name} is {value!r}; must be >= 0")


def _at_least_one(_inst: object, attr: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attr.name} is {value!r}; must be >= 1")


@attrs.frozen(kw_only=True)
class SweepPlan:
    """Sizes and counts of the sweep. ``None`` sizes derive from each engine's
    max_model_len (see `prefill_targets`, `decode_contexts`, `handoff_targets`)."""

    prefill_sizes: tuple[int, ...] | None = attrs.field(default=None, validator=_positive_ints)
    prefill_repeats: int = attrs.field(default=3, validator=_at_least_one)
    decode_active: tuple[int, ...] = attrs.field(
        default=(1, 4, 16, 64, 128, 256), validator=_positive_ints
    )
    decode_contexts: tuple[int, ...] | None = attrs.field(default=None, validator=_positive_ints)
    decode_gaps: int = attrs.field(default=24, validator=_at_least_one)
    # Gaps after the probe's first token that are not measured (the batch settles).
    decode_skip: int = 2
    handoff_sizes: tuple[int, ...] | None = attrs.field(default=None, validator=_positive_ints)
    handoff_repeats: int = attrs.field(default=4, validator=_at_least_one)
    # Repeats of each cached-prefill point (`narwhal.probe._cached`); 0 skips the step.
    cached_repeats: int = attrs.field(default=5, validator=_non_negative_int)
    # Engines measured at the same time (and disjoint pairs during the handoff sweep).
    parallel: int = attrs.field(default=1, validator=_at_least_one)
    budget_s: float = attrs.field(default=900.0, validator=_positive)
    request_timeout_s: float = attrs.field(default=120.0, validator=_positive)
    # A decode point may hold at most this fraction of the engine's KV capacity.
    kv_budget: float = attrs.field(default=0.5, validator=_fraction)
    # A decode point's loads have all been admitted once the engine queues none of them.
    # While some still wait, the running count grows as their prefills proceed (at least
    # one per scheduler step); if it stays put this long, the engine's own cap (its
    # max_num_seqs, or a full KV cache) is below the point and the point is skipped.
    decode_cap_stall_s: float = attrs.field(default=2.0, validator=_positive)
    seed: int = 0

    @classmethod
    def fast(cls) -> SweepPlan:
        """A small sweep for tests and smoke runs."""
        return cls(
            prefill_repeats=2,
            decode_active=(1, 4, 12),
            decode_contexts=(128, 1024),
            decode_gaps=12,
            handoff_sizes=(64, 1024),
            handoff_repeats=2,
            budget_s=120.0,
        )

    def prefill_targets(self, max_model_len: int) -> list[int]:
        top = _largest_prompt(max_model_len, 1)
        if self.prefill_sizes is not None:
            return sorted({min(n, top) for n in self.prefill_sizes})
        small = [2, 16, 64, 256, 512, 1024]
        large = [round(top * f) for f in (0.25, 0.5, 0.75, 1.0)]
        return sorted({n for n in small + large if 1 <= n <= top})

    def decode_contexts_for(self, max_model_len: int) -> list[int]:
        if self.decode_contexts is not None:
            return sorted({min(n, max_model_len // 2) for n in self.decode_contexts})
        return sorted({min(256, max_model_len // 8), min(2048, max_model_len // 4)} - {0})

    def handoff_targets(self, max_model_len: int) -> list[int]:
        top = _largest_prompt(max_model_len, 2)
        if self.handoff_sizes is not None:
            return sorted({min(n, top) for n in self.handoff_sizes})
        return sorted({min(64, top), top // 4, top // 2, top} - {0})


def _largest_prompt(max_model_len: int, max_tokens: int) -> int:
    # Token counts of generated text vary by a few percent around the target, and the
    # engine rejects prompt + max_tokens > max_model_len; aim a little below the limit.
    return max(1, int((max_model_len - max_tokens - 1) * 0.95))


@attrs.frozen
class EngineMeasurement:
    identity: Identity
    chars_per_token: float
    # None: not measurable on this engine (an SGLang prefill server's decode, a decode
    # server's prefill); the partner's model is stored with a source that says so.
    prefill: PrefillModel | None
    decode: DecodeModel | None
    kv_capacity_tokens: int
    kv_capacity_source: str
    max_num_seqs: int = 0  # 0: unknown
    max_num_seqs_source: str = ""
    cached: CachedPrefill | None = None


class SweepFailed(Exception):
    """The sweep could not finish; the message names the engine and the step."""


class TooFewGaps(ProbeError):
    """A decode probe's tokens came in too few reads to measure the point's gaps."""


class DecodePointTooLarge(ProbeError):
    """The engine would not run a decode point's requests at once; `running` is the
    number it settled at while the rest waited."""

    def __init__(self, message: str, *, running: int) -> None:
        super().__init__(message)
        self.running = running


class _Clock:
    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._start = trio.current_time()

    def elapsed(self) -> float:
        return trio.current_time() - self._start

    def say(self, message: str) -> None:
        self._progress(f"[{self.elapsed():6.1f}s] {message}")


async def profile_fleet(
    config: Config, plan: SweepPlan, *, progress: Progress = lambda _: None
) -> ProfileStore:
    """Measure every configured engine and pair; the store to write. Raises `SweepFailed`."""
    clock = _Clock(progress)
    # Every decode load holds a connection; leave room for the probe and the gauges.
    connections = max(plan.decode_active) + 8
    clients = {
        spec.id: EngineClient(spec, config.engine, max_connections=connections)
        for spec in config.engines
    }
    try:
        with trio.fail_after(plan.budget_s):
            return await _profile(config, plan, clients, clock)
    except trio.TooSlowError:
        raise SweepFailed(
            f"the sweep exceeded its time budget of {plan.budget_s} s (--budget-s)"
        ) from None
    except BaseExceptionGroup as group:
        failure = first_exception(group, SweepFailed)
        if failure is None:
            raise
        raise failure from None
    finally:
        for client in clients.values():
            await client.aclose()


async def _profile(
    config: Config, plan: SweepPlan, clients: dict[str, EngineClient], clock: _Clock
) -> ProfileStore:
    engine_ids = list(clients)
    clock.say(f"profiling {len(engine_ids)} engine(s): {', '.join(engine_ids)}")
    measured: dict[str, EngineMeasurement] = {}
    paired = _assign_partners(clients)
    # A pair loads its partner too: measured at once, two pairs would skew each other.
    parallel = 1 if paired else plan.parallel
    if paired and plan.parallel > 1:
        clock.say("SGLang prefill/decode servers are measured one at a time (--parallel ignored)")
    limiter = trio.CapacityLimiter(parallel)

    async def one(engine_id: str) -> None:
        async with limiter:
            measured[engine_id] = await _measure_engine(clients[engine_id], plan, clock)

    if parallel == 1:
        for engine_id in engine_ids:
            await one(engine_id)
    else:
        async with trio.open_nursery() as nursery:
            for engine_id in engine_ids:
                nursery.start_soon(one, engine_id)
    connectors = await _connectors(clients, plan, clock)
    none = frozenset(e for e, c in connectors.items() if c.present is False)
    pairs = crossed_pairs(config.engines, no_connector=none)
    handoffs = await _handoffs(clients, pairs, measured, plan, clock)
    profiles = {
        engine_id: _engine_profile(clients[engine_id], m, measured, connectors.get(engine_id))
        for engine_id, m in measured.items()
    }
    by_dialect: dict[str, list[float]] = {}
    for p in profiles.values():
        by_dialect.setdefault(p.dialect, []).append(p.chars_per_token)
    max_len = min(m.identity.max_model_len for m in measured.values())
    # Rounded once so the progress line and the stored record never disagree (9.2501 s
    # prints as 9.3 but its two-decimal record, 9.25, prints as 9.2).
    duration = round(clock.elapsed(), 2)
    clock.say(f"done in {duration:.1f} s")
    return ProfileStore(
        created_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        tool=f"narwhal-profile {__version__}",
        engines=profiles,
        handoffs=handoffs,
        chars_per_token={d: round(statistics.fmean(v), 4) for d, v in by_dialect.items()},
        sweep={
            "duration_s": duration,
            # The sizes actually used (derived from max_model_len unless given).
            "prefill_sizes": plan.prefill_targets(max_len),
            "prefill_repeats": plan.prefill_repeats,
            "decode_active": list(plan.decode_active),
            "decode_contexts": plan.decode_contexts_for(max_len),
            "decode_gaps": plan.decode_gaps,
            "kv_budget": plan.kv_budget,
            "handoff_sizes": plan.handoff_targets(max_len),
            "handoff_repeats": plan.handoff_repeats,
            "cached_repeats": plan.cached_repeats,
            "parallel": plan.parallel,
            "seed": plan.seed,
            "prefill_measures": "plain max_tokens=1 completions on an idle engine, "
            "request sent to response end",
            "handoff_measures": "prefill response to first decode token",
            **(
                {
                    "sglang_pd": "prefill/decode servers measured in bootstrap pairs; see "
                    "each engine's prefill_source and decode_source"
                }
                if paired
                else {}
            ),
        },
    )


def _assign_partners(clients: dict[str, EngineClient]) -> bool:
    """Pair every SGLang prefill/decode server with the first engine of the other role
    (config order); whether there are any. One without is left unpaired, and its first
    generation request fails naming it."""
    for client in clients.values():
        if client.pd_role is not None:
            other = "decode" if client.pd_role == "prefill" else "prefill"
            client.partner = next((c for c in clients.values() if c.pd_role == other), None)
    return any(c.pd_role is not None for c in clients.values())


async def _connectors(
    clients: dict[str, EngineClient], plan: SweepPlan, clock: _Clock
) -> dict[str, KvConnector]:
    """Which vLLM engines have a KV connector (`kv_connectors`), said for each. One
    without is profiled on itself alone: its prefill and decode models are its own
    plain requests' (measured above), and it joins no crossed pair."""
    found = await _within(
        plan.request_timeout_s * max(1, len(clients)),
        "KV connector probes (the router's prefill leg)",
        kv_connectors(list(clients.values()), TextMaker(f"{plan.seed}/connectors").text(64)),
    )
    for engine_id, connector in found.items():
        if connector.present is None:
            raise SweepFailed(f"engine {engine_id!r}: KV connector probe: {connector.detail}")
        if connector.present:
            clock.say(f"{engine_id}: KV connector present ({connector.detail})")
        else:
            clock.say(
                f"{engine_id}: no KV connector ({connector.detail}): profiled on itself, "
                "in no crossed pair"
            )
    return found


def _engine_profile(
    client: EngineClient,
    m: EngineMeasurement,
    measured: dict[str, EngineMeasurement],
    connector: KvConnector | None,
) -> EngineProfile:
    prefill, decode = m.prefill, m.decode
    prefill_source = decode_source = ""
    partner = client.partner
    if client.pd_role == "prefill" and partner is not None:
        prefill_source = (
            f"bootstrap pairs with decode partner {partner.id!r}: sent to the end of the "
            "prefill response, which includes the bootstrap handshake and the KV transfer "
            "(an SGLang prefill server answers no plain request)"
        )
        decode = measured[partner.id].decode
        decode_source = (
            f"decode partner {partner.id!r}'s model: an SGLang prefill server never decodes"
        )
    elif client.pd_role == "decode" and partner is not None:
        prefill = measured[partner.id].prefill
        prefill_source = (
            f"prefill partner {partner.id!r}'s model (with its bootstrap and KV transfer): "
            "an SGLang decode server computes no prompt"
        )
        decode_source = (
            f"bootstrap pairs with prefill partner {partner.id!r}: the gaps after the first "
            "token are this server's own decode steps"
        )
    assert prefill is not None
    assert decode is not None
    return EngineProfile(
        id=client.id,
        url=client.spec.url,
        dialect=client.spec.dialect,
        model=client.spec.model,
        build=m.identity.build_identity,
        max_model_len=m.identity.max_model_len,
        kv_capacity_tokens=m.kv_capacity_tokens,
        kv_capacity_source=m.kv_capacity_source,
        max_num_seqs=m.max_num_seqs,
        max_num_seqs_source=m.max_num_seqs_source,
        prefill=prefill,
        decode=decode,
        chars_per_token=m.chars_per_token,
        prefill_source=prefill_source,
        decode_source=decode_source,
        kv_connector="" if connector is None else connector.stored,
        cached=m.cached,
    )


async def _within(seconds: float, what: str, call: Awaitable[T]) -> T:
    """Await `call`, bounded: a probe that hangs is a failure that names what hung."""
    with trio.move_on_after(seconds):
        return await call
    raise ProbeError(f"{what} took longer than {seconds} s (--request-timeout-s)")


async def _measure_engine(
    client: EngineClient, plan: SweepPlan, clock: _Clock
) -> EngineMeasurement:
    eid = client.id
    limit = plan.request_timeout_s
    try:
        identity = await _within(limit, f"engine {eid!r} identity probes", client.identity())
        health = await _within(limit, f"engine {eid!r} /health", client.health())
        if health != 200:
            raise ProbeError(f"engine {eid!r}: /health answered {health}")
        mismatch = mode_mismatch(client.spec, identity.disaggregation_mode)
        if mismatch is not None:
            raise ProbeError(mismatch)
        capacity = identity.kv_capacity_tokens
        clock.say(
            f"{eid}: {identity.build_identity}; KV capacity "
            f"{capacity if capacity is not None else 'unknown'} tokens; runs "
            f"{identity.max_num_seqs or 'an unpublished number of'} requests at once"
        )
        texts = TextMaker(f"{plan.seed}/{eid}")
        cpt = await measure_chars_per_token(client, texts, plan)
        clock.say(f"{eid}: {cpt:.3f} chars/token (/tokenize)")
        warm = await _within(
            limit,
            f"engine {eid!r} warm-up",
            client.complete(client.completion_body("Hello", 1, stream=False)),
        )
        if warm.error is not None:
            raise ProbeError(f"engine {eid!r}: warm-up request failed: {warm.error}")
        prefill: PrefillModel | None = None
        decode: DecodeModel | None = None
        estimate = cap = None
        cached: CachedPrefill | None = None
        if client.pd_role == "decode":
            clock.say(f"{eid}: prefill not measured: an SGLang decode server computes no prompt")
        else:
            prefill = await _prefill_sweep(client, texts, cpt, identity, plan, clock)
        if prefill is not None and client.pd_role is None and plan.cached_repeats:
            cached, prefill = await _within(
                limit * cached_requests(plan.cached_repeats),
                f"engine {eid!r} cached prefill",
                measure_cached_prefill(client, texts, cpt, identity, prefill, plan.cached_repeats),
            )
            clock.say(f"{eid}: cached prefill: {cached_summary(cached)}")
        if client.pd_role == "prefill":
            clock.say(f"{eid}: decode not measured: an SGLang prefill server never decodes")
        else:
            decode, estimate, cap = await _decode_sweep(client, texts, cpt, identity, plan, clock)
    except ProbeError as exc:
        raise SweepFailed(str(exc)) from None
    except FitError as exc:
        raise SweepFailed(f"engine {eid!r}: {exc}") from None
    source = identity.kv_capacity_source
    if capacity is None:
        if estimate is not None:
            capacity = estimate
            source = "estimated: resident tokens / kv_cache_usage_perc during the decode sweep"
        else:
            capacity, source = 0, "unknown: no cache config and no KV usage metric"
    seqs, seqs_source = identity.max_num_seqs, identity.max_num_seqs_source
    if seqs is None and cap is not None:
        seqs, seqs_source = cap, "observed: the most requests it ran at once in the decode sweep"
    return EngineMeasurement(
        identity=identity,
        chars_per_token=cpt,
        prefill=prefill,
        decode=decode,
        kv_capacity_tokens=capacity,
        kv_capacity_source=source,
        max_num_seqs=seqs or 0,
        max_num_seqs_source=seqs_source,
        cached=cached,
    )


async def measure_chars_per_token(client: EngineClient, texts: TextMaker, plan: SweepPlan) -> float:
    """Σ characters / Σ /tokenize counts over three texts of the sweep's generator."""
    chars = 0
    tokens = 0
    for size in (400, 2000, 8000):
        text = texts.text(size)
        count, _ = await _within(
            plan.request_timeout_s, f"engine {client.id!r} /tokenize", client.tokenize(text)
        )
        if count is None or count <= 0:
            raise ProbeError(f"engine {client.id!r}: /tokenize gave no token count")
        chars += len(text)
        tokens += count
    return chars / tokens


async def measure_prefill(
    client: EngineClient,
    texts: TextMaker,
    cpt: float,
    target: int,
    plan: SweepPlan,
) -> tuple[int, float, str]:
    """A one-token completion of about `target` prompt tokens: (tokens, seconds, text).

    Generated text only approximates a token count, so a prompt the engine rejects as too
    long (400) is shortened by 10 % and retried, at most three times.
    """
    chars = max(1, round(target * cpt))
    for _ in range(4):
        text = texts.text(chars)
        body = client.completion_body(text, 1, stream=False)
        result = await _within(
            plan.request_timeout_s,
            f"engine {client.id!r} prefill of ~{target} tokens",
            client.complete(body),
        )
        if result.status == 400 and chars > 1:
            chars = max(1, int(chars * 0.9))
            continue
        if result.error is not None:
            raise ProbeError(f"engine {client.id!r}: prefill of ~{target} tokens: {result.error}")
        tokens = result.prompt_tokens
        if tokens is None:
            count, _ = await client.tokenize(text)
            if count is None:
                raise ProbeError(f"engine {client.id!r}: no prompt token count for a prefill")
            tokens = count
        return tokens, result.seconds, text
    raise ProbeError(
        f"engine {client.id!r}: a prompt of ~{target} tokens stays too long for the engine"
    )


async def _prefill_sweep(
    client: EngineClient,
    texts: TextMaker,
    cpt: float,
    identity: Identity,
    plan: SweepPlan,
    clock: _Clock,
) -> PrefillModel:
    samples: list[tuple[int, float]] = []
    groups: list[int] = []
    targets = plan.prefill_targets(identity.max_model_len)
    # Short prompts take milliseconds, where a busy host's scheduling noise is largest
    # relative to the prefill; they are cheap, so they get three times the repeats.
    runs = [
        target
        for target in targets
        for _ in range(plan.prefill_repeats * (3 if target <= _SHORT_PROMPT else 1))
    ]
    # Sizes in random order: a drift in the host's load during the sweep then spreads over
    # every size instead of bending the curve.
    random.Random(f"{plan.seed}/{client.id}/prefill").shuffle(runs)
    step = max(1, len(runs) // 5)
    for i, target in enumerate(runs, 1):
        tokens, seconds, _ = await measure_prefill(client, texts, cpt, target, plan)
        samples.append((tokens, seconds))
        groups.append(target)
        if i % step == 0 or i == len(runs):
            clock.say(f"{client.id}: prefill {i}/{len(runs)} requests ({len(targets)} sizes)")
    model = fit_prefill(samples, groups=groups)
    clock.say(
        f"{client.id}: prefill fit a={model.a_s * 1e3:.2f} ms b={model.b_s_per_token * 1e6:.3f} "
        f"us/token c={model.c_s_per_token2 * 1e12:.1f} ps/token^2, residual p50 "
        f"{100 * model.residual_p50:.1f}% p90 {100 * model.residual_p90:.1f}% over "
        f"{model.points} sizes, repeat spread p50 {100 * model.spread_p50:.1f}% p90 "
        f"{100 * model.spread_p90:.1f}%"
    )
    return model


async def wait_idle(client: EngineClient, plan: SweepPlan) -> None:
    """Bounded wait until the engine runs and queues nothing (the previous point's
    cancelled loads are gone). There is no event to await on a remote engine, so this
    polls its gauges."""
    with trio.move_on_after(min(_IDLE_WAIT_S, plan.request_timeout_s)):
        while True:
            gauges = await client.gauges()
            if gauges.running is None or (gauges.running == 0 and not gauges.waiting):
                return
            await trio.sleep(_IDLE_POLL_S)
    raise ProbeError(f"engine {client.id!r} did not become idle after a decode point")


async def engine_cap(client: EngineClient, loads: int, plan: SweepPlan) -> int | None:
    """Wait until the engine runs all `loads` requests it was sent; None then, or when
    its gauges cannot tell. Otherwise the running count it stayed at for
    `plan.decode_cap_stall_s` while the rest waited. Polls: a remote engine has no event
    to await."""
    if loads < 1:
        return None
    best, since = -1.0, trio.current_time()
    with trio.move_on_after(plan.request_timeout_s):
        while True:
            gauges = await client.gauges()
            if gauges.running is None or gauges.waiting is None:
                return None
            if gauges.running >= loads or not gauges.waiting:
                return None
            now = trio.current_time()
            if gauges.running > best:
                best, since = gauges.running, now
            elif now - since >= plan.decode_cap_stall_s:
                return round(gauges.running)
            await trio.sleep(_CAP_POLL_S)
    return None


async def measure_decode_point(
    client: EngineClient,
    texts: TextMaker,
    cpt: float,
    identity: Identity,
    active: int,
    context: int,
    plan: SweepPlan,
) -> tuple[DecodePoint, float | None]:
    """Measure one (active, context) point; (point, KV-capacity estimate or None)."""
    # A lone request is cheap to measure and its median is the idle floor, which every
    # decode-load computation subtracts: measure it over twice the window.
    count = plan.decode_gaps * (2 if active == 1 else 1)
    window = plan.decode_skip + count
    # Loads must outlast the probe: they start decoding while the others still prefill.
    load_tokens = min(
        identity.max_model_len - context - 2,
        active + math.ceil(active * context / 256) + window + 32,
    )
    probe_tokens = min(identity.max_model_len - context - 2, window + 1)
    chars = max(1, round(context * cpt))
    limit = plan.request_timeout_s
    result = None
    gauges = None
    capped: int | None = None
    errors: list[str] = []
    async with trio.open_nursery() as nursery:
        accepted = trio.Semaphore(0)
        for _ in range(active - 1):
            body = client.completion_body(texts.text(chars), load_tokens, stream=True)
            nursery.start_soon(
                partial(client.hold_stream, body, accepted=accepted.release, failed=errors.append)
            )
        # Errors stay out of the nursery body, so they are not wrapped in a group.
        try:
            with trio.move_on_after(limit) as wait:
                for _ in range(active - 1):
                    await accepted.acquire()
            if wait.cancelled_caught:
                raise ProbeError(f"engine {client.id!r}: decode loads not accepted in {limit} s")
            if not errors:
                capped = await engine_cap(client, active - 1, plan)
            if not errors and capped is None:
                body = client.completion_body(texts.text(chars), probe_tokens, stream=True)
                probe = client.stream(body)
                result = await _within(limit, f"engine {client.id!r} decode probe", probe)
                gauges = await _within(limit, f"engine {client.id!r} /metrics", client.gauges())
        except ProbeError as exc:
            errors.append(str(exc))
        nursery.cancel_scope.cancel()
    if capped is not None and not errors:
        # The probe would queue behind loads that decode for a long while (and time out).
        raise DecodePointTooLarge(
            f"engine {client.id!r} runs {capped} of the point's {active - 1} load requests "
            "at once and queues the rest (its max_num_seqs or KV cache is smaller)",
            running=capped,
        )
    if errors or result is None or gauges is None:
        raise ProbeError(errors[0] if errors else f"engine {client.id!r}: decode point failed")
    if not result.ok:
        raise ProbeError(f"engine {client.id!r}: decode probe failed: {result.error}")
    gaps = result.gaps[plan.decode_skip : plan.decode_skip + count]
    if len(gaps) < min(_MIN_GAPS, count):
        raise TooFewGaps(
            f"engine {client.id!r}: decode probe gave {len(gaps)} gaps; need {_MIN_GAPS}"
        )
    probe_prompt = result.prompt_tokens or context
    probe_kv = probe_prompt + result.tokens
    # The gauges were read just after the window ended (the probe had finished and freed
    # its KV); the window's middle had about half a window less KV per request.
    half = len(gaps) / 2
    measured_active = active
    kv = active * (probe_prompt + plan.decode_skip + half)
    estimate: float | None = None
    capacity = identity.kv_capacity_tokens
    if gauges.running is not None:
        # The engine's count adds other clients' requests to the point's own, but is no
        # witness below them: vLLM 0.32 reads 0 for a second or more while requests run
        # (tests/real), and a point recorded at 1 would bend the decode fit. Every load is
        # running here: one that failed, ended or queued has already failed the point.
        measured_active = max(active, round(gauges.running) + 1)
    if gauges.kv_usage is not None and gauges.kv_usage > 0:
        if capacity:
            kv = gauges.kv_usage * capacity + probe_kv - measured_active * half
        else:
            estimate = (kv + measured_active * half - probe_kv) / gauges.kv_usage
    point = DecodePoint(
        active=measured_active,
        kv_tokens=max(0, round(kv)),
        interval_s=statistics.median(gaps),
        gaps=tuple(gaps),
    )
    return point, estimate


async def _decode_sweep(
    client: EngineClient,
    texts: TextMaker,
    cpt: float,
    identity: Identity,
    plan: SweepPlan,
    clock: _Clock,
) -> tuple[DecodeModel, int | None, int | None]:
    """The decode fit, a KV-capacity estimate (None: no KV usage metric) and the number
    of requests the engine was seen to run at once when a point asked for more (None:
    every point ran whole, or the KV capacity is unknown, so the cap may be KV)."""
    contexts = plan.decode_contexts_for(identity.max_model_len)
    capacity = identity.kv_capacity_tokens
    points: list[DecodePoint] = []
    estimates: list[float] = []
    grid = [(b, ctx) for ctx in contexts for b in sorted(set(plan.decode_active))]
    idle_floor: float | None = None
    # Loads the engine was seen to run at once, when a point asked for more.
    cap: int | None = None
    for i, (active, context) in enumerate(grid, 1):
        if cap is not None and active - 1 > cap:
            clock.say(
                f"{client.id}: decode point {active} x {context} tokens skipped: the engine "
                f"ran only {cap} requests at once"
            )
            continue
        need = active * (context + plan.decode_skip + plan.decode_gaps + 64)
        if capacity and need > plan.kv_budget * capacity:
            clock.say(
                f"{client.id}: decode point {active} x {context} tokens skipped: needs {need} "
                f"KV tokens, over {plan.kv_budget:.0%} of capacity {capacity}"
            )
            continue
        try:
            point, estimate = await _decode_point(
                client, texts, cpt, identity, active, context, plan
            )
        except DecodePointTooLarge as exc:
            cap = exc.running if cap is None else min(cap, exc.running)
            clock.say(f"{client.id}: decode point {active} x {context} tokens skipped: {exc}")
            continue
        except TooFewGaps as exc:
            clock.say(
                f"{client.id}: decode point {active} x {context} tokens skipped: {exc} "
                f"in {1 + _GAP_RETRIES} tries (the engine sends its tokens in bursts)"
            )
            continue
        points.append(point)
        if estimate is not None:
            estimates.append(estimate)
        if point.active == 1 and idle_floor is None:
            idle_floor = point.interval_s
        clock.say(
            f"{client.id}: decode {i}/{len(grid)}: {point.active} active, {point.kv_tokens} KV "
            f"tokens, median gap {1000 * point.interval_s:.2f} ms"
        )
    await wait_idle(client, plan)
    model = fit_decode(points, idle_floor_s=idle_floor)
    clock.say(
        f"{client.id}: decode fit t0={model.t0_s * 1e3:.2f} ms "
        f"kv={model.kv_s_per_token * 1e9:.1f} ns/token "
        f"active={model.active_s_per_request * 1e6:.1f} us/request, idle floor "
        f"{model.idle_floor_s * 1e3:.2f} ms, residual p50 {100 * model.residual_p50:.1f}% "
        f"p90 {100 * model.residual_p90:.1f}% over {model.points} points, gap spread p50 "
        f"{100 * model.spread_p50:.1f}% p90 {100 * model.spread_p90:.1f}%"
    )
    estimate = round(statistics.median(estimates)) if estimates else None
    # Points over the KV budget were skipped, so with a known capacity a point the engine
    # would not run whole met its max_num_seqs, not its KV cache.
    return model, estimate, cap if capacity else None


async def _decode_point(
    client: EngineClient,
    texts: TextMaker,
    cpt: float,
    identity: Identity,
    active: int,
    context: int,
    plan: SweepPlan,
) -> tuple[DecodePoint, float | None]:
    """`measure_decode_point` on an idle engine, measured again (at most `_GAP_RETRIES`
    times) when its probe's tokens came in too few reads (`TooFewGaps`)."""
    retries = 0
    while True:
        await wait_idle(client, plan)
        try:
            return await measure_decode_point(client, texts, cpt, identity, active, context, plan)
        except TooFewGaps:
            retries += 1
            if retries > _GAP_RETRIES:
                raise


def ordered_pairs(engine_ids: Sequence[str]) -> list[tuple[str, str]]:
    """Every ordered pair of distinct engines; the self pair for a one-engine fleet."""
    if len(engine_ids) == 1:
        return [(engine_ids[0], engine_ids[0])]
    return [(p, d) for p in engine_ids for d in engine_ids if p != d]


async def _handoffs(
    clients: dict[str, EngineClient],
    pairs: list[tuple[str, str]],
    measured: dict[str, EngineMeasurement],
    plan: SweepPlan,
    clock: _Clock,
) -> dict[tuple[str, str], HandoffProfile]:
    out: dict[tuple[str, str], HandoffProfile] = {}
    limiter = trio.CapacityLimiter(plan.parallel)
    locks = {engine_id: trio.Lock() for engine_id in clients}
    order = {engine_id: i for i, engine_id in enumerate(clients)}
    done = 0

    async def one(p: str, d: str) -> None:
        nonlocal done
        # Both engines of a pair are held, always in config order, so pairs measured at
        # the same time are disjoint and cannot deadlock.
        async with limiter, contextlib.AsyncExitStack() as stack:
            for engine_id in sorted({p, d}, key=order.__getitem__):
                await stack.enter_async_context(locks[engine_id])
            try:
                out[(p, d)] = await _pair(clients[p], clients[d], measured, plan)
            except (ProbeError, FitError) as exc:
                raise SweepFailed(f"handoff {p!r} -> {d!r}: {exc}") from None
        done += 1
        worst = out[(p, d)].max_first_token_p99_s
        clock.say(
            f"handoff {done}/{len(pairs)}: {p} -> {d}, first-token p99 up to {1000 * worst:.1f} ms"
        )

    if plan.parallel == 1:
        for p, d in pairs:
            await one(p, d)
    else:
        async with trio.open_nursery() as nursery:
            for p, d in pairs:
                nursery.start_soon(one, p, d)
    return out


async def _pair(
    p: EngineClient,
    d: EngineClient,
    measured: dict[str, EngineMeasurement],
    plan: SweepPlan,
) -> HandoffProfile:
    max_len = min(measured[p.id].identity.max_model_len, measured[d.id].identity.max_model_len)
    cpt = measured[p.id].chars_per_token
    texts = TextMaker(f"{plan.seed}/{p.id}/{d.id}")
    groups: list[list[HandoffSample]] = []
    for target in plan.handoff_targets(max_len):
        group: list[HandoffSample] = []
        for _ in range(plan.handoff_repeats):
            text = texts.text(max(1, round(target * cpt)))
            result = await _within(
                plan.request_timeout_s,
                f"handoff {p.id} -> {d.id}",
                crossed_handoff(p, d, text),
            )
            if not result.ok or result.handoff_s is None or result.first_token_s is None:
                raise SweepFailed(f"handoff {p.id!r} -> {d.id!r} failed: {result.error}")
            group.append(
                HandoffSample(
                    tokens=result.prompt_tokens or target,
                    handoff_s=result.handoff_s,
                    first_token_s=result.first_token_s,
                )
            )
        groups.append(group)
    return handoff_profile(p.id, d.id, groups)


def carry_facts(new: ProfileStore, old: ProfileStore | None) -> tuple[ProfileStore, str | None]:
    """Keep narwhal-check's recorded facts when every engine they were measured on still
    has the same build; otherwise drop them (and say why)."""
    if old is None or old.facts is None:
        return new, None
    facts: MeasuredFacts = old.facts
    changed = sorted(
        engine_id
        for engine_id, build in facts.builds.items()
        if engine_id not in new.engines or new.engines[engine_id].build != build
    )
    if changed:
        return new, (
            "dropped the recorded narwhal-check facts: measured on other builds of "
            + ", ".join(changed)
            + "; run narwhal-check --record again"
        )
    return attrs.evolve(new, facts=facts), None


E = TypeVar("E", bound=BaseException)


def first_exception(group: BaseExceptionGroup[BaseException], kind: type[E]) -> E | None:
    """The first `kind` leaf of a (nested) exception group, if any."""
    for exc in group.exceptions:
        if isinstance(exc, kind):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            found = first_exception(exc, kind)
            if found is not None:
                return found
    return None
