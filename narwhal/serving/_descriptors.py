"""listen.max_open_connections against the process's open-file limit (RLIMIT_NOFILE).

Every client connection is a descriptor, and so is everything else the daemon holds. With
the usual soft limit outside systemd (1024), accept() fails with EMFILE long before 4096
client connections, and engine connects fail too, which recovery would then blame on the
engines. So at start and at each reload the daemon works out the descriptors it may hold at
once (listen.max_open_connections plus `descriptor_reserve`), and raises the soft limit to
that if it is lower: any process may, up to the hard limit. The soft limit is never
lowered, and raised only as far as needed, not to the hard limit: the number in the log and
in /narwhal/state is then the one this sizing chose.

If even the hard limit is lower, the daemon keeps serving with fewer client connections
(`DescriptorBudget.effective`: the hard limit less the reserve), says so at WARNING with
both numbers, and shows both in /narwhal/state and on /metrics. That is the choice that
keeps the daemon's own guarantees: the engine pools and the control socket keep the
descriptors they need, a client over the lowered cap waits in the listen backlog as one
over the configured cap would (rather than being accepted and failing somewhere else), and
an operator with `narwhalctl` still gets in. Refusing to start would make a limit that is
merely tight an outage. But a cap at or under `serving.max_connections +
serving.queue_capacity` is one the loader refuses (configuration rule 16: every retained
request holds a connection, and the 429 at the ceiling and /health need one more), so then
the daemon does not start, or the reload is rejected, with a message naming the limit.

The reserve counts what the daemon may open besides client connections, at most, at once:

* each engine's two pools: the serving pool opens a connection only when it has no idle
  one, so it never holds more than serving.max_connections (its in-use bound), and the
  control pool likewise at most `engine.control_pool_size`. Idle connections stay in a
  pool, so the fleet's total is the sum over engines, not a share of the admitted
  requests;
* `OTHER_DESCRIPTORS`, itemised below. Not counted: an engine removed by a reload keeps
  its pools until its resident requests end (the margin absorbs a few; a reload that
  replaces the whole fleet under full load can briefly need more).
"""

from __future__ import annotations

import logging
import resource
from collections.abc import Callable
from types import MappingProxyType

import attrs

from ..config import Config
from ..ctl import MAX_CONNECTIONS as CTL_MAX_CONNECTIONS

log = logging.getLogger("narwhal.server")

UNLIMITED = resource.RLIM_INFINITY
# Connections the admin listener keeps open at once (a Prometheus scraper, a few
# operators): at the limit the one idle longest makes room, as on the client listener.
ADMIN_MAX_CONNECTIONS = 16

# Descriptors besides client connections and engine pools, each at its most at once.
OTHER_DESCRIPTORS_BY_USE = MappingProxyType(
    {
        # stdin, stdout, stderr (the log).
        "stdio": 3,
        # trio's epoll descriptor and its two wake-up socket pairs (measured).
        "event loop": 5,
        # Up to two listeners (IPv4 and IPv6 for a wildcard host), each with the
        # descriptor the accept loop duplicates to accept without yielding.
        "listening sockets": 4,
        # The same for the admin listener, its connections and a newcomer evicting one.
        "admin listener": 4 + ADMIN_MAX_CONNECTIONS + 1,
        # The listener, its MAX_CONNECTIONS clients and a newcomer evicting one of them.
        "control socket": 1 + CTL_MAX_CONNECTIONS + 1,
        "systemd notify socket": 1,
        # The config file, an engine's api_key_file (or the admin token or client keys
        # file: the loader reads one at a time), the profile store and its lock, read at
        # start and at a reload.
        "files": 4,
        # An engine given by host name is resolved in a worker thread (trio allows 40 at
        # once), each with a resolver socket and a file such as /etc/hosts open.
        "name resolution": 40 * 2,
        # Happy-eyeballs connects holding a socket per address for a moment, modules
        # imported late, anything this list misses.
        "margin": 64,
    }
)
OTHER_DESCRIPTORS = sum(OTHER_DESCRIPTORS_BY_USE.values())


