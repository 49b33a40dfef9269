"""The monitor loop: one pass every controller.monitor_interval_s gathers what role
control needs and hands it to the registered pass handlers.

Owns
  `Monitor` (its passes, failure streak and the degraded state they set),
  `MonitorPass`, what one pass hands its handlers, and `MonitorSection`, the state
  document's `monitor` section. A pass has four stages:
  1. load: GET /metrics of every engine not being removed (`Scrapes`): running and
     waiting requests and KV-cache usage (`vllm:num_requests_running`,
     `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, or SGLang's
     equivalents); recovery reads a changed `process_start_time_seconds` or a
     prompt-token counter that went backwards as a restart (`_health`);
  2. residuals: at most one latency residual per engine (recovery's residual stage);
  3. verdicts: each engine's availability and health verdict, frozen into `MonitorPass`;
  4. handlers: every registered handler is awaited with the pass, each bounded by
     max(controller.monitor_interval_s, engine.health_timeout_s).

Invariants
  Passes start controller.monitor_interval_s apart; one that overruns (a slow handler)
  is followed by the next at once, not by a burst of catch-up passes, so a slow pass
  delays later ones and can undersample a residual window (docs/design.md#role-control). The monitor
  is the only writer of `MonitorHost.degraded_reason`.

Errors (monitoring-stage failures)
  A pass fails when any of these happens, and only then:
  - a stage raised (a bug, or data the stage cannot interpret);
  - no engine could be observed: every engine's /metrics failed (down, exhausted
    control pool, malformed, no answer within engine.health_timeout_s), and the pass
    took at least one of those failures. An engine whose scrape is in flight counts as
    failed when its previous scrape failed, but that failure was counted by the pass
    that took it. One engine being down is not a monitor failure: its load is reported
    missing, and health probes and breakers deal with the engine;
  - a pass handler raised or overran its bound (the role controller could not decide).
  A pass that observed no engine and took no failure (scrapes are in flight, within
  their engine.health_timeout_s) has no new evidence: it is inconclusive, neither
  counting a failure nor clearing one. So each failed scrape is counted once: a fleet
  whose every /metrics hangs (or a router too starved to read the answers in time)
  fails one pass per engine.health_timeout_s, not one per interval, and a fleet that
  refuses every connection one pass per interval. controller.monitor_failure_limit
  consecutive failed passes put Narwhal in the degraded state: `degraded_reason` names
  the cause and new admissions get a 503 with code `degraded`; requests already
  admitted continue. The first pass that succeeds clears it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

import attrs
import trio
from prometheus_client import Counter

from ..fleet import EngineState
from ._evidence import LoadSample, Prober
from ._host import MonitorHost
from ._scrapes import Scrapes
from ._service import Recovery

log = logging.getLogger("narwhal.monitor")


@attrs.frozen
class EngineObservation:
    id: str
    role: str
    # Why the engine takes no new work right now, or None (EngineState.unavailable_reason).
    unavailable: str | None
    health: str
    pinned: bool
    drained: bool
    # What the engine's /metrics said since the previous pass; None when its scrape failed
    # or has not answered yet (then the engine's load is unknown, not zero).
    load: LoadSample | None
    load_error: str | None
    residual: float | None
    # Seconds the engine's scrape had been out unanswered when the pass took its
    # outcomes; None when the pass has its outcome.
    load_pending_s: float | None = None


@attrs.frozen
class MonitorPass:
    number: int
    started_at: float
    finished_at: float
    engines: tuple[EngineObservation, ...]
    # Monitoring-stage failures of the gathering stages (handlers are not in here yet).
    failures: tuple[str, ...]

    @property
    def observed(self) -> tuple[EngineObservation, ...]:
        return tuple(e for e in self.engines if e.load is not None)


PassHandler = Callable[[MonitorPass], Awaitable[None]]


@attrs.frozen(kw_only=True)
class FailedPass:
    number: int
    failures: tuple[str, ...]


@attrs.frozen(kw_only=True)
class EngineScrape:
    """What the pass read of one engine's load (None: its scrape failed or is out)."""

    running: float | None
    waiting: float | None
    kv_usage: float | None
    load_error: str | None
    load_pending_s: float | None
    residual: float | None


@attrs.frozen(kw_only=True)
class PassReport:
    number: int
    duration_s: float
    result: str | None
    failures: tuple[str, ...]
    engines: Mapping[str, EngineScrape]


@attrs.frozen(kw_only=True)
class MonitorSection:
    """The `monitor` section of /narwhal/state."""

    interval_s: float
    failure_limit: int
    passes: int
    consecutive_failures: int
    degraded: str | None
    last_failed_pass: FailedPass | None
    handlers: tuple[str, ...]
    last_pass: PassReport | None


