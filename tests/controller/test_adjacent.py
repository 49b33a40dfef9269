"""Manual 7.5: adjacent-split decisions, shrink, movement margin, the mixed-pressure
rule, confirmations and their resets, and P-to-D rules."""

from __future__ import annotations

import math

import attrs
import pytest

from narwhal.controller import CandidateKey, Move, decide

from .helpers import (
    DECODE_HEAVY,
    DECODE_URGENT,
    PREFILL_HEAVY,
    config,
    fleet,
    opened_at,
    run_passes,
    settled,
    snapshot,
)

NOW = 1000.0
STEPS = [NOW + 5.0 * i for i in range(6)]
# Prefill-bound, but one decode engine fewer leaves decode at 0.5565 > shrink 0.5:
# on PPDDD, current worst 1.2 (prefill), split (3, 2) worst 0.629.
MIXED = (4.0, 400, 345)


def test_controller_evaluates_the_current_and_each_adjacent_split() -> None:
    d = decide(snapshot(fleet("PPPPDDDD"), DECODE_HEAVY), settled(NOW), NOW, config())
    loads = d.loads
    assert loads.current is not None
    assert loads.to_prefill is not None
    assert loads.to_decode is not None
    assert [(s.prefill, s.decode) for s in (loads.current, loads.to_prefill, loads.to_decode)] == [
        (4, 4),
        (5, 3),
        (3, 5),
    ]
    assert loads.current.decode_load == pytest.approx(0.25)
    assert loads.to_decode.decode_load == pytest.approx(1 / 6)
    assert (d.proposed.prefill, d.proposed.decode) == (3, 5)


def test_ordinary_consolidation_requires_projected_source_at_or_below_shrink() -> None:
    d = decide(snapshot(fleet("PPDDD"), MIXED), settled(NOW), NOW, config())
    assert d.loads.to_prefill is not None
    assert d.loads.to_prefill.decode_load == pytest.approx(0.5565, rel=1e-3)
    assert (d.result, d.gate) == ("blocked", "shrink")
    # with shrink above the projected source load the same move is ordinary
    d = decide(snapshot(fleet("PPDDD"), MIXED), settled(NOW), NOW, config(shrink=0.6))
    assert (d.result, d.rule) == ("move", "ordinary")


def test_ordinary_consolidation_at_exactly_shrink_is_allowed() -> None:
    # "at or below": the boundary itself passes, the next float below it does not.
    probe = decide(snapshot(fleet("PPDDD"), MIXED), settled(NOW), NOW, config())
    assert probe.loads.to_prefill is not None
    at = probe.loads.to_prefill.decode_load
    d = decide(snapshot(fleet("PPDDD"), MIXED), settled(NOW), NOW, config(shrink=at))
    assert (d.result, d.rule) == ("move", "ordinary")
    below = math.nextafter(at, 0.0)
    d = decide(snapshot(fleet("PPDDD"), MIXED), settled(NOW), NOW, config(shrink=below))
    assert (d.result, d.gate) == ("blocked", "shrink")


def test_mixed_pressure_rule_moves_decode_to_prefill_above_shrink() -> None:
    snap = snapshot(fleet("PPDDD"), MIXED, prefill_pressure=1.0)
    decisions = run_passes(snap, settled(NOW), config(), STEPS[:3])
    assert [d.result for d in decisions] == ["confirming", "confirming", "move"]
    assert all(d.rule == "mixed-pressure" and d.reason == "mixed_pressure" for d in decisions)
    assert decisions[0].urgent  # urgent, yet mixed-pressure moves still need confirmations
    assert decisions[-1].move == Move("d0", "d2p")


def test_mixed_pressure_rule_needs_measured_prefill_pressure_at_expand() -> None:
    snap = snapshot(fleet("PPDDD"), MIXED, prefill_pressure=0.99)
    d = decide(snap, settled(NOW), NOW, config())
    assert d.gate == "shrink"
    assert "< expand" in d.detail


def test_mixed_pressure_rule_requires_every_engine_to_have_a_profile() -> None:
    snap = snapshot(fleet("PPDDD", p1={"profile": None}), MIXED, prefill_pressure=1.5)
    d = decide(snap, settled(NOW), NOW, config())
    assert d.gate == "shrink"
    assert "profile" in d.detail


def test_mixed_pressure_move_must_improve_worst_ratio_by_movement_margin() -> None:
    snap = snapshot(fleet("PPDDD"), MIXED, prefill_pressure=1.5)
    # the improvement is 1.2 - 0.629 = 0.571
    d = decide(snap, settled(NOW), NOW, config(movement_margin=0.6))
    assert (d.result, d.reason) == ("hold", "balanced")
    d = decide(snap, settled(NOW), NOW, config(movement_margin=0.55))
    assert d.rule == "mixed-pressure"


