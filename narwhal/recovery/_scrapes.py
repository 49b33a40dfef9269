"""The monitor's /metrics scrapes: at most one per engine, outliving the pass that started it.

Owns
  `Scrapes`: each engine's scrape in flight (or finished and not yet taken by a pass),
  and the engines whose last scrape failed (`unscraped`, logged once until one answers).

Invariants
  Scrapes run in the monitor's own nursery, not in the pass: one engine whose /metrics
  accepted the connection and never answered would otherwise hold every pass, and so
  the residual stage and the role controller for the whole fleet, for
  engine.health_timeout_s. A pass (`gather`)
  1. takes, for each engine, the outcome of its scrape that finished since the last
     pass took one (a late answer to an earlier pass's scrape);
  2. starts a scrape of every engine that has none in flight;
  3. waits for those of its own scrapes whose engine has no outcome yet, until they
     have all finished or half of controller.monitor_interval_s has passed (the rest of
     the interval is the other stages'), and takes the outcomes of those that finished;
  4. reports each engine still without an outcome as in flight: its load is missing
     (never an earlier sample, so it is not mistaken for an idle engine), `pending`
     says how long its scrape has been out, and `errors` repeats its previous scrape's
     failure, if that failed.
  A scrape's outcome is acted on when it arrives, whichever pass takes it: recovery
  sees a restart at once, and a failure is logged once (and again when the engine
  answers). So an engine whose /metrics hangs delays at most the first pass after it
  hangs, by half an interval, and is scraped again every engine.health_timeout_s; one
  that answers after its pass stopped waiting is observed by the next pass, with a
  sample at most an interval old.

Errors
  A failed scrape is no monitor failure (its health probes judge the engine); a scrape
  that raised anything but `ScrapeError` is, as `Gathered.failures`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import attrs
import trio

from ..fleet import EngineState
from ._evidence import LoadSample, Prober, ScrapeError
from ._host import MonitorHost

log = logging.getLogger("narwhal.monitor")

# How many monitor intervals an engine's reported load stands for the other replicas'
# legs on it (`EngineState.seen_load`); after that pricing falls back to this replica's
# ledger times the members. A late or missed scrape is not yet a stale estimate.
SEEN_LOAD_PASSES = 3


@attrs.define(eq=False)
class _Scrape:
    """One engine's /metrics scrape, from its start until a pass takes its outcome."""

    engine: EngineState
    pass_number: int
    started_at: float
    done: trio.Event = attrs.Factory(trio.Event)
    sample: LoadSample | None = None
    error: str | None = None
    # The load stage raised (not a ScrapeError): a monitoring-stage failure.
    raised: str | None = None


@attrs.frozen
class Gathered:
    """What a pass's load stage learnt: each engine's load, or its error, or how long
    its scrape has been out; the load stage's own failures; and whether the pass took
    a failed scrape (a failure each pass counts once)."""

    loads: Mapping[str, LoadSample]
    errors: Mapping[str, str]
    pending: Mapping[str, float]
    failures: tuple[str, ...]
    new_failures: bool


