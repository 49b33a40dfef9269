"""A count per client address against a limit: connections open, request bodies arriving.

Owns `PerClient`, one per thing counted (`OpenConnections` keeps the connections' one,
`ServingContext` the request bodies'), and `client_key`, the address a count is kept
under. The limits exist so that one client cannot take what every client shares: a
slowloris from one address held the whole retained-request ceiling with slow bodies,
and filled listen.max_open_connections with connections that pushed out everyone
else's idle ones.

Invariants: an address is in the table only while its count is above zero, so the
table is bounded by what it counts; `full` and `hold` never await, so a caller that
checks and then holds cannot be overtaken. An IPv6 client is counted by its /64
prefix, the block one host or one site is given: counting single addresses would let
any IPv6 client take a fresh one per connection.

Logging: the first refusal of an address logs a WARNING, and the episode ends with one
INFO line (how many were refused) when the address has nothing counted any more, or
when it next drops below its limit `QUIET_S` after its last refusal: a client held at
its limit, however fast it retries, makes one pair of lines. The caller counts each
refusal in its metrics (`on_refused`) and answers it.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable

import attrs
import trio

from .._errors import Refused
from .._records import key

log = logging.getLogger("narwhal.server")

QUIET_S = 10.0
# A client's own connections or bodies end in milliseconds to serving.body_timeout_s;
# the header takes whole seconds, and the ceiling's refusal says 1 too.
RETRY_AFTER_S = 1.0


def client_key(host: str) -> str:
    """The address `host` is counted under: itself (an IPv4-mapped IPv6 address as the
    IPv4 address it is), or for IPv6 its /64 prefix."""
    if ":" not in host:
        return host
    try:
        address = ipaddress.IPv6Address(host.split("%", 1)[0])
    except ValueError:
        return host
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(ipaddress.IPv6Network((address, 64), strict=False))


@attrs.frozen
class PerClientStatistics:
    """Also the state document's `clients.connections` and `clients.pending_bodies`."""

    limit: int = attrs.field(metadata=key("limit_per_client"))
    counted: int  # over every address
    clients: int  # addresses with something counted
    busiest: int  # the most one address has
    refused: int = attrs.field(metadata=key("refused_total"))
    refusing: int  # addresses whose refusals are being logged as under way


def _nothing() -> None:
    pass


@attrs.define
class _Episode:
    started: float
    last: float
    refused: int = 0


class PerClient:
    """`noun` counted per client address, at most `limit` each (a reload sets `limit`).
    `setting` names the limit, `bound` says what it allows (with `{limit}`) and `code` is
    the refusal's error code, all for messages."""

    def __init__(
        self,
        limit: int,
        *,
        noun: str,
        setting: str,
        bound: str,
        code: str,
        on_refused: Callable[[], None] = _nothing,
    ) -> None:
        self.limit = limit
        self.code = code
        self._noun = noun
        self._setting = setting
        self._bound = bound
        self._on_refused = on_refused
        self._counts: dict[str, int] = {}
        self._counted = 0
        self._refused = 0
        self._episodes: dict[str, _Episode] = {}

    def __repr__(self) -> str:
        return (
            f"<PerClient {self._counted} {self._noun} from {len(self._counts)} client(s), "
            f"{self.limit} each>"
        )

    def count(self, client: str) -> int:
        return self._counts.get(client, 0)

    def full(self, client: str) -> bool:
        """Whether `client` has its limit already (then refuse it: `refused`)."""
        return self._counts.get(client, 0) >= self.limit

    def refusal(self, client: str) -> Refused:
        """What refuses `client` now (429 with Retry-After)."""
        bound = self._bound.format(limit=self.limit)
        return Refused(
            f"client {client} already has {self.count(client)} {self._noun}: narwhal "
            f"{bound} from one client address ({self._setting})",
            code=self.code,
            retry_after_s=RETRY_AFTER_S,
        )

    def refused(self, client: str) -> None:
        """One of `client`'s was refused: counted, and logged if it begins an episode."""
        self._refused += 1
        self._on_refused()
        now = trio.current_time()
        episode = self._episodes.get(client)
        if episode is not None and now - episode.last >= QUIET_S:
            self._end(client)
            episode = None
        if episode is None:
            episode = self._episodes[client] = _Episode(started=now, last=now)
            log.warning(
                "client %s has %d %s, %s=%d: more are refused with 429 %s",
                client,
                self.count(client),
                self._noun,
                self._setting,
                self.limit,
                self.code,
                extra={
                    "event": "client_limit",
                    "outcome": "reached",
                    "code": self.code,
                    "client": client,
                    "count": self.count(client),
                    "limit": self.limit,
                },
            )
        episode.refused += 1
        episode.last = now

    def hold(self, client: str) -> Callable[[], None]:
        """Count one more for `client`; the returned callable counts it out (once, however
        often it is called)."""
        self._counts[client] = self._counts.get(client, 0) + 1
        self._counted += 1
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self._release(client)

        return release

    def _release(self, client: str) -> None:
        self._counted -= 1
        left = self._counts[client] - 1
        if left:
            self._counts[client] = left
        else:
            del self._counts[client]
        episode = self._episodes.get(client)
        if episode is None:
            return
        if not left or (left < self.limit and trio.current_time() - episode.last >= QUIET_S):
            self._end(client)

    def _end(self, client: str) -> None:
        episode = self._episodes.pop(client)
        lasted = trio.current_time() - episode.started
        count = self.count(client)
        log.info(
            "client %s: %d refused with 429 %s over %.1f s (%s now: %d)",
            client,
            episode.refused,
            self.code,
            lasted,
            self._noun,
            count,
            extra={
                "event": "client_limit",
                "outcome": "cleared",
                "code": self.code,
                "client": client,
                "count": count,
                "refused": episode.refused,
                "duration_s": round(lasted, 3),
            },
        )

    def statistics(self) -> PerClientStatistics:
        return PerClientStatistics(
            limit=self.limit,
            counted=self._counted,
            clients=len(self._counts),
            busiest=max(self._counts.values(), default=0),
            refused=self._refused,
            refusing=len(self._episodes),
        )