def test_movement_margin_required_for_ordinary_consolidation() -> None:
    snap = snapshot(fleet("PPPDDDDD"), DECODE_HEAVY)
    # (3, 5) -> (2, 6): worst decode load 0.1667 -> 0.125, a reduction of 0.042
    d = decide(snap, settled(NOW), NOW, config(movement_margin=0.05))
    assert (d.result, d.reason, d.gate) == ("hold", "balanced", None)
    assert (d.proposed.prefill, d.proposed.decode) == (3, 5)
    d = decide(snap, settled(NOW), NOW, config(movement_margin=0.04))
    assert d.result == "confirming"
    assert (d.proposed.prefill, d.proposed.decode) == (2, 6)


def test_zero_movement_margin_still_requires_strictly_positive_improvement() -> None:
    snap = snapshot(fleet("PPPDDDDD"), DECODE_HEAVY)
    d = decide(snap, settled(NOW), NOW, config(movement_margin=0.0))
    assert d.result == "confirming"
    # at (1, 7) no adjacent split improves at all: held even with a zero margin
    d = decide(
        snapshot(fleet("PDDDDDDD"), DECODE_HEAVY), settled(NOW), NOW, config(movement_margin=0.0)
    )
    assert d.loads.to_prefill is not None
    assert d.loads.current is not None
    assert d.loads.to_prefill.worst > d.loads.current.worst
    assert d.result == "hold"


@pytest.mark.parametrize(
    ("confirmations", "sustained", "required"),
    [(2, 3, 3), (4, 1, 4), (1, 1, 1), (3, 3, 3)],
)
def test_confirmations_required_are_max_of_confirmations_and_sustained_intervals(
    confirmations: int, sustained: int, required: int
) -> None:
    snap = snapshot(fleet("PPPPDDDD"), DECODE_HEAVY)  # nonurgent P-to-D
    cfg = config(confirmations=confirmations, sustained_intervals=sustained)
    decisions = run_passes(snap, settled(NOW), cfg, STEPS)
    first_move = next(i for i, d in enumerate(decisions) if d.result == "move")
    assert first_move == required - 1
    assert decisions[0].required == required


def test_confirmation_rule_also_applies_when_demand_evidence_is_complete() -> None:
    snap = snapshot(fleet("PPPPDDDD"), DECODE_HEAVY)
    d = decide(snap, settled(NOW), NOW, config())
    assert d.evidence.closed
    assert not d.urgent
    assert (d.result, d.confirmations, d.required) == ("confirming", 1, 3)


def test_urgent_ordinary_proposal_with_complete_demand_moves_on_first_evaluation() -> None:
    d = decide(snapshot(fleet("PPPPDDDD"), DECODE_URGENT), settled(NOW), NOW, config())
    assert d.urgent
    assert d.evidence.closed
    assert (d.result, d.reason, d.required) == ("move", "expand_decode", 1)
    assert d.move == Move("p0", "p2d")


def test_decode_slots_the_router_enforces_bound_the_projected_batch() -> None:
    # 3 decode engines need a steady batch of 20 streams each (load 0.5: not urgent).
    # With serving.decode_concurrency 8 that batch is never reached: the pool is
    # overloaded (1.5 at its 8 slots), so expanding decode is urgent and moves at once.
    free = decide(snapshot(fleet("PPPPPDDD"), DECODE_HEAVY), settled(NOW), NOW, config())
    assert free.loads.current is not None
    assert free.loads.current.decode_projection.active == pytest.approx(20.0)
    assert (free.result, free.urgent) == ("confirming", False)
    slots = {
        f"{role}{i}": {"decode_slots": 8} for role, n in (("p", 5), ("d", 3)) for i in range(n)
    }
    capped = decide(snapshot(fleet("PPPPPDDD", **slots), DECODE_HEAVY), settled(NOW), NOW, config())
    assert capped.loads.decode_slots == 8
    assert capped.loads.current is not None
    assert capped.loads.current.decode_load == pytest.approx(2000 / 3 * 0.018 / 8)
    assert (capped.result, capped.reason, capped.urgent) == ("move", "expand_decode", True)
    # One uncapped engine leaves every split uncapped (slots are averaged like profiles).
    slots["p0"] = {}
    mixed = decide(snapshot(fleet("PPPPPDDD", **slots), DECODE_HEAVY), settled(NOW), NOW, config())
    assert mixed.loads.decode_slots == float("inf")
    assert mixed.result == "confirming"


def test_incomplete_demand_proposals_need_confirmations() -> None:
    snap = snapshot(fleet("PPPPDDDD"), DECODE_URGENT)
    state = opened_at(NOW - 1.0, snap.arrivals_total)
    decisions = run_passes(snap, state, config(), STEPS[:3])
    assert [d.result for d in decisions] == ["confirming", "confirming", "move"]
    assert all(d.urgent and not d.evidence.closed for d in decisions)


def test_change_of_proposed_split_resets_confirmation_sequence() -> None:
    snap = snapshot(fleet("PPPPDDDD"), DECODE_HEAVY)
    other = CandidateKey("p2d", 2, 6, True, "ordinary")
    d = decide(snap, settled(NOW, candidate=other, confirmations=2), NOW, config())
    assert d.confirmations == 1
    assert d.state.candidate == CandidateKey("p2d", 3, 5, True, "ordinary")


