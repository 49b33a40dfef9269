"""Manual 7.7 reactive parameters: step_s and the guarded breach-step evaluation,
panic_ratio, dwell_s, min_arrivals, demand_floor, the decode correction, and 7.4
advisory mode."""

from __future__ import annotations

import attrs
import pytest

from narwhal.controller import CandidateKey, Move, decide

from .helpers import (
    DECODE_HEAVY,
    DECODE_URGENT,
    PREFILL_HEAVY,
    config,
    demand,
    fleet,
    opened_at,
    settled,
    snapshot,
)

NOW = 1000.0
# Prefill-leaning but below expand on PPDDDDDD: prefill load 0.7 -> 0.533 at (3, 5).
PREFILL_MILD = (3.0, 400, 10)


def test_step_s_is_the_minimum_interval_between_scheduled_evaluations() -> None:
    snap = snapshot(fleet("PPPPDDDD"), DECODE_HEAVY)
    state = settled(NOW)
    callers = []
    for t in [NOW, NOW + 1, NOW + 2, NOW + 4.9, NOW + 5.0, NOW + 6.0, NOW + 10.0]:
        d = decide(snap, state, t, config(step_s=5.0))
        state = d.state
        callers.append(d.caller)
    assert callers == ["scheduled", "none", "none", "none", "scheduled", "none", "scheduled"]


def test_waiting_passes_keep_the_confirmation_sequence() -> None:
    snap = snapshot(fleet("PPPPDDDD"), DECODE_HEAVY)
    d1 = decide(snap, settled(NOW), NOW, config())
    d2 = decide(snap, d1.state, NOW + 1.0, config())
    assert (d2.caller, d2.result, d2.reason) == ("none", "waiting", "between_steps")
    assert d2.state.candidate == d1.state.candidate
    assert d2.state.confirmations == 1


def test_projected_ttft_breach_triggers_one_guarded_d2p_evaluation_between_steps() -> None:
    snap = snapshot(fleet("PPDDDDDD"), PREFILL_HEAVY, ttft_breach=True)
    state = settled(NOW, last_scheduled_at=NOW - 1.0)
    d = decide(snap, state, NOW, config())
    assert (d.caller, d.result) == ("breach-step", "move")
    assert d.move == Move("d0", "d2p")
    assert d.state.breach_step_used


def test_breach_step_runs_once_until_the_next_scheduled_evaluation() -> None:
    cfg = config()
    snap = snapshot(fleet("PPDDDDDD"), PREFILL_HEAVY, ttft_breach=True)
    early = opened_at(NOW - 1.0, snap.arrivals_total, last_scheduled_at=NOW - 1.0)
    d1 = decide(snap, early, NOW, cfg)
    assert d1.caller == "breach-step"
    assert d1.gate == "evidence"
    d2 = decide(snap, d1.state, NOW + 1.0, cfg)
    assert d2.caller == "none"
    d3 = decide(snap, d2.state, NOW + 4.0, cfg)  # step_s since NOW - 1
    assert d3.caller == "scheduled"
    assert not d3.state.breach_step_used
    d4 = decide(snap, d3.state, NOW + 5.0, cfg)
    assert d4.caller == "breach-step"


def test_measured_prefill_pressure_above_target_is_a_projected_ttft_breach() -> None:
    snap = snapshot(fleet("PPDDDDDD"), PREFILL_HEAVY, prefill_pressure=1.3)
    d = decide(snap, settled(NOW, last_scheduled_at=NOW - 1.0), NOW, config())
    assert d.caller == "breach-step"
    calm = attrs.evolve(snap, prefill_pressure=1.0)
    d = decide(calm, settled(NOW, last_scheduled_at=NOW - 1.0), NOW, config())
    assert d.caller == "none"


def test_breach_step_evaluates_only_the_d2p_direction() -> None:
    snap = snapshot(fleet("PPPPDDDD"), DECODE_URGENT, ttft_breach=True)
    key = CandidateKey("p2d", 3, 5, True, "ordinary")
    state = settled(NOW, last_scheduled_at=NOW - 1.0, candidate=key, confirmations=1)
    d = decide(snap, state, NOW, config())
    assert (d.caller, d.result, d.move) == ("breach-step", "hold", None)
    # no D-to-P proposal: the scheduled sequence is left alone
    assert d.state.candidate == key
    assert d.state.confirmations == 1


def test_breach_step_counts_as_a_confirmation() -> None:
    cfg = config()
    snap = snapshot(fleet("PPDDDDDD"), PREFILL_MILD)
    d1 = decide(snap, settled(NOW), NOW, cfg)
    assert (d1.result, d1.confirmations, d1.urgent) == ("confirming", 1, False)
    d2 = decide(attrs.evolve(snap, ttft_breach=True), d1.state, NOW + 1.0, cfg)
    assert (d2.caller, d2.confirmations) == ("breach-step", 2)
    d3 = decide(snap, d2.state, NOW + 5.0, cfg)
    assert (d3.caller, d3.result) == ("scheduled", "move")


