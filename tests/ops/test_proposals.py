"""`narwhalctl proposals`: advisory role control's proposals with wall-clock times."""

from __future__ import annotations

import datetime
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from narwhal._records import to_json
from narwhal.cli import ctl
from narwhal.supervisor._operations import proposals_view

from ..controller.helpers import PREFILL_HEAVY
from ..controller.test_controller import offer, setup
from .daemon import Launch, launcher
from .test_daemon import document, start_fleet

# 2025-01-02T03:04:05Z, and the daemon's monotonic clock at that moment.
WALL_NOW = 1735787045.0
MONOTONIC_NOW = 500.0


def test_a_proposal_is_shown_at_the_wall_clock_time_it_was_made() -> None:
    _, _, controller = setup("PPDD", advisory=True)
    offer(controller, PREFILL_HEAVY, 0.0, 200.0)
    assert controller.step(200.0) is not None
    view = to_json(
        proposals_view(controller.state_section(), monotonic_now=MONOTONIC_NOW, wall_now=WALL_NOW)
    )
    proposals = view["proposals"]
    assert isinstance(proposals, list)
    (proposal,) = proposals
    made = datetime.datetime.fromisoformat(proposal["wall_time"])
    # Made at monotonic 200, 300 s before "now".
    assert made.timestamp() == WALL_NOW - 300.0
    assert made.utcoffset() is not None  # local time, with its offset
    assert proposal["age_s"] == 300.0
    assert (proposal["engine"], proposal["from"], proposal["to"]) == ("d0", "decode", "prefill")
    text = ctl._human("proposals", json.loads(json.dumps(view)))
    first = text.splitlines()[0]
    assert first.startswith(f"{proposal['wall_time']}  d0 decode -> prefill  2P:2D -> 3P:1D  ")
    assert "last evaluated" in text.splitlines()[-1]


def test_without_a_controller_nothing_is_proposed() -> None:
    view = to_json(proposals_view(None, monotonic_now=MONOTONIC_NOW, wall_now=WALL_NOW))
    assert ctl._human("proposals", view) == (
        "role control is off (controller.enabled is false): nothing is proposed"
    )


@pytest.fixture
async def launch(short_tmp: Path) -> AsyncIterator[Launch]:
    async with launcher(short_tmp) as start:
        yield start


async def test_narwhalctl_proposals_asks_a_running_daemon(
    nursery: trio.Nursery, launch: Launch
) -> None:
    fleet = await start_fleet(nursery, 2)
    daemon = await launch(
        document(fleet, ["prefill", "decode"], controller={"enabled": True, "advisory": True})
    )
    result = await daemon.ctl("proposals")
    assert result.returncode == 0, result.stderr
    assert result.stdout.decode().startswith("no role change proposed yet")
    result = await daemon.ctl("--json", "proposals")
    response = json.loads(result.stdout)
    assert response["result"]["advisory"] is True
    assert response["result"]["proposals"] == []
