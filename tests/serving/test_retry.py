"""`next_attempt`, without sockets or a clock: whether a failed attempt is retried, after
how long and without which engines (docs/design.md#retries)."""

from __future__ import annotations

import copy

import pytest

from narwhal._errors import EngineFailed, Exclude
from narwhal.config import Serving
from narwhal.serving._failure import FAILURE_POLICY, FailureKind, leg_failure
from narwhal.serving._retry import GiveUp, Reason, Retry, Tried, next_attempt

K = FailureKind
SERVING = Serving(max_attempts=3, retry_base_s=0.1, retry_cap_s=1.0)
# A P/D pair: prefill on p0, decode on d0.
PREFILL, DECODE = "p0", "d0"
# Engine statuses for the rows that pass one on.
STATUS = {
    K.REFUSED: 400,
    K.BUSY: 429,
    K.TIMED_OUT: 408,
    K.ENGINE_ERROR: 503,
    K.UNEXPECTED_STATUS: 501,
}


def failure(kind: FailureKind, engine: str = DECODE, phase: str = "decode") -> EngineFailed:
    return leg_failure(
        kind,
        f"{phase} engine {engine}: it failed",
        public=f"{phase} engine: it failed",
        engine_id=engine,
        phase=phase,
        engine_status=STATUS.get(kind),
    )


def decide(
    failed: EngineFailed,
    tried: Tried | None = None,
    *,
    visible: bool = False,
    budget: float = 10.0,
    deadline: float = 100.0,
    now: float = 0.0,
    jitter: float = 0.5,
    prefill: str | None = PREFILL,
) -> Retry | GiveUp:
    return next_attempt(
        failed,
        tried or Tried(),
        prefill=prefill,
        visible=visible,
        serving=SERVING,
        budget_credits=budget,
        deadline=deadline,
        now=now,
        jitter=jitter,
    )


# What a retry of each row leaves out, after a decode leg's failure on d0 of the pair.
LEFT_OUT = {
    Exclude.ENGINE: Tried(2, excluded=frozenset({DECODE})),
    Exclude.NOTHING: Tried(2),
    Exclude.PAIR_PREFILL: Tried(2, avoided=frozenset({PREFILL})),
}


@pytest.mark.parametrize("kind", list(FailureKind))
def test_each_row_retries_as_the_table_says_leaving_out_what_it_says(kind: FailureKind) -> None:
    rule = FAILURE_POLICY[kind]
    decision = decide(failure(kind))
    if rule.retry:
        assert decision == Retry(0.05, LEFT_OUT[rule.exclude])
    else:
        assert decision == GiveUp(Reason.PERMANENT)


@pytest.mark.parametrize("kind", [k for k, rule in FAILURE_POLICY.items() if rule.retry])
def test_output_the_client_has_seen_is_never_retried(kind: FailureKind) -> None:
    assert decide(failure(kind), visible=True) == GiveUp(Reason.OUTPUT_VISIBLE)


def test_the_last_attempt_is_not_retried() -> None:
    transient = failure(K.CONNECTION_LOST)
    assert isinstance(decide(transient, Tried(2)), Retry)
    assert decide(transient, Tried(3)) == GiveUp(Reason.ATTEMPTS_SPENT)


def test_an_exhausted_budget_gives_up_saying_so() -> None:
    transient = failure(K.ENGINE_ERROR)
    assert isinstance(decide(transient, budget=1.0), Retry)
    assert decide(transient, budget=0.99) == GiveUp(
        Reason.BUDGET_EXHAUSTED, " (retry budget exhausted)"
    )


def test_a_retry_whose_backoff_reaches_the_deadline_is_not_made() -> None:
    transient = failure(K.FIRST_TOKEN_TIMEOUT)
    # jitter 0.5 of the first retry's ceiling (serving.retry_base_s=0.1): 0.05 s.
    assert isinstance(decide(transient, now=9.949, deadline=10.0), Retry)
    assert decide(transient, now=9.95, deadline=10.0) == GiveUp(Reason.DEADLINE)
    assert decide(transient, now=10.0, deadline=10.0, jitter=0.0) == GiveUp(Reason.DEADLINE)


