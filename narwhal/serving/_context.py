"""Shared state of the serving side: config, fleet, gate, budget, metrics, records."""

from __future__ import annotations

import logging
import random
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Protocol

import attrs
import trio

from .._codes import ErrorCode
from .._errors import EngineFailed, MalformedRequest, NarwhalError
from .._records import JsonObject
from ..admission import (
    AdmissionGate,
    BacklogBook,
    FirstTokenLag,
    KvTurnover,
    ProfileSource,
    ProjectionErrors,
    RetryBudget,
    ttft_budget_s,
)
from ..config import Config
from ..engines._dialects import ChatTokenizeRefusals
from ..fleet import EngineState, Fleet, Share
from ..metrics import Metrics
from ..prefix import PromptKey
from ..signals import DecodeGaps as DecodeGaps, LegObserver as LegObserver
from ._connections import OpenConnections
from ._descriptors import DescriptorBudget, report
from ._lag import LoopLag, Paced
from ._per_client import PerClient
from ._slo import SloTally, slo_result

if TYPE_CHECKING:
    from ._decisions import Decisions

log = logging.getLogger("narwhal.request")

# Why a degraded Narwhal refuses, as a client is told it (`degraded_reason` is the
# operator's, naming the monitor's last failure).
DEGRADED_PUBLIC = "its monitor passes keep failing (controller.monitor_failure_limit)"
# Answers to requests a deadline ended, at most this many per pass of the scheduler
# (`Paced`): each is a few hundred µs of work, so a pass stays within a few ms.
DEADLINE_ANSWERS_PER_PASS = 16


class PrefixCaches(Protocol):
    """What each engine holds of a prompt in its prefix cache (`narwhal.caches`)."""

    def cached_tokens(self, engine_id: str, key: PromptKey, now: float) -> int: ...

    def routed(self, engine_id: str, key: PromptKey, now: float) -> None: ...


class ServingSignals(Protocol):
    """What the request path tells the role controller and the decode correction.

    Called on the request path, so implementations must be quick and must not block.
    """

    def first_token_timeout(self, engine: EngineState) -> None: ...

    def ttft_breach(self) -> None: ...

    def decode_gaps(self, engine: EngineState, gaps: DecodeGaps) -> None:
        """A finished stream's token gaps (at least one), summarised."""


class _NoSignals:
    def first_token_timeout(self, engine: EngineState) -> None:
        pass

    def ttft_breach(self) -> None:
        pass

    def decode_gaps(self, engine: EngineState, gaps: DecodeGaps) -> None:
        pass


class _NoObserver:
    def leg_ok(
        self,
        engine: EngineState,
        phase: str,
        duration_s: float,
        *,
        prompt_tokens: int = 0,
        contended: bool = False,
        gaps: DecodeGaps | None = None,
    ) -> None:
        pass

    def leg_failed(self, engine: EngineState, phase: str, failure: EngineFailed) -> None:
        pass


