"""The breaker state machine, row by row (pure: times are passed in, no clock)."""

from __future__ import annotations

import itertools

import pytest

from narwhal.recovery import (
    TRANSITIONS,
    Breaker,
    BreakerEvent,
    BreakerSettings,
    BreakerState,
)

C, OPEN, H = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN
F = BreakerEvent.FAILURE
ELAPSED = BreakerEvent.OPEN_ELAPSED
OK, BAD, UNSURE = (
    BreakerEvent.VERIFY_OK,
    BreakerEvent.VERIFY_FAILED,
    BreakerEvent.VERIFY_INCONCLUSIVE,
)
SETTINGS = BreakerSettings(failure_threshold=3, window_s=10.0, open_s=5.0)

# (name, [(event, time)], state after each step)
CASES: list[tuple[str, list[tuple[BreakerEvent, float]], list[BreakerState]]] = [
    ("failures below threshold stay closed", [(F, 0), (F, 1)], [C, C]),
    ("threshold within window opens", [(F, 0), (F, 1), (F, 2)], [C, C, OPEN]),
    ("threshold exactly at window edge opens", [(F, 0), (F, 5), (F, 10)], [C, C, OPEN]),
    ("failures spread wider than the window stay closed", [(F, 0), (F, 6), (F, 11)], [C, C, C]),
    ("the window slides", [(F, 0), (F, 6), (F, 11), (F, 12)], [C, C, C, OPEN]),
    ("open ignores failures", [(F, 0), (F, 0), (F, 0), (F, 1), (F, 2)], [C, C, OPEN, OPEN, OPEN]),
    (
        "open_elapsed before open_s is ignored",
        [(F, 0), (F, 0), (F, 0), (ELAPSED, 4.9)],
        [C, C, OPEN, OPEN],
    ),
    ("open_elapsed at open_s half-opens", [(F, 0), (F, 0), (F, 0), (ELAPSED, 5)], [C, C, OPEN, H]),
    (
        "half-open ignores failures",
        [(F, 0), (F, 0), (F, 0), (ELAPSED, 5), (F, 6)],
        [C, C, OPEN, H, H],
    ),
    (
        "verification passes: closed",
        [(F, 0), (F, 0), (F, 0), (ELAPSED, 5), (OK, 6)],
        [C, C, OPEN, H, C],
    ),
    (
        "verification fails: reopened",
        [(F, 0), (F, 0), (F, 0), (ELAPSED, 5), (BAD, 6)],
        [C, C, OPEN, H, OPEN],
    ),
    (
        "inconclusive verification changes nothing",
        [(F, 0), (F, 0), (F, 0), (ELAPSED, 5), (UNSURE, 6)],
        [C, C, OPEN, H, H],
    ),
    ("verification results while closed are ignored", [(OK, 0), (BAD, 1), (UNSURE, 2)], [C, C, C]),
    ("open_elapsed while closed is ignored", [(ELAPSED, 100)], [C]),
    (
        "closing forgets old failures",
        [(F, 0), (F, 0), (F, 0), (ELAPSED, 5), (OK, 6), (F, 7), (F, 7)],
        [C, C, OPEN, H, C, C, C],
    ),
    (
        "a reopened breaker waits a fresh open_s",
        [(F, 0), (F, 0), (F, 0), (ELAPSED, 5), (BAD, 6), (ELAPSED, 10), (ELAPSED, 11)],
        [C, C, OPEN, H, OPEN, OPEN, H],
    ),
]


@pytest.mark.parametrize(
    ("steps", "expected"), [(s, e) for _, s, e in CASES], ids=[name for name, _, _ in CASES]
)
def test_transitions(steps: list[tuple[BreakerEvent, float]], expected: list[BreakerState]) -> None:
    breaker = Breaker("d0", "decode", SETTINGS)
    seen = []
    for event, at in steps:
        before = breaker.state
        transition = breaker.handle(event, at, "detail")
        seen.append(breaker.state)
        if breaker.state is before:
            assert transition is None
        else:
            assert transition is not None
            assert (transition.old, transition.new, transition.event) == (
                before,
                breaker.state,
                event,
            )
            assert transition.engine == "d0"
            assert transition.phase == "decode"
    assert seen == expected