class Scrapes:
    """Every engine's scrape, for the passes to take (`gather`)."""

    def __init__(
        self,
        ctx: MonitorHost,
        prober: Prober,
        observe: Callable[[EngineState, LoadSample], None],
    ) -> None:
        self.ctx = ctx
        self.prober = prober
        # Told every sample as it arrives (recovery: a restart may show there).
        self._observe = observe
        # Engines whose last finished scrape failed, with that scrape (logged once).
        self.unscraped: dict[str, _Scrape] = {}
        # Each engine's scrape that is in flight, or finished and not yet taken by a pass:
        # at most one per engine.
        self._scrapes: dict[str, _Scrape] = {}

    async def gather(
        self, nursery: trio.Nursery, engines: list[EngineState], number: int, started: float
    ) -> Gathered:
        """Pass `number`'s load stage: take the outcomes that finished since the last
        pass, start a scrape of every engine without one in flight (in `nursery`, where
        it may outlive the pass), and wait for this pass's own until they have all
        finished or half of controller.monitor_interval_s has passed."""
        failures: list[str] = []
        loads: dict[str, LoadSample] = {}
        errors: dict[str, str] = {}
        taken: set[str] = set()
        self._forget(engines)
        for engine in engines:
            scrape = self._scrapes.get(engine.id)
            if scrape is not None and scrape.done.is_set():
                self._take(scrape, taken, loads, errors, failures)
        for engine in engines:
            if engine.id not in self._scrapes:
                scrape = _Scrape(engine, number, started)
                self._scrapes[engine.id] = scrape
                nursery.start_soon(self._scrape, scrape)
        awaited = [
            scrape
            for scrape in self._scrapes.values()
            if scrape.pass_number == number and scrape.engine.id not in taken
        ]
        with trio.move_on_at(started + self.ctx.config.controller.monitor_interval_s / 2):
            for scrape in awaited:
                await scrape.done.wait()
        for scrape in awaited:
            if scrape.done.is_set():
                self._take(scrape, taken, loads, errors, failures)
        # Failures of scrapes this pass took: each failure is counted by one pass only.
        new_failures = bool(errors)
        now = trio.current_time()
        pending: dict[str, float] = {}
        for engine in engines:
            if engine.id not in taken:
                pending[engine.id] = now - self._scrapes[engine.id].started_at
                failed = self.unscraped.get(engine.id)
                if failed is not None:
                    errors[engine.id] = str(failed.error)
        return Gathered(loads, errors, pending, tuple(failures), new_failures=new_failures)

    def _forget(self, engines: list[EngineState]) -> None:
        """Drop the scrapes of engines a reload removed or replaced: a scrape still in
        flight for one runs out on its own (engine.health_timeout_s), unseen, and an
        engine added again under the same id is logged afresh when it fails."""
        current = {engine.id: engine for engine in engines}
        for scrapes in (self._scrapes, self.unscraped):
            for engine_id, scrape in list(scrapes.items()):
                if current.get(engine_id) is not scrape.engine:
                    del scrapes[engine_id]

    def _take(
        self,
        scrape: _Scrape,
        taken: set[str],
        loads: dict[str, LoadSample],
        errors: dict[str, str],
        failures: list[str],
    ) -> None:
        """Make a finished scrape's outcome this pass's observation of its engine."""
        engine_id = scrape.engine.id
        del self._scrapes[engine_id]
        taken.add(engine_id)
        if scrape.sample is not None:
            loads[engine_id] = scrape.sample
        if scrape.error is not None:
            errors[engine_id] = scrape.error
        if scrape.raised is not None:
            failures.append(scrape.raised)

    def unobserved(self, engines: list[EngineState], errors: Mapping[str, str]) -> str:
        """The failure of a pass that observed no engine, each one's error named."""
        failure = (
            "no engine could be observed ("
            + "; ".join(f"{e.id}: {errors.get(e.id, 'no answer')}" for e in engines)
            + ")"
        )
        # Still a failure (the pass has no load to decide on), but say whose: under a
        # client flood the degraded reason would otherwise point at the engines. The
        # failures reported may be those of scrapes earlier passes started.
        since = min(
            [s.started_at for e in engines if (s := self.unscraped.get(e.id)) is not None],
            default=trio.current_time(),
        )
        timeout = self.ctx.config.engine.health_timeout_s
        lag = self.ctx.loop_lag.starved(timeout, since=since)
        if lag is not None:
            failure += (
                f"; the router's own event loop lagged {lag:.3g} s while the scrapes ran "
                "(router overload)"
            )
        return failure

    async def _scrape(self, scrape: _Scrape) -> None:
        engine = scrape.engine
        try:
            scrape.sample = sample = await self.prober.scrape(engine, self.ctx.config)
            # With other replicas, what the engine runs beyond this one's legs is theirs
            # (pricing's estimate of the fleet's load), trusted for a few passes.
            trusted_s = SEEN_LOAD_PASSES * self.ctx.config.controller.monitor_interval_s
            engine.saw_engine_load(sample.running + sample.waiting, trio.current_time(), trusted_s)
            self._observe(engine, sample)
        except ScrapeError as exc:
            scrape.error = str(exc)
            self._scrape_failed(scrape)
        except Exception as exc:
            log.exception("monitor load stage failed for %s", engine.id)
            scrape.error = f"internal error: {exc!r}"
            scrape.raised = f"load stage raised {type(exc).__name__} for {engine.id}: {exc}"
        else:
            self._scraped(scrape)
        finally:
            scrape.done.set()

    def _scrape_failed(self, scrape: _Scrape) -> None:
        """One engine's /metrics could not be read: not a monitor failure, but its load
        is missing from role control and a restart shows there no more, which the
        operator should hear of once (its health probes judge the engine itself)."""
        engine = scrape.engine
        if self._scrapes.get(engine.id) is not scrape:
            return  # the engine was removed or replaced meanwhile
        detail = str(scrape.error)
        logged = engine.id in self.unscraped
        self.unscraped[engine.id] = scrape
        if logged:
            return
        log.warning(
            "monitor cannot read the /metrics of %s: %s; its load is missing from role "
            "control and a restart shows only on /version or when it stops answering",
            engine.id,
            detail,
            extra={"event": "scrape", "engine": engine.id, "outcome": "failed", "detail": detail},
        )

    def _scraped(self, scrape: _Scrape) -> None:
        engine = scrape.engine
        if self._scrapes.get(engine.id) is not scrape:
            return
        failed = self.unscraped.pop(engine.id, None)
        if failed is not None:
            log.info(
                "monitor reads the /metrics of %s again (it failed with: %s)",
                engine.id,
                failed.error,
                extra={"event": "scrape", "engine": engine.id, "outcome": "ok"},
            )
