"""Recovery's pure decisions, row by row: no sockets, no clock."""

from __future__ import annotations

from typing import get_args

import pytest

from narwhal.fleet import EngineState, Fleet
from narwhal.recovery import BreakerEvent, VerifyPair, VerifyResult
from narwhal.recovery._evidence import VerifyOutcome
from narwhal.recovery._transfer import TransferFailure, suspect
from narwhal.recovery._verify import BREAKER_EVENTS, attribute, backoff_wait, resent

from .fakes import config


def test_every_verification_outcome_moves_a_breaker() -> None:
    assert set(BREAKER_EVENTS) == set(get_args(VerifyOutcome))
    assert BREAKER_EVENTS == {
        "ok": BreakerEvent.VERIFY_OK,
        "failed": BreakerEvent.VERIFY_FAILED,
        "inconclusive": BreakerEvent.VERIFY_INCONCLUSIVE,
        # The engine refused Narwhal's key or the model: nothing said of its health.
        "refused": BreakerEvent.VERIFY_INCONCLUSIVE,
    }


@pytest.mark.parametrize(
    ("failed", "interval", "wait"),
    [
        (2, 1.0, 2.0),
        (3, 1.0, 4.0),
        (4, 1.0, 8.0),
        (5, 1.0, 8.0),  # at most _VERIFY_BACKOFF_MAX intervals
        (30, 0.5, 4.0),
        (3, 0.05, 0.2),
    ],
)
def test_readmission_backoff_doubles_up_to_its_cap(
    failed: int, interval: float, wait: float
) -> None:
    assert backoff_wait(failed, interval) == pytest.approx(wait)


@pytest.mark.parametrize(
    ("result", "sent_again"),
    [
        (VerifyResult("failed", "prefill leg on d0 returned HTTP 500"), True),
        (VerifyResult("failed", "no answer", deadline_s=2.0), False),  # waited its deadline
        (VerifyResult("ok", "completed"), False),
        (VerifyResult("inconclusive", "exhausted"), False),
        (VerifyResult("refused", "HTTP 401"), False),
    ],
)
def test_only_a_pair_that_failed_at_once_is_sent_again(
    result: VerifyResult, sent_again: bool
) -> None:
    assert resent(result) is sent_again


def _engines() -> dict[str, EngineState]:
    return {engine.id: engine for engine in Fleet(config())}


FAILED = "prefill on p0, decode on d0: decode leg on d0 returned HTTP 500"


@pytest.mark.parametrize(
    ("subject", "partner", "standby", "outcome", "culprit", "counted"),
    [
        # A local pair has nobody else to blame.
        ("d0", None, False, "failed", None, True),
        # An available partner is presumed sound: only its own failure excuses the subject.
        ("d0", "p0", False, "failed", None, True),
        ("d0", "p0", False, "failed", "d0", True),
        ("d0", "p0", False, "failed", "p0", False),
        # A standby partner is unverified itself: only the subject's own failure counts.
        ("d0", "p0", True, "failed", None, False),
        ("d0", "p0", True, "failed", "d0", True),
        ("d0", "p0", True, "failed", "p0", False),
        # Only failures are attributed.
        ("d0", "p0", True, "ok", None, True),
        ("d0", "p0", True, "inconclusive", None, True),
    ],
)
def test_a_failed_pair_counts_against_the_subject_only_when_it_may_be_its_own(
    subject: str,
    partner: str | None,
    standby: bool,
    outcome: VerifyOutcome,
    culprit: str | None,
    counted: bool,
) -> None:
    engines = _engines()
    other = engines[partner or subject]
    pair = VerifyPair(engines[subject], "decode", other, engines[subject], "r1", standby)
    result = VerifyResult(outcome, FAILED, culprit)
    judged = attribute(pair, result)
    if counted:
        assert judged is result
        return
    why = (
        f"the failure is {partner}'s own"
        if culprit == partner
        else f"either engine may have caused it, and {partner} is unverified itself"
    )
    assert judged == VerifyResult("inconclusive", f"{FAILED}; not counted against {subject}: {why}")


def _failures(*partners: str, first_leg: int = 1) -> list[TransferFailure]:
    return [(float(i), first_leg + i, partner) for i, partner in enumerate(partners)]


@pytest.mark.parametrize(
    ("failures", "legs_seen", "available", "share"),
    [
        # Fewer failures than the threshold: nobody is suspect.
        (_failures("d0", "d1"), 2, 2, None),
        # Three in a row with two partners: failed 3 of its last 3 legs.
        (_failures("d0", "d1", "d0"), 3, 2, (3, 3)),
        # Three failures among many answered legs: under failure_ratio of them.
        (_failures("d0", "d1", "d0", first_leg=1), 10, 2, None),
        # Exactly at the ratio (3 of its last 6 legs, at 0.5) counts; just under it does not.
        (_failures("d0", "d1", "d0", first_leg=3), 8, 2, (3, 6)),
        (_failures("d0", "d1", "d0", first_leg=3), 9, 2, None),
        # All with one partner while another was available: the partner may be at fault.
        (_failures("d0", "d0", "d0"), 3, 2, None),
        # All with the one partner available: that is all there is to pair with.
        (_failures("d0", "d0", "d0"), 3, 1, (3, 3)),
        # Only the last `threshold` failures count, and the legs since the first of them.
        (_failures("d0", "d0", "d0", "d1", "d0", first_leg=1), 6, 2, (3, 4)),
    ],
)
def test_an_engine_is_suspect_when_it_fails_its_transfers_with_whomever_it_is_paired(
    failures: list[TransferFailure],
    legs_seen: int,
    available: int,
    share: tuple[int, int] | None,
) -> None:
    decided = suspect(failures, legs_seen, threshold=3, ratio=0.5, available=lambda: available)
    assert decided == share
