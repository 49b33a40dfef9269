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
