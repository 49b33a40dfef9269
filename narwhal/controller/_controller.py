"""The live controller: the object the monitor loop calls once per pass.

It owns the controller state, the demand estimator, the per-pass inputs the request path
reports (arrivals, first-token timeouts, TTFT-breach signals, decode token intervals)
and the flip history. It has no task of its own: `on_pass` builds a snapshot of the
fleet, calls the pure `decide`, applies the move (unless advisory) and returns the
decision. Between the snapshot and the application there is no checkpoint, so the
decision always sees the fleet it changes.

Every recording method is synchronous and O(1), safe to call from the request path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from functools import partial
from typing import Protocol

import trio
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from ..admission import cached_prefill_s, unstreamed_tokens
from ..config import Config
from ..fleet import EngineState
from ._apply import (
    FlipHistory,
    FlipRecord,
    MoveRejected,
    apply_move,
    flip_record,
    resident_streams,
)
from ._decide import Decision, decide
from ._demand import Arrival, DemandEstimator
from ._expose import (
    ControllerCounters,
    ControllerSection,
    Exposure,
    Gauge,
    controller_gauges,
    counter_families,
    state_section,
)
from ._profile import EngineProfiles, MeanProfile, Profile
from ._snapshot import (
    EngineSnapshot,
    FleetSnapshot,
    decode_slots,
    measured_prefill_pressure,
    prefill_work_s,
)
from ._state import ControllerState, initial_state

log = logging.getLogger("narwhal.controller")

DecodeCorrectionOf = Callable[[str], float]


class EngineSource(Protocol):
    """The live fleet (`narwhal.fleet.Fleet` fits)."""

    def __iter__(self) -> Iterator[EngineState]: ...

    def get(self, engine_id: str) -> EngineState | None: ...


def _no_profile() -> Profile | None:
    return None


def _no_engine_profile(engine_id: str) -> Profile | None:
    return None


def _no_correction(engine_id: str) -> float:
    return 1.0


class Controller:
    """Reactive role control over a live fleet (docs/design.md#role-control).

    `mean_profile` and `engine_profiles` are read on every pass, so a profile reload is
    seen at the next pass (and re-prices the demand window); `decode_correction` returns
    an engine's live/profile decode ratio (clamped here to the configured bounds).
    """

    def __init__(
        self,
        config: Config,
        engines: EngineSource,
        *,
        mean_profile: MeanProfile = _no_profile,
        engine_profiles: EngineProfiles = _no_engine_profile,
        decode_correction: DecodeCorrectionOf = _no_correction,
        started_at: float | None = None,
    ) -> None:
        now = trio.current_time() if started_at is None else started_at
        self._config = config
        self._engines = engines
        self._mean_profile = mean_profile
        self._engine_profiles = engine_profiles
        self._decode_correction = decode_correction
        self.demand = DemandEstimator.from_config(config.controller.reactive, started_at=now)
        self._priced_with: Profile | None = None
        self.state: ControllerState = initial_state(now)
        self.history = FlipHistory(config.controller.flip_history)
        self.counters = ControllerCounters()
        self.last_pass: Decision | None = None
        self.last_evaluation: Decision | None = None
        self.last_result: str | None = None
        self.last_snapshot: FleetSnapshot | None = None
        self._now = now
        # Per-pass inputs, consumed by the next pass.
        self._first_token_timeouts = 0
        self._p2d_recovery_moves = 0
        self._ttft_breach = False
        self._intervals: dict[str, tuple[float, int]] = {}
        # Each engine's role as the last pass left it: a role that differs at the next
        # pass was changed by someone else (`narwhalctl pin`, a reload).
        self._roles: dict[str, str] = {}

    # -- inputs from the request path and recovery ---------------------------------------

    def record_arrival(
        self,
        time: float,
        prompt_tokens: int,
        output_tokens: int,
        *,
        admitted: bool = True,
        cached_tokens: int = 0,
        weight: int = 1,
    ) -> None:
        """An offered request (admitted or refused by predictive admission) with its
        prompt tokens, expected output tokens and the leading prompt tokens an engine
        held cached, which its prefill demand is priced without; `weight`: the arrivals
        it stands for (one sample all the same)."""
        self.demand.record(
            Arrival(time, prompt_tokens, output_tokens, admitted, cached_tokens, weight)
        )

    def record_first_token_timeout(self) -> None:
        """A decode leg hit engine.first_token_timeout_s (resets the evidence window)."""
        self._first_token_timeouts += 1

    def record_p2d_recovery_move(self) -> None:
        """A prefill-to-decode recovery move made outside this controller."""
        self._p2d_recovery_moves += 1

    def signal_ttft_breach(self) -> None:
        """Admission priced a request above the TTFT target: allows one guarded D-to-P
        evaluation before the next scheduled one."""
        self._ttft_breach = True

    def observe_decode_interval(self, engine_id: str, interval_s: float) -> None:
        """A measured decode token interval on an engine (e.g. one stream's mean gap
        since its last report); the pass uses the mean of the samples since the last."""
        total, count = self._intervals.get(engine_id, (0.0, 0))
        self._intervals[engine_id] = (total + interval_s, count + 1)

    # -- configuration ---------------------------------------------------------------------

    @property
    def config(self) -> Config:
        return self._config

    def reconfigure(self, config: Config) -> None:
        """A reload: new parameters take effect at the next pass; the state, the demand
        window and the history carry over."""
        self._config = config
        self.demand.reconfigure(config.controller.reactive)
        self.history.resize(config.controller.flip_history)

    # -- one pass ------------------------------------------------------------------------

    def snapshot(self, now: float) -> FleetSnapshot:
        """The fleet and its demand as the decision will see them (consumes the per-pass
        inputs)."""
        cfg = self._config
        mean = self._mean_profile()
        if mean is not self._priced_with:
            self._priced_with = mean
            self.demand.set_pricer(
                None if mean is None else partial(cached_prefill_s, mean.prefill)
            )
        rx = cfg.controller.reactive
        engines: list[EngineSnapshot] = []
        for engine in self._engines:
            profile = self._engine_profiles(engine.id)
            total, count = self._intervals.get(engine.id, (0.0, 0))
            correction = min(
                rx.decode_correction_max,
                max(rx.decode_correction_min, self._decode_correction(engine.id)),
            )
            unseen = 0  # KV made by non-streaming decode legs, as admission estimates it
            # The fleet's load, as admission estimates it (`EngineState.fleet_load`);
            # the view is the fleet's already.
            load = engine.fleet_load(now)
            if load.unstreamed_legs and profile is not None:
                view = engine.view(now)
                unseen = round(unstreamed_tokens(view, profile.decode, correction))
            engines.append(
                EngineSnapshot(
                    id=engine.id,
                    role=engine.role,
                    prefill_blocked=engine.unavailable_reason(now, "prefill"),
                    decode_blocked=engine.unavailable_reason(now, "decode"),
                    pinned=engine.pinned,
                    fixed_role=engine.fixed_role,
                    since_role_change_s=self.state.since_role_change(engine.id, now),
                    decode_active=load.decode_active,
                    decode_tokens=load.decode_tokens + unseen,
                    decode_pending=load.decode_pending,
                    decode_pending_tokens=load.decode_pending_tokens,
                    prefill_inflight=load.prefill_inflight,
                    prefill_tokens_inflight=load.prefill_tokens_inflight,
                    # Prefills waiting for one of the router's slots
                    # (serving.prefill_concurrency) are work the engine will do: without
                    # them a capped pool looked idle however long its queue.
                    prefill_work_s=prefill_work_s(
                        profile or mean,
                        load.prefill_inflight + load.prefill_queued,
                        load.prefill_tokens_inflight + load.prefill_queued_tokens,
                    ),
                    handoffs_pending=load.handoffs_pending,
                    profile=profile,
                    decode_interval_s=total / count if count else None,
                    decode_correction=correction,
                    # The engine's whole limit: this replica holds its part of it.
                    decode_slots=decode_slots(engine.whole_limit("decode"), profile),
                )
            )
        short, long = self.demand.estimates(now)
        snap = FleetSnapshot(
            engines=tuple(engines),
            mean_profile=mean,
            short=short,
            long=long,
            arrivals_total=self.demand.total,
            prefill_pressure=measured_prefill_pressure(engines, cfg.slo.ttft_s),
            first_token_timeouts=self._first_token_timeouts,
            p2d_recovery_moves=self._p2d_recovery_moves,
            ttft_breach=self._ttft_breach,
        )
        self._first_token_timeouts = 0
        self._p2d_recovery_moves = 0
        self._ttft_breach = False
        self._intervals.clear()
        return snap

    def step(self, now: float) -> Decision | None:
        """One pass, synchronously. None when the controller is disabled."""
        self._now = now
        if not self._config.controller.enabled:
            return None
        self._stamp_outside_role_changes(now)
        snap = self.snapshot(now)
        decision = decide(snap, self.state, now, self._config)
        result: str = decision.result
        move = decision.move
        if move is not None and decision.result == "move":
            engine = self._engines.get(move.engine)
            try:
                if engine is None:
                    raise MoveRejected(f"engine {move.engine!r} is not in the fleet")
                record = apply_move(engine, decision)
            except MoveRejected as exc:
                result = "failed"
                self.counters.apply_failures += 1
                log.error(
                    "role change refused: %s",
                    exc,
                    extra={"event": "role_change_refused", "engine": move.engine},
                )
            else:
                result = "applied"
                self.history.append(record)
                self.counters.flips[(move.direction, decision.caller)] += 1
                log.info(
                    "role change: %s %s -> %s (%s)",
                    move.engine,
                    move.from_role,
                    move.to_role,
                    decision.reason,
                    extra={
                        "event": "role_change",
                        "engine": move.engine,
                        "from_role": move.from_role,
                        "to_role": move.to_role,
                        "caller": decision.caller,
                        "reason": decision.reason,
                        "resident_streams": record.resident_streams,
                    },
                )
        elif move is not None and decision.result == "advisory":
            engine = self._engines.get(move.engine)
            resident = resident_streams(engine) if engine is not None else 0
            record = flip_record(decision, resident_streams=resident, applied=False)
            self.counters.proposals[(move.direction, decision.caller)] += 1
            # Advisory mode re-proposes the same move every time it is confirmed again,
            # because nothing changes; the history keeps the first of a run of identical
            # proposals (the counter counts them all).
            if not _same_proposal(self.history.last, record):
                self.history.append(record)
                log.info(
                    "advisory role change: %s %s -> %s (%s)",
                    move.engine,
                    move.from_role,
                    move.to_role,
                    decision.reason,
                    extra={
                        "event": "role_change_proposed",
                        "engine": move.engine,
                        "caller": decision.caller,
                        "reason": decision.reason,
                    },
                )
        self.state = decision.state
        self._roles = {engine.id: engine.role for engine in self._engines}
        self.last_pass = decision
        self.last_snapshot = snap
        if decision.evaluated:
            self.last_evaluation = decision
            self.last_result = result
            self.counters.evaluations[(decision.caller, result)] += 1
        return decision

    def _stamp_outside_role_changes(self, now: float) -> None:
        """Give an engine whose role an operator pin or a reload changed since the last
        pass a dwell timestamp, as a move of the controller's own gets. dwell_s is a
        residence time in a role, whoever set it: without this, an engine pinned to
        another role and then unpinned was the idlest candidate of its new pool and went
        straight back at the next pass. The pass that first sees the change stamps it,
        so the change counts from at most one monitor interval after it was made."""
        for engine in self._engines:
            seen = self._roles.get(engine.id)
            if seen is not None and seen != engine.role:
                self.state = self.state.with_role_change(engine.id, now)

    async def on_pass(self, now: float | None = None) -> Decision | None:
        """The monitor loop's call, once per `controller.monitor_interval_s`."""
        decision = self.step(trio.current_time() if now is None else now)
        await trio.lowlevel.checkpoint()
        return decision

    # -- exposure ------------------------------------------------------------------------

    def __repr__(self) -> str:
        d = self.last_evaluation
        if d is None:
            return "<Controller (no evaluation yet)>"
        gate = f" ({d.gate})" if d.gate else ""
        return (
            f"<Controller {d.current.prefill}P:{d.current.decode}D proposed "
            f"{d.proposed.prefill}P:{d.proposed.decode}D | {d.caller} {self.last_result}{gate}>"
        )

    def exposure(self) -> Exposure:
        return Exposure(
            config=self._config,
            now=self._now,
            decision=self.last_evaluation,
            result=self.last_result,
            last_pass=self.last_pass,
            snapshot=self.last_snapshot,
            history=self.history,
            counters=self.counters,
        )

    def state_section(self) -> ControllerSection:
        """For `ServingContext.state_providers`: ("controller", controller.state_section)."""
        return state_section(self.exposure())

    def gauges(self) -> Iterator[Gauge]:
        """For `Metrics.add_live_gauges(controller.gauges)`."""
        return controller_gauges(self.exposure())

    def collector(self) -> Collector:
        """For `metrics.registry.register(controller.collector())`: the counters."""
        return _Counters(self)


def _same_proposal(last: FlipRecord | None, record: FlipRecord) -> bool:
    return (
        last is not None
        and not last.applied
        and (last.engine, last.from_role, last.before, last.after)
        == (record.engine, record.from_role, record.before, record.after)
    )


class _Counters(Collector):
    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    def collect(self) -> Iterator[Metric]:
        return counter_families(self.controller.exposure())