@attrs.define(eq=False)
class RequestRecord:
    """A retained request, for /narwhal/state; removed when its response ends."""

    id: str
    endpoint: str
    arrival: float
    stream: bool = False
    stage: str = "reading"
    prefill_engine: str | None = None
    decode_engine: str | None = None
    attempts: int = 0
    prompt_tokens: int | None = None
    token_count_method: str | None = None
    # Why the count is an estimate, when token_count_method is "fallback".
    token_count_fallback: str | None = None
    # Why engine.tokenizer_path's tokenizer did not count it, when it did not.
    token_count_local_miss: str | None = None
    # Why an exact count was not checked against a context length, when it was not.
    context_unchecked: str | None = None
    # The leading prompt tokens priced as cached on the engine that ran the prefill of
    # the latest attempt (docs/design.md#prefix-caching).
    cached_tokens: int = 0
    # What the engine that computed the prompt said it found cached
    # (usage.prompt_tokens_details.cached_tokens); None when it did not say.
    engine_cached_tokens: int | None = None
    # Predictive admission's projected TTFT for the prefill path the first attempt took
    # (as priced at admission), the part of it that was load (backlog, decode lag, KV
    # wait) rather than the engine's own work, and whether that path's profile measured
    # this prompt size.
    projected_ttft_s: float | None = None
    projected_wait_s: float | None = None
    projected_in_domain: bool | None = None
    # When the first generated token became visible to the client (streaming only: a
    # non-streaming response shows nothing until its whole body is ready).
    first_output_at: float | None = None
    # The request's mean time per output token after its first, when it had two or more.
    observed_tpot_s: float | None = None
    # When the last prefill leg answered: splits an observed TTFT into prefill and the
    # handoff plus first decode step after it.
    prefilled_at: float | None = None
    # The request's deadline scope, and the error to report if something other than the
    # deadline cancels it (the supervisor, when recovery.shutdown_grace_s runs out).
    scope: trio.CancelScope | None = None
    abort: NarwhalError | None = None

    @property
    def observed_ttft_s(self) -> float | None:
        if self.first_output_at is None:
            return None
        return self.first_output_at - self.arrival

    @property
    def prefill_s(self) -> float | None:
        if self.prefilled_at is None:
            return None
        return self.prefilled_at - self.arrival


@attrs.frozen
class DemandEvent:
    """One offered request once its admission was decided: the controller's demand input.

    Refusals are offered demand too (docs/design.md#evidence-gate), so they are recorded, not
    dropped.
    """

    at: float
    prompt_tokens: int
    max_tokens: int | None
    admitted: bool
    reason: str | None = None
    # The most of the prompt an engine held cached, as admission credited it.
    cached_tokens: int = 0


@attrs.frozen
class LoadSignals:
    """What the admission books say of each engine in the fleet, by engine id: committed
    prefill backlog (every engine), and the decode side's recent first-token lag and KV
    turnover (the engines with an observation)."""

    backlog_s: Mapping[str, float]
    first_token_lag_s: Mapping[str, float]
    kv_release_per_s: Mapping[str, float]


# Enough for the longest demand window at a few hundred requests per second; the monitor
# drains it every pass, so this only bounds memory if the monitor stops.
DEMAND_EVENTS_MAX = 100_000


def served_models(config: Config) -> tuple[str, ...]:
    """The model names the configured engines serve, sorted."""
    return tuple(sorted({spec.model for spec in config.engines}))


