"""The monitor loop: one pass every controller.monitor_interval_s gathers what role
control needs and hands it to the registered pass handlers.

A pass has four stages:

1. load: GET /metrics of every engine that is not being removed, concurrently on the
   control pools, each bounded by engine.health_timeout_s; running and waiting
   requests and KV-cache usage (`vllm:num_requests_running`, `vllm:num_requests_waiting`,
   `vllm:kv_cache_usage_perc`, or SGLang's equivalents). Recovery reads a changed
   `process_start_time_seconds` or a prompt-token counter that went backwards as a
   restart (`_health`);
2. residuals: at most one latency residual per engine (recovery's residual stage);
3. verdicts: each engine's availability and health verdict, frozen into `MonitorPass`;
4. handlers: every registered handler is awaited with the pass, each bounded by
   max(controller.monitor_interval_s, engine.health_timeout_s).

Monitoring-stage failure
  A pass fails when any of these happens, and only then:
  - a stage raised (a bug, or data the stage cannot interpret);
  - no engine could be observed: every engine's /metrics failed (down, exhausted
    control pool, malformed). One engine being down is not a monitor failure: its
    load is reported missing, and health probes and breakers deal with the engine;
  - a pass handler raised or overran its bound (the role controller could not decide).
  controller.monitor_failure_limit consecutive failed passes put Narwhal in the degraded
  state: `ServingContext.degraded_reason` names the cause and new admissions get a 503
  with code `degraded`; requests already admitted continue. The first pass that
  succeeds clears it. The monitor is the only writer of `degraded_reason`.

Passes start controller.monitor_interval_s apart; a pass that overruns is followed by
the next one at once (not by a burst of catch-up passes), so a slow pass delays later
ones and can undersample a residual window (manual 7).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import attrs
import trio
from prometheus_client import Counter

from ..fleet import EngineState
from ..serving import ServingContext
from ._probe import LoadSample, Prober, ScrapeError
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
    load: LoadSample | None
    load_error: str | None
    residual: float | None


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


class Monitor:
    def __init__(
        self,
        ctx: ServingContext,
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
        # Engines whose /metrics the last pass could not read, with why (logged once).
        self.unscraped: dict[str, str] = {}
        registry = ctx.metrics.registry
        self._m_passes = Counter(
            "narwhal_monitor_passes",
            "Monitor passes by result (ok, failed).",
            ["result"],
            registry=registry,
        )
        ctx.metrics.add_live_gauges(self._gauges)

    def add_handler(self, name: str, handler: PassHandler) -> None:
        """Register a pass handler (the role controller); called after every pass."""
        self.handlers.append((name, handler))

    def remove_handler(self, name: str) -> None:
        self.handlers = [(n, h) for n, h in self.handlers if n != name]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        next_at = trio.current_time()
        while True:
            await trio.sleep_until(next_at)
            started = trio.current_time()
            await self.run_pass()
            next_at = max(
                started + self.ctx.config.controller.monitor_interval_s, trio.current_time()
            )

    async def run_pass(self) -> MonitorPass:
        self.passes += 1
        number = self.passes
        started = trio.current_time()
        failures: list[str] = []
        engines = [engine for engine in self.ctx.fleet if not engine.removed]
        loads: dict[str, LoadSample] = {}
        errors: dict[str, str] = {}
        async with trio.open_nursery() as nursery:
            for engine in engines:
                nursery.start_soon(self._scrape, engine, loads, errors, failures)
        if engines and not loads:
            failure = (
                "no engine could be observed ("
                + "; ".join(f"{e.id}: {errors.get(e.id, 'no answer')}" for e in engines)
                + ")"
            )
            # Still a failure (the pass has no load to decide on), but say whose: under a
            # client flood the degraded reason would otherwise point at the engines.
            timeout = self.ctx.config.engine.health_timeout_s
            lag = self.ctx.loop_lag.starved(timeout, since=started)
            if lag is not None:
                failure += (
                    f"; the router's own event loop lagged {lag:.3g} s during the pass "
                    "(router overload)"
                )
            failures.append(failure)
        residuals: dict[str, float] = {}
        try:
            residuals = self.recovery.residual_pass(trio.current_time())
        except Exception as exc:
            log.exception("monitor residual stage failed", extra={"event": "monitor_stage"})
            failures.append(f"residual stage raised {type(exc).__name__}: {exc}")
        observations: tuple[EngineObservation, ...] = ()
        try:
            observations = self._observe(engines, loads, errors, residuals)
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
        self._account(number, tuple(failures))
        return result

    async def _scrape(
        self,
        engine: EngineState,
        loads: dict[str, LoadSample],
        errors: dict[str, str],
        failures: list[str],
    ) -> None:
        try:
            loads[engine.id] = sample = await self.prober.scrape(engine, self.ctx.config)
            self.recovery.observe_metrics(engine, sample)
        except ScrapeError as exc:
            errors[engine.id] = str(exc)
            self._scrape_failed(engine, str(exc))
        except Exception as exc:
            log.exception("monitor load stage failed for %s", engine.id)
            errors[engine.id] = f"internal error: {exc!r}"
            failures.append(f"load stage raised {type(exc).__name__} for {engine.id}: {exc}")
        else:
            self._scraped(engine)

    def _scrape_failed(self, engine: EngineState, detail: str) -> None:
        """One engine's /metrics could not be read: not a monitor failure, but its load
        is missing from role control and a restart shows there no more, which the
        operator should hear of once (its health probes judge the engine itself). A
        scrape that hangs also holds every pass for engine.health_timeout_s."""
        if engine.id in self.unscraped:
            self.unscraped[engine.id] = detail
            return
        self.unscraped[engine.id] = detail
        log.warning(
            "monitor cannot read the /metrics of %s: %s; its load is missing from role "
            "control and a restart shows only on /version or when it stops answering",
            engine.id,
            detail,
            extra={"event": "scrape", "engine": engine.id, "outcome": "failed", "detail": detail},
        )

    def _scraped(self, engine: EngineState) -> None:
        detail = self.unscraped.pop(engine.id, None)
        if detail is not None:
            log.info(
                "monitor reads the /metrics of %s again (it failed with: %s)",
                engine.id,
                detail,
                extra={"event": "scrape", "engine": engine.id, "outcome": "ok"},
            )

    def _observe(
        self,
        engines: list[EngineState],
        loads: dict[str, LoadSample],
        errors: dict[str, str],
        residuals: dict[str, float],
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

    def _account(self, number: int, failures: tuple[str, ...]) -> None:
        ctx = self.ctx
        limit = ctx.config.controller.monitor_failure_limit
        self.last_failures = failures
        if failures:
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

    def state(self) -> dict[str, object]:
        last = self.last_pass
        config = self.ctx.config.controller
        return {
            "interval_s": config.monitor_interval_s,
            "failure_limit": config.monitor_failure_limit,
            "passes": self.passes,
            "consecutive_failures": self.consecutive_failures,
            "degraded": self.ctx.degraded_reason,
            "handlers": [name for name, _ in self.handlers],
            "last_pass": None
            if last is None
            else {
                "number": last.number,
                "duration_s": round(last.finished_at - last.started_at, 6),
                "failures": list(self.last_failures),
                "engines": {
                    e.id: {
                        "running": e.load.running if e.load else None,
                        "waiting": e.load.waiting if e.load else None,
                        "kv_usage": e.load.kv_usage if e.load else None,
                        "load_error": e.load_error,
                        "residual": e.residual,
                    }
                    for e in last.engines
                },
            },
        }

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
