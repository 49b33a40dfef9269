"""narwhal-check against engines started with --api-key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

from narwhal.config import Config
from narwhal.engines import dialect_for
from narwhal.probe import SweepFailed, format_table, profile_fleet, run_check
from narwhal.sim import Fleet

from ..support import StartFleet
from .test_check import PLAN, SGLANG_PLAN, rows, setup, sglang_config, statuses

KEY = "sk-check-key"


def key_file(tmp_path: Path, key: str) -> str:
    path = tmp_path / "engine-api-key"
    path.write_text(key + "\n")
    return str(path)


async def keyed_fleet(start_fleet: StartFleet, tmp_path: Path) -> tuple[Fleet, Config]:
    """Two engines started with --api-key, and a config that sends them that key."""
    fleet = await start_fleet(engines=2, speed=1.0, lease_s=0.5, api_key=KEY)
    config = await setup(
        fleet,
        tmp_path,
        serving={"handoff_timeout_s": 0.2},
        engine={"api_key_file": key_file(tmp_path, KEY)},
    )
    return fleet, config


async def test_a_keyed_fleet_passes_every_check(start_fleet: StartFleet, tmp_path: Path) -> None:
    _, config = await keyed_fleet(start_fleet, tmp_path)
    report = await run_check(config, PLAN)
    assert not report.failed, format_table(report.rows)
    assert {row.status for row in report.rows} == {"pass"}


@pytest.mark.parametrize(
    ("configured", "measured", "note"),
    [
        (
            "wrong-key",
            "API key refused (HTTP 401)",
            "the engine refused narwhal's API key (HTTP 401: Unauthorized); check "
            "engine.api_key_file against the engine's --api-key",
        ),
        (
            None,
            "API key required, none configured (HTTP 401)",
            "the engine requires an API key and narwhal sends none (HTTP 401: Unauthorized); "
            "set engine.api_key_file to the key of the engine's --api-key",
        ),
    ],
)
async def test_a_refused_or_missing_key_fails_the_health_check_and_says_so(
    start_fleet: StartFleet, tmp_path: Path, configured: str | None, measured: str, note: str
) -> None:
    fleet = await start_fleet(engines=2, speed=1.0, lease_s=0.5)
    engine = {} if configured is None else {"api_key_file": key_file(tmp_path, configured)}
    config = await setup(fleet, tmp_path, serving={"handoff_timeout_s": 0.2}, engine=engine)
    for handle in fleet:
        handle.set_api_key(KEY)
    report = await run_check(config, PLAN)
    assert report.failed
    health = rows(report, "health")
    assert statuses(report, "health") == {"e0": "fail", "e1": "fail"}
    assert (health["e0"].measured, health["e0"].note) == (measured, note)
    # The engines are left out of the checks that need them, rather than failing each.
    assert rows(report, "tokenize")["e0"].note == "unhealthy"
    table = format_table(report.rows)
    assert note in " ".join(table.split())  # wrapped to fit 100 columns
    assert KEY not in table


async def test_the_key_test_asks_the_dialects_key_check_path(
    start_fleet: StartFleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The route recovery's key check asks; /v1/models takes the key here.
    monkeypatch.setattr(
        "narwhal.probe._client.dialect_for",
        lambda name: attrs.evolve(dialect_for(name), key_check_path=b"/key-check"),
    )
    fleet, config = await keyed_fleet(start_fleet, tmp_path)

    async def forbidden(req: Any, resp: Any) -> None:
        await resp.send_json(403, {"error": {"message": "Forbidden", "code": 403}})

    fleet[0].engine._routes[("GET", "/key-check")] = forbidden
    report = await run_check(config, PLAN)
    health = rows(report, "health")
    assert statuses(report, "health") == {"e0": "fail", "e1": "pass"}
    assert health["e0"].measured == "API key refused (HTTP 403)"


async def test_narwhal_profile_sweeps_a_keyed_sglang_fleet(
    start_fleet: StartFleet, tmp_path: Path
) -> None:
    # SGLang guards /version, /get_server_info and /tokenize too: the sweep reads them all.
    fleet = await start_fleet(engines=2, speed=4.0, dialect="sglang", api_key=KEY)
    config = sglang_config(fleet, tmp_path, engine={"api_key_file": key_file(tmp_path, KEY)})
    plan = attrs.evolve(SGLANG_PLAN, handoff_sizes=(64,))
    store = await profile_fleet(config, plan)
    assert store.engines.keys() == {"e0", "e1"}
    for profile in store.engines.values():
        assert profile.kv_capacity_source == "sglang /get_server_info max_total_num_tokens"
    fleet[0].set_api_key("another-key")
    refused = (
        r"^engine 'e0' GET /v1/models: the engine refused narwhal's API key \(HTTP 401: "
        r"Unauthorized\); check engine\.api_key_file against the engine's --api-key$"
    )
    with pytest.raises(SweepFailed, match=refused):
        await profile_fleet(config, plan)
