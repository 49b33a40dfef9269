"""The open-connection count and its limit, on their own (the accept loop's side)."""

from __future__ import annotations

import errno
import logging
from functools import partial

import pytest
import trio
import trio.testing

from narwhal.serving._connections import OpenConnections

CLIENT = "192.0.2.1"


async def _waiter(connections: OpenConnections, woke: list[float]) -> None:
    await connections.wait_room()
    woke.append(trio.current_time())


async def test_wait_room_returns_when_a_connection_closes_goes_idle_or_the_limit_rises(
    autojump_clock: trio.testing.MockClock,
) -> None:
    connections = OpenConnections(2)
    for key in "ab":
        connections.opened(key, CLIENT)
    woke: list[float] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_waiter, connections, woke)
        await trio.sleep(1)
        assert woke == []
        connections.closed("a")
    assert woke == [1]
    connections.opened("c", CLIENT)
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
        connections.opened(key, CLIENT)
        connections.idle(key, partial(closed.append, key))
    connections.busy("a")  # a request in flight: never closed here
    connections.idle("b", lambda: closed.append("b"))  # idle again: now the newest
    assert connections.make_room()
    assert closed == ["c"]
    assert repr(connections) == "<OpenConnections 2/3, 1 idle>"
    connections.opened("d", CLIENT)
    connections.closed("c")  # its task ends: it was counted out already
    assert repr(connections) == "<OpenConnections 3/3, 1 idle>"
    assert connections.make_room()
    assert closed == ["c", "b"]
    connections.opened("e", CLIENT)
    assert not connections.make_room()  # nothing idle: the caller waits
    stats = connections.statistics()
    assert (stats.open, stats.idle, stats.shed, len(shed)) == (3, 0, 2, 2)


async def test_the_limit_is_logged_once_reached_and_once_a_tenth_below_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.server")
    reached: list[int] = []
    connections = OpenConnections(20, on_limit_reached=lambda: reached.append(1))
    for key in range(20):
        connections.opened(key, CLIENT)
    for key in range(3):  # a flood that keeps it at the limit: one line
        connections.limit_reached()
        connections.closed(key)
        connections.opened(f"again {key}", CLIENT)
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
    connections.opened("a", CLIENT)
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
    connections.opened("a", CLIENT)
    connections.opened("b", CLIENT)
    connections.limit_reached()
    stats = connections.statistics()
    assert (stats.limit, stats.configured_limit) == (2, 4096)
    assert [r.getMessage() for r in caplog.records] == [
        "2 client connections open, the limit of 2 the open-file limit leaves "
        "(listen.max_open_connections=4096): the longest idle are closed to make room, and "
        "new connections wait in the listen backlog while none is idle"
    ]


async def test_a_client_at_its_limit_is_refused_and_the_others_are_not() -> None:
    refused: list[int] = []
    connections = OpenConnections(10, per_client=2, on_client_refused=lambda: refused.append(1))
    assert connections.opened("a1", "192.0.2.1") is None
    assert connections.opened("a2", "192.0.2.1") is None
    refusal = connections.opened("a3", "192.0.2.1")
    assert refusal is not None
    assert (refusal.status, refusal.code) == (429, "connections_per_client")
    assert refusal.message == (
        "client 192.0.2.1 already has 2 connections open: narwhal keeps at most 2 open from "
        "one client address (listen.max_open_connections_per_client)"
    )
    assert connections.opened("b1", "192.0.2.2") is None  # another address
    # The refused connection counts as open until it has closed, not as its client's.
    stats = connections.statistics()
    assert (stats.open, stats.per_client.counted, stats.per_client.refused) == (4, 3, 1)
    connections.closed("a3")
    connections.closed("a1")
    assert connections.opened("a4", "192.0.2.1") is None  # room again for that client
    connections.per_client.limit = 1  # a reload
    assert connections.opened("b2", "192.0.2.2") is not None
    assert len(refused) == 2


async def test_refused_connections_are_closed_first_to_make_room() -> None:
    # They have been answered already; the idle connections of other clients have not.
    closed: list[str] = []
    connections = OpenConnections(3, per_client=1)
    assert connections.opened("idle", "192.0.2.1") is None
    connections.idle("idle", partial(closed.append, "idle"))
    assert connections.opened("busy", "192.0.2.2") is None
    assert connections.opened("refused", "192.0.2.2") is not None
    connections.refusing("refused", partial(closed.append, "refused"))
    assert connections.make_room()
    assert closed == ["refused"]
    assert connections.opened("new", "192.0.2.3") is None
    assert connections.make_room()
    assert closed == ["refused", "idle"]
    # A connection closed to make room counts out of its client at once.
    assert connections.opened("again", "192.0.2.1") is None


async def test_a_refused_connection_being_answered_wakes_a_waiting_accept_loop(
    autojump_clock: trio.testing.MockClock,
) -> None:
    connections = OpenConnections(2, per_client=1)
    connections.opened("a", "192.0.2.1")
    connections.opened("b", "192.0.2.1")  # refused
    woke: list[float] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_waiter, connections, woke)
        await trio.sleep(1)
        assert woke == []
        connections.refusing("b", lambda: None)
    assert woke == [1]


async def test_a_client_at_its_limit_makes_room_with_its_own_longest_idle_connection() -> None:
    # As at listen.max_open_connections, but among its own: a pooling client or a
    # gateway keeps connections it does not use, and a new one replaces the oldest.
    closed: list[str] = []
    shed: list[int] = []
    connections = OpenConnections(10, per_client=2, on_shed=lambda: shed.append(1))
    for key in ("a1", "a2", "b1"):
        connections.opened(key, "192.0.2.1" if key.startswith("a") else "192.0.2.2")
        connections.idle(key, partial(closed.append, key))
    connections.idle("a1", partial(closed.append, "a1"))  # idle again: a2 is now the oldest
    assert connections.opened("a3", "192.0.2.1") is None
    assert closed == ["a2"]
    connections.busy("a1")
    connections.busy("a3")
    # All of its connections in use: refused; the other client's idle one is not touched.
    assert connections.opened("a4", "192.0.2.1") is not None
    assert closed == ["a2"]
    connections.closed("a2")  # its task ends: counted out when it was closed
    stats = connections.statistics()
    assert (stats.open, stats.shed, len(shed)) == (4, 1, 1)
    assert (stats.per_client.counted, stats.per_client.refused) == (3, 1)
