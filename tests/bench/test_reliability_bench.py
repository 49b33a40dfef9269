"""The soak's fault clock and its readings of /metrics and the engines' outcome rings
(tools/bench/reliability.py)."""

from __future__ import annotations

import random

import pytest
import reliability
from prometheus_client import CollectorRegistry, Counter, generate_latest

from tests.reliability.client import Exchange


def test_reload_counts_reads_each_outcome_and_nothing_else() -> None:
    registry = CollectorRegistry()
    reloads = Counter("narwhal_reloads", "reloads", ["outcome"], registry=registry)
    reloads.labels("applied").inc(2)
    reloads.labels("rejected").inc()
    # Another counter with the same label must not be mistaken for reloads.
    Counter("narwhal_refusals", "refusals", ["outcome"], registry=registry).labels("applied").inc(7)
    page = generate_latest(registry).decode()
    assert reliability.reload_counts(page) == {"applied": 2, "rejected": 1}
    assert reliability.reload_counts("") == {}


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_faults_are_armed_only_on_engines_in_placement(dialect: str) -> None:
    rng = random.Random(3)
    for placed in ({0, 2}, {1, 3}, {0, 1, 3}, {1}, {2, 3}):
        drawn = [reliability.random_fault(rng, dialect, placed) for _ in range(400)]
        armed = [d for d in drawn if d is not None]
        assert {index for index, _ in armed} <= placed
        for index, fault in armed:
            # Every fault but a down names the leg of its engine's role.
            assert fault.get("leg", reliability.ROLES[index]) == reliability.ROLES[index]
        if {0, 1} & placed and {2, 3} & placed:
            assert drawn.count(None) == 0
    # A kind whose role has no engine in placement arms nothing rather than aiming at an
    # engine the router only sends its verification legs to.
    only_prefill = [reliability.random_fault(rng, dialect, {0}) for _ in range(400)]
    assert any(d is None for d in only_prefill)
    assert {d[0] for d in only_prefill if d is not None} == {0}
    assert all(reliability.random_fault(rng, dialect, set()) is None for _ in range(50))


def test_in_placement_maps_available_engines_to_the_soaks_indexes() -> None:
    engines = [{"id": "p0"}, {"id": "p1"}, {"id": "d2"}, {"id": "d3"}]
    state = {
        "engines": [
            {"id": "d3", "available": True},
            {"id": "p0", "available": False},
            {"id": "p1", "available": True},
            {"id": "d2", "available": False},
        ]
    }
    assert reliability.in_placement(state, engines) == {1, 3}


def _exchange(status: int, body: bytes) -> Exchange:
    return Exchange(
        request_id="soak-1",
        stream=False,
        status=status,
        headers={"content-type": "application/json"},
        body=body,
        complete=True,
    )


def test_a_refusal_for_want_of_an_engine_draws_no_fault() -> None:
    refused = (
        b'{"error": {"message": "no prefill engine", "type": "x", "code": "no_engine_available"}}'
    )
    failed = b'{"error": {"message": "gone", "type": "x", "code": "engine_unreachable"}}'
    assert not reliability.served(_exchange(503, refused))
    assert reliability.served(_exchange(502, failed))
    assert reliability.served(_exchange(200, b'{"choices": []}'))


def test_legs_with_armed_faults_are_counted_by_whose_they_were() -> None:
    states = [
        {
            "outcomes": [
                {"request_id": "soak-4", "armed_fault": True},
                {"request_id": "soak-5", "armed_fault": False},
                {"request_id": "narwhal-verify-p0-7", "armed_fault": True},
            ]
        },
        {"outcomes": [{"request_id": "narwhal-probe-d2-load-1", "armed_fault": True}]},
    ]
    assert reliability.legs_with_armed_faults(states) == {
        "serving": 1,
        "verification": 1,
        "other": 1,
    }


def test_verification_counts_give_the_failed_share_of_pairs_and_of_verdicts() -> None:
    registry = CollectorRegistry()
    verifications = Counter(
        "narwhal_verifications", "pairs", ["engine", "purpose", "outcome"], registry=registry
    )
    verifications.labels("p0", "readmission", "ok").inc(6)
    verifications.labels("d2", "breaker", "ok").inc(2)
    verifications.labels("p0", "readmission", "retried").inc(1)
    verifications.labels("d2", "readmission", "failed").inc(1)
    counts = reliability.verification_counts(generate_latest(registry).decode())
    assert counts == {
        "by_outcome": {"failed": 1, "ok": 8, "retried": 1},
        "pairs": 10,
        "failed_pairs": 2,
        "failed_pair_share": 0.2,
        "verdicts": 9,
        "failed_verdicts": 1,
        "failed_verdict_share": 0.1111,
    }


def test_shares_leave_refusals_for_want_of_an_engine_out_of_ok_of_served() -> None:
    outcomes = {
        "ok": 90,
        "error:no_engine_available": 8,
        "stream_error:no_engine_available": 2,
        "stream_error:engine_unreachable": 5,
        "hung_up": 5,
    }
    assert reliability.shares(outcomes) == {
        "ok": 0.8182,
        "no_engine_available": 0.0909,
        "ok_of_served": 0.9,
    }
    assert reliability.shares({}) == {"ok": None, "no_engine_available": None, "ok_of_served": None}
