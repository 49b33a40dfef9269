"""Open client connections, bounded by listen.max_open_connections.

The retained-request ceiling (manual 4.2) bounds requests, not sockets: a connection
that sends nothing, or trickles its request head (hypercorn's keep-alive timer keeps
running until a whole head has arrived, so it lives for the keep-alive timeout), holds
a socket, a task and hypercorn/h11 state (about 14 kB) with no request to count. The
accept loop asks `room()` before accepting and takes at most that many; at the limit
it leaves new connections in the kernel's listen backlog, where they cost the router
nothing, and `wait_room()` wakes it as soon as one closes. Accepting and then dropping
them would spend the same work per connection and tell clients nothing better.

Being at the limit is logged once (WARNING) when a waiting connection first finds it,
and once (INFO) when the open count has fallen a tenth of the limit below it: a flood
holding the router at the limit then makes one pair of lines, not one per connection.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import attrs
import trio

log = logging.getLogger("narwhal.server")


@attrs.frozen
class ConnectionStatistics:
    open: int
    limit: int
    at_limit: bool
    limit_reached: int


def _nothing() -> None:
    pass


class OpenConnections:
    """The count of open client connections against a limit a reload may change."""

    def __init__(self, limit: int, *, on_limit_reached: Callable[[], None] = _nothing) -> None:
        self._limit = limit
        self._open = 0
        self._at_limit = False
        self._limit_reached = 0
        self._on_limit_reached = on_limit_reached
        self._room = trio.lowlevel.ParkingLot()

    def __repr__(self) -> str:
        at = " | at limit" if self._at_limit else ""
        return f"<OpenConnections {self._open}/{self._limit}{at}>"

    @property
    def limit(self) -> int:
        return self._limit

    @limit.setter
    def limit(self, value: int) -> None:
        self._limit = value
        self._maybe_clear()
        if self.room():
            self._room.unpark_all()

    def room(self) -> int:
        """Connections that may be accepted now."""
        return max(0, self._limit - self._open)

    async def wait_room(self) -> None:
        """Return once a connection may be accepted."""
        while not self.room():
            await self._room.park()

    def limit_reached(self) -> None:
        """The accept loop found a connection waiting while the limit was reached."""
        self._limit_reached += 1
        self._on_limit_reached()
        if not self._at_limit:
            self._at_limit = True
            log.warning(
                "%d client connections open, listen.max_open_connections=%d: new "
                "connections wait in the listen backlog until one closes",
                self._open,
                self._limit,
                extra={
                    "event": "connection_limit",
                    "outcome": "reached",
                    "open": self._open,
                    "limit": self._limit,
                },
            )

    def opened(self) -> None:
        self._open += 1

    def closed(self) -> None:
        self._open -= 1
        self._maybe_clear()
        if self._room.statistics().tasks_waiting and self.room():
            self._room.unpark_all()

    def _maybe_clear(self) -> None:
        if self._at_limit and self._open <= self._limit - max(1, self._limit // 10):
            self._at_limit = False
            log.info(
                "%d client connections open, under listen.max_open_connections=%d again",
                self._open,
                self._limit,
                extra={
                    "event": "connection_limit",
                    "outcome": "cleared",
                    "open": self._open,
                    "limit": self._limit,
                },
            )

    def statistics(self) -> ConnectionStatistics:
        return ConnectionStatistics(
            open=self._open,
            limit=self._limit,
            at_limit=self._at_limit,
            limit_reached=self._limit_reached,
        )