def test_change_of_demand_completeness_resets_confirmation_sequence() -> None:
    snap = snapshot(fleet("PPPPDDDD"), DECODE_HEAVY)
    incomplete = CandidateKey("p2d", 3, 5, False, "ordinary")
    d = decide(snap, settled(NOW, candidate=incomplete, confirmations=2), NOW, config())
    assert d.confirmations == 1
    assert d.result == "confirming"
    complete = CandidateKey("p2d", 3, 5, True, "ordinary")
    d = decide(snap, settled(NOW, candidate=complete, confirmations=2), NOW, config())
    assert d.result == "move"


def test_change_of_eligibility_rule_resets_confirmation_sequence() -> None:
    snap = snapshot(fleet("PPDDD"), MIXED, prefill_pressure=1.5)
    ordinary = CandidateKey("d2p", 3, 2, True, "ordinary")
    d = decide(snap, settled(NOW, candidate=ordinary, confirmations=2), NOW, config())
    assert d.rule == "mixed-pressure"
    assert d.confirmations == 1
    mixed = CandidateKey("d2p", 3, 2, True, "mixed-pressure")
    d = decide(snap, settled(NOW, candidate=mixed, confirmations=2), NOW, config())
    assert d.result == "move"


def test_failed_eligibility_check_clears_the_candidate() -> None:
    snap = snapshot(fleet("PPPPDDDD"), DECODE_HEAVY)
    key = CandidateKey("p2d", 3, 5, True, "ordinary")
    state = settled(NOW, candidate=key, confirmations=2, last_p2d_at=NOW - 1.0)
    d = decide(snap, state, NOW, config(cooldown_s=10.0))
    assert (d.result, d.gate) == ("blocked", "cooldown")
    assert d.state.candidate is None
    assert d.state.confirmations == 0


def test_a_held_pass_clears_the_candidate() -> None:
    snap = snapshot(fleet("PPPDDDDD"), DECODE_HEAVY)
    key = CandidateKey("p2d", 2, 6, True, "ordinary")
    d = decide(snap, settled(NOW, candidate=key, confirmations=2), NOW, config())
    assert d.result == "hold"
    assert d.state.candidate is None


def test_p2d_requires_prefill_pressure_at_or_below_shrink() -> None:
    # TTFT 0.1 s: one prefill engine fewer leaves prefill at 1.2
    snap = snapshot(fleet("PPDDDD"), (20.0, 40, 170), ttft_s=0.1)
    d = decide(snap, settled(NOW), NOW, config(ttft_s=0.1))
    assert d.loads.to_decode is not None
    assert d.loads.to_decode.prefill_load > 0.5
    assert (d.proposed.prefill, d.proposed.decode) == (1, 5)
    assert (d.result, d.gate) == ("blocked", "shrink")


def test_p2d_obeys_decode_cooldown() -> None:
    snap = snapshot(fleet("PPPPDDDD"), DECODE_URGENT)
    d = decide(snap, settled(NOW, last_p2d_at=NOW - 3.0), NOW, config(cooldown_s=10.0))
    assert (d.result, d.gate) == ("blocked", "cooldown")
    d = decide(snap, settled(NOW, last_p2d_at=NOW - 10.0), NOW, config(cooldown_s=10.0))
    assert d.result == "move"


def test_cooldown_does_not_apply_to_d2p_moves() -> None:
    snap = snapshot(fleet("PPDDDDDD"), PREFILL_HEAVY)
    d = decide(snap, settled(NOW, last_p2d_at=NOW - 1.0), NOW, config(cooldown_s=10.0))
    assert d.result == "move"
    assert d.move is not None
    assert d.move.direction == "d2p"


def test_only_adjacent_splits_one_engine_per_move() -> None:
    d = decide(snapshot(fleet("PPPPPPPD"), DECODE_URGENT), settled(NOW), NOW, config())
    assert (d.current.prefill, d.current.decode) == (7, 1)
    assert (d.proposed.prefill, d.proposed.decode) == (6, 2)


def test_applied_move_records_dwell_and_cooldown_and_clears_candidate() -> None:
    d = decide(snapshot(fleet("PPPPDDDD"), DECODE_URGENT), settled(NOW), NOW, config())
    assert d.state.changed_at("p0") == NOW
    assert d.state.last_p2d_at == NOW
    assert d.state.candidate is None
    d = decide(snapshot(fleet("PPDDDDDD"), PREFILL_HEAVY), settled(NOW), NOW, config())
    assert d.state.changed_at("d0") == NOW
    assert d.state.last_p2d_at == settled(NOW).last_p2d_at


def test_p2d_candidate_has_least_predicted_prefill_work() -> None:
    engines = fleet(
        "PPPPDDDD",
        p0={"prefill_work_s": 0.3},
        p1={"prefill_work_s": 0.1, "prefill_inflight": 2},
        p2={"prefill_work_s": 0.1, "prefill_inflight": 1},
        p3={"prefill_work_s": 0.2},
    )
    snap = attrs.evolve(snapshot(engines, DECODE_URGENT), prefill_pressure=0.0)
    d = decide(snap, settled(NOW), NOW, config())
    assert d.move == Move("p2", "p2d")
