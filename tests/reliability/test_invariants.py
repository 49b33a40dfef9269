"""The leg checks on plain data: what aborts_seen accepts and what it flags."""

from __future__ import annotations

import json

from .client import Exchange
from .invariants import RACE_SLACK_S, Leg, Report, check_legs, verdict

ENDED = 1_000.0  # the client's end, wall clock


def timed_out_stream(request_id: str) -> Exchange:
    """A stream the router ended with first_token_timeout: it cancelled the decode leg."""
    error = {"error": {"message": "m", "type": "t", "param": None, "code": "first_token_timeout"}}
    return Exchange(
        request_id=request_id,
        stream=True,
        status=200,
        headers={"content-type": "text/event-stream"},
        body=b"data: " + json.dumps(error).encode() + b"\n\n",
        complete=True,
        ended_wall=ENDED,
    )


def decode_leg(request_id: str, outcome: str, wall: float | None) -> Leg:
    return Leg("d0", request_id, "decode", outcome, 200, 0, 0.0, True, wall=wall)


def test_a_cancelled_leg_must_end_aborted_unless_the_engine_ended_it_first() -> None:
    cases = {
        "aborted": decode_leg("aborted", "aborted", ENDED),
        # The engine failed the leg itself as the router gave up: a race, nothing leaked.
        "raced": decode_leg("raced", "error", ENDED - 0.01),
        "raced-late-read": decode_leg("raced-late-read", "error", ENDED + RACE_SLACK_S / 2),
        # Long after the client's end: the engine was still working on a cancelled leg.
        "leaked": decode_leg("leaked", "ok", ENDED + 2.0),
        # No wall clock in the record: outcome alone, as before.
        "unknown": decode_leg("unknown", "error", None),
    }
    exchanges = [timed_out_stream(name) for name in cases]
    verdicts = {ex.request_id: verdict(ex) for ex in exchanges}
    report = Report()
    check_legs(report, exchanges, verdicts, {name: [leg] for name, leg in cases.items()})
    aborts = report.checks["aborts_seen"]
    assert aborts.notes == {"expected": 5, "seen": 1, "engine_first": 2}
    flagged = sorted(v.split(" ")[0] for v in aborts.violations)
    assert flagged == ["leaked", "unknown"]


def committed_stream(request_id: str, head_wall: float) -> Exchange:
    """A stream that ended well after output, its head read at `head_wall`."""
    chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": None}]}
    return Exchange(
        request_id=request_id,
        stream=True,
        status=200,
        headers={"content-type": "text/event-stream"},
        body=b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n",
        complete=True,
        head_wall=head_wall,
        ended_wall=ENDED,
    )


def test_a_decode_leg_that_ended_before_the_commit_is_no_retry_after_output() -> None:
    head = ENDED - 0.5
    cases = {
        # SGLang: the first pair's decode leg failed with its prefill, before the stream
        # was committed; the retry's leg served the stream. Its output waited for its
        # prefill's answer, so that leg may end before the head reaches the client too.
        "before-commit": [
            decode_leg("before-commit", "error", head - 0.1),
            decode_leg("before-commit", "ok", head - 0.01),
        ],
        "aborted-before-commit": [
            decode_leg("aborted-before-commit", "aborted", head - 0.05),
            decode_leg("aborted-before-commit", "ok", ENDED),
        ],
        # A leg that failed after the commit, then another one: a retry after output.
        "after-commit": [
            decode_leg("after-commit", "error", head + 0.1),
            decode_leg("after-commit", "ok", ENDED),
        ],
        "no-wall-clock": [
            decode_leg("no-wall-clock", "error", None),
            decode_leg("no-wall-clock", "ok", None),
        ],
        "none": [],
    }
    exchanges = [committed_stream(name, head) for name in cases]
    verdicts = {ex.request_id: verdict(ex) for ex in exchanges}
    report = Report()
    check_legs(report, exchanges, verdicts, cases)
    retry = report.checks["no_retry_after_output"]
    assert retry.checked == 5
    flagged = sorted(v.split(":")[0] for v in retry.violations)
    assert flagged == ["after-commit", "no-wall-clock", "none"]


def test_a_leg_the_engine_ended_after_the_response_outlived_its_request() -> None:
    def prefill_leg(request_id: str, outcome: str, wall: float) -> Leg:
        return Leg("p0", request_id, "prefill", outcome, 200, 0, 0.0, True, wall=wall)

    cases = {
        # An SGLang pair whose decode failed: the router cancelled the prefill, which
        # recorded the close after the client had its answer.
        "closed": prefill_leg("closed", "aborted", ENDED + 1.0),
        "done-first": prefill_leg("done-first", "ok", ENDED - 0.2),
        "raced": prefill_leg("raced", "error", ENDED + RACE_SLACK_S / 2),
        # Left waiting in its bootstrap room until the engine gave up on it.
        "left-behind": prefill_leg("left-behind", "error", ENDED + 15.0),
        "hung-up": prefill_leg("hung-up", "ok", ENDED + 2.0),
    }
    exchanges = [timed_out_stream(name) for name in cases]
    exchanges[-1].hung_up = "after 1 events"
    verdicts = {ex.request_id: verdict(ex) for ex in exchanges}
    report = Report()
    check_legs(report, exchanges, verdicts, {name: [leg] for name, leg in cases.items()})
    within = report.checks["legs_end_with_request"]
    assert within.checked == 4
    assert [v.split(" ")[0] for v in within.violations] == ["left-behind"]
