"""The daemon compares every usable profile's build with the engine's live build."""

from __future__ import annotations

import logging
from pathlib import Path

import attrs
import pytest
import trio

from narwhal._records import to_json
from narwhal.config import Config
from narwhal.profiles import FleetProfiles, load_profiles, save_profiles
from narwhal.serving import ServingContext
from narwhal.supervisor import Supervisor, profiles_section
from narwhal.supervisor._control import (
    install_profiles,
    load_fleet_profiles,
    recheck_profile_build,
)

from ..support import StartFleet
from .helpers import config_for, decode, store_for
from .test_check import build_of


async def _never_answer(_stream: trio.SocketStream) -> None:
    await trio.sleep_forever()


async def save_with_e1_stale(config: Config, urls: dict[str, str], path: Path) -> tuple[str, str]:
    """Save a store of `urls` whose profiles match the engines' live build (b2) but e1's,
    measured on b1; (the live build, e1's profile build)."""
    live = await build_of(config)
    old = live.replace("[b2]", "[b1]")
    store = store_for(urls, build=live)
    engines = dict(store.engines)
    engines["e1"] = attrs.evolve(engines["e1"], build=old)
    save_profiles(attrs.evolve(store, engines=engines), path)
    return live, old


async def test_a_profile_of_another_build_is_not_used_by_the_daemon(
    start_fleet: StartFleet, tmp_path: Path, nursery: trio.Nursery
) -> None:
    fleet = await start_fleet(engines=2, speed=50.0, build="b2")
    # An engine that accepts connections and never answers: its build cannot be read.
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    nursery.start_soon(trio.serve_listeners, _never_answer, listeners)
    silent = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
    urls = {"e0": fleet[0].url, "e1": fleet[1].url, "e2": silent}
    path = tmp_path / "profiles.json"
    config = config_for(urls, profiles=str(path), engine={"health_timeout_s": 0.5})
    live, old = await save_with_e1_stale(config, urls, path)

    start = trio.current_time()
    profiles, found = await load_fleet_profiles(config)
    assert trio.current_time() - start < 2.0
    assert profiles is not None
    assert profiles.check.usable == {"e0", "e2"}
    assert profiles.profile("e1") is None
    assert found.problems == (
        f"engine 'e1': build is {live!r} but the profile was measured on {old!r}; the profile "
        "is stale, run narwhal-profile again",
        f"engine 'e2': build not verified (no identity answer in 0.5 s "
        f"(engine.health_timeout_s)); its profile, measured on {live!r}, is used until a "
        "reload can compare them",
    )


async def test_predictive_admission_refuses_a_fleet_of_stale_profiles(
    start_fleet: StartFleet, tmp_path: Path
) -> None:
    fleet = await start_fleet(engines=1, speed=50.0, build="b2")
    path = tmp_path / "profiles.json"
    config = config_for({"e0": fleet[0].url}, profiles=str(path))
    live = await build_of(config)
    save_profiles(store_for({"e0": fleet[0].url}, build=live.replace("[b2]", "[b1]")), path)
    profiles, found = await load_fleet_profiles(config)
    assert profiles is None
    (problem,) = found.problems
    assert problem.startswith(f"engine 'e0': build is {live!r} but the profile was measured on")


async def loaded_before_upgrade(
    start_fleet: StartFleet, tmp_path: Path
) -> tuple[ServingContext, str, str]:
    """Two engines on build b2, priced with a store in which e1's profile is b1's, as
    loaded before e1 was upgraded; (the context, the live build, e1's profile build)."""
    fleet = await start_fleet(engines=2, speed=50.0, build="b2")
    urls = {"e0": fleet[0].url, "e1": fleet[1].url}
    path = tmp_path / "profiles.json"
    config = config_for(urls, profiles=str(path))
    live, old = await save_with_e1_stale(config, urls, path)
    ctx = ServingContext(config)
    install_profiles(ctx, FleetProfiles(load_profiles(str(path), config)), config)
    return ctx, live, old