def test_panic_ratio_bypasses_cooldown_while_prefill_is_below_shrink() -> None:
    snap = snapshot(fleet("PPPPDDDD"), DECODE_URGENT)  # decode load 1.42
    state = settled(NOW, last_p2d_at=NOW - 1.0)
    d = decide(snap, state, NOW, config(cooldown_s=10.0, panic_ratio=1.2))
    assert d.result == "move"
    assert d.move is not None
    assert d.move.direction == "p2d"
    d = decide(snap, state, NOW, config(cooldown_s=10.0, panic_ratio=2.0))
    assert (d.result, d.gate) == ("blocked", "cooldown")


def test_panic_needs_prefill_strictly_below_shrink() -> None:
    snap = snapshot(fleet("PPPPDDDD"), DECODE_URGENT)
    probe = decide(snap, settled(NOW), NOW, config())
    assert probe.loads.to_decode is not None
    at_shrink = probe.loads.to_decode.prefill_load
    cfg = config(cooldown_s=10.0, panic_ratio=1.2, shrink=at_shrink)
    d = decide(snap, settled(NOW, last_p2d_at=NOW - 1.0), NOW, cfg)
    # prefill at exactly shrink: P-to-D allowed, but not a panic bypass
    assert (d.result, d.gate) == ("blocked", "cooldown")


def test_panic_ratio_zero_disables_panic() -> None:
    snap = snapshot(fleet("PPPPDDDD"), DECODE_URGENT)
    d = decide(snap, settled(NOW, last_p2d_at=NOW - 1.0), NOW, config(panic_ratio=0.0))
    assert d.gate == "cooldown"


def test_dwell_s_is_minimum_residence_after_a_role_change() -> None:
    recent = {"since_role_change_s": 5.0}
    engines = fleet("PPPPDDDD", p0=recent, p1=recent, p2=recent, p3=recent)
    snap = snapshot(engines, DECODE_URGENT)
    d = decide(snap, settled(NOW), NOW, config(dwell_s=30.0))
    assert (d.result, d.gate) == ("blocked", "dwell")
    d = decide(snap, settled(NOW), NOW, config(dwell_s=5.0))
    assert d.result == "move"
    engines = fleet("PPDDDDDD", **dict.fromkeys(["d0", "d1", "d2", "d3", "d4", "d5"], recent))
    d = decide(snapshot(engines, PREFILL_HEAVY), settled(NOW), NOW, config(dwell_s=30.0))
    assert (d.result, d.gate) == ("blocked", "dwell")


def test_min_arrivals_is_required_for_a_decision() -> None:
    long = demand(*DECODE_URGENT, arrivals=9)
    snap = snapshot(
        fleet("PPPPDDDD"), long=long, short=demand(*DECODE_URGENT, horizon=60.0, arrivals=9)
    )
    key = CandidateKey("p2d", 3, 5, True, "ordinary")
    d = decide(snap, settled(NOW, candidate=key, confirmations=1), NOW, config(min_arrivals=10))
    assert (d.result, d.gate, d.reason) == ("blocked", "min_arrivals", "insufficient_arrivals")
    assert d.state.candidate is None
    assert decide(snap, settled(NOW), NOW, config(min_arrivals=9)).result == "move"


def test_demand_floor_is_the_minimum_demand_signal_priced() -> None:
    trickle = (0.1, 20, 100)  # 10 tokens/s of decode demand
    snap = snapshot(fleet("PPPPDDDD"), trickle)
    low = decide(snap, settled(NOW), NOW, config(demand_floor=0.05))
    high = decide(snap, settled(NOW), NOW, config(demand_floor=20.0))
    assert low.loads.current is not None
    assert high.loads.current is not None
    # at 20 req/s the trickle is priced like DECODE_HEAVY
    assert high.loads.current.decode_load == pytest.approx(0.25)
    assert low.loads.current.decode_load < 0.01


def test_decisions_need_a_profile_to_price_demand() -> None:
    snap = snapshot(fleet("PPPPDDDD"), DECODE_URGENT, mean_profile=None)
    d = decide(snap, settled(NOW), NOW, config())
    assert (d.result, d.gate, d.reason) == ("blocked", "no_profile", "no_profile")


def test_recent_token_intervals_apply_bounded_correction_to_projections() -> None:
    slow = {"decode_correction": 1.5}
    engines = fleet("PPPPDDDD", d0=slow, d1=slow, d2=slow, d3=slow)
    plain = decide(snapshot(fleet("PPPPDDDD"), DECODE_HEAVY), settled(NOW), NOW, config())
    corrected = decide(snapshot(engines, DECODE_HEAVY), settled(NOW), NOW, config())
    assert plain.loads.current is not None
    assert corrected.loads.current is not None
    assert corrected.loads.current.decode_load > plain.loads.current.decode_load


def test_advisory_mode_records_proposals_and_keeps_roles() -> None:
    snap = snapshot(fleet("PPPPDDDD"), DECODE_URGENT)
    state = settled(NOW)
    d = decide(snap, state, NOW, config(advisory=True))
    assert (d.result, d.gate, d.reason, d.caller) == (
        "advisory",
        "advisory",
        "expand_decode",
        "scheduled",
    )
    assert d.move == Move("p0", "p2d")
    assert (d.proposed.prefill, d.proposed.decode) == (3, 5)
    assert d.state.role_changed_at == ()
    assert d.state.last_p2d_at == state.last_p2d_at
