"""The open-connection count and its limit, on their own (the accept loop's side)."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from narwhal.serving._connections import OpenConnections


async def _waiter(connections: OpenConnections, woke: list[float]) -> None:
    await connections.wait_room()
    woke.append(trio.current_time())


async def test_wait_room_returns_when_a_connection_closes_or_the_limit_rises(
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
        connections.closed()
    assert woke == [1]
    connections.opened()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_waiter, connections, woke)
        await trio.sleep(1)
        connections.limit = 3  # a reload
    assert woke == [1, 2]
    assert connections.room() == 1
    connections.limit = 1  # lower than what is open: nothing closes, nothing is accepted
    assert (connections.statistics().open, connections.room()) == (2, 0)


async def test_the_limit_is_logged_once_reached_and_once_a_tenth_below_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.server")
    reached: list[int] = []
    connections = OpenConnections(20, on_limit_reached=lambda: reached.append(1))
    for _ in range(20):
        connections.opened()
    for _ in range(3):  # a flood that keeps it at the limit: one line
        connections.limit_reached()
        connections.closed()
        connections.opened()
    assert repr(connections) == "<OpenConnections 20/20 | at limit>"
    connections.closed()
    assert connections.statistics().at_limit  # 19 open: not yet a tenth below
    connections.closed()
    assert repr(connections) == "<OpenConnections 18/20>"
    assert connections.statistics().limit_reached == len(reached) == 3
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        (
            "WARNING",
            "20 client connections open, listen.max_open_connections=20: new connections "
            "wait in the listen backlog until one closes",
        ),
        ("INFO", "18 client connections open, under listen.max_open_connections=20 again"),
    ]
