"""The narwhal-profile and narwhal-check commands, end to end against the simulator.

Each command runs its own trio.run; it runs in a worker thread while the simulated fleet
keeps serving in the test's event loop.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import attrs
import pytest
import trio

from narwhal.cli import check as check_cli, profile as profile_cli
from narwhal.config import Config
from narwhal.probe import SweepPlan
from narwhal.profiles import ProfileStore, load_profiles

from ..support import StartFleet
from .helpers import config_document, config_for, decode, store_for

PROFILE_ARGS = [
    "--fast",
    "--prefill-sizes",
    "16,1024,4096",
    "--prefill-repeats",
    "1",
    "--decode-active",
    "1,4",
    "--decode-contexts",
    "256",
    "--decode-gaps",
    "8",
    "--kv-budget",
    "0.6",
    "--handoff-sizes",
    "64,1024",
    "--handoff-repeats",
    "1",
    "--quiet",
]
CHECK_ARGS = [
    "--handoff-samples",
    "1",
    "--handoff-sizes",
    "64",
    "--lease-max-s",
    "5",
    "--lease-poll-s",
    "0.01",
    "--quiet",
]


async def run_cli(main: object, argv: list[str]) -> int:
    assert callable(main)
    code = await trio.to_thread.run_sync(partial(main, argv))
    assert isinstance(code, int)
    return code


async def test_profile_then_check_and_record(
    start_fleet: StartFleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = await start_fleet(engines=2, speed=4.0, lease_s=2.0)
    urls = {"p0": fleet[0].url, "d0": fleet[1].url}
    store_path = tmp_path / "runs" / "profiles.json"
    document = config_document(urls, profiles=str(store_path), serving={"handoff_timeout_s": 0.1})
    config_path = tmp_path / "narwhal.json"
    await trio.Path(config_path).write_text(json.dumps(document))

    assert await run_cli(profile_cli.main, ["--config", str(config_path), *PROFILE_ARGS]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"wrote {store_path}: 2 engine profile(s), 2 handoff pair(s) in ")
    config = config_for(urls, profiles=str(store_path))
    check = load_profiles(store_path, config)
    assert check.ok, check.messages
    assert check.store is not None
    assert check.store.facts is None
    assert check.store.sweep["prefill_sizes"] == [16, 1024, 4096]
    assert check.store.sweep["decode_contexts"] == [256]
    assert check.store.sweep["kv_budget"] == 0.6

    report = tmp_path / "check.json"
    argv = ["--config", str(config_path), "--record", "--json", str(report), *CHECK_ARGS]
    assert await run_cli(check_cli.main, argv) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].startswith("check ")
    assert "FAIL" not in table
    rows = json.loads(await trio.Path(report).read_text())
    assert rows["failed"] is False
    assert {row["check"] for row in rows["rows"]} == {
        "health",
        "tokenize",
        "metrics",
        "profile",
        "cached-prefill",
        "handoff",
        "lease",
        "handoff-wait",
        "first-token",
    }
    recorded = load_profiles(store_path, config)
    assert recorded.ok
    assert recorded.store is not None
    facts = recorded.store.facts
    assert facts is not None
    assert facts.lease_s == rows["lease_s"]
    assert facts.lease_s is not None
    assert 0.3 < facts.lease_s <= 0.5
    assert facts.crossed_handoff_p99_s == rows["crossed_handoff_p99_s"]
    assert set(facts.builds) == {"p0", "d0"}
    # The profiles themselves are untouched by --record.
    assert recorded.store.engines == check.store.engines

    # Profiling again on the same builds keeps the recorded facts.
    assert await run_cli(profile_cli.main, ["--config", str(config_path), *PROFILE_ARGS]) == 0
    again = load_profiles(store_path, config)
    assert again.store is not None
    assert again.store.facts == facts


async def test_check_exit_codes(
    start_fleet: StartFleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = await start_fleet(engines=2, speed=4.0, lease_s=2.0)
    urls = {"p0": fleet[0].url, "d0": fleet[1].url}
    config_path = tmp_path / "narwhal.json"
    document = config_document(urls, profiles=str(tmp_path / "none.json"))
    await trio.Path(config_path).write_text(json.dumps(document))
    # No profile store: the profile rows fail, and --record has nothing to record into.
    argv = ["--config", str(config_path), "--record", "--no-lease", *CHECK_ARGS]
    assert await run_cli(check_cli.main, argv) == 1
    captured = capsys.readouterr()
    assert "profile       p0           FAIL    no store" in captured.out
    assert "nothing recorded: no valid profile store" in captured.err
    assert not (tmp_path / "none.json").exists()

    missing = ["--config", str(tmp_path / "absent.json")]
    assert await run_cli(check_cli.main, missing) == 2
    assert await run_cli(profile_cli.main, missing) == 2
    assert "no such file" in capsys.readouterr().err

    await fleet[1].go_down()
    argv = ["--config", str(config_path), *PROFILE_ARGS]
    assert await run_cli(profile_cli.main, argv) == 1
    err = capsys.readouterr().err
    assert "engine 'd0' GET /version: connect to" in err
    assert err.rstrip().endswith("nothing was written")
    assert not (tmp_path / "none.json").exists()


@pytest.mark.parametrize("budget", ["0", "1.5", "-0.2"])
def test_profile_rejects_a_kv_budget_outside_0_1(
    budget: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_path = tmp_path / "narwhal.json"
    config_path.write_text(json.dumps(config_document({"p0": "http://127.0.0.1:9"})))
    assert profile_cli.main(["--config", str(config_path), "--kv-budget", budget]) == 2
    assert f"kv_budget is {float(budget)!r}; must be in (0, 1]" in capsys.readouterr().err


def test_profile_rejects_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        profile_cli.main(["--config", "x.json", "--prefill-sizes", "16,zero"])
    assert exit_info.value.code == 2
    assert "'16,zero' is not a comma-separated list of integers" in capsys.readouterr().err


@pytest.mark.parametrize("quiet", [False, True])
async def test_profile_warns_of_a_poor_fit_and_still_writes(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    quiet: bool,
) -> None:
    urls = {"p0": "http://127.0.0.1:8100", "d0": "http://127.0.0.1:8101"}
    out = tmp_path / "profiles.json"
    config = config_for(urls, profiles=str(out))
    store = store_for(urls)
    poor = attrs.evolve(decode(), residual_p90=0.42, residual_max=0.9, points=12)
    store = attrs.evolve(
        store, engines={**store.engines, "d0": attrs.evolve(store.engines["d0"], decode=poor)}
    )

    async def measured(
        _config: Config, _plan: SweepPlan, *, progress: object = None
    ) -> ProfileStore:
        return store

    monkeypatch.setattr(profile_cli, "profile_fleet", measured)
    assert await profile_cli.run(config, SweepPlan.fast(), str(out), quiet=quiet) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"wrote {out}: 2 engine profile(s)")
    assert captured.err.splitlines() == [
        "narwhal-profile: WARNING: engine 'd0': decode fit residual p90 42.0% (max 90.0% over "
        "12 measured points) is above 25%: the model misses its own measurements by that "
        "much, so this engine's predicted token interval, which decode load, admission's "
        "decode side and the role controller's split projections are made of, can be that "
        "far off (a projection at 80% of a target can be a breach); re-run narwhal-profile "
        "on a quiet host"
    ]
    assert load_profiles(out, config).ok
