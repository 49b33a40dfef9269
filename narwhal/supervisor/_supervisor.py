"""The supervisor: one nursery that owns everything running beside the requests.

Services, started in this order with the start protocol (each reports started only
when it is ready, so a failure stops startup before the daemon claims to be ready):

1. the control socket (when `serve_ctl`): a socket path that is not ours stops startup
   here, before any port is bound;
2. recovery: one probe of every engine, then a probe loop per engine (breakers,
   quarantine, health ejection, restart holds, verifications); then a KV-event
   subscriber per engine that publishes them (`narwhal.caches`);
3. the monitor loop and its pass handlers (the role controller registers one), and the
   event-loop lag probe (`serving._lag`, which recovery also consults);
4. the admin listener (admin.host:admin.port: /narwhal/state and /metrics), then the
   client listener (listen.host:listen.port). A port that cannot be bound stops startup
   with a `ListenError` naming its settings. Then READY=1 goes to systemd and `run`
   reports started with the supervisor itself as the value (tests and the daemon read
   `url` and `admin_url`).

Each reason startup stops (and each it starts degraded for) is decided by a function
`narwhal validate` asks too, before the daemon runs (`_preflight`).

Before any of them, the process's open-file limit is fitted to listen.max_open_connections
(`serving._descriptors`: raised if it can be, the connection limit lowered if it cannot, and
startup stopped if not even the retained requests' connections fit); a reload does the same
for its configuration before applying it, and is rejected where startup would stop.

Reload (SIGHUP, `narwhalctl reload`, `reload()`): one at a time; RELOADING=1 before the
file is read and READY=1 after, whether it was applied or rejected. Once shutdown has been
requested, a reload is refused (and one under way ends without READY=1). Its file reads
are bounded (`narwhal._files`), and a cancelled reload abandons the thread reading them:
a shutdown never waits on one. See `_reload`.

Shutdown (`request_shutdown()`, SIGTERM): STOPPING=1; new requests get 503
`shutting_down` (the listeners stay open during the drain so clients get that answer
rather than a refused connection, /health says so to load balancers, and the admin
routes show the drain); requests in
flight get up to recovery.shutdown_grace_s to finish; whatever is left is then
cancelled, each reporting `shutting_down` (a stream as its terminal error event);
after CLEANUP_S for those last writes, connections close and the services stop. A
second request skips the rest of the grace.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from functools import partial
from typing import Any

import trio
from prometheus_client import Counter

from .._codes import ErrorCode
from .._errors import Unavailable, os_reason
from ..admission import ProfileSource
from ..caches import EngineCaches, events_without_ids_warning
from ..cluster import ClusterService, SharedProfiles, replica_name
from ..config import (
    Config,
    ConfigError,
    ReloadPlan,
    config_folder,
    diff,
    keep_running,
    load_config_file,
    resolve_paths,
)
from ..ctl import ControlServer
from ..fleet import EngineState, Role
from ..profiles import FleetProfiles, StoreDocument
from ..recovery import HttpProber, Monitor, PassHandler, Predictor, Prober, Recovery
from ..serving import (
    ADMIN_MAX_CONNECTIONS,
    AdminApp,
    App,
    DescriptorLimitError,
    OpenConnections,
    OpenFileLimit,
    ServingContext,
    serve_app,
)
from ._control import (
    ControlLink,
    ProfileFindings,
    check_fleet_profiles,
    install_profiles,
    load_fleet_profiles,
    profile_predictor,
    read_profiles_file,
    recheck_profile_build,
    report_fleet_profiles,
    require_profiles,
)
from ._notify import Notifier
from ._operations import Operations
from ._plane import Plane, worker_count
from ._reload import ReloadReport, ReloadResult, apply_config
from ._state import listener_url, profiles_section, supervisor_section

log = logging.getLogger("narwhal.supervisor")

# Bound on the last writes after the grace (terminal error events) and on closing.
CLEANUP_S = 2.0
_LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


class ListenError(Exception):
    """A listener's address cannot be bound; the message names its settings."""


