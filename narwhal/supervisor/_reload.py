"""Applying a reloaded configuration in place, without dropping requests in flight.

The order matters for requests arriving during the reload:

1. engines that need a new instance (added, or replaced because their url or dialect
   changed) are built and probed once before anything changes, so placement never sees
   an engine nobody has looked at;
2. the new config becomes `ctx.config`: each request snapshots it at ingress, so
   requests in flight keep the timeouts they started with and new ones get the new
   values; the listen address, the control socket and `controller.enabled` keep their
   running values (they need a restart, and the state document must show what is
   actually in force);
3. the admission gate, the client connection limit (as the open-file limit allows it,
   fitted by the caller) and retry budget are resized in place; a smaller gate lets the
   requests holding slots finish and admits no more until they do;
4. removed and replaced engines leave placement (`removed`); their resident requests
   finish on them, then their pools close and admission forgets what it learnt about
   them (the supervisor's retire task). Admission's books are kept per engine instance,
   so a replacement starts with none of it, and the old instance's legs end on their own
   without adding to them (`ServingContext.kv_freed`);
5. new instances join, every live engine's pools and phase limiters are resized in
   place (the control pool share depends on the engine count), configured role changes
   apply unless the engine is pinned (an SGLang engine's always apply: its role is the
   mode it was relaunched in), and recovery picks up new breaker settings.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import cast

import attrs
import trio

from ..admission import ttft_budget_s
from ..config import Config, PlanReport, ReloadPlan, keep_running
from ..fleet import EngineState, Role
from ..recovery import Recovery
from ..serving import DescriptorBudget, ServingContext

log = logging.getLogger("narwhal.reload")


@attrs.frozen(kw_only=True)
class ReloadReport:
    """A reload as narwhalctl and the state document (`supervisor.reloads`) show it."""

    applied: bool
    source: str
    trigger: str
    errors: tuple[str, ...]
    changes: tuple[str, ...]  # one line per difference (`ReloadPlan.summary`)
    plan: PlanReport | None


@attrs.frozen
class ReloadResult:
    applied: bool
    source: str
    errors: tuple[str, ...] = ()
    plan: ReloadPlan | None = None
    trigger: str = ""

    def report(self) -> ReloadReport:
        return ReloadReport(
            applied=self.applied,
            source=self.source,
            trigger=self.trigger,
            errors=self.errors,
            changes=tuple(self.plan.summary()) if self.plan is not None else (),
            plan=self.plan.report() if self.plan is not None else None,
        )


async def apply_config(
    ctx: ServingContext,
    recovery: Recovery,
    new: Config,
    plan: ReloadPlan,
    retire: Callable[[EngineState], None],
    *,
    descriptors: DescriptorBudget,
    deferred_roles: dict[str, Role] | None = None,
) -> Config:
    """Apply `new` as described by `plan`; returns the config now in force.
    `descriptors`: the open-file limit fitted to it (`OpenFileLimit.fit`), which sets
    the client connection limit.

    A configured role change of a pinned engine goes into `deferred_roles` (engine id
    -> role) instead, for `unpin` to apply.
    """
    deferred = {} if deferred_roles is None else deferred_roles
    old = ctx.config
    effective = keep_running(new, old)
    fresh = fresh_engines(ctx, effective, plan)
    async with trio.open_nursery() as nursery:
        for engine in fresh.values():
            nursery.start_soon(recovery.admit, engine)

    ctx.take_config(effective)
    serving = effective.serving
    ctx.gate.reconfigure(queue_capacity=serving.queue_capacity)
    ctx.apply_share()
    ctx.apply_descriptors(descriptors)
    ctx.retry_budget.reconfigure(
        maximum=float(serving.retry_budget), replenish=serving.retry_replenish
    )
    # Load signals are averaged over the TTFT target's timescale.
    ctx.first_token_lags.tau_s = effective.slo.ttft_s
    ctx.kv_turnover.tau_s = effective.slo.ttft_s
    ctx.projection_errors.reconfigure(
        effective.slo.percentile,
        ttft_budget_s(effective.slo.ttft_s, effective.serving.admission_margin),
    )
    ctx.slo.window_s = effective.controller.reactive.window_s

    for engine_id in plan.engines_removed:
        deferred.pop(engine_id, None)
    for retired in swap_engines(ctx, effective, plan, fresh):
        recovery.retire(retired)
        replacement = fresh.get(retired.id)
        if replacement is not None:
            # Operator intent survives a new url: a drained or pinned engine stays so.
            replacement.operator_intent_from(retired)
        retire(retired)
    for engine_id, old_role, new_role in plan.role_changes:
        live = ctx.fleet.get(engine_id)
        if live is None:
            continue
        # A fixed role is how the engine was launched, and only the configuration
        # records that: the relaunched engine has the new role, pinned or not. A pinned
        # one (a replacement keeps the pin and the pinned role) takes it at unpin; a
        # later reload's change replaces this one.
        if live.pinned and live.fixed_role is None:
            deferred[engine_id] = cast(Role, new_role)
            log.warning(
                "engine %s is pinned as %s; the configured role change %s -> %s waits for unpin",
                engine_id,
                live.role,
                old_role,
                new_role,
                extra={"event": "reload_role", "engine": engine_id, "outcome": "kept_pinned"},
            )
            continue
        deferred.pop(engine_id, None)
        if engine_id not in fresh:
            live.role = cast(Role, new_role)
    recovery.reconfigure(effective)
    logging.getLogger("narwhal").setLevel(effective.log.level.upper())
    return effective


def fresh_engines(ctx: ServingContext, config: Config, plan: ReloadPlan) -> dict[str, EngineState]:
    """New instances of the engines `plan` adds or replaces, by id."""
    fresh: dict[str, EngineState] = {}
    for engine_id in (*plan.engines_added, *plan.engines_replaced):
        spec = config.engine_by_id(engine_id)
        assert spec is not None
        fresh[engine_id] = EngineState(spec, config, connect=ctx.fleet.connect)
    return fresh


def swap_engines(
    ctx: ServingContext, config: Config, plan: ReloadPlan, fresh: dict[str, EngineState]
) -> list[EngineState]:
    """Take the engines `plan` removes or replaces out of `ctx.fleet`, put the `fresh`
    instances in, and resize every live engine to `config`; the instances taken out,
    whose legs in flight finish on them before they are closed."""
    retired = [
        engine
        for engine_id in (*plan.engines_removed, *plan.engines_replaced)
        if (engine := ctx.fleet.retire(engine_id)) is not None
    ]
    for engine in fresh.values():
        ctx.fleet.add(engine)
    ctx.fleet.reorder([spec.id for spec in config.engines])
    for engine in ctx.fleet:
        spec = config.engine_by_id(engine.id)
        if spec is not None:
            engine.reconfigure(spec, config)
    # The split spreads remainders by config order, which the reload may have changed.
    ctx.fleet.apply_share(config)
    return retired
