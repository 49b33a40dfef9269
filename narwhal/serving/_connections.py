"""Open client connections, bounded by listen.max_open_connections, and per client
address by listen.max_open_connections_per_client.

The retained-request ceiling (docs/design.md#retained-ceiling) bounds requests, not sockets: a
connection that sends nothing, or trickles its request head (hypercorn's keep-alive timer keeps
running until a whole head has arrived, so it lives for the keep-alive timeout), holds a socket, a
task and hypercorn/h11 state (about 14 kB) with no request to count. The accept loop asks `room()`
before accepting and takes at most that many.

At the limit, with a connection waiting, `make_room()` closes the connection that has
been idle longest (no request in flight: between requests, or not yet through its
request head, which is where a slowloris sits), as nginx does with its reusable
connections when it runs out of them. Idle connections are the cheapest to shed: no
work is lost, and a keep-alive client reconnects; the longest idle is the least likely
to be sending a request at that moment. Its descriptor is closed at once, so its slot
is handed over then, not when its task has finished. When nothing is idle, every
connection has a request in flight: new connections wait in the kernel's listen
backlog, where they cost the router nothing, and `wait_room()` wakes the loop as soon
as one closes or goes idle. Accepting and then dropping them would spend the same work
per connection and tell clients nothing better.

Being at the limit is logged once (WARNING) when a waiting connection first finds it,
and once (INFO) when the open count has fallen a tenth of the limit below it: a flood
holding the router at the limit then makes one pair of lines, not one per connection.

One address may have at most listen.max_open_connections_per_client of them open
(`per_client`, see `serving._per_client`): otherwise one client trickling request heads on
every connection it can open takes the whole table, and each new connection of its
closes the connection idle longest, someone else's keep-alive connection. At its limit a
new connection from that address takes the place of that address's own connection idle
longest, as at listen.max_open_connections; with none of them idle, it is accepted,
answered 429 at once and closed by the accept loop (`opened` says so). Until it has
closed it counts as open, and it is the first closed to make room: its answer has been
written already.

The limit in force can be lower than listen.max_open_connections (`configured`) when the
process's open-file limit leaves no room for that many (`serving._descriptors`); the log
lines then name both.

accept() itself can fail for want of descriptors or memory (EMFILE, ENFILE, ENOMEM,
ENOBUFS: another process used up the system's files, or the descriptor reserve fell
short). The accept loop retries every tenth of a second while connections wait, so
such an episode is logged once (WARNING, with the errno) when it begins and once (INFO,
with how long it lasted and how many attempts failed) when a burst of accepts next
empties the backlog without such a failure: one accept getting through between failures
does not end it, or a process at its limit would log a pair per connection closed.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Hashable

import attrs
import trio

from .._codes import ErrorCode
from .._errors import Refused
from ._per_client import PerClient, PerClientStatistics

log = logging.getLogger("narwhal.server")


@attrs.frozen
class ConnectionStatistics:
    open: int
    idle: int
    limit: int
    configured_limit: int
    at_limit: bool
    limit_reached: int
    shed: int
    accept_failing: bool
    accept_failures: int
    per_client: PerClientStatistics


def _nothing() -> None:
    pass


def _ignore(_: str) -> None:
    pass


class OpenConnections:
    """The count of open client connections against a limit a reload may change."""

    def __init__(
        self,
        limit: int,
        *,
        per_client: int | None = None,
        on_limit_reached: Callable[[], None] = _nothing,
        on_shed: Callable[[], None] = _nothing,
        on_accept_failed: Callable[[str], None] = _ignore,
        on_client_refused: Callable[[], None] = _nothing,
    ) -> None:
        """`per_client`: listen.max_open_connections_per_client in force (None: `limit`);
        a reload sets `per_client.limit`."""
        self.per_client = PerClient(
            limit if per_client is None else per_client,
            noun="connections open",
            setting="listen.max_open_connections_per_client",
            bound="keeps at most {limit} open",
            code=ErrorCode.CONNECTIONS_PER_CLIENT,
            on_refused=on_client_refused,
        )
        self._limit = limit
        self._configured = limit
        self._open = 0
        self._at_limit = False
        self._limit_reached = 0
        self._shed_total = 0
        self._on_limit_reached = on_limit_reached
        self._on_shed = on_shed
        self._on_accept_failed = on_accept_failed
        self._accept_failures = 0
        # The accept failure episode under way: when it began, and its failures so far.
        self._failing_since: float | None = None
        self._episode_failures = 0
        # Idle connections, longest idle first (dicts keep insertion order), each with
        # what closes it; and those closed here whose tasks have not ended yet.
        self._idle: dict[Hashable, Callable[[], None]] = {}
        # Connections refused at accept while they are answered and closed, likewise;
        # each served one's client and what counts it out of that client's count; and
        # each client's idle connections, longest idle first.
        self._refusing: dict[Hashable, Callable[[], None]] = {}
        self._clients: dict[Hashable, tuple[str, Callable[[], None]]] = {}
        self._idle_of: dict[str, dict[Hashable, None]] = {}
        self._shed: set[Hashable] = set()
        self._room = trio.lowlevel.ParkingLot()

    def __repr__(self) -> str:
        at = " | at limit" if self._at_limit else ""
        failing = " | accept failing" if self._failing_since is not None else ""
        return f"<OpenConnections {self._open}/{self._limit}, {len(self._idle)} idle{at}{failing}>"

    @property
    def limit(self) -> int:
        return self._limit

    @limit.setter
    def limit(self, value: int) -> None:
        self.set_limit(value, configured=value)

    @property
    def configured_limit(self) -> int:
        return self._configured

    def set_limit(self, limit: int, *, configured: int) -> None:
        """Enforce `limit` from now on; `configured` is listen.max_open_connections, which
        `limit` is below when the open-file limit leaves no room for it."""
        self._limit = limit
        self._configured = configured
        self._maybe_clear()
        if self.room():
            self._room.unpark_all()

    def room(self) -> int:
        """Connections that may be accepted now."""
        return max(0, self._limit - self._open)

    def make_room(self) -> bool:
        """Whether a connection may be accepted now, after closing a refused connection
        or else the longest-idle one if there is no room."""
        if self.room():
            return True
        closable = self._refusing or self._idle
        if not closable:
            return False
        key = next(iter(closable))
        self._close_now(key, closable.pop(key))
        return True

    def _close_now(self, key: Hashable, close: Callable[[], None]) -> None:
        """Close connection `key` to make room; it counts out at once."""
        self._forget_idle(key)
        self._count_out(key)
        self._shed.add(key)
        self._open -= 1
        self._shed_total += 1
        self._on_shed()
        close()

    async def wait_room(self) -> None:
        """Return once `make_room()` can succeed: a connection closed or went idle, or
        the limit rose."""
        while not (self.room() or self._idle or self._refusing):
            await self._room.park()

    def limit_reached(self) -> None:
        """The accept loop found a connection waiting while the limit was reached."""
        self._limit_reached += 1
        self._on_limit_reached()
        if not self._at_limit:
            self._at_limit = True
            log.warning(
                "%d client connections open, %s: the longest idle are closed to make "
                "room, and new connections wait in the listen backlog while none is idle",
                self._open,
                self._limit_text(),
                extra={
                    "event": "connection_limit",
                    "outcome": "reached",
                    "open": self._open,
                    "limit": self._limit,
                    "configured": self._configured,
                },
            )

    def _limit_text(self) -> str:
        if self._limit == self._configured:
            return f"listen.max_open_connections={self._limit}"
        return (
            f"the limit of {self._limit} the open-file limit leaves "
            f"(listen.max_open_connections={self._configured})"
        )

    def accept_failed(self, err: int, retry_s: float) -> None:
        """accept() failed with `err`, an errno meaning the process or system is out of
        descriptors or memory; the accept loop retries in `retry_s`."""
        name = errno.errorcode.get(err, str(err))
        self._accept_failures += 1
        self._on_accept_failed(name)
        if self._failing_since is None:
            self._failing_since = trio.current_time()
            self._episode_failures = 0
            log.warning(
                "accepting client connections failed: %s (%s), %d open, %s; retrying "
                "every %s s while connections wait, logged again when it works",
                os.strerror(err),
                name,
                self._open,
                self._limit_text(),
                retry_s,
                extra={
                    "event": "accept_failed",
                    "outcome": "started",
                    "errno": name,
                    "open": self._open,
                    "limit": self._limit,
                },
            )
        self._episode_failures += 1

    def accepted_all(self) -> None:
        """An accept burst ended without failing for want of descriptors or memory."""
        if self._failing_since is None:
            return
        lasted = trio.current_time() - self._failing_since
        self._failing_since = None
        log.info(
            "accepting client connections again after %.1f s; %d attempt(s) failed",
            lasted,
            self._episode_failures,
            extra={
                "event": "accept_failed",
                "outcome": "ended",
                "duration_s": round(lasted, 3),
                "failures": self._episode_failures,
                "open": self._open,
            },
        )

    def opened(self, key: Hashable, client: str) -> Refused | None:
        """Connection `key` was accepted from `client` (a `client_key`). None: serve it,
        after closing `client`'s own connection idle longest if it has
        listen.max_open_connections_per_client open. Else, with none of them idle, the
        refusal to answer it with, counted and logged. Either way it counts as open until
        `closed`."""
        self._open += 1
        if self.per_client.full(client):
            idle = self._idle_of.get(client)
            if not idle:
                refusal = self.per_client.refusal(client)
                self.per_client.refused(client)
                return refusal
            oldest = next(iter(idle))
            self._close_now(oldest, self._idle.pop(oldest))
        self._clients[key] = (client, self.per_client.hold(client))
        return None

    def refusing(self, key: Hashable, close: Callable[[], None]) -> None:
        """Refused connection `key` is being answered and closed; `close` closes it now."""
        self._refusing[key] = close
        if self._room:
            self._room.unpark_all()

    def idle(self, key: Hashable, close: Callable[[], None]) -> None:
        """Connection `key` has no request in flight from now; `close` closes it."""
        self._idle.pop(key, None)
        self._idle[key] = close
        served = self._clients.get(key)
        if served is not None:
            mine = self._idle_of.setdefault(served[0], {})
            mine.pop(key, None)
            mine[key] = None
        if self._room:
            self._room.unpark_all()

    def busy(self, key: Hashable) -> None:
        """Connection `key` has a request in flight, or is ending."""
        self._idle.pop(key, None)
        self._forget_idle(key)

    def closed(self, key: Hashable) -> None:
        self._idle.pop(key, None)
        self._refusing.pop(key, None)
        self._forget_idle(key)
        self._count_out(key)
        if key in self._shed:
            self._shed.discard(key)  # counted out when it was shed
            return
        self._open -= 1
        self._maybe_clear()
        if self._room and self.room():
            self._room.unpark_all()

    def _forget_idle(self, key: Hashable) -> None:
        served = self._clients.get(key)
        if served is None:
            return
        mine = self._idle_of.get(served[0])
        if mine is not None:
            mine.pop(key, None)
            if not mine:
                del self._idle_of[served[0]]

    def _count_out(self, key: Hashable) -> None:
        """Connection `key` no longer counts against its client's limit."""
        served = self._clients.pop(key, None)
        if served is not None:
            served[1]()

    def _maybe_clear(self) -> None:
        if self._at_limit and self._open <= self._limit - max(1, self._limit // 10):
            self._at_limit = False
            log.info(
                "%d client connections open, under %s again",
                self._open,
                self._limit_text(),
                extra={
                    "event": "connection_limit",
                    "outcome": "cleared",
                    "open": self._open,
                    "limit": self._limit,
                    "configured": self._configured,
                },
            )

    def statistics(self) -> ConnectionStatistics:
        return ConnectionStatistics(
            open=self._open,
            idle=len(self._idle),
            limit=self._limit,
            configured_limit=self._configured,
            at_limit=self._at_limit,
            limit_reached=self._limit_reached,
            shed=self._shed_total,
            accept_failing=self._failing_since is not None,
            accept_failures=self._accept_failures,
            per_client=self.per_client.statistics(),
        )