class DescriptorLimitError(Exception):
    """The open-file limit leaves no room for the retained-request ceiling's connections."""


def descriptor_reserve(config: Config) -> int:
    """Descriptors `config` may need besides client connections (module docstring)."""
    engines = len(config.engines)
    per_engine = config.serving.max_connections + config.engine.control_pool_size(engines)
    return engines * per_engine + OTHER_DESCRIPTORS


def _room_for(limit: int, count: int) -> bool:
    return limit == UNLIMITED or limit >= count


def _text(limit: int) -> str:
    return "unlimited" if limit == UNLIMITED else str(limit)


@attrs.frozen(kw_only=True)
class OpenFiles:
    """The state document's `connections.open_files` (None: unlimited)."""

    soft: int | None
    hard: int | None
    needed: int
    reserve: int
    raised_from: int | None  # the soft limit found, when it was raised
    note: str | None  # why the soft limit could not be raised


@attrs.frozen
class DescriptorBudget:
    """Client connections against the open-file limit, as decided by `plan_descriptors`."""

    configured: int  # listen.max_open_connections
    reserve: int  # descriptors for everything else
    soft: int  # the soft RLIMIT_NOFILE in force once this is applied
    hard: int
    previous_soft: int  # the soft limit found
    effective: int  # the client connection limit in force (<= configured)
    # Why the soft limit could not be raised (setrlimit refused), or "".
    note: str = ""

    @property
    def needed(self) -> int:
        return self.configured + self.reserve

    @property
    def raised(self) -> bool:
        return self.soft != self.previous_soft

    @property
    def capped(self) -> bool:
        return self.effective < self.configured

    def open_files(self) -> OpenFiles:
        unlimited = {UNLIMITED: None}
        return OpenFiles(
            soft=unlimited.get(self.soft, self.soft),
            hard=unlimited.get(self.hard, self.hard),
            needed=self.needed,
            reserve=self.reserve,
            raised_from=unlimited.get(self.previous_soft, self.previous_soft)
            if self.raised
            else None,
            note=self.note or None,
        )


def plan_descriptors(*, configured: int, reserve: int, soft: int, hard: int) -> DescriptorBudget:
    """The soft limit to set and the client connection limit for `configured` client
    connections and `reserve` other descriptors, given the limits found (`UNLIMITED` for
    none). The soft limit is raised to what is needed, as far as the hard limit allows,
    and never lowered."""
    needed = configured + reserve
    if _room_for(soft, needed):
        new_soft = soft
    elif _room_for(hard, needed):
        new_soft = needed
    else:
        new_soft = hard
    effective = configured if _room_for(new_soft, needed) else min(configured, new_soft - reserve)
    return DescriptorBudget(
        configured=configured,
        reserve=reserve,
        soft=new_soft,
        hard=hard,
        previous_soft=soft,
        effective=effective,
    )


def check_budget(budget: DescriptorBudget, *, ceiling: int) -> None:
    """Raise DescriptorLimitError unless the budget's client connections exceed the
    retained-request ceiling (`ceiling`), as configuration rule 16 requires of
    listen.max_open_connections itself."""
    if budget.effective > ceiling:
        return
    which = "soft" if budget.note else "hard"
    limit = budget.soft if budget.note else budget.hard
    raise DescriptorLimitError(
        f"the {which} open-file limit (RLIMIT_NOFILE) is {_text(limit)}: with {budget.reserve} "
        f"descriptors for engine pools, sockets and files, it leaves room for "
        f"{max(0, budget.effective)} client connections, which must exceed "
        f"serving.max_connections + serving.queue_capacity = {ceiling}; "
        f"listen.max_open_connections={budget.configured} needs {budget.needed} in all: "
        f"raise the hard limit (LimitNOFILE= in the unit, ulimit -Hn) to at least that"
        + (f" ({budget.note})" if budget.note else "")
    )


