"""The supervisor's sections of /narwhal/state, and the list of every added section.

Owns
  `SupervisorSection` (listeners, reloads, retiring engines, notifications, loop lag) and
  `ProfilesSection` (the profile store in use) as frozen records, built from the
  supervisor by `supervisor_section` and `profiles_section`; `STATE_SECTIONS`, the
  record of each section the supervisor adds after the serving ones, in their order.

Invariants
  Reads only. The supervisor adds exactly the `STATE_SECTIONS` keys, in that order
  (`controller` only while controller.enabled is on).

See
  docs/observability.md, `narwhal.serving.StateDocument`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import attrs

from ..caches import CachesSection
from ..cluster import ClusterSection
from ..controller import ControllerSection
from ..profiles import FleetProfiles
from ..recovery import MonitorSection, RecoverySection
from ..serving import LagStatistics
from ._reload import ReloadReport

if TYPE_CHECKING:
    from ._supervisor import Supervisor


@attrs.frozen(kw_only=True)
class RetiringEngine:
    """A removed or replaced engine still finishing its resident requests."""

    id: str
    resident: int


@attrs.frozen(kw_only=True)
class NotifySection:
    socket: str | None  # NOTIFY_SOCKET
    sent: tuple[str, ...]  # the last messages but pings


@attrs.frozen(kw_only=True)
class SupervisorSection:
    listen: tuple[str, ...]  # the client listener's URLs
    admin: tuple[str, ...]
    ctl_socket: str | None  # None when not served
    config_path: str | None
    stopping: bool
    retiring_engines: tuple[RetiringEngine, ...]
    reloads: tuple[ReloadReport, ...]  # the last 10
    notify: NotifySection
    loop: LagStatistics | None


@attrs.frozen(kw_only=True)
class PoorFitEntry:
    engine: str
    phase: str
    residual_p90: float
    points: int


@attrs.frozen(kw_only=True)
class ProfilesSection:
    path: str | None  # profiles.path
    loaded: bool
    source: str  # "profiles.path", "cluster" (its etcd key), or "injected" (tests)
    usable_engines: tuple[str, ...]
    problems: tuple[str, ...]
    decode_correction: Mapping[str, float]
    # Each engine's own request cap, which bounds the controller's decode projection
    # (None: the profile does not know it).
    max_num_seqs: Mapping[str, int | None]
    # Fits that miss their own measurements (`narwhal.profiles.POOR_FIT_RESIDUAL_P90`):
    # used all the same, and logged when a load first finds them; here for whoever
    # reads the state.
    poor_fits: tuple[PoorFitEntry, ...]


STATE_SECTIONS: Mapping[str, type[attrs.AttrsInstance]] = {
    "controller": ControllerSection,
    "supervisor": SupervisorSection,
    "recovery": RecoverySection,
    "monitor": MonitorSection,
    "profiles": ProfilesSection,
    "caches": CachesSection,
    "cluster": ClusterSection,
}


def supervisor_section(supervisor: Supervisor) -> SupervisorSection:
    ctx = supervisor.ctx
    return SupervisorSection(
        listen=tuple(listener_url(address) for address in supervisor.bound),
        admin=tuple(listener_url(address) for address in supervisor.admin_bound),
        ctl_socket=supervisor.config.ctl.socket if supervisor.serve_ctl else None,
        config_path=supervisor.config_path,
        stopping=supervisor.stopping,
        retiring_engines=tuple(
            RetiringEngine(id=e.id, resident=e.resident_work)
            for e in (ctx.fleet.retiring if ctx is not None else [])
        ),
        reloads=tuple(supervisor.reloads),
        notify=NotifySection(
            socket=supervisor.notifier.address, sent=tuple(supervisor.notifier.sent[-5:])
        ),
        loop=ctx.loop_lag.state() if ctx is not None else None,
    )


def profiles_section(supervisor: Supervisor) -> ProfilesSection:
    ctx = supervisor.ctx
    source = None if ctx is None else ctx.profiles
    usable: list[str] = []
    corrections: dict[str, float] = {}
    caps: dict[str, int | None] = {}
    poor: list[PoorFitEntry] = []
    if isinstance(source, FleetProfiles):
        usable = sorted(source.check.usable)
        for engine_id in usable:
            profile = source.profile(engine_id)
            caps[engine_id] = (profile.max_num_seqs or None) if profile is not None else None
        poor = [
            PoorFitEntry(
                engine=fit.engine,
                phase=fit.phase,
                residual_p90=round(fit.residual_p90, 4),
                points=fit.points,
            )
            for fit in source.poor_fits()
        ]
    if ctx is not None and source is not None:
        corrections = {e.id: round(source.decode_correction(e.id), 4) for e in ctx.fleet}
    return ProfilesSection(
        path=supervisor.config.profiles.path,
        loaded=source is not None,
        source=_profiles_source(supervisor),
        usable_engines=tuple(usable),
        problems=tuple(supervisor.profile_problems),
        decode_correction=corrections,
        max_num_seqs=caps,
        poor_fits=tuple(poor),
    )


def _profiles_source(supervisor: Supervisor) -> str:
    if supervisor.injected_profiles is not None:
        return "injected"
    cluster = supervisor.cluster
    if cluster is not None and cluster.profiles.source == "cluster":
        return "cluster"
    return "profiles.path"


def listener_url(address: tuple[str, int]) -> str:
    """A bound listener's address as a URL (an IPv6 host in brackets)."""
    host, port = address
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
