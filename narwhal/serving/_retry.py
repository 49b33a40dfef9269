"""Whether a request's failed attempt is tried again (docs/design.md#retries).

Owns
  `next_attempt`, its answers `Retry` and `GiveUp`, `Tried` (what the attempts so far
  leave the next one), and `GIVE_UP`, the rules it applies in order.

Invariants
  Pure: the caller passes the clock (`now`), the retry budget's credits and a uniform
  draw for the backoff's jitter, and does what the answer says (spends the credit,
  sleeps, places the retry). The failure is judged, never changed.
  A retry happens only before anything reached the client, for a transient failure
  (`FAILURE_POLICY`'s retry column, carried by `EngineFailed.retryable`), within
  serving.max_attempts complete attempts and one credit of serving.retry_budget, and
  only when its backoff ends before the request's deadline.
  A retry leaves out what the failure's row says (`EngineFailed.exclude`): the engine
  whose leg failed, so a prefill leg's failure leaves out the prefill engine, never its
  decode partner. Placement takes a left-out engine back when no other can serve.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import attrs

from .._errors import EngineFailed, Exclude
from ..admission import backoff_ceiling
from ..config import Serving


@attrs.frozen
class Tried:
    """`attempts`: how many the request has made, the current one included. `excluded`:
    engines whose leg failed. `avoided`: prefill servers of SGLang pairs whose KV transfer
    failed, given up after `excluded` when nothing else can serve (`_failure`)."""

    attempts: int = 1
    excluded: frozenset[str] = frozenset()
    avoided: frozenset[str] = frozenset()


@attrs.frozen
class Retry:
    """Sleep `backoff_s`, spend a credit, then make the attempt `tried` describes."""

    backoff_s: float
    tried: Tried


class Reason(enum.Enum):
    OUTPUT_VISIBLE = "output_visible"
    PERMANENT = "permanent"
    ATTEMPTS_SPENT = "attempts_spent"
    BUDGET_EXHAUSTED = "budget_exhausted"
    DEADLINE = "deadline"


@attrs.frozen
class GiveUp:
    """The failure ends the request; `note` goes at the end of its message."""

    reason: Reason
    note: str = ""


@attrs.frozen
class Situation:
    """What `next_attempt` judges, for the rules of `GIVE_UP`."""

    failure: EngineFailed
    tried: Tried
    visible: bool
    max_attempts: int
    credits: float
    backoff_s: float
    deadline: float
    now: float


def _visible(s: Situation) -> bool:
    # The client has seen output (a stream's 200, say): a retry would repeat or mix it.
    return s.visible


def _permanent(s: Situation) -> bool:
    return not s.failure.retryable


def _attempts_spent(s: Situation) -> bool:
    return s.tried.attempts >= s.max_attempts


def _no_credit(s: Situation) -> bool:
    return s.credits < 1.0


def _past_deadline(s: Situation) -> bool:
    # The request's deadline would end the backoff: the deadline answers the client
    # (`expired`), and no credit is spent on a retry that never starts.
    return s.now + s.backoff_s >= s.deadline


# Tried in order; the first that holds gives up. The budget comes before the deadline:
# a client whose retry the budget refuses is told so at once.
GIVE_UP: tuple[tuple[Callable[[Situation], bool], GiveUp], ...] = (
    (_visible, GiveUp(Reason.OUTPUT_VISIBLE)),
    (_permanent, GiveUp(Reason.PERMANENT)),
    (_attempts_spent, GiveUp(Reason.ATTEMPTS_SPENT)),
    (_no_credit, GiveUp(Reason.BUDGET_EXHAUSTED, " (retry budget exhausted)")),
    (_past_deadline, GiveUp(Reason.DEADLINE)),
)


def next_attempt(
    failure: EngineFailed,
    tried: Tried,
    *,
    prefill: str | None,
    visible: bool,
    serving: Serving,
    budget_credits: float,
    deadline: float,
    now: float,
    jitter: float,
) -> Retry | GiveUp:
    """What follows `failure` of the attempt `tried` describes, whose prefill leg ran on
    `prefill` (None: one engine served it). `visible`: output reached the client.
    `budget_credits`: the retry budget's level. `jitter`: uniform in [0, 1), the backoff's share
    of its ceiling (full jitter between serving.retry_base_s and serving.retry_cap_s)."""
    backoff_s = jitter * backoff_ceiling(
        tried.attempts, base_s=serving.retry_base_s, cap_s=serving.retry_cap_s
    )
    situation = Situation(
        failure, tried, visible, serving.max_attempts, budget_credits, backoff_s, deadline, now
    )
    for holds, give_up in GIVE_UP:
        if holds(situation):
            return give_up
    excluded, avoided = tried.excluded, tried.avoided
    if failure.exclude is Exclude.ENGINE:
        excluded |= {failure.engine_id}
    elif failure.exclude is Exclude.PAIR_PREFILL and prefill is not None:
        avoided |= {prefill}
    return Retry(backoff_s, Tried(tried.attempts + 1, excluded, avoided))