def _get_nofile() -> tuple[int, int]:
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _set_nofile(soft: int, hard: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class OpenFileLimit:
    """The process's RLIMIT_NOFILE; tests pass their own `get` and `set`."""

    def __init__(
        self,
        get: Callable[[], tuple[int, int]] = _get_nofile,
        set: Callable[[int, int], None] = _set_nofile,  # noqa: A002
    ) -> None:
        self._get = get
        self._set = set

    def plan(self, config: Config) -> DescriptorBudget:
        """The budget for `config` under the limits in force, changing nothing (`narwhal
        validate` asks this too). Raises DescriptorLimitError when the limit leaves no
        room for the retained-request ceiling's connections."""
        soft, hard = self._get()
        budget = plan_descriptors(
            configured=config.listen.max_open_connections,
            reserve=descriptor_reserve(config),
            soft=soft,
            hard=hard,
        )
        check_budget(budget, ceiling=_ceiling(config))
        return budget

    def fit(self, config: Config) -> DescriptorBudget:
        """The budget for `config`, with the soft limit raised to it. Raises
        DescriptorLimitError, having changed nothing, when the limit leaves no room for
        the retained-request ceiling's connections."""
        budget = self.plan(config)
        if not budget.raised:
            return budget
        try:
            self._set(budget.soft, budget.hard)
        except (OSError, ValueError) as exc:
            # Linux refuses a soft limit above fs.nr_open even under an unlimited hard
            # limit; serve within the soft limit found, and say why.
            found = budget.previous_soft
            budget = attrs.evolve(
                plan_descriptors(
                    configured=budget.configured, reserve=budget.reserve, soft=found, hard=found
                ),
                hard=budget.hard,
                note=f"raising the soft limit to {budget.soft} failed: {exc}",
            )
            check_budget(budget, ceiling=_ceiling(config))
        return budget


def _ceiling(config: Config) -> int:
    return config.serving.max_connections + config.serving.queue_capacity


def capped_warning(budget: DescriptorBudget) -> str:
    """What a budget with fewer client connections than configured (`capped`) costs,
    and the fix: logged by the daemon, reported by `narwhal validate`."""
    return (
        f"listen.max_open_connections={budget.configured} does not fit the open-file limit "
        f"(RLIMIT_NOFILE, hard {_text(budget.hard)}): with {budget.reserve} descriptors for "
        f"engine pools, sockets and files, at most {budget.effective} client connections "
        f"are kept open; raise the hard limit (LimitNOFILE= in the unit, ulimit -Hn) to "
        f"{budget.needed} for all of them" + (f" ({budget.note})" if budget.note else "")
    )


def report(budget: DescriptorBudget, previous: DescriptorBudget | None) -> None:
    """Log what `budget` changed since `previous` (None: at start)."""
    extra: dict[str, object] = {
        "event": "open_file_limit",
        "configured": budget.configured,
        "limit": budget.effective,
        "soft": budget.soft,
        "hard": budget.hard,
        "reserve": budget.reserve,
    }
    if budget.raised:
        log.info(
            "raised the soft open-file limit (RLIMIT_NOFILE) from %s to %s: "
            "listen.max_open_connections=%d and %d for engine pools, sockets and files",
            _text(budget.previous_soft),
            _text(budget.soft),
            budget.configured,
            budget.reserve,
            extra={**extra, "outcome": "raised", "previous_soft": budget.previous_soft},
        )
    was_capped = previous is not None and previous.capped
    if budget.capped and not (
        was_capped
        and previous is not None
        and (previous.effective, previous.configured) == (budget.effective, budget.configured)
    ):
        log.warning(
            "%s",
            capped_warning(budget),
            extra={**extra, "outcome": "capped", "needed": budget.needed},
        )
    elif was_capped and not budget.capped:
        log.info(
            "listen.max_open_connections=%d is in force again: the open-file limit has room for it",
            budget.configured,
            extra={**extra, "outcome": "uncapped"},
        )
