"""A reload logs only what changed in the profile store's problems and poor fits."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import attrs
import pytest
import trio

from narwhal.config import load_config
from narwhal.profiles import PoorFit, ProfileStore, save_profiles
from narwhal.serving import state_document
from narwhal.supervisor import Supervisor
from narwhal.supervisor._control import ProfileFindings, ProfileNews

from ..recovery.conftest import FAST
from ..recovery.fakes import merge
from ..support import FakeFileLimit, StartFleet
from .helpers import MODEL, config_document, decode, store_for
from .test_check import build_of

PATH = "runs/profiles.json"
STORE = store_for({"e0": "http://127.0.0.1:1"})
POOR = PoorFit(engine="e0", phase="decode", residual_p90=0.31, residual_max=0.5, points=8)
WORSE = attrs.evolve(POOR, residual_p90=0.4)
PREFILL = attrs.evolve(POOR, phase="prefill")


def found(
    problems: tuple[str, ...],
    fits: tuple[PoorFit, ...] | None = (),
    store: ProfileStore | None = STORE,
) -> ProfileFindings:
    return ProfileFindings(PATH, store, problems, fits)


def test_the_first_load_says_everything() -> None:
    assert found(("a", "b"), (POOR,)).since(None) == ProfileNews(("a", "b"), (POOR,))


def test_a_reload_of_the_same_store_says_what_is_new_and_what_went_away() -> None:
    previous = found(("a", "b"), (POOR, PREFILL))
    assert found(("a", "c"), (WORSE,)).since(previous) == ProfileNews(
        problems=("c",),
        # Another residual is another fit, said again; the same engine and phase did not
        # go away.
        poor_fits=(WORSE,),
        cleared_problems=("b",),
        cleared_fits=(PREFILL,),
        unchanged_problems=1,
        unchanged_fits=0,
    )
    assert found(("a", "b"), (POOR, PREFILL)).since(previous) == ProfileNews(
        unchanged_problems=2, unchanged_fits=2
    )


def test_everything_a_changed_store_holds_is_new() -> None:
    previous = found(("a", "b"), (POOR,))
    rewritten = attrs.evolve(STORE, created_at="2026-02-01T00:00:00+00:00")
    assert found(("a",), (POOR,), store=rewritten).since(previous) == ProfileNews(
        problems=("a",), poor_fits=(POOR,), cleared_problems=("b",)
    )
    # A store that went missing, and one read at another path, are changed stores too.
    missing = found(("a",), None, store=None)
    assert missing.since(previous).problems == ("a",)
    moved = attrs.evolve(previous, path="elsewhere.json")
    assert previous.since(moved) == ProfileNews(problems=("a", "b"), poor_fits=(POOR,))
    # The same missing store twice is the same store.
    assert missing.since(missing) == ProfileNews(unchanged_problems=1)


def test_a_load_without_a_usable_profile_clears_no_fit() -> None:
    # No fit was judged (the previous profiles may even stay in use): none went away.
    unusable = found(("every profile is stale",), None)
    assert unusable.since(found((), (POOR,))) == ProfileNews(problems=("every profile is stale",))
    # And the next usable load says its fits as new.
    assert found((), (POOR,)).since(unusable) == ProfileNews(
        poor_fits=(POOR,), cleared_problems=("every profile is stale",)
    )


PROFILE_EVENTS = (
    "profile_problem",
    "profile_poor_fit",
    "profile_problem_cleared",
    "profile_poor_fit_cleared",
    "profile_unchanged",
)


def said(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    """The profile lines logged since the last call: a warning's message, an info line's
    event (with its counts for `profile_unchanged`)."""
    out = []
    for r in caplog.records:
        event = r.__dict__.get("event")
        if event not in PROFILE_EVENTS:
            continue
        if r.levelno >= logging.WARNING:
            out.append((r.levelname, r.getMessage()))
        elif event == "profile_unchanged":
            out.append((r.levelname, f"{event} {r.__dict__['problems']}+{r.__dict__['poor_fits']}"))
        else:
            out.append((r.levelname, event))
    caplog.clear()
    return out


async def test_reloads_of_an_unchanged_store_warn_of_nothing_new(
    start_fleet: StartFleet, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal")
    fleet = await start_fleet(engines=3, speed=50.0)
    urls = {f"e{i}": handle.url for i, handle in enumerate(fleet)}
    store_path = tmp_path / "profiles.json"
    document = merge(
        config_document(
            urls,
            profiles=str(store_path),
            listen={"host": "127.0.0.1", "port": 0},
            admin={"host": "127.0.0.1", "port": 0},
            serving={"admission": "open"},
        ),
        FAST,
    )
    config = load_config(document)
    build = await build_of(config)

    def save(e1_url: str) -> None:
        """A store where e0's decode fit is poor (`POOR`), e1 is measured at `e1_url`
        and e2 not at all."""
        store = store_for({"e0": urls["e0"], "e1": e1_url}, build=build)
        poor = attrs.evolve(decode(), residual_p90=0.31, residual_max=0.5, points=8)
        engines = {**store.engines, "e0": attrs.evolve(store.engines["e0"], decode=poor)}
        save_profiles(attrs.evolve(store, engines=engines), store_path)

    save("http://10.0.0.9:8000")
    config_path = tmp_path / "narwhal.json"
    config_path.write_text(json.dumps(document))
    url_problem = (
        f"engine 'e1': url is {urls['e1']!r} in the config but 'http://10.0.0.9:8000' in "
        "the profile"
    )
    missing = "engine 'e2': no profile in the store; run narwhal-profile"
    async with trio.open_nursery() as nursery:
        supervisor: Supervisor = await nursery.start(
            Supervisor(config, config_path=str(config_path), open_files=FakeFileLimit().limit()).run
        )
        assert supervisor.ctx is not None
        assert said(caplog) == [
            ("WARNING", f"profile: {url_problem}"),
            ("WARNING", f"profile: {missing}"),
            ("WARNING", f"profile: {POOR.message()}"),
        ]
        for _ in range(3):
            assert (await supervisor.reload(trigger="SIGHUP")).applied
            assert said(caplog) == [("INFO", "profile_unchanged 2+1")]
        # Nothing is lost: /narwhal/state lists them all.
        section = state_document(supervisor.ctx)["profiles"]
        assert isinstance(section, dict)
        assert section["problems"] == [url_problem, missing]
        assert section["poor_fits"] == [
            {"engine": "e0", "phase": "decode", "residual_p90": 0.31, "points": 8}
        ]

        # narwhal-profile ran again and measured e1 where it is: that problem went away,
        # and what the new store still has wrong is said again.
        save(urls["e1"])
        assert (await supervisor.reload(trigger="SIGHUP")).applied
        assert said(caplog) == [
            ("WARNING", f"profile: {missing}"),
            ("WARNING", f"profile: {POOR.message()}"),
            ("INFO", "profile_problem_cleared"),
        ]
        # A new problem with the same store is said; the rest is counted.
        document["engines"].append({"id": "e3", "url": "http://127.0.0.1:1", "model": MODEL})
        config_path.write_text(json.dumps(document))
        assert (await supervisor.reload(trigger="SIGHUP")).applied
        assert said(caplog) == [
            ("WARNING", "profile: engine 'e3': no profile in the store; run narwhal-profile"),
            ("INFO", "profile_unchanged 1+1"),
        ]
        supervisor.request_shutdown()
