"""The daemon's half of the stale-profile rule: compare each usable profile's build with
the build its engine runs now.

`narwhal.profiles` compares a store with the configuration (url, model, dialect) without
I/O; only a live engine can say which build it runs. At start and on every reload the
daemon asks each engine with a usable profile for its identity, as narwhal-profile
recorded it, and an engine whose build differs loses its profile (reported, never used).
An engine that cannot answer within ``engine.health_timeout_s`` keeps its profile, with a
message saying the build was not verified: it is out of placement while unreachable, and
holding the daemon's start on it would turn one engine's outage into the fleet's.
"""

from __future__ import annotations

import attrs
import trio

from ..config import Config
from ..profiles import ProfileCheck
from ._client import EngineClient, ProbeError


async def with_live_builds(check: ProfileCheck, config: Config) -> ProfileCheck:
    """`check` after comparing every usable profile's build with its engine's, bounded by
    ``engine.health_timeout_s`` (the engines are asked at once)."""
    store = check.store
    if store is None or not check.usable:
        return check
    limit = config.engine.health_timeout_s
    observed: dict[str, str] = {}
    unverified: dict[str, str] = {}

    async def one(spec_index: int) -> None:
        spec = config.engines[spec_index]
        client = EngineClient(spec, config.engine, max_connections=2)
        try:
            with trio.move_on_after(limit):
                try:
                    observed[spec.id] = (await client.identity()).build_identity
                except ProbeError as exc:
                    unverified[spec.id] = str(exc)
                return
            unverified[spec.id] = f"no identity answer in {limit:g} s (engine.health_timeout_s)"
        finally:
            with trio.move_on_after(1.0, shield=True):
                await client.aclose()

    async with trio.open_nursery() as nursery:
        for i, spec in enumerate(config.engines):
            if spec.id in check.usable:
                nursery.start_soon(one, i)
    checked = check.with_builds(observed)
    notes = []
    for engine_id in sorted(unverified):
        profile = store.profile(engine_id)
        assert profile is not None
        notes.append(
            f"engine {engine_id!r}: build not verified ({unverified[engine_id]}); its profile, "
            f"measured on {profile.build!r}, is used until a reload can compare them"
        )
    return attrs.evolve(checked, messages=checked.messages + tuple(notes))
