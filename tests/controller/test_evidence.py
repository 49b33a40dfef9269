"""Manual 7.6: evidence gating for D-to-P consolidation, its resets, and the
rising-demand pause."""

from __future__ import annotations

from narwhal.config import Reactive
from narwhal.controller import (
    Arrival,
    DemandEstimator,
    EvidenceWindow,
    decide,
    evidence_view,
)

from .helpers import (
    DECODE_HEAVY,
    PREFILL_HEAVY,
    config,
    demand,
    fleet,
    opened_at,
    settled,
    snapshot,
)

RX = Reactive(evidence_span_s=60.0, evidence_max_span_s=120.0, evidence_min_arrivals=10)
NOW = 1000.0


def view(opened: float, now: float, short_arrivals: int, since_open: int | None = None):  # type: ignore[no-untyped-def]
    total = 1000
    at_open = total - (short_arrivals if since_open is None else since_open)
    short = demand(1.0, 100, 10, horizon=60.0, arrivals=short_arrivals)
    return evidence_view(
        EvidenceWindow(opened, at_open), arrivals_total=total, short=short, now=now, reactive=RX
    )


def test_window_closes_when_evidence_span_elapsed_with_min_arrivals() -> None:
    assert not view(0.0, 59.9, 10).closed
    v = view(0.0, 60.0, 10)
    assert v.closed
    assert v.samples == 10
    assert v.why == "span elapsed with samples"


def test_window_stays_open_under_sparse_traffic_until_evidence_max_span() -> None:
    v = view(0.0, 119.0, 9)
    assert not v.closed
    assert v.samples == 9
    v = view(0.0, 120.0, 0)
    assert v.closed
    assert v.why == "maximum span elapsed"


def test_samples_are_arrivals_in_the_span_since_the_window_opened() -> None:
    # the short horizon holds 30 arrivals, but only 4 came after the reset
    v = view(0.0, 70.0, 30, since_open=4)
    assert v.samples == 4
    assert not v.closed
    v = view(0.0, 30.0, 30, since_open=12)
    assert v.samples == 12
    assert not v.closed


def test_refusals_count_as_evidence_samples() -> None:
    est = DemandEstimator.from_config(RX, started_at=0.0)
    for i in range(10):
        est.record(Arrival(float(i), 100, 10, admitted=False))
    short, _ = est.estimates(60.0)
    v = evidence_view(
        EvidenceWindow(0.0, 0), arrivals_total=est.total, short=short, now=60.0, reactive=RX
    )
    assert v.closed
    assert v.samples == 10


def test_d2p_consolidation_requires_closed_evidence_window() -> None:
    snap = snapshot(fleet("PPDDDDDD"), PREFILL_HEAVY)
    cfg = config()
    d = decide(snap, opened_at(NOW - 10.0, snap.arrivals_total - 5), NOW, cfg)
    assert d.proposed.prefill == 3
    assert (d.result, d.gate) == ("blocked", "evidence")
    closed = decide(snap, settled(NOW), NOW, cfg)
    assert closed.result == "move"
    assert closed.move is not None


def test_first_token_timeout_resets_consolidation_evidence_window() -> None:
    snap = snapshot(fleet("PPDDDDDD"), PREFILL_HEAVY, first_token_timeouts=1)
    d = decide(snap, settled(NOW), NOW, config())
    assert d.state.evidence == EvidenceWindow(NOW, snap.arrivals_total)
    assert not d.evidence.closed
    assert d.gate == "evidence"


def test_p2d_recovery_move_resets_consolidation_evidence_window() -> None:
    snap = snapshot(fleet("PPDDDDDD"), PREFILL_HEAVY, p2d_recovery_moves=1)
    d = decide(snap, settled(NOW), NOW, config())
    assert d.state.evidence.opened_at == NOW
    assert d.gate == "evidence"


def test_decode_floor_recovery_move_resets_consolidation_evidence_window() -> None:
    engines = fleet("PPPD", d0={"decode_blocked": "drained"})
    snap = snapshot(engines, PREFILL_HEAVY)
    d = decide(snap, settled(NOW), NOW, config())
    assert d.caller == "floor-recovery"
    assert d.move is not None
    assert d.move.direction == "p2d"
    assert d.state.evidence == EvidenceWindow(NOW, snap.arrivals_total)


def test_ordinary_p2d_move_does_not_reset_evidence_window() -> None:
    snap = snapshot(fleet("PPPPDDDD"), DECODE_HEAVY)
    state = settled(NOW)
    decisions = []
    for i in range(3):
        d = decide(snap, state, NOW + 5 * i, config())
        state = d.state
        decisions.append(d)
    assert decisions[-1].result == "move"
    assert decisions[-1].move is not None
    assert decisions[-1].move.direction == "p2d"
    assert state.evidence == settled(NOW).evidence


def test_moves_toward_decode_proceed_while_evidence_is_accumulating() -> None:
    snap = snapshot(fleet("PPPPDDDD"), DECODE_HEAVY)
    state = opened_at(NOW - 1.0, snap.arrivals_total)
    results = []
    for i in range(3):
        d = decide(snap, state, NOW + 5 * i, config())
        state = d.state
        results.append((d.result, d.gate, d.evidence.closed))
    assert results == [
        ("confirming", "confirmations", False),
        ("confirming", "confirmations", False),
        ("move", None, False),
    ]


def test_rising_decode_demand_pauses_d2p_consolidation() -> None:
    long = demand(*PREFILL_HEAVY)
    short = demand(4.0, 400, 20, horizon=60.0)  # decode tokens/s doubled
    snap = snapshot(fleet("PPDDDDDD"), short=short, long=long)
    d = decide(snap, settled(NOW), NOW, config())
    assert d.demand_rising
    assert (d.result, d.gate) == ("blocked", "demand_rise")


def test_mixed_pressure_d2p_moves_are_evidence_gated_too() -> None:
    snap = snapshot(fleet("PPDDD"), (4.0, 400, 345), prefill_pressure=1.5)
    d = decide(snap, opened_at(NOW - 10.0, snap.arrivals_total - 5), NOW, config())
    assert d.proposed.prefill == 3
    assert (d.result, d.gate) == ("blocked", "evidence")


def test_a_replicas_weighted_arrivals_count_as_the_samples_it_saw() -> None:
    # A replica of three stands each arrival for three in the demand, but the evidence
    # gate needs evidence_min_arrivals real ones.
    est = DemandEstimator.from_config(RX, started_at=0.0)
    for i in range(4):
        est.record(Arrival(float(i), 100, 10, weight=3))
    short, _ = est.estimates(60.0)
    assert (short.arrivals, short.samples) == (12, 4)
    v = evidence_view(
        EvidenceWindow(0.0, 0), arrivals_total=est.total, short=short, now=60.0, reactive=RX
    )
    assert not v.closed
    assert v.samples == 4
    for i in range(4, 10):
        est.record(Arrival(float(i), 100, 10, weight=3))
    short, _ = est.estimates(60.0)
    assert short.rate == 30 / 60.0  # the fleet's rate
    assert evidence_view(
        EvidenceWindow(0.0, 0), arrivals_total=est.total, short=short, now=60.0, reactive=RX
    ).closed