def test_every_state_event_pair_is_in_the_table_or_deliberately_absent() -> None:
    # The absent pairs are exactly the ones that cannot change a verdict.
    absent = {
        pair for pair in itertools.product(BreakerState, BreakerEvent) if pair not in TRANSITIONS
    }
    assert absent == {
        (C, ELAPSED),
        (C, OK),
        (C, BAD),
        (C, UNSURE),
        (OPEN, OK),
        (OPEN, BAD),
        (OPEN, UNSURE),
        (H, ELAPSED),
        # Successes are only counted (for failure_ratio), never a move.
        (C, BreakerEvent.SUCCESS),
        (OPEN, BreakerEvent.SUCCESS),
        (H, BreakerEvent.SUCCESS),
    }


def test_open_and_half_open_block_with_a_reason_closed_does_not() -> None:
    breaker = Breaker("p0", "prefill", SETTINGS)
    assert breaker.blocked(0) is None
    for _ in range(3):
        breaker.handle(F, 0, "prefill engine p0 returned HTTP 500")
    assert breaker.blocked(0) == "prefill breaker open"
    assert breaker.due() == 5.0
    breaker.handle(ELAPSED, 5)
    assert breaker.blocked(5) == "prefill breaker half-open (verifying)"
    assert breaker.due() is None


def test_reasons_name_the_setting_and_the_value() -> None:
    breaker = Breaker("p0", "prefill", SETTINGS)
    breaker.handle(F, 0, "x")
    breaker.handle(F, 0, "x")
    transition = breaker.handle(F, 0, "prefill engine p0 returned HTTP 500")
    assert transition is not None
    assert transition.reason == (
        "3 counted prefill failures, at least recovery.breaker.failure_ratio=0.0 of its "
        "legs, within recovery.breaker.window_s=10.0 "
        "(last: prefill engine p0 returned HTTP 500)"
    )
    transition = breaker.handle(ELAPSED, 5)
    assert transition is not None
    assert transition.reason == "open for recovery.breaker.open_s=5.0; verifying"


def test_memory_is_bounded_by_the_threshold() -> None:
    breaker = Breaker("p0", "prefill", BreakerSettings(3, 0.5, 1.0))
    for i in range(10_000):
        breaker.handle(F, float(i), "x")  # one per second: never three within 0.5 s
    assert breaker.state is C
    assert len(breaker.failures) == 3


def test_reconfigure_keeps_state_and_recent_failures() -> None:
    breaker = Breaker("p0", "prefill", SETTINGS)
    breaker.handle(F, 0, "x")
    breaker.handle(F, 1, "x")
    breaker.configure(BreakerSettings(failure_threshold=2, window_s=10.0, open_s=1.0))
    assert list(breaker.failures) == [0, 1]
    breaker.handle(F, 2, "x")
    assert breaker.state is OPEN
    assert breaker.due() == 3.0


def test_a_busy_engine_with_rare_failures_stays_closed() -> None:
    settings = BreakerSettings(failure_threshold=3, window_s=10.0, open_s=5.0, failure_ratio=0.5)
    breaker = Breaker("d0", "decode", settings)
    for i in range(1000):  # 100 legs a second, one in fifty failing
        now = i / 100
        breaker.handle(F if i % 50 == 0 else BreakerEvent.SUCCESS, now, "x")
    assert breaker.state is C
    assert breaker.failures_in_window(10.0) == 3  # the count alone would have opened it
    assert len(breaker._legs) <= 12  # ten buckets per window, bounded at any rate


def test_failing_most_legs_opens_it_once_the_count_is_reached() -> None:
    settings = BreakerSettings(failure_threshold=3, window_s=10.0, open_s=5.0, failure_ratio=0.5)
    breaker = Breaker("d0", "decode", settings)
    breaker.handle(BreakerEvent.SUCCESS, 0.0)
    breaker.handle(F, 1.0, "x")
    breaker.handle(F, 2.0, "x")
    assert breaker.state is C  # 2 of 3 failed, but the count is not reached
    transition = breaker.handle(F, 3.0, "x")
    assert transition is not None
    assert breaker.state is OPEN  # 3 of 4 legs failed: 0.75 >= 0.5
