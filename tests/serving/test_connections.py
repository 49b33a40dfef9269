"""The open-connection count and its limit, on their own (the accept loop's side)."""

from __future__ import annotations

import errno
import logging
from functools import partial

import pytest
import trio
import trio.testing

from narwhal.serving._connections import OpenConnections


async def _waiter(connections: OpenConnections, woke: list[float]) -> None:
    await connections.wait_room()
    woke.append(trio.current_time())


async def test_wait_room_returns_when_a_connection_closes_goes_idle_or_the_limit_rises(
    autojump_clock: trio.testing.MockClock,
) -> None:
    connections = OpenConnections(2)
    for _ in range(2):
        connections.opened()
    woke: list[float] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_waiter, connections, woke)
        await trio.sleep(1)
        assert woke == []
        connections.closed("a")
    assert woke == [1]
    connections.opened()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_waiter, connections, woke)
        await trio.sleep(1)
        connections.idle("b", lambda: None)
    assert woke == [1, 2]
    connections.busy("b")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_waiter, connections, woke)
        await trio.sleep(1)
        connections.limit = 3  # a reload
    assert woke == [1, 2, 3]
    assert connections.room() == 1
    connections.limit = 1  # lower than what is open: nothing closes, nothing is accepted
    assert (connections.statistics().open, connections.room()) == (2, 0)


def test_make_room_closes_the_longest_idle_connection_and_counts_it_out_at_once() -> None:
    closed: list[str] = []
    shed: list[int] = []
    connections = OpenConnections(3, on_shed=lambda: shed.append(1))
    for key in "abc":
        connections.opened()
        connections.idle(key, partial(closed.append, key))
    connections.busy("a")  # a request in flight: never closed here
    connections.idle("b", lambda: closed.append("b"))  # idle again: now the newest
    assert connections.make_room()
    assert closed == ["c"]
    assert repr(connections) == "<OpenConnections 2/3, 1 idle>"
    connections.opened()
    connections.closed("c")  # its task ends: it was counted out already
    assert repr(connections) == "<OpenConnections 3/3, 1 idle>"
    assert connections.make_room()
    assert closed == ["c", "b"]
    connections.opened()
    assert not connections.make_room()  # nothing idle: the caller waits
    stats = connections.statistics()
    assert (stats.open, stats.idle, stats.shed, len(shed)) == (3, 0, 2, 2)


async def test_the_limit_is_logged_once_reached_and_once_a_tenth_below_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.server")
    reached: list[int] = []
    connections = OpenConnections(20, on_limit_reached=lambda: reached.append(1))
    for _ in range(20):
        connections.opened()
    for key in range(3):  # a flood that keeps it at the limit: one line
        connections.limit_reached()
        connections.closed(key)
        connections.opened()
    assert repr(connections) == "<OpenConnections 20/20, 0 idle | at limit>"
    connections.closed("x")
    assert connections.statistics().at_limit  # 19 open: not yet a tenth below
    connections.closed("y")
    assert repr(connections) == "<OpenConnections 18/20, 0 idle>"
    assert connections.statistics().limit_reached == len(reached) == 3
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        (
            "WARNING",
            "20 client connections open, listen.max_open_connections=20: the longest idle "
            "are closed to make room, and new connections wait in the listen backlog while "
            "none is idle",
        ),
        ("INFO", "18 client connections open, under listen.max_open_connections=20 again"),
    ]


async def test_accept_failures_are_logged_once_per_episode_and_counted(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.server")
    failed: list[str] = []
    connections = OpenConnections(8, on_accept_failed=failed.append)
    connections.opened()
    for _ in range(3):
        connections.accept_failed(errno.EMFILE, 0.1)
        await trio.sleep(0.1)
    assert repr(connections) == "<OpenConnections 1/8, 0 idle | accept failing>"
    connections.accept_failed(errno.ENFILE, 0.1)  # the same episode
    await trio.sleep(0.1)
    connections.accepted_all()
    connections.accepted_all()
    connections.accept_failed(errno.EMFILE, 0.1)  # a new one
    stats = connections.statistics()
    assert (stats.accept_failing, stats.accept_failures) == (True, 5)
    assert failed == ["EMFILE", "EMFILE", "EMFILE", "ENFILE", "EMFILE"]
    warning = (
        "WARNING",
        "accepting client connections failed: Too many open files (EMFILE), 1 open, "
        "listen.max_open_connections=8; retrying every 0.1 s while connections wait, logged "
        "again when it works",
    )
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        warning,
        ("INFO", "accepting client connections again after 0.4 s; 4 attempt(s) failed"),
        warning,
    ]
    fields = [
        {key: getattr(r, key, None) for key in ("outcome", "errno", "duration_s", "failures")}
        for r in caplog.records
    ]
    assert fields == [
        {"outcome": "started", "errno": "EMFILE", "duration_s": None, "failures": None},
        {"outcome": "ended", "errno": None, "duration_s": 0.4, "failures": 4},
        {"outcome": "started", "errno": "EMFILE", "duration_s": None, "failures": None},
    ]


def test_the_limit_in_force_below_the_configured_one_is_named_with_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.server")
    connections = OpenConnections(4096)
    connections.set_limit(2, configured=4096)  # what the open-file limit leaves
    connections.opened()
    connections.opened()
    connections.limit_reached()
    stats = connections.statistics()
    assert (stats.limit, stats.configured_limit) == (2, 4096)
    assert [r.getMessage() for r in caplog.records] == [
        "2 client connections open, the limit of 2 the open-file limit leaves "
        "(listen.max_open_connections=4096): the longest idle are closed to make room, and "
        "new connections wait in the listen backlog while none is idle"
    ]
