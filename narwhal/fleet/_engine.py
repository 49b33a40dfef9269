"""Each engine as the router sees it, and the view of it placement reads.

Owns
  `EngineState`: an engine's pools, phase limiters, role, availability flags and what
  it says of its context; its load is an `EngineLoad` ledger (`_load.py`). `EngineView`,
  one engine at one instant.

Invariants
  Each availability flag has one owner and changes only through the methods named
  after it: `operator_*` (narwhalctl), `reload_*` and `operator_intent_from` (a
  reload), `note_*` (whichever request met a refused key or model, through
  `key_refused` and `model_refused`) and `recovery_*`; everyone else reads a property.
  Flags stay in force while the role changes (docs/design.md#placement). A change that may
  leave a role without an engine reaches the fleet's watcher at once (`Fleet.watch`).
  Decisions (placement, admission, role control) read frozen views of all this, so they
  stay pure functions of a snapshot and a clock value.

Errors
  None: this is bookkeeping.

See
  tests/fleet/test_owners.py (nothing outside narwhal/fleet stores a flag or a count),
  tests/fleet/test_watch.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, Protocol

import attrs
import trio

from ..config import Config, EngineSpec
from ..engines import Connect, ConnectionPool, Dialect, dialect_for
from ._load import EngineLoad, LoadStatistics, SeenLoad
from ._share import Share

Role = Literal["prefill", "decode", "both"]
Phase = Literal["prefill", "decode", "aggregate"]


def _limit(value: int) -> float:
    # 0 means "no per-engine limit" (docs/design.md#bounded-serving: bounded serving is opt-in).
    return math.inf if value == 0 else value


@attrs.frozen
class EngineView:
    """What placement and admission may know about one engine at one instant."""

    id: str
    role: Role
    # None when the engine can take new work of that phase, else the first reason why not.
    prefill_blocked: str | None
    decode_blocked: str | None
    prefill_inflight: int
    prefill_tokens_inflight: int
    prefill_slots_free: float
    decode_active: int
    decode_tokens: int
    decode_slots_free: float
    handoffs_pending: int = 0
    # How long the oldest decode leg still waiting for its first token has waited.
    first_token_wait_s: float = 0.0
    # Non-streaming decode legs, whose tokens the router cannot count as they are made:
    # the seconds they have run (summed over the legs) and the most tokens they may
    # still generate (their max_tokens summed; inf when one has no bound).
    unstreamed_age_s: float = 0.0
    unstreamed_cap: float = 0.0

    @property
    def available(self) -> bool:
        return self.prefill_blocked is None and self.decode_blocked is None

    def unstreamed_tokens(self, step_s: float) -> float:
        """Tokens the engine's non-streaming decode legs have made by now, estimated.

        The router sees none of them until a leg's body arrives, so they are taken as one
        per decode step of `step_s` for as long as the legs have run, up to their
        max_tokens. Summed over the legs, the bound is a little loose: one leg past its
        own bound lets the others' growth run on; such a leg is about to end anyway.
        0 without legs, or without a step to count by.
        """
        if not self.unstreamed_age_s or not step_s > 0:
            return 0.0
        return min(self.unstreamed_cap, self.unstreamed_age_s / step_s)

    def blocked(self, phase: Phase) -> str | None:
        if phase == "prefill":
            return self.prefill_blocked
        if phase == "decode":
            return self.decode_blocked
        return self.prefill_blocked or self.decode_blocked


class PhaseGate(Protocol):
    """A per-phase admission veto owned by recovery (a circuit breaker)."""

    def blocked(self, now: float) -> str | None: ...


# observe_packing: streams shorter than this are skipped; the weight of one stream; the
# largest ratio believed (speculative decoding rarely accepts more than a few per step).
PACKING_MIN_EVENTS = 4
PACKING_ALPHA = 0.2
PACKING_MAX = 16.0


class _Refusal:
    """Why an engine refuses something every request needs, noted by whichever request
    met it, and how many were noted: a check clears it only if none arrived while it
    was under way."""

    __slots__ = ("count", "reason")

    def __init__(self) -> None:
        self.reason: str | None = None
        self.count = 0

    def note(self, reason: str) -> bool:
        """True at the onset: a refusal where there was none."""
        onset = self.reason is None
        self.reason = reason
        self.count += 1
        return onset


class EngineState:
    """One engine as the router sees it; created from config, mutated in place on reload."""

    def __init__(
        self, spec: EngineSpec, config: Config, *, connect: Connect = trio.open_tcp_stream
    ) -> None:
        self.spec = spec
        self.id = spec.id
        self.dialect: Dialect = dialect_for(spec.dialect)
        self.host, self.port = spec.origin()
        engine_cfg = config.engine
        self.serving_pool = ConnectionPool(
            self.host,
            self.port,
            # Admission already caps requests at max_connections and each holds at most
            # one connection per engine, so the data pool can never starve by itself.
            max_connections=config.serving.max_connections,
            connect_timeout_s=engine_cfg.connect_timeout_s,
            pool_timeout_s=engine_cfg.pool_timeout_s,
            api_key=spec.api_key_text(),
            connect=connect,
        )
        self.control_pool = ConnectionPool(
            self.host,
            self.port,
            max_connections=control_share(config),
            connect_timeout_s=engine_cfg.connect_timeout_s,
            pool_timeout_s=engine_cfg.pool_timeout_s,
            api_key=spec.api_key_text(),
            connect=connect,
        )
        # Called with this engine after a change that may take it out of placement or
        # move the work it takes (`Fleet.watch`); set while it belongs to a fleet.
        self._on_change: Callable[[EngineState], None] | None = None
        self._role: Role = spec.role
        self.prefill_limiter = trio.CapacityLimiter(math.inf)
        self.decode_limiter = trio.CapacityLimiter(math.inf)
        # This replica's part of the phase limits (`cluster_share`; whole for one replica)
        # and the phases it has none of, which it must not place here.
        self._share = Share()
        self._share_offset = 0
        # The other replicas' legs on the engine, from its last scrape (`saw_engine_load`)
        # and as they last published them (`saw_replica_loads`).
        self._seen: SeenLoad | None = None
        self._published: SeenLoad | None = None
        self._whole_limits: dict[str, float] = {}
        self._no_share: frozenset[str] = frozenset()
        self._apply_limits(config)
        # Availability, each flag behind its owner's methods (module docstring).
        self._removed = False
        self._drained = False
        self._pinned = False
        self._key_refusal = _Refusal()
        self._model_refusal = _Refusal()
        self._held_until = -math.inf
        self._quarantined_until = -math.inf
        self._ejected: str | None = None
        self._unreachable: str | None = None
        # Another replica's ejection or quarantine of the engine (narwhal.cluster): out
        # until then, for that reason.
        self._peer_held_until = -math.inf
        self._peer_reason = ""
        # The context length the engine refuses requests beyond (`set_context`): read by
        # recovery at a good probe while `context_due` (the first one, and the first after
        # a failed probe or a restart), and from each vLLM /tokenize answer. None, with
        # `context_note` saying why, when it is not known: the request path then checks
        # nothing against it, and the engine is the one to refuse.
        self.context_length: int | None = None
        self.context_note = "not read yet"
        self.context_due = True
        # The engine's version as its /version reported it at recovery's last health probe
        # that read one; None until then, or when it does not say. The context check
        # applies the rule of that build (`narwhal.serving.context_rule`).
        self.version: str | None = None
        # Circuit breakers per phase, installed by recovery; absent means always closed.
        self.phase_gates: dict[str, PhaseGate] = {}
        # Load the router itself put on the engine.
        self.load = EngineLoad()
        # Generated tokens per streamed event, learnt from the engines' usage reports
        # (`observe_packing`): streamed legs grow resident KV by this much per event.
        self.tokens_per_event = 1.0
        # Restarts recovery has detected on this instance's address: each is a new
        # engine process, with none of its predecessor's prefix cache.
        self._restarts_detected = 0

    def __repr__(self) -> str:
        return (
            f"<EngineState {self.id} {self.role} "
            f"[prefill {self.load.prefill_inflight}, decode {self.load.decode_active}"
            f"{', drained' if self.drained else ''}]>"
        )

    # The role and the flags recovery does not own report their changes to the fleet's
    # watcher (`Fleet.watch`): the operator (drain, pin), a reload, the role controller
    # and the request path (a refused key or model) each change them in their own
    # place, and recovery must hear of every change that may leave a role without an
    # engine. Only changes that may do that, or that may make a waiting engine the last
    # of its role (an undrain, a role change), are reported: a refusal's clearing
    # returns an engine.
    @property
    def role(self) -> Role:
        return self._role

    @role.setter
    def role(self, role: Role) -> None:
        if role != self._role:
            self._role = role
            self._changed()

    # ------------------------------------------------------------ the operator's

    @property
    def drained(self) -> bool:
        """narwhalctl drain: no new work; resident requests finish."""
        return self._drained

    @property
    def pinned(self) -> bool:
        """narwhalctl pin: the role controller leaves the engine's role alone."""
        return self._pinned

    def operator_drain(self) -> None:
        self._set_drained(True)

    def operator_undrain(self) -> None:
        self._set_drained(False)

    def operator_pin(self) -> None:
        self._pinned = True

    def operator_unpin(self) -> None:
        self._pinned = False

    def operator_intent_from(self, retired: EngineState) -> None:
        """A reload replaced `retired` (same id, another url) with this engine: what the
        operator set survives, drained or pinned, and a pinned role unless this
        engine's role is fixed by how it was launched."""
        self._set_drained(retired.drained)
        self._pinned = retired.pinned
        if retired.pinned and self.fixed_role is None:
            self.role = retired.role

    def _set_drained(self, drained: bool) -> None:
        if drained != self._drained:
            self._drained = drained
            self._changed()

    # ------------------------------------------------------------ a reload's

    @property
    def removed(self) -> bool:
        """A reload dropped the engine from the config; resident work finishes."""
        return self._removed

    def reload_remove(self) -> None:
        """Out of placement for good (`Fleet.retire`)."""
        if not self._removed:
            self._removed = True
            self._changed()

    # ------------------------------------------------------------ refusals

    @property
    def auth_refused(self) -> str | None:
        """Why the engine refuses Narwhal's API key (HTTP 401/403): noted by whichever
        request met the refusal (`key_refused`); cleared by recovery when the key is
        accepted again, or by a reload that changes the key."""
        return self._key_refusal.reason

    @property
    def auth_refusals(self) -> int:
        """Key refusals noted so far: a key check clears `auth_refused` only if none
        arrived while it was under way."""
        return self._key_refusal.count

    @property
    def model_missing(self) -> str | None:
        """Why the engine does not serve the configured engines[].model: noted when it
        answered a leg 404 naming the model (`model_refused`); cleared by recovery when
        its /v1/models lists the model again (read at each good probe until then), or by
        a reload that changes the model."""
        return self._model_refusal.reason

    @property
    def model_refusals(self) -> int:
        """Model refusals noted so far: a /v1/models reading clears `model_missing` only
        if none arrived while it was under way."""
        return self._model_refusal.count

    def note_key_refused(self, reason: str) -> None:
        """Only `narwhal.fleet.key_refused` calls this, for any request that met it."""
        if self._key_refusal.note(reason):
            self._changed()

    def note_model_missing(self, reason: str) -> None:
        """Only `narwhal.fleet.model_refused` calls this, for any leg that met it."""
        if self._model_refusal.note(reason):
            self._changed()

    # ------------------------------------------------------------ recovery's

    @property
    def ejected(self) -> str | None:
        """Why recovery's health verdict has the engine out (ejected or verifying)."""
        return self._ejected

    @property
    def unreachable(self) -> str | None:
        """A leg could not connect: out until a health probe sent after it answers."""
        return self._unreachable

    @property
    def held_until(self) -> float:
        """A restart hold: out until recovery's verification releases it."""
        return self._held_until

    @property
    def quarantined_until(self) -> float:
        """recovery.failure_quarantine_s after a counted failure."""
        return self._quarantined_until

    def recovery_eject(self, reason: str) -> None:
        self._ejected = reason

    def recovery_readmit(self) -> None:
        self._ejected = None

    def recovery_unreachable(self, reason: str) -> None:
        self._unreachable = reason

    def recovery_reachable(self) -> None:
        self._unreachable = None

    def recovery_hold(self) -> None:
        self._held_until = math.inf

    @property
    def restarts_detected(self) -> int:
        return self._restarts_detected

    def recovery_new_instance(self) -> None:
        self._restarts_detected += 1

    def recovery_release_hold(self) -> None:
        self._held_until = -math.inf

    def recovery_quarantine(self, until: float) -> None:
        self._quarantined_until = until

    def cluster_hold(self, until: float, reason: str) -> None:
        """Only the cluster service calls this: another replica ejected or quarantined
        the engine, so it is out here too until `until` (-inf: released)."""
        was = self._peer_held_until
        self._peer_held_until, self._peer_reason = until, reason if until > -math.inf else ""
        if (until > -math.inf) != (was > -math.inf):
            self._changed()

    def recovery_key_accepted(self) -> None:
        self._key_refusal.reason = None

    def recovery_model_listed(self) -> None:
        self._model_refusal.reason = None

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self)

    def reconfigure(self, spec: EngineSpec, config: Config) -> None:
        """Apply a reloaded config in place: resident requests keep their reservations."""
        # Another model or key is another question; an unchanged one keeps its answer, or
        # each reload would send the engine one more request it refuses (recovery's
        # /v1/models read and key check readmit it when it changes its mind).
        if spec.model != self.spec.model:
            self._model_refusal.reason = None
        if spec.api_key_text() != self.spec.api_key_text():
            self._key_refusal.reason = None
        self.spec = spec
        engine_cfg = config.engine
        self.serving_pool.resize(config.serving.max_connections)
        self.control_pool.resize(control_share(config))
        for pool in (self.serving_pool, self.control_pool):
            pool.configure(
                connect_timeout_s=engine_cfg.connect_timeout_s,
                pool_timeout_s=engine_cfg.pool_timeout_s,
            )
            pool.set_api_key(spec.api_key_text())
        # A reload may point the id at another server.
        self.context_due = True
        self._apply_limits(config)

    def cluster_share(self, share: Share, offset: int, config: Config) -> None:
        """Only the cluster's share split calls this (`Fleet.apply_share`): this replica's
        part of the engine's phase limits; `offset` is the engine's index in config order."""
        self._share, self._share_offset = share, offset
        self._apply_limits(config)

    def _apply_limits(self, config: Config) -> None:
        # A part lowered under the requests holding slots leaves them be: new ones wait.
        no_share = set()
        phases: tuple[tuple[Literal["prefill", "decode"], trio.CapacityLimiter], ...] = (
            ("prefill", self.prefill_limiter),
            ("decode", self.decode_limiter),
        )
        for phase, limiter in phases:
            total = _concurrency(self.spec, config, phase)
            self._whole_limits[phase] = _limit(total)
            part = self._share.of(total, self._share_offset)
            if total and not part:
                no_share.add(phase)
            limiter.total_tokens = _limit(max(part, 1) if total else 0)
        if frozenset(no_share) != self._no_share:
            self._no_share = frozenset(no_share)
            self._changed()

    def set_context(self, length: int | None, note: str) -> bool:
        """Record what the engine says of its context length (`note`: where it was read,
        or why it is not known); True when that changed."""
        changed = (length, note) != (self.context_length, self.context_note)
        self.context_length, self.context_note = length, note
        return changed

    @property
    def resident_work(self) -> int:
        """Requests that still need this engine: legs in flight or placed on it, KV
        handoffs waiting for their decode, and connections (a tokenize call holds one
        without a phase slot)."""
        return max(self.load.placed, self.serving_pool.in_use)

    @property
    def fixed_role(self) -> str | None:
        """Why nothing may change this engine's role at run time, or None. Only the
        configuration, which records how the engine was launched, sets it then."""
        return self.dialect.fixed_role or self.spec.launch_fixes_role

    def unavailable_reason(self, now: float, phase: Phase | None = None) -> str | None:
        """Why the engine takes no new work (of `phase`, if given) now, or None."""
        # The fields, not their properties: placement asks this of every engine for
        # every request.
        if self._removed:
            return "removed"
        if self._drained:
            return "drained"
        if (refused := self._key_refusal.reason) is not None:
            return f"auth refused: {refused}"
        if (missing := self._model_refusal.reason) is not None:
            return f"model not served: {missing}"
        if self._ejected is not None:
            return f"ejected: {self._ejected}"
        if self._unreachable is not None:
            return f"unreachable: {self._unreachable}"
        if now < self._held_until:
            return "restart hold"
        if now < self._quarantined_until:
            return "quarantined"
        if now < self._peer_held_until:
            return self._peer_reason
        phases = ("prefill", "decode") if phase in (None, "aggregate") else (phase,)
        for name in phases:
            if name in self._no_share:
                return f"no {name} share on this replica"
            gate = self.phase_gates.get(name)
            if gate is not None and (reason := gate.blocked(now)) is not None:
                return reason
        return None

    def observe_packing(self, events: int, tokens: int) -> None:
        """A finished stream's token events and the generated tokens its engine reported.

        vLLM merges deltas when its API server falls behind, speculative decoding accepts
        several tokens a step, SGLang packs --stream-interval tokens: under load an event
        carries more than one token. A bounded moving average of the recent ratio
        estimates running streams' KV. Streams of few events say little and are skipped.
        """
        if events < PACKING_MIN_EVENTS:
            return
        ratio = min(PACKING_MAX, max(1.0, tokens / events))
        self.tokens_per_event += PACKING_ALPHA * (ratio - self.tokens_per_event)

    def whole_limit(self, phase: Literal["prefill", "decode"]) -> float:
        """The engine's limit of `phase`'s concurrency over all replicas (inf: none);
        its limiter holds this replica's part."""
        return self._whole_limits[phase]

    @property
    def load_scale(self) -> int:
        """What this replica's ledger is multiplied by to estimate the engine's load: the
        cluster's member count (1 for one replica). Each replica's ledger holds only the
        work it sent, and behind an even balancer every member sends about as much; a
        replica pricing its own part alone admitted into decode batches and KV the
        others were filling too."""
        return self._share.count

    def saw_engine_load(self, requests: float, now: float, valid_s: float) -> None:
        """The engine's /metrics reported `requests` running or waiting (the monitor's
        scrape, as it arrives): with other replicas, those beyond this replica's legs on
        it are theirs (`SeenLoad`), trusted for `valid_s`. By the engine's role they are
        prefill or decode legs; on an engine of both, in the proportion of this
        replica's own (decode when it has none there)."""
        if self._share.count == 1:
            self._seen = None
            return
        load, last = self.load, self._seen
        prefill, decode = load.prefill_inflight, load.decode_active
        others = max(0, round(requests) - prefill - decode)
        if self._role == "prefill":
            theirs_prefill = others
        elif self._role == "decode" or not prefill:
            theirs_prefill = 0
        else:
            theirs_prefill = round(others * prefill / (prefill + decode))
        self._seen = SeenLoad(
            prefill=theirs_prefill,
            decode=others - theirs_prefill,
            prefill_tokens=load.prefill_tokens_inflight / prefill
            if prefill
            else (last.prefill_tokens if last is not None else 0.0),
            decode_tokens=load.decode_tokens / decode
            if decode
            else (last.decode_tokens if last is not None else 0.0),
            until=now + valid_s,
        )

    def saw_replica_loads(self, published: SeenLoad | None) -> None:
        """The other replicas' legs on the engine, as they published them
        (narwhal.cluster's shared loads; their booked prefill work goes to the
        `BacklogBook`); None when some member's word is missing or too old."""
        self._published = published

    def seen_load(self, now: float) -> SeenLoad | None:
        """The other replicas' legs on the engine: as they published them while that is
        trusted, else as the last scrape showed them while that is; None for one
        replica, or without either."""
        if self._share.count == 1:
            return None
        for seen in (self._published, self._seen):
            if seen is not None and now <= seen.until:
                return seen
        return None

    def fleet_load(self, now: float) -> LoadStatistics:
        """The engine's load as the fleet's: this replica's ledger plus the other
        replicas' legs its last scrape showed (`seen_load`), or, without one, the
        ledger times the member count (`load_scale`). Times the members alone, each of
        two replicas priced its own commits twice and the other's not at all, and their
        admitted prefills missed TTFT (the replicas benchmark, docs/benchmarks.md)."""
        own = self.load.statistics()
        seen = self.seen_load(now)
        return own.scaled(self._share.count) if seen is None else own.with_others(seen)

    def view(self, now: float) -> EngineView:
        """The engine's load as the fleet's (`fleet_load`); its free slots are this
        replica's part of them."""
        load, n = self.load, self._share.count
        # One replica reads its ledger's counters directly: placement asks this of
        # every engine for every request.
        fleet: EngineLoad | LoadStatistics = load if n == 1 else self.fleet_load(now)
        return EngineView(
            id=self.id,
            role=self._role,
            prefill_blocked=self.unavailable_reason(now, "prefill"),
            decode_blocked=self.unavailable_reason(now, "decode"),
            prefill_inflight=fleet.prefill_inflight,
            prefill_tokens_inflight=fleet.prefill_tokens_inflight + fleet.prefill_queued_tokens,
            prefill_slots_free=self.prefill_limiter.available_tokens,
            decode_active=fleet.decode_active + fleet.decode_pending,
            decode_tokens=fleet.decode_tokens + fleet.decode_pending_tokens,
            decode_slots_free=self.decode_limiter.available_tokens,
            # Not in an engine's /metrics: this ledger's, times the members.
            handoffs_pending=load.handoffs_pending * n,
            first_token_wait_s=load.first_token_wait_s(now),
            unstreamed_age_s=load.unstreamed_age_s(now) * n,
            unstreamed_cap=load.unstreamed_cap * n,
        )

    async def aclose(self) -> None:
        await self.serving_pool.aclose()
        await self.control_pool.aclose()


def _concurrency(spec: EngineSpec, config: Config, phase: Literal["prefill", "decode"]) -> int:
    override = spec.prefill_concurrency if phase == "prefill" else spec.decode_concurrency
    if override is not None:
        return override
    serving = config.serving
    return serving.prefill_concurrency if phase == "prefill" else serving.decode_concurrency


def control_share(config: Config) -> int:
    """Each engine's slice of the control pool (docs/design.md#admission: 0 → two per
    engine, min 4)."""
    total = config.engine.control_pool_size(len(config.engines))
    return max(1, math.ceil(total / max(1, len(config.engines))))