# How often a retiring engine is checked for resident work. Its counters belong to
# the request path and have no wakeup of their own; retiring is rare and bounded by
# serving.request_timeout_s, so a slow check is the simple, cheap choice.
_RETIRE_CHECK_S = 0.25


class Supervisor:
    def __init__(
        self,
        config: Config,
        *,
        config_path: str | None = None,
        serve_ctl: bool = False,
        notifier: Notifier | None = None,
        prober: Prober | None = None,
        predictor: Predictor | None = None,
        pass_handlers: Sequence[tuple[str, PassHandler]] = (),
        profiles: ProfileSource | None = None,
        open_files: OpenFileLimit | None = None,
    ) -> None:
        # Relative paths as a reload of `config_path` will take them (from its folder):
        # a config built in code must not see its paths "change" at the first reload.
        self.config = (
            config if config_path is None else resolve_paths(config, config_folder(config_path))
        )
        self.config_path = config_path
        self.serve_ctl = serve_ctl
        self.notifier = notifier or Notifier(None)
        self.prober: Prober = prober or HttpProber()
        self.predictor = predictor
        self.pass_handlers = list(pass_handlers)
        # Injected profiles (tests) replace loading profiles.path, at start and on reload.
        self.injected_profiles = profiles
        # The process's RLIMIT_NOFILE, fitted to listen.max_open_connections at start and
        # at each reload (tests pass their own).
        self.open_files = open_files or OpenFileLimit()
        self.profile_problems: list[str] = []
        # What the last load of profiles.path reported: a reload logs only what changed.
        self.profile_findings: ProfileFindings | None = None
        self.link: ControlLink | None = None
        self.ctx: ServingContext | None = None
        self.recovery: Recovery | None = None
        self.monitor: Monitor | None = None
        self.caches: EngineCaches | None = None
        # serving.workers above 1: the worker processes this daemon is the core of.
        self.plane: Plane | None = None
        # This replica's membership of its cluster (`cluster.endpoints`; idle without).
        self.cluster: ClusterService | None = None
        self.bound: list[tuple[str, int]] = []
        self.admin_bound: list[tuple[str, int]] = []
        self.reloads: list[ReloadReport] = []
        # Configured role changes a reload could not apply because the engine was pinned:
        # `unpin` applies them (the newest per engine).
        self.deferred_roles: dict[str, Role] = {}
        self.stopping = False
        self._shutdown = trio.Event()
        self._force = trio.Event()
        self._started = trio.Event()
        self._reload_lock = trio.Lock()
        # Held while a profile store is checked and installed: a reload's, or the
        # cluster's (`_adopt_cluster_profiles`).
        self._profiles_lock = trio.Lock()
        self._nursery: trio.Nursery | None = None
        self._m_reloads: Counter | None = None

    @property
    def url(self) -> str:
        """The client listener's first address."""
        return listener_url(self.bound[0])

    @property
    def admin_url(self) -> str:
        """The admin listener's first address (/narwhal/state, /metrics)."""
        return listener_url(self.admin_bound[0])

    def request_shutdown(self) -> None:
        """First call: graceful drain. Second call: skip what is left of the grace."""
        if self._shutdown.is_set():
            self._force.set()
        self._shutdown.set()

    async def run(
        self, *, task_status: trio.TaskStatus[Supervisor] = trio.TASK_STATUS_IGNORED
    ) -> None:
        config = self.config
        ctx = ServingContext(config)
        self.ctx = ctx
        # Before anything is opened: a limit with no room for the retained requests'
        # connections stops startup here (DescriptorLimitError).
        ctx.apply_descriptors(self.open_files.fit(config))
        profiles_file: StoreDocument | None = None
        if self.injected_profiles is not None:
            install_profiles(ctx, self.injected_profiles, config)
        else:
            profiles_file = await read_profiles_file(config)
            profiles, found = await load_fleet_profiles(config, document=profiles_file)
            self.profile_findings = found
            self.profile_problems = list(found.problems)
            install_profiles(ctx, profiles, config)
        link = ControlLink(ctx)
        self.link = link
        ctx.signals = link
        recovery = Recovery(
            ctx, prober=self.prober, predictor=self.predictor or profile_predictor(ctx)
        )
        self.recovery = recovery
        recovery.before_release = self._recheck_profile_build
        ctx.leg_observer = recovery
        monitor = Monitor(ctx, recovery, self.prober, on_degraded=self._degraded_changed)
        # Always: without a controller the pass still drains the demand events.
        monitor.add_handler("controller", link.on_pass)
        if link.controller is not None:
            ctx.state_providers.append(("controller", link.controller.state_section))
            ctx.metrics.add_live_gauges(link.controller.gauges)
            ctx.metrics.registry.register(link.controller.collector())
        for name, handler in self.pass_handlers:
            monitor.add_handler(name, handler)
        self.monitor = monitor
        caches = EngineCaches(ctx.fleet, config, ctx.metrics.registry)
        self.caches = ctx.prefix_caches = caches
        cluster = ClusterService(config, replica_name(config))
        self.cluster = cluster
        if config.cluster.enabled and profiles_file is not None:
            # One store for every replica: the cluster's, or this one's file published.
            cluster.profiles.adopt = self._adopt_cluster_profiles
            cluster.profiles.checked(
                profiles_file, profiles_file, installed=ctx.profiles is not None
            )
        link.leads = cluster.leads
        link.moved = lambda engine: cluster.share_facts(engine, "role")
        link.arrival_weight = lambda: ctx.fleet.share.count
        recovery.verdicts.on_change = cluster.verdict_changed
        ctx.metrics.add_live_gauges(cluster.gauges)
        ctx.state_providers.extend(
            [
                ("supervisor", partial(supervisor_section, self)),
                ("recovery", recovery.state),
                ("monitor", monitor.state),
                ("profiles", partial(profiles_section, self)),
                ("caches", caches.state),
                ("cluster", lambda: cluster.state(ctx.config.serving.max_connections)),
            ]
        )
        self._m_reloads = Counter(
            "narwhal_reloads",
            "Configuration reloads by outcome (applied, rejected).",
            ["outcome"],
            registry=ctx.metrics.registry,
        )
        stop_server = trio.Event()
        servers_done = [trio.Event(), trio.Event()]
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self.serve_ctl:
                    server = ControlServer(config.ctl.socket, Operations(self))
                    await nursery.start(server.run)
                if config.cluster.enabled:
                    # Before any listener: this replica admits against its part of the
                    # capacity from its first request, with the fleet's shared facts.
                    # Before recovery: a replica that rejoins takes the others' verdicts
                    # and spreads its probes by its place among them.
                    await nursery.start(cluster.run, ctx)
                # With the cluster's profile store, when it has one.
                require_profiles(config, ctx.profiles, self.profile_problems)
                await nursery.start(recovery.run)
                await nursery.start(caches.run)
                await nursery.start(monitor.run)
                await nursery.start(ctx.loop_lag.run)
                # The admin listener first: the state and metrics of a router that
                # serves clients must be readable.
                admin = AdminApp(ctx)
                admin_connections = OpenConnections(ADMIN_MAX_CONNECTIONS)
                self.admin_bound = await self._listen(
                    nursery, admin, "admin", admin_connections, stop_server, servers_done[0]
                )
                if worker_count(config) > 1:
                    self.plane = Plane(ctx, worker_count(config))
                    self.bound = await self._listen_plane(nursery, self.plane, servers_done[1])
                else:
                    self.bound = await self._listen(
                        nursery, App(ctx), "listen", ctx.connections, stop_server, servers_done[1]
                    )
                await nursery.start(self.notifier.watchdog)
                log.info(
                    "listening on %s; admin on %s",
                    self.url,
                    self.admin_url,
                    extra={
                        "event": "listening",
                        "url": self.url,
                        "admin_url": self.admin_url,
                        "ctl_socket": config.ctl.socket if self.serve_ctl else None,
                        "engines": len(ctx.fleet),
                    },
                )
                self._warn_open_admin(config)
                self._warn_events_without_ids(config)
                self.notifier.ready(self._status_line())
                self._started.set()
                task_status.started(self)
                await self._shutdown.wait()
                await self._drain(ctx)
                stop_server.set()
                if self.plane is not None:
                    await self.plane.stop(CLEANUP_S)
                with trio.move_on_after(CLEANUP_S + 1.0):
                    for done in servers_done:
                        await done.wait()
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(CLEANUP_S):
                await ctx.fleet.aclose()
            self.notifier.close()
            log.info("stopped", extra={"event": "stopped"})

    async def _listen(
        self,
        nursery: trio.Nursery,
        app: App | AdminApp,
        section: str,
        connections: OpenConnections,
        stop: trio.Event,
        done: trio.Event,
    ) -> list[tuple[str, int]]:
        """Serve `app` on the address of the `section` settings ("listen", "admin");
        the bound addresses. An address that cannot be bound is a ListenError."""
        address = self.config.listen if section == "listen" else self.config.admin
        try:
            bound: list[tuple[str, int]] = await nursery.start(
                self._serve_http, app, address.host, address.port, connections, stop, done
            )
        except OSError as exc:
            raise ListenError(listen_refusal(section, address.host, address.port, exc)) from None
        return bound

    async def _listen_plane(
        self, nursery: trio.Nursery, plane: Plane, done: trio.Event
    ) -> list[tuple[str, int]]:
        """The client listener bound here and served by `plane`'s workers."""
        address = self.config.listen

        async def run(*, task_status: trio.TaskStatus[list[tuple[str, int]]]) -> None:
            try:
                await plane.run(address.host, address.port, task_status=task_status)
            finally:
                done.set()

        try:
            bound: list[tuple[str, int]] = await nursery.start(run)
        except OSError as exc:
            raise ListenError(listen_refusal("listen", address.host, address.port, exc)) from None
        return bound

    async def _serve_http(
        self,
        app: App | AdminApp,
        host: str,
        port: int,
        connections: OpenConnections,
        stop: trio.Event,
        done: trio.Event,
        *,
        task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        try:
            await serve_app(
                app,
                host=host,
                port=port,
                # The running value: a reload changes it for open connections too.
                client_stall_s=lambda: self.config.serving.client_stall_s,
                shutdown=stop,
                # The drain happened before `stop`; this only bounds the last writes.
                graceful_timeout_s=CLEANUP_S,
                open_connections=connections,
                protocol_error=app.ctx.client_protocol_error,
                task_status=task_status,
            )
        finally:
            done.set()

    @staticmethod
    def _warn_open_admin(config: Config) -> None:
        """One WARNING when the admin listener is off loopback and asks no token."""
        warning = open_admin_warning(config)
        if warning is not None:
            admin = config.admin
            log.warning(
                "%s",
                warning,
                extra={"event": "admin_open", "host": admin.host, "port": admin.port},
            )

    @staticmethod
    def _warn_events_without_ids(config: Config) -> None:
        """One WARNING when engines publish KV events that text prompts cannot be matched
        against: their cache would be invisible to pricing without a word."""
        warning = events_without_ids_warning(config)
        if warning is not None:
            log.warning("%s", warning, extra={"event": "cache_events_without_ids"})

    # ------------------------------------------------------------------ shutdown

    async def _drain(self, ctx: ServingContext) -> None:
        self.stopping = True
        ctx.accepting = False
        grace = ctx.config.recovery.shutdown_grace_s
        in_flight = ctx.retained
        self.notifier.stopping(f"draining {in_flight} request(s) for up to {grace}s")
        log.info(
            "shutting down: %d request(s) in flight, recovery.shutdown_grace_s=%s",
            in_flight,
            grace,
            extra={"event": "shutdown", "outcome": "draining", "in_flight": in_flight},
        )
        with trio.move_on_after(grace):
            await _first_of(ctx.wait_idle, self._force.wait)
        if ctx.retained:
            error = Unavailable(
                f"narwhal shut down before the request finished "
                f"(recovery.shutdown_grace_s={grace})",
                code=ErrorCode.SHUTTING_DOWN,
            )
            cancelled = ctx.cancel_requests(error)
            if self.plane is not None:
                self.plane.cancel_requests(error)
                cancelled = ctx.retained
            log.warning(
                "shutdown grace over: cancelled %d request(s)",
                cancelled,
                extra={"event": "shutdown", "outcome": "cancelled", "cancelled": cancelled},
            )
            with trio.move_on_after(CLEANUP_S):
                await ctx.wait_idle()
        log.info(
            "drained; stopping",
            extra={"event": "shutdown", "outcome": "drained", "left": ctx.retained},
        )

    # ------------------------------------------------------------------ reload

    @property
    def shutting_down(self) -> bool:
        return self._shutdown.is_set()

    async def reload(self, trigger: str = "api") -> ReloadResult:
        await self._started.wait()
        async with self._reload_lock:
            if self.shutting_down:
                # A SIGHUP queued behind startup, or sent during the drain: applying it
                # would probe and add engines to a daemon that is stopping, and its
                # READY=1 would follow STOPPING=1.
                return self._refuse_reload(trigger)
            self.notifier.reloading()
            result = ReloadResult(False, self.config_path or "<none>", trigger=trigger)
            try:
                result = await self._reload(trigger)
            finally:
                self._record_reload(result)
                if self._shutdown.is_set():
                    # Stopping began during the reload: systemd has STOPPING=1, and a
                    # READY=1 now would claim the service is up again.
                    self.notifier.status(self._status_line())
                else:
                    self.notifier.ready(self._status_line())
            return result

    def _refuse_reload(self, trigger: str) -> ReloadResult:
        path = self.config_path or "<none>"
        message = "narwhal is shutting down; the configuration is not re-read"
        log.warning(
            "reload refused: %s",
            message,
            extra={"event": "reload", "trigger": trigger, "source": path, "outcome": "refused"},
        )
        result = ReloadResult(False, path, (message,), trigger=trigger)
        self._record_reload(result)
        return result

    def _record_reload(self, result: ReloadResult) -> None:
        self.reloads = [*self.reloads[-9:], result.report()]
        if self._m_reloads is not None:
            self._m_reloads.labels("applied" if result.applied else "rejected").inc()

    async def _reload(self, trigger: str) -> ReloadResult:
        ctx, recovery = self.ctx, self.recovery
        assert ctx is not None
        assert recovery is not None
        path = self.config_path
        extra: dict[str, Any] = {"event": "reload", "trigger": trigger, "source": path}
        if path is None:
            message = "narwhal was started without a config file; there is nothing to re-read"
            log.error("reload refused: %s", message, extra={**extra, "outcome": "unavailable"})
            return ReloadResult(False, "<none>", (message,), trigger=trigger)
        log.info("reloading %s", path, extra={**extra, "outcome": "started"})
        try:
            # Abandoned if cancelled (shutdown): each read is bounded, but a shutdown
            # waits on no file.
            new = await trio.to_thread.run_sync(load_config_file, path, abandon_on_cancel=True)
        except ConfigError as exc:
            for problem in exc.messages:
                log.error(
                    "reload rejected: %s",
                    problem,
                    extra={**extra, "event": "reload_error", "problem": problem},
                )
            log.error(
                "reload of %s rejected: %d problem(s); the running configuration is kept",
                path,
                len(exc.messages),
                extra={**extra, "outcome": "rejected", "problems": len(exc.messages)},
            )
            return ReloadResult(False, path, tuple(exc.messages), trigger=trigger)
        try:
            descriptors = self.open_files.fit(keep_running(new, ctx.config))
        except DescriptorLimitError as exc:
            # Logged as a configuration problem is: the same config would not start here.
            problem = str(exc)
            log.error(
                "reload rejected: %s",
                problem,
                extra={**extra, "event": "reload_error", "problem": problem},
            )
            log.error(
                "reload of %s rejected: 1 problem(s); the running configuration is kept",
                path,
                extra={**extra, "outcome": "rejected", "problems": 1},
            )
            return ReloadResult(False, path, (problem,), trigger=trigger)
        plan = diff(ctx.config, new)
        # From here on only the configuration in force: `new` still holds the values
        # that need a restart.
        self.config = await apply_config(
            ctx,
            recovery,
            new,
            plan,
            self._retire,
            descriptors=descriptors,
            deferred_roles=self.deferred_roles,
        )
        await self._reload_profiles(self.config, plan)
        if self.caches is not None:
            self.caches.reconfigure(self.config)
        if self.plane is not None:
            self.plane.reloaded(self.config)
        if self.link is not None:
            self.link.reconfigure(self.config)
        if self.cluster is not None and self.ctx is not None:
            self.cluster.reconfigure(self.config)
            self.cluster.take_waiting_facts(self.ctx)
        for change in plan.restart_required:
            log.warning(
                "%s needs a restart; the running value stays in force",
                change,
                extra={**extra, "event": "reload_restart_required", "path": change.path},
            )
        log.info(
            "reload of %s applied: %d change(s), %d need a restart",
            path,
            len(plan.changes),
            len(plan.restart_required),
            extra={**extra, "outcome": "applied", "changes": plan.summary()},
        )
        return ReloadResult(True, path, plan=plan, trigger=trigger)

    async def _reload_profiles(self, config: Config, plan: ReloadPlan) -> None:
        if self.injected_profiles is not None:
            return
        async with self._profiles_lock:
            shared = self._shared_profiles()
            file = await read_profiles_file(config)
            # In a cluster, the cluster's store in use unless the operator changed the file.
            document = file if shared is None else shared.to_check(file)
            installed = await self._install_reloaded(
                config, plan, document, keep=shared is not None
            )
            if shared is not None:
                shared.checked(file, document, installed=installed)

    async def _install_reloaded(
        self, config: Config, plan: ReloadPlan, document: StoreDocument, *, keep: bool
    ) -> bool:
        """Price with the reloaded `document` if it gives a usable profile; whether it
        does. Under predictive admission, or when `keep` (a cluster: its store stays
        good), unusable profiles leave the previous ones in place."""
        ctx = self.ctx
        assert ctx is not None
        previous = ctx.profiles
        profiles, found = await load_fleet_profiles(
            config, self.profile_findings, document=document
        )
        self.profile_findings = found
        problems = list(found.problems)
        if profiles is None and (
            config.serving.admission == "predictive" or (keep and previous is not None)
        ):
            # Keep pricing with what we have rather than refuse every request; but not a
            # replaced engine (another url or dialect) with its predecessor's profile.
            if isinstance(previous, FleetProfiles):
                previous.forget(plan.engines_replaced)
            log.error(
                "reloaded profiles are unusable; keeping the previous ones",
                extra={"event": "profiles_reload", "outcome": "kept", "problems": problems},
            )
            self.profile_problems = problems
            return False
        # Every reload re-reads the profiles: an engine it left alone keeps what was
        # learnt of its decode speed, which started again from 1.0 on each reload (a key
        # rotation reset the whole fleet's TPOT pricing).
        changed = {*plan.engines_added, *plan.engines_replaced, *plan.engines_removed}
        kept = [e.id for e in config.engines if e.id not in changed]
        self._price_with(profiles, problems, config, carry=kept)
        return profiles is not None

    def _price_with(
        self,
        profiles: FleetProfiles | None,
        problems: list[str],
        config: Config,
        *,
        carry: Iterable[str],
    ) -> None:
        """Price with `profiles` from now on; the engines in `carry` keep what was learnt
        of their decode speed under the previous ones."""
        ctx = self.ctx
        assert ctx is not None
        previous = ctx.profiles
        if isinstance(profiles, FleetProfiles) and isinstance(previous, FleetProfiles):
            profiles.carry_corrections(previous, carry)
        install_profiles(ctx, profiles, config)
        self.profile_problems = problems

    def _shared_profiles(self) -> SharedProfiles | None:
        """The cluster's profile store, when this replica shares one (in a cluster, with
        profiles read from profiles.path, not injected)."""
        cluster = self.cluster
        return None if cluster is None or cluster.profiles.adopt is None else cluster.profiles

    async def _adopt_cluster_profiles(self, document: StoreDocument) -> None:
        """`SharedProfiles.adopt`: the cluster's store, checked as profiles.path is, and
        priced with if it gives a usable profile; refused, and said, if not."""
        shared = self._shared_profiles()
        assert shared is not None
        async with self._profiles_lock:
            # The store in use already, or another value came while a reload ran.
            if not shared.wants(document):
                return
            config = self.config
            profiles, found = await check_fleet_profiles(config, document)
            if profiles is None:
                shared.refused(document, found.problems)
                return
            report_fleet_profiles(profiles, found, self.profile_findings)
            # The engines are the same ones: what was learnt of their decode speed stays.
            self._price_with(
                profiles, list(found.problems), config, carry=[e.id for e in config.engines]
            )
            self.profile_findings = found
            shared.adopted(document)

    async def _recheck_profile_build(self, engine: EngineState) -> None:
        """Recovery's `before_release`: `recheck_profile_build`, whose problems the
        state's `profiles.problems` lists with the last load's until the next load."""
        assert self.ctx is not None
        self.profile_problems += await recheck_profile_build(self.ctx, engine)

    def _retire(self, engine: EngineState) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._finish_retiring, engine)

    async def _finish_retiring(self, engine: EngineState) -> None:
        ctx = self.ctx
        assert ctx is not None
        resident = engine.resident_work
        log.info(
            "engine %s removed from placement; %d resident request(s) finish on it",
            engine.id,
            resident,
            extra={"event": "engine_retiring", "engine": engine.id, "resident": resident},
        )
        bound = ctx.config.serving.request_timeout_s + CLEANUP_S
        for _ in range(int(bound / _RETIRE_CHECK_S) + 1):
            if engine.resident_work == 0:
                break
            await trio.sleep(_RETIRE_CHECK_S)
        with trio.move_on_after(CLEANUP_S, shield=True):
            await engine.aclose()
        ctx.fleet.forget(engine)
        ctx.engine_retired(engine)
        log.info(
            "engine %s retired",
            engine.id,
            extra={"event": "engine_retired", "engine": engine.id, "left": engine.resident_work},
        )

    # ------------------------------------------------------------------ status

    def _status_line(self) -> str:
        ctx = self.ctx
        if ctx is None:
            return "starting"
        if self.stopping:
            return f"stopping; {ctx.retained} request(s) in flight"
        now = trio.current_time()
        engines = list(ctx.fleet)
        available = sum(1 for e in engines if e.unavailable_reason(now) is None)
        where = f"{self.url}; admin on {self.admin_url}" if self.bound else "(not listening)"
        text = f"listening on {where}; {available}/{len(engines)} engines available"
        if ctx.degraded_reason is not None:
            text += f"; degraded: {ctx.degraded_reason}"
        last = self.reloads[-1] if self.reloads else None
        if last is not None and not last.applied:
            # A SIGHUP (`kill -HUP`) cannot report a rejection to whoever sent it:
            # `systemctl status` shows it whichever way the reload came.
            text += f"; last reload rejected ({len(last.errors)} problem(s), see the journal)"
        return text

    def _degraded_changed(self, reason: str | None) -> None:
        self.notifier.status(self._status_line())


def listen_refusal(section: str, host: str, port: int, exc: OSError) -> str:
    """Why the `section` listener ("listen", "admin") cannot have its address."""
    return f"cannot listen on {section}.host:{section}.port = {host}:{port}: {os_reason(exc)}"


def open_admin_warning(config: Config) -> str | None:
    """The warning for an admin listener off loopback that asks no token, or None."""
    admin = config.admin
    if admin.host in _LOOPBACK or admin.bearer_token() is not None:
        return None
    return (
        f"the admin listener on {admin.host}:{admin.port} asks no token: whoever reaches it "
        "reads every engine's url and the requests in flight; set admin.token_file"
    )


async def _first_of(*waits: Callable[[], Awaitable[object]]) -> None:
    """Return as soon as any of `waits` returns."""
    async with trio.open_nursery() as nursery:

        async def one(wait: Callable[[], Awaitable[object]]) -> None:
            await wait()
            nursery.cancel_scope.cancel()

        for wait in waits:
            nursery.start_soon(one, wait)
