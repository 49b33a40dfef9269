"""What narwhalctl's commands do to the running daemon.

- `drain ENGINE`: the engine takes no new work of any phase; requests resident on it
  (phase slots, pending handoffs, open streams) finish where they are. `undrain` undoes
  it. The operator owns this flag; recovery, reload and the controller leave it alone.
- `pin ENGINE prefill|decode`: sets the engine's role now and marks it pinned: the role
  controller must not move it and a reload's configured role change waits for `unpin`.
  Resident requests keep their engine (docs/design.md#placement: a live role change affects new
  placement only). `unpin` clears the mark and keeps the current role, unless a reload
  changed the engine's configured role while it was pinned: that role applies at
  `unpin` (the result's `role` and `previous_role` say so). An engine whose
  dialect fixes its role at launch (SGLang) may be pinned only to the role it has: the
  router cannot make an SGLang prefill server decode, it can only send it requests that
  fail, so any other role is refused (`role_fixed`) and nothing changes.
- `state`: the /narwhal/state document.
- `proposals`: advisory mode's proposed role changes (the flip history's unapplied
  records), each stamped with the wall-clock time it was made: the daemon's own times
  are monotonic seconds, which mean nothing to a person reading them later.
- `reload`: the same as SIGHUP; an invalid file is refused with every problem listed.

Each change is logged (`"event": "operator"`) with the engine, the command and the
old and new values, and each refusal by the control server (`"event": "ctl"`). When
the change leaves no placeable engine pair (say, draining the last decode engine), the
command still succeeds and its result carries a warning.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import attrs
import trio

from .._records import SPLICED, to_json
from ..cluster import What
from ..controller import ControllerSection, FlipEntry, RoleMove, SplitCounts
from ..ctl import CtlError, CtlRequest
from ..fleet import EngineState, Role
from ..placement import NoPlacement, choose
from ..serving import ServingContext, full_state_document

if TYPE_CHECKING:
    from ._supervisor import Supervisor

log = logging.getLogger("narwhal.operator")


# The shared facts (narwhal.cluster) each engine command may change.
_FACTS: dict[str, tuple[What, ...]] = {
    "drain": ("drained",),
    "undrain": ("drained",),
    "pin": ("role", "pinned"),
    "unpin": ("role", "pinned"),
}


class Operations:
    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    @property
    def ctx(self) -> ServingContext:
        ctx = self.supervisor.ctx
        assert ctx is not None
        return ctx

    async def __call__(self, request: CtlRequest) -> object:
        command = request.command
        if command == "state":
            return await full_state_document(self.ctx)
        if command == "proposals":
            controller = self.supervisor.link.controller if self.supervisor.link else None
            view = proposals_view(
                controller.state_section() if controller is not None else None,
                monotonic_now=trio.current_time(),
                wall_now=time.time(),
            )
            return to_json(view)
        if command == "reload":
            reloaded = await self.supervisor.reload(trigger="narwhalctl")
            if not reloaded.applied:
                if reloaded.source == "<none>":
                    code = "reload_unavailable"
                elif self.supervisor.shutting_down:
                    code = "shutting_down"
                else:
                    code = "invalid_config"
                raise CtlError(
                    code,
                    f"reload of {reloaded.source} rejected; the running configuration is kept",
                    details=to_json(reloaded.report()),
                    logged=True,  # by the reload, with each problem and the trigger
                )
            return to_json(reloaded.report())
        assert request.engine is not None
        engine = self._engine(request.engine)
        result = self._engine_command(command, request, engine)
        cluster = self.supervisor.cluster
        if cluster is not None and cluster.config.cluster.enabled:
            # Fleet-wide: every replica applies it from etcd (now, or once etcd answers).
            cluster.share_facts(engine, *_FACTS[command])
            result["replicas"] = "all"
        return result

    def _engine_command(
        self, command: str, request: CtlRequest, engine: EngineState
    ) -> dict[str, object]:
        if command == "drain":
            return self._flag(engine, "drained", engine.operator_drain)
        if command == "undrain":
            return self._flag(engine, "drained", engine.operator_undrain)
        if command == "pin":
            assert request.role is not None
            if engine.fixed_role is not None and request.role != engine.role:
                raise CtlError(
                    "role_fixed",
                    f"pin: engine {engine.id!r} (dialect {engine.dialect.name}) has role "
                    f"{engine.role!r} and cannot be pinned as {request.role!r}: "
                    f"{engine.fixed_role}; relaunch it in the other mode and change its "
                    "role in the configuration instead",
                )
            old_role = engine.role
            engine.role = cast(Role, request.role)
            # The operator chose the role now: a configured change still waiting for an
            # unpin stays waiting (the pin keeps it, as a reload while pinned does).
            if old_role != engine.role:
                self._log(engine, "role", old_role, engine.role)
            result = self._flag(engine, "pinned", engine.operator_pin)
            result["role"] = engine.role
            result["previous_role"] = old_role
            return result
        if command == "unpin":
            result = self._flag(engine, "pinned", engine.operator_unpin)
            # A reload's role change that waited for the pin to go (docs/design.md#placement:
            # resident requests keep their engine; new placement sees the role at once).
            configured = self.supervisor.deferred_roles.pop(engine.id, None)
            if configured is not None and configured != engine.role:
                old_role = engine.role
                engine.role = configured
                self._log(engine, "role", old_role, engine.role)
                result["previous_role"] = old_role
            result["role"] = engine.role
            return result
        raise CtlError("bad_request", f"unknown command {command!r}")

    def _engine(self, engine_id: str) -> EngineState:
        fleet = self.ctx.fleet
        engine = fleet.get(engine_id)
        if engine is not None:
            return engine
        if any(e.id == engine_id for e in fleet.retiring):
            raise CtlError(
                "unknown_engine",
                f"engine {engine_id!r} was removed by a reload and is finishing its "
                "resident requests",
            )
        known = ", ".join(e.id for e in fleet) or "none"
        raise CtlError("unknown_engine", f"no engine {engine_id!r}; engines: {known}")

    def _flag(
        self, engine: EngineState, name: str, change: Callable[[], None]
    ) -> dict[str, object]:
        old = bool(getattr(engine, name))
        change()
        value = bool(getattr(engine, name))
        if old != value:
            self._log(engine, name, old, value)
        result: dict[str, object] = {
            "engine": engine.id,
            name: value,
            "changed": old != value,
            "resident": engine.resident_work,
            "available": engine.unavailable_reason(trio.current_time()) is None,
        }
        warning = self._placement_warning()
        if warning is not None:
            result["warning"] = warning
        return result

    def _placement_warning(self) -> str | None:
        placement = choose(self.ctx.fleet.views(trio.current_time()))
        if isinstance(placement, NoPlacement):
            return f"new requests cannot be placed now: {placement.reason}"
        return None

    def _log(self, engine: EngineState, what: str, old: object, new: object) -> None:
        log.warning(
            "operator set %s of %s: %s -> %s",
            what,
            engine.id,
            old,
            new,
            extra={
                "event": "operator",
                "engine": engine.id,
                "kind": what,
                "from": old,
                "to": new,
                "resident": engine.resident_work,
            },
        )


@attrs.frozen(kw_only=True)
class Proposal:
    record: FlipEntry = attrs.field(metadata=SPLICED)
    wall_time: str  # ISO 8601, local time with its offset
    age_s: float


@attrs.frozen(kw_only=True)
class ProposalsNow:
    """The last evaluation: what the controller would do now."""

    wall_time: str
    split: SplitCounts
    result: str | None
    reason: str
    gate: str | None
    move: RoleMove | None


@attrs.frozen(kw_only=True)
class Proposals:
    enabled: bool
    advisory: bool
    proposals: tuple[Proposal, ...]
    now: ProposalsNow | None


def proposals_view(
    section: ControllerSection | None, *, monotonic_now: float, wall_now: float
) -> Proposals:
    """The `proposals` result from the controller's state section (None: no controller).

    Each proposal keeps its record's fields and gains `wall_time` (ISO 8601, local time
    with its offset) and `age_s`; the last evaluation's proposed split comes along, so
    an operator sees what the controller would do now, not only what it said before.
    """
    if section is None:
        return Proposals(enabled=False, advisory=False, proposals=(), now=None)

    def wall(monotonic: float) -> str:
        stamp = wall_now - (monotonic_now - monotonic)
        moment = datetime.datetime.fromtimestamp(stamp, tz=datetime.UTC).astimezone()
        return moment.isoformat(timespec="seconds")

    evaluation = section.evaluation
    return Proposals(
        enabled=section.enabled,
        advisory=section.advisory,
        proposals=tuple(
            Proposal(
                record=record,
                wall_time=wall(record.time),
                age_s=round(monotonic_now - record.time, 3),
            )
            for record in section.flips.history
            if not record.applied
        ),
        now=None
        if evaluation is None
        else ProposalsNow(
            wall_time=wall(evaluation.time),
            split=evaluation.split,
            result=evaluation.result,
            reason=evaluation.reason,
            gate=evaluation.gate,
            move=evaluation.move,
        ),
    )