async def test_an_engine_restarted_on_another_build_loses_its_profile_before_release(
    start_fleet: StartFleet, tmp_path: Path
) -> None:
    # Loaded while e1 still ran b1; it was then relaunched on b2 (an upgrade between
    # reloads). Recovery holds a restarted engine until verified, and before it lets it go
    # the supervisor compares builds again: the old profile is not priced with.
    ctx, live, old = await loaded_before_upgrade(start_fleet, tmp_path)
    assert isinstance(ctx.profiles, FleetProfiles)
    assert ctx.profiles.check.usable == {"e0", "e1"}  # as loaded before the upgrade
    found = {}
    for engine_id in ("e0", "e1"):
        engine = ctx.fleet.get(engine_id)
        assert engine is not None
        found[engine_id] = await recheck_profile_build(ctx, engine)
    assert ctx.profiles.check.usable == {"e0"}
    assert ctx.profiles.prefill_curve("e1") is None
    stale = (
        f"engine 'e1': build is {live!r} but the profile was measured on {old!r}; the profile "
        "is stale, run narwhal-profile again"
    )
    assert ctx.profiles.check.messages[-1] == stale
    assert found == {"e0": [], "e1": [stale]}


async def test_a_profile_dropped_after_a_restart_is_listed_in_the_state(
    start_fleet: StartFleet, tmp_path: Path
) -> None:
    # Recovery's before_release is the supervisor's: the stale build found there is a
    # profile problem like one found at a load, in /narwhal/state until the next load.
    ctx, _, _ = await loaded_before_upgrade(start_fleet, tmp_path)
    supervisor = Supervisor(ctx.config)
    supervisor.ctx = ctx
    supervisor.profile_problems = ["a problem of the last load"]
    e1 = supervisor.ctx.fleet.get("e1")
    assert e1 is not None
    await supervisor._recheck_profile_build(e1)
    problems = to_json(profiles_section(supervisor))["problems"]
    assert isinstance(problems, list)
    assert problems[0] == "a problem of the last load"
    assert [p.startswith("engine 'e1': build is ") for p in problems[1:]] == [True]


async def test_a_poor_fit_is_used_and_logged_at_load(
    start_fleet: StartFleet, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fleet = await start_fleet(engines=2, speed=50.0)
    urls = {"e0": fleet[0].url, "e1": fleet[1].url}
    path = tmp_path / "profiles.json"
    config = config_for(urls, profiles=str(path))
    store = store_for(urls, build=await build_of(config))
    poor = attrs.evolve(decode(), residual_p90=0.31, residual_max=0.5, points=8)
    good = attrs.evolve(decode(), residual_p90=0.12, residual_max=0.12, points=8)
    engines = {
        "e0": attrs.evolve(store.engines["e0"], decode=good),
        "e1": attrs.evolve(store.engines["e1"], decode=poor),
    }
    save_profiles(attrs.evolve(store, engines=engines), path)
    with caplog.at_level(logging.INFO, logger="narwhal.control"):
        profiles, found = await load_fleet_profiles(config)
    assert profiles is not None
    assert profiles.check.usable == {"e0", "e1"}
    assert found.problems == ()
    warned = [
        (r.levelno, r.__dict__.get("engine"), r.__dict__.get("phase"), r.getMessage())
        for r in caplog.records
        if r.__dict__.get("event") == "profile_poor_fit"
    ]
    assert warned == [
        (
            logging.WARNING,
            "e1",
            "decode",
            "profile: engine 'e1': decode fit residual p90 31.0% (max 50.0% over 8 measured "
            "points) is above 25%: the model misses its own measurements by that much, so "
            "this engine's predicted token interval, which decode load, admission's decode "
            "side and the role controller's split projections are made of, can be that far "
            "off (a projection at 80% of a target can be a breach); re-run narwhal-profile "
            "on a quiet host",
        )
    ]
    # And /narwhal/state lists it for as long as the store is in use.
    supervisor = Supervisor(config)
    supervisor.ctx = ServingContext(config)
    install_profiles(supervisor.ctx, profiles, config)
    assert to_json(profiles_section(supervisor))["poor_fits"] == [
        {"engine": "e1", "phase": "decode", "residual_p90": 0.31, "points": 8}
    ]
