"""The recovery service: breakers, quarantine, health ejection, restart holds, readmission.

Owns
  `Recovery`, the supervisor's service and the request path's `LegObserver`: it adopts
  each engine instance (`EngineRecovery`, its breakers installed as `phase_gates`) and
  runs one probe loop per engine. Four of `EngineState`'s availability flags are
  recovery's (`ejected`, `held_until`, `quarantined_until`, `unreachable`); drains and
  pins belong to the operator (narwhalctl), `removed` to reload.

Invariants
  The work is split along its seams, each owning its part of the record:
  `LegAccounting` (leg outcomes, residuals) with `TransferAttribution` (SGLang KV
  transfers), `ProbeLoop` (probes, key checks, holds, timers), `Verification` (leg pairs,
  backoff), `Verdicts` (every verdict change, the last engine of a role) and `_expose`
  (state document, counters, gauges). Every verdict change goes through
  `Verdicts.changed`.

Errors
  None raised to callers: what an engine does wrong becomes a verdict, a log line and a
  metric.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator

import trio

from .._errors import EngineFailed
from ..config import Config
from ..fleet import EngineState
from ..signals import DecodeGaps
from ._breaker import BreakerSettings
from ._evidence import LoadSample, Prober
from ._expose import RecoveryMetrics, RecoverySection, live_gauges, state_document
from ._host import RecoveryHost
from ._legs import LegAccounting, Predictor
from ._probe import HttpProber
from ._probing import ProbeLoop
from ._record import EngineRecovery
from ._verdicts import Verdicts
from ._verify import Verification


class Recovery:
    """Implements `LegObserver`; `run` is a supervisor service (start protocol)."""

    def __init__(
        self,
        ctx: RecoveryHost,
        *,
        prober: Prober | None = None,
        predictor: Predictor | None = None,
    ) -> None:
        self.ctx = ctx
        self.prober: Prober = prober or HttpProber()
        self.verdicts = Verdicts(ctx, RecoveryMetrics.register(ctx.metrics.registry))
        self.recent_changes = self.verdicts.recent_changes
        self.legs = LegAccounting(self.verdicts, predictor)
        self.verification = Verification(self.verdicts, self.prober)
        self.loop = ProbeLoop(self.verdicts, self.prober, self.verification)
        self._nursery: trio.Nursery | None = None
        ctx.metrics.add_live_gauges(self._gauges)
        ctx.fleet.watch(self.placement_changed)

    @property
    def predictor(self) -> Predictor | None:
        """The profile's latency for a leg (`LegAccounting.residual_pass`); None: no
        latency residuals."""
        return self.legs.predictor

    @predictor.setter
    def predictor(self, predictor: Predictor | None) -> None:
        self.legs.predictor = predictor

    @property
    def before_release(self) -> Callable[[EngineState], Awaitable[None]] | None:
        """Awaited before a restarted engine that passed its verification is released
        (`Verification.before_release`)."""
        return self.verification.before_release

    @before_release.setter
    def before_release(self, hook: Callable[[EngineState], Awaitable[None]] | None) -> None:
        self.verification.before_release = hook

    # ------------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            records = [self._adopt(engine) for engine in self.ctx.fleet]
            async with trio.open_nursery() as first:
                for record in records:
                    first.start_soon(self.loop.first_probe, record, "startup")
            for record in records:
                await nursery.start(self.loop.run, record)
            task_status.started()

    def _adopt(self, engine: EngineState) -> EngineRecovery:
        record = EngineRecovery(engine, self.ctx.config)
        records = self.verdicts.records
        previous = records.get(engine.id)
        if previous is not None and previous.engine is not engine:
            self.verdicts.replaced.append(previous)
        records[engine.id] = record
        return record

    async def admit(self, engine: EngineState) -> None:
        """A reload added `engine`: probe it once and start its loop, before placement
        can see it (the caller adds it to the fleet afterwards)."""
        assert self._nursery is not None, "recovery is not running"
        record = self._adopt(engine)
        await self.loop.first_probe(record, "added by reload")
        await self._nursery.start(self.loop.run, record)

    def retire(self, engine: EngineState) -> None:
        """A reload removed (or replaced) `engine`: stop probing that instance."""
        record = self.verdicts.record_for(engine)
        if record is None:
            return
        if self.verdicts.records.get(engine.id) is record:
            del self.verdicts.records[engine.id]
        else:
            self.verdicts.replaced.remove(record)
        if record.scope is not None:
            record.scope.cancel()

    def reconfigure(self, config: Config) -> None:
        settings = BreakerSettings.from_config(config.recovery.breaker)
        for record in self.verdicts.records.values():
            for breaker in record.breakers.values():
                breaker.configure(settings)
            record.wake.set()

    def record(self, engine_id: str) -> EngineRecovery | None:
        return self.verdicts.records.get(engine_id)

    # ------------------------------------------------------------------ inputs

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
        self.legs.leg_ok(
            engine,
            phase,
            duration_s,
            prompt_tokens=prompt_tokens,
            contended=contended,
            gaps=gaps,
        )

    def leg_failed(self, engine: EngineState, phase: str, failure: EngineFailed) -> None:
        self.legs.leg_failed(engine, phase, failure)

    def residual_pass(self, now: float) -> dict[str, float]:
        """The monitor's residual stage (`LegAccounting.residual_pass`)."""
        return self.legs.residual_pass(now)

    def observe_metrics(self, engine: EngineState, sample: LoadSample) -> None:
        """The monitor scraped `engine`'s /metrics: a restart may show there."""
        self.loop.observe_metrics(engine, sample)

    def placement_changed(self, engine: EngineState) -> None:
        """The fleet's watcher (`Fleet.watch`): `engine` changed role, or was drained,
        undrained, removed by a reload, or found refusing Narwhal's API key or not serving
        its model, by narwhalctl, a reload, the role controller or the request path. Any
        of these may leave a role without an engine in placement, or make a waiting
        engine (this one, undrained or given an empty role) the last of its role:
        `Verdicts.left_placement`.

        Two waiting engines of one role do not wake each other's probes in turn through
        here: their probes and verdicts change none of these, but for a key refusal,
        which is reported once until a key check clears it (`EngineState.auth_refused`;
        a model refusal comes only from the request path), and a verification still waits
        for `next_verify_at`."""
        self.verdicts.left_placement()

    # ------------------------------------------------------------------ introspection

    def state(self) -> RecoverySection:
        now = trio.current_time()
        verdicts = self.verdicts
        return state_document(verdicts.records, verdicts.recent_changes, verdicts.backoff_cut, now)

    def _gauges(self) -> Iterator[tuple[str, str, list[str], list[tuple[list[str], float]]]]:
        return live_gauges(list(self.verdicts.records.values()), trio.current_time())