class Monitor:
    def __init__(
        self,
        ctx: MonitorHost,
        recovery: Recovery,
        prober: Prober,
        *,
        on_degraded: Callable[[str | None], None] | None = None,
    ) -> None:
        self.ctx = ctx
        self.recovery = recovery
        self.prober = prober
        self.on_degraded = on_degraded
        self.handlers: list[tuple[str, PassHandler]] = []
        self.passes = 0
        self.consecutive_failures = 0
        self.last_pass: MonitorPass | None = None
        self.last_failures: tuple[str, ...] = ()
        self.last_result: str | None = None
        # The latest failed pass since the last good one (number, failures): an
        # inconclusive pass neither clears the failure count nor explains it, so the
        # state keeps the failures a degraded reason comes from.
        self.last_failed: tuple[int, tuple[str, ...]] | None = None
        self.scrapes = Scrapes(ctx, prober, recovery.observe_metrics)
        registry = ctx.metrics.registry
        self._m_passes = Counter(
            "narwhal_monitor_passes",
            "Monitor passes by result (ok, failed, inconclusive: no engine observed and "
            "no failed scrape to count, the scrapes being in flight).",
            ["result"],
            registry=registry,
        )
        ctx.metrics.add_live_gauges(self._gauges)

    @property
    def unscraped(self) -> Mapping[str, object]:
        """Engines whose last finished scrape failed (`Scrapes.unscraped`)."""
        return self.scrapes.unscraped

    def add_handler(self, name: str, handler: PassHandler) -> None:
        """Register a pass handler (the role controller); called after every pass."""
        self.handlers.append((name, handler))

    def remove_handler(self, name: str) -> None:
        self.handlers = [(n, h) for n, h in self.handlers if n != name]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as scrapes:
            task_status.started()
            next_at = trio.current_time()
            while True:
                await trio.sleep_until(next_at)
                started = trio.current_time()
                await self.run_pass(scrapes)
                next_at = max(
                    started + self.ctx.config.controller.monitor_interval_s, trio.current_time()
                )

    async def run_pass(self, scrapes: trio.Nursery) -> MonitorPass:
        """One pass; `scrapes` is the monitor's nursery, where scrapes outlive the pass."""
        self.passes += 1
        number = self.passes
        started = trio.current_time()
        failures: list[str] = []
        engines = [engine for engine in self.ctx.fleet if not engine.removed]
        gathered = await self.scrapes.gather(scrapes, engines, number, started)
        failures.extend(gathered.failures)
        loads, errors, pending = gathered.loads, gathered.errors, gathered.pending
        inconclusive = False
        if engines and not loads:
            if gathered.new_failures and all(e.id in errors for e in engines):
                failures.append(self.scrapes.unobserved(engines, errors))
            else:
                inconclusive = True
        residuals: dict[str, float] = {}
        try:
            residuals = self.recovery.residual_pass(trio.current_time())
        except Exception as exc:
            log.exception("monitor residual stage failed", extra={"event": "monitor_stage"})
            failures.append(f"residual stage raised {type(exc).__name__}: {exc}")
        observations: tuple[EngineObservation, ...] = ()
        try:
            observations = self._observe(engines, loads, errors, residuals, pending)
        except Exception as exc:
            log.exception("monitor verdict stage failed", extra={"event": "monitor_stage"})
            failures.append(f"verdict stage raised {type(exc).__name__}: {exc}")
        result = MonitorPass(
            number=number,
            started_at=started,
            finished_at=trio.current_time(),
            engines=observations,
            failures=tuple(failures),
        )
        await self._run_handlers(result, failures)
        self.last_pass = result
        self._account(number, tuple(failures), inconclusive=inconclusive)
        return result

    def _observe(
        self,
        engines: list[EngineState],
        loads: Mapping[str, LoadSample],
        errors: Mapping[str, str],
        residuals: dict[str, float],
        pending: Mapping[str, float],
    ) -> tuple[EngineObservation, ...]:
        now = trio.current_time()
        out = []
        for engine in engines:
            record = self.recovery.record(engine.id)
            out.append(
                EngineObservation(
                    id=engine.id,
                    role=engine.role,
                    unavailable=engine.unavailable_reason(now),
                    health=record.health.verdict.value if record is not None else "unknown",
                    pinned=engine.pinned,
                    drained=engine.drained,
                    load=loads.get(engine.id),
                    load_error=errors.get(engine.id),
                    residual=residuals.get(engine.id),
                    load_pending_s=pending.get(engine.id),
                )
            )
        return tuple(out)

    async def _run_handlers(self, result: MonitorPass, failures: list[str]) -> None:
        config = self.ctx.config
        bound = max(config.controller.monitor_interval_s, config.engine.health_timeout_s)
        for name, handler in list(self.handlers):
            with trio.move_on_after(bound) as timer:
                try:
                    await handler(result)
                except Exception as exc:
                    log.exception(
                        "monitor pass handler %r raised", name, extra={"event": "monitor_stage"}
                    )
                    failures.append(f"pass handler {name!r} raised {type(exc).__name__}: {exc}")
            if timer.cancelled_caught:
                failures.append(f"pass handler {name!r} did not finish within {bound}s")

    def _account(self, number: int, failures: tuple[str, ...], *, inconclusive: bool) -> None:
        ctx = self.ctx
        limit = ctx.config.controller.monitor_failure_limit
        self.last_failures = failures
        if not failures and inconclusive:
            self.last_result = "inconclusive"
            self._m_passes.labels("inconclusive").inc()
            return
        if failures:
            self.last_result = "failed"
            self.last_failed = (number, failures)
            self._m_passes.labels("failed").inc()
            self.consecutive_failures += 1
            log.warning(
                "monitor pass %d failed (%d consecutive): %s",
                number,
                self.consecutive_failures,
                "; ".join(failures),
                extra={
                    "event": "monitor_pass",
                    "outcome": "failed",
                    "pass": number,
                    "consecutive_failures": self.consecutive_failures,
                    "failures": list(failures),
                },
            )
            if self.consecutive_failures >= limit and ctx.degraded_reason is None:
                reason = (
                    f"{self.consecutive_failures} consecutive monitor passes failed "
                    f"(controller.monitor_failure_limit={limit}); last: {failures[0]}"
                )
                ctx.degraded_reason = reason
                log.error(
                    "degraded: %s",
                    reason,
                    extra={
                        "event": "degraded",
                        "from": "ok",
                        "to": "degraded",
                        "reason": reason,
                    },
                )
                if self.on_degraded is not None:
                    self.on_degraded(reason)
            return
        self.last_result = "ok"
        self.last_failed = None
        self._m_passes.labels("ok").inc()
        if ctx.degraded_reason is not None:
            previous = ctx.degraded_reason
            ctx.degraded_reason = None
            log.warning(
                "degraded state cleared: monitor pass %d succeeded",
                number,
                extra={
                    "event": "degraded",
                    "from": "degraded",
                    "to": "ok",
                    "reason": f"monitor pass {number} succeeded after: {previous}",
                },
            )
            if self.on_degraded is not None:
                self.on_degraded(None)
        elif self.consecutive_failures:
            log.info(
                "monitor pass %d succeeded after %d failed",
                number,
                self.consecutive_failures,
                extra={"event": "monitor_pass", "outcome": "ok", "pass": number},
            )
        self.consecutive_failures = 0

    def state(self) -> MonitorSection:
        last = self.last_pass
        config = self.ctx.config.controller
        return MonitorSection(
            interval_s=config.monitor_interval_s,
            failure_limit=config.monitor_failure_limit,
            passes=self.passes,
            consecutive_failures=self.consecutive_failures,
            degraded=self.ctx.degraded_reason,
            last_failed_pass=None
            if self.last_failed is None
            else FailedPass(number=self.last_failed[0], failures=self.last_failed[1]),
            handlers=tuple(name for name, _ in self.handlers),
            last_pass=None
            if last is None
            else PassReport(
                number=last.number,
                duration_s=round(last.finished_at - last.started_at, 6),
                result=self.last_result,
                failures=self.last_failures,
                engines={
                    e.id: EngineScrape(
                        running=e.load.running if e.load else None,
                        waiting=e.load.waiting if e.load else None,
                        kv_usage=e.load.kv_usage if e.load else None,
                        load_error=e.load_error,
                        load_pending_s=None
                        if e.load_pending_s is None
                        else round(e.load_pending_s, 6),
                        residual=e.residual,
                    )
                    for e in last.engines
                },
            ),
        )

    def _gauges(self) -> list[tuple[str, str, list[str], list[tuple[list[str], float]]]]:
        return [
            (
                "narwhal_degraded",
                "1 while new admission is stopped by consecutive monitor failures.",
                [],
                [([], float(self.ctx.degraded_reason is not None))],
            ),
            (
                "narwhal_monitor_consecutive_failures",
                "Consecutive failed monitor passes.",
                [],
                [([], float(self.consecutive_failures))],
            ),
        ]