class ServingContext:
    def __init__(self, config: Config, *, seed: int | None = None) -> None:
        self.config = config
        self.fleet = Fleet(config)
        self.gate = AdmissionGate(
            max_admitted=config.serving.max_connections,
            queue_capacity=config.serving.queue_capacity,
        )
        self.retry_budget = RetryBudget(
            maximum=float(config.serving.retry_budget),
            replenish=config.serving.retry_replenish,
        )
        self.metrics = Metrics()
        # Run by the supervisor; recovery asks it whether a deadline was the router's.
        self.loop_lag = LoopLag(self.metrics.registry)
        self.rng = random.Random(seed)
        self.connections = OpenConnections(
            config.listen.max_open_connections,
            per_client=config.connections_per_client(),
            on_limit_reached=self.metrics.client_connection_limit_reached.inc,
            on_shed=self.metrics.client_connections_shed.inc,
            on_accept_failed=lambda name: self.metrics.client_accept_failures.labels(name).inc(),
            on_client_refused=self.metrics.client_connections_refused.inc,
        )
        # Completion requests whose bodies are still arriving, per client address: each
        # holds a retained request, so one client must not hold them all.
        self.pending_bodies = PerClient(
            config.serving.pending_bodies_per_client(),
            noun="request bodies arriving",
            setting="serving.max_pending_bodies_per_client",
            bound="reads at most {limit} at once",
            code=ErrorCode.PENDING_BODIES_PER_CLIENT,
        )
        self.deadline_answers = Paced(DEADLINE_ANSWERS_PER_PASS)
        # Requests the HTTP server could not parse, and upgrades it refused, by status.
        self.protocol_errors: Counter[int] = Counter()
        # The open-file limit against listen.max_open_connections (`apply_descriptors`);
        # None until the supervisor has looked.
        self.descriptors: DescriptorBudget | None = None
        self._retained = 0
        self._idle = trio.Event()
        self._idle.set()
        self.records: dict[int, RequestRecord] = {}
        self.outcomes: Counter[str] = Counter()
        self.slo = SloTally(window_s=config.controller.reactive.window_s)
        self.unsized_offers = 0
        self.token_methods: Counter[str] = Counter()
        self.token_fallbacks: Counter[str] = Counter()
        # Prompts engine.tokenizer_path's tokenizer left to the engines, by why.
        self.token_local_misses: Counter[str] = Counter()
        # Results of the context check (`_tokens.count_tokens`), by result.
        self.context_checks: Counter[str] = Counter()
        # Non-streaming decode legs sent to the engine as non-streaming requests, by why
        # their answer could not be assembled from a stream (engines.unassemblable_reason).
        self.unstreamed_legs: Counter[str] = Counter()
        # SGLang engines whose build's /tokenize has no chat form (`_tokens.count_tokens`).
        self.chat_tokenize_refusals: ChatTokenizeRefusals[EngineState] = ChatTokenizeRefusals()
        self.models = served_models(config)
        self.started_at = trio.current_time()
        # Set by the supervisor when Narwhal cannot make sound decisions
        # (docs/design.md#role-control: monitor failures); new admissions are refused with this
        # reason. It quotes the monitor's last failure, which names an engine: clients get
        # DEGRADED_PUBLIC.
        self.degraded_reason: str | None = None
        self.accepting = True
        # Other subsystems (controller, recovery) add sections to /narwhal/state: each a
        # frozen record, shown under its key (`narwhal._records.to_json`).
        self.state_providers: list[tuple[str, Callable[[], attrs.AttrsInstance]]] = []
        self.leg_observer: LegObserver = _NoObserver()
        # A worker of the multi-process plane: its requests' decisions, taken by its core.
        self.decide_with: Callable[[Config, str], Decisions] | None = None
        # A decision core: its workers' /metrics expositions, and their sections of
        # /narwhal/state (`narwhal.supervisor.Plane`).
        self.worker_metrics: Callable[[], Awaitable[list[bytes]]] | None = None
        self.worker_states: Callable[[], Awaitable[list[JsonObject]]] | None = None
        self.signals: ServingSignals = _NoSignals()
        # Predictive admission: the profile source (None until profiles are loaded) and
        # the prefill work committed to each engine.
        self.profiles: ProfileSource | None = None
        # What each engine has cached (set by the supervisor): None prices every prompt
        # uncached.
        self.prefix_caches: PrefixCaches | None = None
        # Characters per token the profile sweep measured on this fleet's dialect; the
        # token-count fallback prefers it to engine.chars_per_token (a guess for the
        # tokenizer). None without a loaded store that has one.
        self.measured_chars_per_token: float | None = None
        # Keyed by engine instance: a leg commits, releases and observes on the engine
        # it ran on, which a reload may have replaced since (same id, another url).
        self.backlog: BacklogBook[EngineState] = BacklogBook()
        self.first_token_lags: FirstTokenLag[EngineState] = FirstTokenLag(tau_s=config.slo.ttft_s)
        self.kv_turnover: KvTurnover[EngineState] = KvTurnover(tau_s=config.slo.ttft_s)
        self.projection_errors = ProjectionErrors(
            percentile=config.slo.percentile,
            budget_s=ttft_budget_s(config.slo.ttft_s, config.serving.admission_margin),
        )
        self.demand_events: deque[DemandEvent] = deque(maxlen=DEMAND_EVENTS_MAX)
        self.unserved_placements = 0

    def decisions_for(self, config: Config, endpoint: str = "") -> Decisions:
        """A new request's global decisions (a request to `endpoint`), on this process's
        state; a worker of the multi-process plane asks its decision core instead
        (`narwhal.plane`)."""
        if self.decide_with is not None:
            return self.decide_with(config, endpoint)
        from ._decisions import Decisions

        return Decisions(self, config)

    def finished(self, outcome: str, record: RequestRecord | None = None) -> None:
        """Count a request's final outcome, and how it counts for SLO attainment."""
        self.outcomes[outcome] += 1
        slo = self.config.slo
        result = slo_result(
            outcome,
            ttft_s=None if record is None else record.observed_ttft_s,
            tpot_s=None if record is None else record.observed_tpot_s,
            ttft_target_s=slo.ttft_s,
            tpot_target_s=slo.tpot_s,
        )
        if result is not None:
            self.slo.record(result, trio.current_time())
            self.metrics.slo_requests.labels(result).inc()

    def projection_observed(self, record: RequestRecord, now: float) -> None:
        """Compare a finished request's projected TTFT with the one it had: for the
        error histogram and for what admission allows for at its prompt size."""
        projected = record.projected_ttft_s
        observed = record.observed_ttft_s
        if projected is None or observed is None or observed <= 0:
            return
        self.metrics.ttft_prediction_error.observe((projected - observed) / observed)
        self.projection_errors.observe(
            record.prompt_tokens or 0, projected, record.projected_wait_s or 0.0, observed, now
        )

    def client_protocol_error(self, error: MalformedRequest) -> None:
        """A request that was not HTTP/1.1 Narwhal can serve, answered with `error`."""
        self.protocol_errors[error.status] += 1
        self.metrics.client_protocol_errors.labels(str(error.status)).inc()
        log.info(
            "client protocol error, answered %d: %s",
            error.status,
            error.message,
            extra={
                "event": "client_protocol_error",
                "status": error.status,
                "code": error.code,
                "reason": error.message,
            },
        )

    def apply_descriptors(self, budget: DescriptorBudget) -> None:
        """Enforce `budget`'s client connection limit, logging what changed."""
        report(budget, self.descriptors)
        self.descriptors = budget
        self.connections.set_limit(budget.effective, configured=budget.configured)

    def apply_share(self, share: Share | None = None) -> None:
        """This replica's part of serving.max_connections and of every engine's phase
        limits (`share`, else the fleet's current one): after a membership change, a
        reload, or a change in whether this replica can reach etcd (narwhal.cluster)."""
        serving = self.config.serving
        self.fleet.apply_share(self.config, share)
        share = self.fleet.share
        self.gate.limit_to(
            share.of(serving.max_connections),
            share.describe("serving.max_connections", serving.max_connections),
        )

    def take_config(self, config: Config) -> None:
        """A reload's configuration in force: new requests snapshot it and may name its
        models, and its limits per client address apply from now on (what is open or
        arriving already stays)."""
        self.config = config
        self.models = served_models(config)
        self.connections.per_client.limit = config.connections_per_client()
        self.pending_bodies.limit = config.serving.pending_bodies_per_client()

    @property
    def retained_ceiling(self) -> int:
        return self.config.serving.retained_ceiling

    def chars_per_token(self, config: Config) -> tuple[float, str]:
        """The token-count fallback's ratio and where it comes from."""
        if self.measured_chars_per_token is not None:
            return self.measured_chars_per_token, "profile"
        return config.engine.chars_per_token, "engine.chars_per_token"

    @property
    def retained(self) -> int:
        """Completion requests between ingress and their last byte."""
        return self._retained

    @retained.setter
    def retained(self, value: int) -> None:
        self._retained = value
        if value == 0:
            self._idle.set()
        elif self._idle.is_set():
            self._idle = trio.Event()

    async def wait_idle(self) -> None:
        """Return once no completion request is retained (graceful shutdown)."""
        while self._retained:
            await self._idle.wait()

    def engine_retired(self, engine: EngineState) -> None:
        """A reload removed or replaced `engine` and its resident requests are done (or
        the wait for them ran out): drop what admission learnt about that instance. (Its
        prefill backlog entry goes with its last leg; readers only look at the engines in
        the fleet anyway.)"""
        self.first_token_lags.forget(engine)
        self.kv_turnover.forget(engine)
        self.backlog.fleet_finish.pop(engine, None)
        self.backlog.booked_s.pop(engine, None)
        self.backlog.others_busy.discard(engine)

    # Legs still running on an engine a reload removed or replaced end after the reload,
    # some after its retirement (a leg that outlives the wait, say when the reload
    # shortened serving.request_timeout_s). Nothing reads a removed instance's values,
    # so they are not learnt: an entry made after its retirement would stay for good.
    def first_token_lag(self, engine: EngineState, lag_s: float, now: float) -> None:
        """A decode leg's first token came `lag_s` after its request (`FirstTokenLag`)."""
        if not engine.removed:
            self.first_token_lags.observe(engine, lag_s, now)

    def kv_freed(self, engine: EngineState, tokens: int, now: float) -> None:
        """A decode leg ended and the engine freed `tokens` of KV (`KvTurnover`)."""
        if not engine.removed:
            self.kv_turnover.observe(engine, tokens, now)

    def load_signals(self, now: float) -> LoadSignals:
        """The admission books' signals for the engines in the fleet now.

        The prefill backlog is the fleet's, estimated (`fleet_backlog_s`). The lag and
        KV turnover are observed on the engines' answers, so they are the fleet's
        already.
        """
        engines = list(self.fleet)
        lags, kv = self.first_token_lags, self.kv_turnover
        return LoadSignals(
            backlog_s={e.id: self.fleet_backlog_s(e, now) for e in engines},
            first_token_lag_s={e.id: lags.lag_s(e, now) for e in engines if e in lags.value},
            kv_release_per_s={e.id: kv.rate_per_s(e, now) for e in engines if e in kv.value},
        )

    def fleet_backlog_s(self, engine: EngineState, now: float) -> float:
        """The engine's prefill backlog, in seconds, over all replicas.

        This replica books only the prefills it sent. While the other replicas' words are
        trusted (`seen_load`, source "replicas"), the book's queue of every replica's
        commits stands for it (`BacklogBook.fleet_wait_s`).
        Without that, those the last scrape showed on the engine beyond this replica's
        legs, each priced as a prompt of the mean size of this replica's: in a burst
        that priced the wait at about half of what it was. Without a recent scrape either,
        the book times the member count stands for it: behind an even balancer each
        member sends about as much, at about the same times. That alone priced each
        replica's own commits twice and the others' not at all (the replicas benchmark,
        docs/benchmarks.md)."""
        own = self.backlog.wait_s(engine, now)
        members = engine.load_scale
        if members == 1:
            return own
        seen = engine.seen_load(now)
        if seen is not None and seen.source == "replicas":
            return self.backlog.fleet_wait_s(engine, now)
        curve = None if self.profiles is None else self.profiles.prefill_curve(engine.id)
        if seen is None or curve is None:
            return own * members
        if not seen.prefill:
            return own
        return own + seen.prefill * curve.prefill_s(round(seen.prefill_tokens))

    def engine_leg_failed(self, failure: EngineFailed, engine: EngineState) -> None:
        """Tell the leg observer about a failed leg on `engine` (the instance it ran on,
        which a reload may have removed or replaced since); the request path calls this
        once per failed engine leg (whether or not it counts against the engine)."""
        self.leg_observer.leg_failed(engine, failure.phase, failure)

    def cancel_requests(self, error: NarwhalError) -> int:
        """Cancel every retained request; each reports `error` (a streaming response as
        its terminal error event). Returns how many were cancelled."""
        count = 0
        for record in list(self.records.values()):
            if record.scope is not None:
                record.abort = error
                record.scope.cancel()
                count += 1
        return count