def test_the_rules_apply_in_order() -> None:
    # Each situation breaks every rule from its own on: the first rule names the reason.
    def late(failed: EngineFailed, tried: Tried, visible: bool = False) -> Retry | GiveUp:
        return decide(failed, tried, visible=visible, budget=0.0, now=10.0, deadline=10.0)

    permanent, transient = failure(K.BAD_STREAM), failure(K.TRUNCATED)
    assert late(permanent, Tried(3), visible=True) == GiveUp(Reason.OUTPUT_VISIBLE)
    assert late(permanent, Tried(3)) == GiveUp(Reason.PERMANENT)
    assert late(transient, Tried(3)) == GiveUp(Reason.ATTEMPTS_SPENT)
    # The budget before the deadline: the client is told at once.
    assert late(transient, Tried(1)) == GiveUp(Reason.BUDGET_EXHAUSTED, " (retry budget exhausted)")
    assert decide(transient, now=10.0, deadline=10.0) == GiveUp(Reason.DEADLINE)


@pytest.mark.parametrize(
    ("attempts", "jitter", "backoff_s"),
    [(1, 1.0, 0.1), (2, 1.0, 0.2), (3, 0.5, 0.2), (5, 1.0, 1.0), (5, 0.0, 0.0)],
)
def test_the_backoff_is_full_jitter_under_an_exponential_capped_ceiling(
    attempts: int, jitter: float, backoff_s: float
) -> None:
    decision = next_attempt(
        failure(K.UNREACHABLE),
        Tried(attempts),
        prefill=None,
        visible=False,
        serving=Serving(max_attempts=9, retry_base_s=0.1, retry_cap_s=1.0),
        budget_credits=1.0,
        deadline=100.0,
        now=0.0,
        jitter=jitter,
    )
    assert isinstance(decision, Retry)
    assert decision.backoff_s == pytest.approx(backoff_s)


def test_a_prefill_failure_leaves_out_the_prefill_engine_not_its_decode_partner() -> None:
    # docs/design.md#retries: every retry starts with a fresh prefill, on another engine
    # where one can take it. The failure is the prefill engine's, in the prefill phase:
    # that engine and phase are charged (recovery counts `phase`'s breaker of `engine_id`).
    for kind in (K.PREFILL_TIMEOUT, K.CONNECTION_LOST, K.ENGINE_ERROR, K.UNREACHABLE):
        failed = failure(kind, PREFILL, "prefill")
        assert (failed.engine_id, failed.phase, failed.counts_against_engine) == (
            PREFILL,
            "prefill",
            True,
        )
        decision = decide(failed)
        assert isinstance(decision, Retry)
        assert decision.tried == Tried(2, excluded=frozenset({PREFILL}))


def test_a_failed_transfer_avoids_the_pairs_prefill_whichever_server_reported_it() -> None:
    for engine, phase in ((PREFILL, "prefill"), (DECODE, "decode")):
        failed = failure(K.TRANSFER_FAILED, engine, phase)
        assert not failed.counts_against_engine  # neither server is charged
        decision = decide(failed)
        assert isinstance(decision, Retry)
        assert decision.tried == Tried(2, avoided=frozenset({PREFILL}))


def test_exclusions_accumulate_over_retries() -> None:
    first = decide(failure(K.PREFILL_TIMEOUT, PREFILL, "prefill"))
    assert isinstance(first, Retry)
    second = decide(failure(K.TRANSFER_FAILED, DECODE, "decode"), first.tried, prefill="p1")
    assert isinstance(second, Retry)
    assert second.tried == Tried(3, frozenset({PREFILL}), frozenset({"p1"}))


def test_the_failure_is_judged_not_changed() -> None:
    failed = failure(K.ENGINE_ERROR)
    before = copy.copy(failed.__dict__)
    for budget in (10.0, 0.0):
        decide(failed, budget=budget)
    assert failed.__dict__ == before
    assert failed.message == "decode engine d0: it failed"
