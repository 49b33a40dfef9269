"""Linking the request path to the profiles and the role controller.

- Profiles: loaded from profiles.path at start and on every reload (with several
  replicas, the cluster's store may stand in for it: `narwhal.cluster`). Problems (missing
  file, stale build, an engine without a profile) are logged one per line and shown in
  /narwhal/state; they are never silently ignored. Predictive admission without a single
  usable profile cannot price anything, so the daemon refuses to start (or, on reload,
  keeps the profiles it has). A usable profile whose fit misses its own measurements
  (`narwhal.profiles.POOR_FIT_RESIDUAL_P90`) is used, with one warning per engine and
  phase. A reload warns only of what is new (`ProfileFindings.since`).
- The role controller runs as a monitor pass handler: each pass hands it the demand
  events the request path recorded since the last pass, then lets it decide.
- Signals from the request path (first-token timeouts, TTFT breaches, decode token gaps)
  go to the controller and to the live decode correction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio

from ..admission import DecodeCurve, ProfileSource
from ..config import Config
from ..controller import Controller
from ..fleet import EngineState
from ..probe import with_live_builds
from ..profiles import (
    DecodeCorrection,
    FleetProfiles,
    PoorFit,
    ProfileCheck,
    ProfileStore,
    StoreDocument,
    check_document,
    read_document,
)
from ..recovery import LegObservation, MonitorPass, Predictor
from ..serving import DecodeGaps, ServingContext

log = logging.getLogger("narwhal.control")

# Expected output tokens of a request with no bound (a chat without max_tokens, or a
# completion that sends it as null): demand pricing needs a number, and this is the order
# of a chat answer (Azure conversation p50 ~130, mean ~210).
DEFAULT_EXPECTED_OUTPUT = 256


class ProfilesUnavailable(Exception):
    """Predictive admission is configured but no engine has a usable profile."""


@attrs.frozen
class ProfileNews:
    """What a load of the profile store has to say, given the previous load's findings:
    what to warn of, what went away, and how many it leaves unsaid."""

    problems: tuple[str, ...] = ()
    poor_fits: tuple[PoorFit, ...] = ()
    cleared_problems: tuple[str, ...] = ()
    cleared_fits: tuple[PoorFit, ...] = ()
    unchanged_problems: int = 0
    unchanged_fits: int = 0


@attrs.frozen
class ProfileFindings:
    """What one load of the profile store found wrong: its problems and poor fits, and
    the store it found them in (None: missing or unreadable).

    A reload re-reads the store each time, and most often nothing about it changed: the
    same warnings at every reload (a soak reloads every few seconds, an operator's
    automation at each key rotation) teach whoever reads the log to skip WARNING lines.
    So at a reload (`since`), what the previous load of the same store found is not said
    again, only counted (/narwhal/state lists it all); what went away is said once; and
    everything a changed store holds is new: whoever re-ran narwhal-profile wants to
    hear what is still wrong.
    """

    path: str  # profiles.path, or where else the store was read (the cluster's etcd key)
    store: ProfileStore | None
    problems: tuple[str, ...]
    # None: the load gave no usable profile, so no fit was judged, and none went away.
    poor_fits: tuple[PoorFit, ...] | None

    def since(self, previous: ProfileFindings | None) -> ProfileNews:
        fits = self.poor_fits or ()
        if previous is None:
            return ProfileNews(self.problems, fits)
        same = (previous.path, previous.store) == (self.path, self.store)
        said_problems = set(previous.problems) if same else set()
        said_fits = set(previous.poor_fits or ()) if same else set()
        judged = {(fit.engine, fit.phase) for fit in fits}
        return ProfileNews(
            problems=tuple(p for p in self.problems if p not in said_problems),
            poor_fits=tuple(fit for fit in fits if fit not in said_fits),
            cleared_problems=tuple(p for p in previous.problems if p not in self.problems),
            cleared_fits=()
            if self.poor_fits is None
            else tuple(
                fit for fit in previous.poor_fits or () if (fit.engine, fit.phase) not in judged
            ),
            unchanged_problems=sum(p in said_problems for p in self.problems),
            unchanged_fits=sum(fit in said_fits for fit in fits),
        )


async def load_fleet_profiles(
    config: Config,
    previous: ProfileFindings | None = None,
    *,
    document: StoreDocument | None = None,
) -> tuple[FleetProfiles | None, ProfileFindings]:
    """Load and check profiles.path (or `document`, a store as read elsewhere: the
    cluster's), and log what is wrong with it: everything at start (`previous` None), what
    changed since `previous` at a reload."""
    if document is None:
        document = await read_profiles_file(config)
    profiles, found = await check_fleet_profiles(config, document)
    report_fleet_profiles(profiles, found, previous)
    return profiles, found


async def read_profiles_file(config: Config) -> StoreDocument:
    """profiles.path's bytes, unparsed (their digest tells a changed file)."""
    # Abandoned if cancelled: a shutdown during a reload waits on no file.
    return await trio.to_thread.run_sync(
        read_document, config.profiles.path, abandon_on_cancel=True
    )


async def check_fleet_profiles(
    config: Config, document: StoreDocument
) -> tuple[FleetProfiles | None, ProfileFindings]:
    """Check a store against `config` and the engines' live builds, logging nothing."""
    check = await trio.to_thread.run_sync(check_document, document, config, abandon_on_cancel=True)
    # A profile measured on another build than the engine runs now is stale (README).
    check = await with_live_builds(check, config)
    profiles = fleet_profiles(config, check)
    fits = tuple(profiles.poor_fits()) if profiles is not None else None
    return profiles, ProfileFindings(document.source, check.store, check.messages, fits)


def report_fleet_profiles(
    profiles: FleetProfiles | None, found: ProfileFindings, previous: ProfileFindings | None
) -> None:
    """Log what a load found: everything at start (`previous` None), what changed since
    `previous` at a reload."""
    path = found.path
    news = found.since(previous)
    for message in news.problems:
        log.warning("profile: %s", message, extra={"event": "profile_problem", "problem": message})
    if profiles is not None:
        check = profiles.check
        log.info(
            "profiles loaded from %s: %d/%d engines usable",
            path,
            len(check.usable),
            len(check.configured),
            extra={"event": "profiles_loaded", "usable": sorted(check.usable)},
        )
    # Used all the same (it is the best measurement there is), but said.
    for fit in news.poor_fits:
        log.warning(
            "profile: %s",
            fit.message(),
            extra={
                "event": "profile_poor_fit",
                "engine": fit.engine,
                "phase": fit.phase,
                "residual_p90": round(fit.residual_p90, 4),
            },
        )
    for message in news.cleared_problems:
        log.info(
            "profile: cleared since the last load: %s",
            message,
            extra={"event": "profile_problem_cleared", "problem": message},
        )
    for fit in news.cleared_fits:
        log.info(
            "profile: cleared since the last load: engine %r: poor %s fit (residual p90 %.1f%%)",
            fit.engine,
            fit.phase,
            100 * fit.residual_p90,
            extra={"event": "profile_poor_fit_cleared", "engine": fit.engine, "phase": fit.phase},
        )
    if news.unchanged_problems or news.unchanged_fits:
        log.info(
            "profile: %d problem(s) and %d poor fit(s) unchanged since the last load of %s, "
            "not logged again; /narwhal/state lists them (profiles)",
            news.unchanged_problems,
            news.unchanged_fits,
            path,
            extra={
                "event": "profile_unchanged",
                "problems": news.unchanged_problems,
                "poor_fits": news.unchanged_fits,
            },
        )


def fleet_profiles(config: Config, check: ProfileCheck) -> FleetProfiles | None:
    """What prices with the usable profiles of `check`; None when there is none."""
    if not check.usable:
        return None
    return FleetProfiles(check, correction=DecodeCorrection.from_config(config.controller.reactive))


async def recheck_profile_build(ctx: ServingContext, engine: EngineState) -> list[str]:
    """After `engine` restarted (and before it is back in placement): drop its profile
    if the engine now runs another build, as a start or a reload would have. An engine
    relaunched on an upgraded build between reloads was otherwise priced with the old
    build's profile until the next reload. Returns the problems found (none when the
    build is unchanged)."""
    source = ctx.profiles
    if not isinstance(source, FleetProfiles) or engine.id not in source.check.usable:
        return []
    one = attrs.evolve(source.check, usable=frozenset({engine.id}), messages=())
    checked = await with_live_builds(one, ctx.config)
    if engine.id in checked.usable:
        return []
    source.check = attrs.evolve(
        source.check,
        usable=source.check.usable - {engine.id},
        messages=source.check.messages + checked.messages,
    )
    for message in checked.messages:
        log.warning(
            "profile: %s (after a restart; re-run narwhal-profile, then reload)",
            message,
            extra={"event": "profile_problem", "problem": message, "engine": engine.id},
        )
    return list(checked.messages)


def install_profiles(ctx: ServingContext, profiles: ProfileSource | None, config: Config) -> None:
    """Price with `profiles` from now on, and count tokens with their measured
    chars/token when they have one for the fleet's dialect."""
    ctx.profiles = profiles
    measured = None
    if isinstance(profiles, FleetProfiles) and config.engines:
        measured = profiles.chars_per_token(config.engines[0].dialect)
    if measured is not None and measured != ctx.measured_chars_per_token:
        configured = config.engine.chars_per_token
        log.info(
            "token-count fallback uses the profiled %.3f chars/token (engine.chars_per_token "
            "is %.3f, %+.0f%%)",
            measured,
            configured,
            100 * (measured / configured - 1),
            extra={"event": "chars_per_token", "measured": measured, "configured": configured},
        )
    ctx.measured_chars_per_token = measured


def require_profiles(config: Config, profiles: ProfileSource | None, problems: list[str]) -> None:
    refusal = profiles_refusal(config, usable=profiles is not None, problems=problems)
    if refusal is not None:
        raise ProfilesUnavailable(refusal)


def profiles_refusal(config: Config, *, usable: bool, problems: Sequence[str]) -> str | None:
    """Why the daemon cannot start with `config` when the profile store gives a usable
    profile or none (`usable`), as loading it found (`problems`); None when it can.
    `narwhal validate` asks this too."""
    if config.serving.admission != "predictive" or usable:
        return None
    detail = "; ".join(problems) or "no engine has a usable profile"
    return (
        f"serving.admission is predictive but profiles.path={config.profiles.path!r} "
        f"gives no usable profile ({detail}); run narwhal-profile, or set "
        "serving.admission to open"
    )


class ControlLink:
    """The controller's pass handler and the serving signals, over `ctx.profiles`."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.controller: Controller | None = None
        # With several replicas (narwhal.cluster) only the leader moves roles, and tells
        # the others of each move; one replica always leads.
        self.leads: Callable[[], bool] = lambda: True
        self.moved: Callable[[EngineState], None] = lambda engine: None
        # How many arrivals one seen here stands for: with replicas behind a balancer that
        # spreads requests evenly, each sees about 1/N of the fleet's (narwhal.cluster).
        self.arrival_weight: Callable[[], int] = lambda: 1
        if ctx.config.controller.enabled:
            self.controller = Controller(
                ctx.config,
                ctx.fleet,
                mean_profile=self._mean_profile,
                engine_profiles=self._engine_profile,
                decode_correction=self._correction,
            )

    # Profiles are whatever the context holds now (reloads replace them); a test may
    # install a source that only prices, without the controller's profile members.
    def _member(self, name: str) -> Any:
        return getattr(self.ctx.profiles, name, None)

    def _mean_profile(self) -> Any:
        mean = self._member("mean_profile")
        return mean() if mean is not None else None

    def _engine_profile(self, engine_id: str) -> Any:
        profile = self._member("profile")
        return profile(engine_id) if profile is not None else None

    def _correction(self, engine_id: str) -> float:
        source = self.ctx.profiles
        return 1.0 if source is None else source.decode_correction(engine_id)

    def reconfigure(self, config: Config) -> None:
        if self.controller is not None:
            self.controller.reconfigure(config)

    async def on_pass(self, monitor_pass: MonitorPass) -> None:
        controller = self.controller
        events = self.ctx.demand_events
        if controller is None:
            events.clear()
            return
        weight = self.arrival_weight()
        while events:
            event = events.popleft()
            # Every replica keeps the demand warm, so a new leader decides at once.
            controller.record_arrival(
                event.at,
                event.prompt_tokens,
                event.max_tokens or DEFAULT_EXPECTED_OUTPUT,
                admitted=event.admitted,
                cached_tokens=event.cached_tokens,
                weight=weight,
            )
        if not self.leads():
            return
        roles = {engine.id: engine.role for engine in self.ctx.fleet}
        await controller.on_pass()
        for engine in self.ctx.fleet:
            if roles.get(engine.id, engine.role) != engine.role:
                self.moved(engine)

    # -- ServingSignals ----------------------------------------------------------------
    # A reload that removed or replaced the engine a leg ran on leaves that instance
    # serving no role: what its last legs show says nothing of the fleet the controller
    # steers, nor of the engine under its id now (corrections are kept by id).
    def _serving(self, engine: EngineState) -> bool:
        return self.ctx.fleet.get(engine.id) is engine

    def first_token_timeout(self, engine: EngineState) -> None:
        if self.controller is not None and self._serving(engine):
            self.controller.record_first_token_timeout()

    def ttft_breach(self) -> None:
        if self.controller is not None:
            self.controller.signal_ttft_breach()

    def decode_gaps(self, engine: EngineState, gaps: DecodeGaps) -> None:
        """A finished stream's token gaps, summarised with the engine's mean decode load
        (requests decoding, resident KV tokens) over them."""
        if not self._serving(engine):
            return
        source = self.ctx.profiles
        if isinstance(source, FleetProfiles):
            curve = source.decode_curve(engine.id)
            if curve is not None:
                source.observe_decode(
                    engine.id, gaps.positive_median_s, gaps.positive, _predicted(curve, gaps)
                )
        if self.controller is not None:
            self.controller.observe_decode_interval(engine.id, gaps.median_s)


# Token gaps a decode leg needs before its median interval is judged against the profile.
# A short answer's few gaps are mostly its first steps, beside the KV loads of requests
# joining the batch, and the median of a handful swings with one scheduler hiccup; the
# profile's own decode points take 24 gaps each (narwhal-profile --decode-gaps).
MIN_RESIDUAL_GAPS = 16


def profile_predictor(ctx: ServingContext) -> Predictor:
    """Predicted latency of a finished leg, for health ejection by latency residual.

    Prefill legs are predicted only uncontended: when another leg shared the engine at
    any moment of this one (not merely at its end), the leg's duration includes batching
    and queueing that the profile does not model, and a loaded engine must not look like
    a sick one. Prompts outside the measured domain are not predicted either.

    Decode legs are judged by their median token interval (`DecodeGaps`), predicted at
    the engine's load while the gaps were measured (`_predicted`, as the decode
    correction is): the profile models a loaded decode batch (active requests, resident
    KV tokens), so contention is priced, not excluded. Not predicted: a leg with fewer
    than MIN_RESIDUAL_GAPS gaps, one whose heaviest load left the measured domain, and
    one whose gaps were not the engine's decoding alone (no `DecodeGaps`). Aggregate
    legs are not predicted either: the router counts a `both` engine's aggregate legs as
    decoding from their start, through their prompt's prefill, whose chunks share the
    decode steps and which the decode profile does not model.
    """

    def predict(engine: EngineState, phase: str, observation: LegObservation) -> float | None:
        source = ctx.profiles
        if source is None:
            return None
        if phase == "decode":
            return _decode_interval(source, engine, observation.gaps)
        tokens = observation.prompt_tokens
        if phase != "prefill" or tokens <= 0:
            return None
        if observation.contended or observation.prefill_inflight > 1:
            return None
        curve = source.prefill_curve(engine.id)
        if curve is None or not curve.in_domain(tokens):
            return None
        return curve.prefill_s(tokens)

    return predict


def _decode_interval(
    source: ProfileSource, engine: EngineState, gaps: DecodeGaps | None
) -> float | None:
    if gaps is None or gaps.count < MIN_RESIDUAL_GAPS:
        return None
    curve = source.decode_curve(engine.id)
    if curve is None or not curve.in_domain(gaps.max_active, gaps.max_kv_tokens):
        return None
    return _predicted(curve, gaps)


def _predicted(curve: DecodeCurve, gaps: DecodeGaps) -> float:
    """The profile's interval at the load the gaps were measured under: the load as the
    stream ended is lighter (the last stream of a batch ends alone), and judged there
    every busy engine looked slow. The load is the gap-weighted mean, as is: the
    profile's interval is linear in both inputs, so that is the mean of the intervals at
    each gap's load."""
    return curve.interval_s(max(1.0, gaps.mean_active), gaps.mean_kv_tokens)
