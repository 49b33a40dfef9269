"""Manual 7.2: role floors, floor recovery, breaches and the safest reachable split."""

from __future__ import annotations

import attrs

from narwhal.controller import Move, decide

from .helpers import (
    DECODE_URGENT,
    PREFILL_HEAVY,
    config,
    fleet,
    opened_at,
    settled,
    snapshot,
)

NOW = 1000.0


def test_decode_floor_recovery_skips_cooldown() -> None:
    snap = snapshot(fleet("PPPD", d0={"decode_blocked": "drained"}), PREFILL_HEAVY)
    state = settled(NOW, last_p2d_at=NOW - 1.0)
    d = decide(snap, state, NOW, config(cooldown_s=10.0))
    assert (d.caller, d.result, d.reason) == ("floor-recovery", "move", "floor_recovery_decode")
    assert d.move == Move("p0", "p2d")
    assert d.state.last_p2d_at == NOW


def test_decode_floor_recovery_observes_dwell() -> None:
    cfg = config(dwell_s=30.0)
    recent = {"since_role_change_s": 5.0}
    engines = fleet("PPPD", p0=recent, p1=recent, p2=recent, d0={"decode_blocked": "drained"})
    d = decide(snapshot(engines, PREFILL_HEAVY), settled(NOW), NOW, cfg)
    assert (d.caller, d.result, d.gate) == ("floor-recovery", "breach", "dwell")
    engines = fleet("PPPD", p0=recent, p1=recent, d0={"decode_blocked": "drained"})
    d = decide(snapshot(engines, PREFILL_HEAVY), settled(NOW), NOW, cfg)
    assert d.move == Move("p2", "p2d")


def test_decode_floor_recovery_restores_one_eligible_engine_per_pass() -> None:
    cfg = config(min_decode=2)
    drained = {"decode_blocked": "drained"}
    engines = fleet("PPPPDD", d0=drained, d1=drained)
    d1 = decide(snapshot(engines, PREFILL_HEAVY), settled(NOW), NOW, cfg)
    assert d1.move == Move("p0", "p2d")
    assert d1.floors.breaches[0].live == 0
    # the live fleet now has p0 as a decode engine; one more pass restores the floor
    engines = (attrs.evolve(engines[0], role="decode", since_role_change_s=1.0), *engines[1:])
    d2 = decide(snapshot(engines, PREFILL_HEAVY), d1.state, NOW + 1.0, cfg)
    assert d2.move == Move("p1", "p2d")
    assert d2.caller == "floor-recovery"
    engines = (engines[0], attrs.evolve(engines[1], role="decode"), *engines[2:])
    d3 = decide(snapshot(engines, PREFILL_HEAVY), d2.state, NOW + 2.0, cfg)
    assert d3.caller != "floor-recovery"
    assert not d3.floors.breaches


def test_prefill_floor_recovery_ignores_cooldown_and_dwell() -> None:
    engines = fleet(
        "PDDD",
        p0={"prefill_blocked": "quarantined", "decode_blocked": "quarantined"},
        d0={"since_role_change_s": 1.0},
        d1={"since_role_change_s": 1.0},
        d2={"since_role_change_s": 1.0},
    )
    state = settled(NOW, last_p2d_at=NOW - 1.0)
    d = decide(snapshot(engines, PREFILL_HEAVY), state, NOW, config(dwell_s=60.0))
    assert (d.caller, d.result, d.reason) == ("floor-recovery", "move", "floor_recovery_prefill")
    assert d.move == Move("d0", "d2p")


def test_prefill_floor_recovery_is_not_gated_by_evidence() -> None:
    engines = fleet("PDDD", p0={"prefill_blocked": "drained", "decode_blocked": "drained"})
    snap = snapshot(engines, PREFILL_HEAVY)
    d = decide(snap, opened_at(NOW - 1.0, snap.arrivals_total), NOW, config())
    assert not d.evidence.closed
    assert d.move == Move("d0", "d2p")


def test_prefill_floor_recovery_prefers_fewest_resident_streams() -> None:
    engines = fleet(
        "PDDD",
        p0={"prefill_blocked": "drained", "decode_blocked": "drained"},
        d0={"decode_active": 9},
        d1={"decode_active": 2},
        d2={"decode_active": 4},
    )
    d = decide(snapshot(engines, PREFILL_HEAVY), settled(NOW), NOW, config())
    assert d.move == Move("d1", "d2p")


def test_pins_block_floor_recovery_and_the_breach_is_reported() -> None:
    pinned = {"pinned": True}
    engines = fleet("PPPD", p0=pinned, p1=pinned, p2=pinned, d0={"decode_blocked": "drained"})
    d = decide(snapshot(engines, PREFILL_HEAVY), settled(NOW), NOW, config())
    assert (d.result, d.gate, d.reason) == ("breach", "no_movable_engine", "floor_breach")
    assert d.move is None
    (breach,) = d.floors.breaches
    assert (breach.pool, breach.floor, breach.live, breach.reachable) == ("decode", 1, 0, 0)


def test_floor_recovery_never_moves_pinned_or_unavailable_engines() -> None:
    engines = fleet(
        "PPPPD",
        p0={"pinned": True},
        p1={"decode_blocked": "breaker open"},  # still live for prefill, but not movable
        p2={"prefill_blocked": "restart hold", "decode_blocked": "restart hold"},
        p3={"prefill_work_s": 50.0},  # least preferred, yet the only eligible one
        d0={"decode_blocked": "ejected: latency"},
    )
    d = decide(snapshot(engines, PREFILL_HEAVY), settled(NOW), NOW, config())
    assert d.move == Move("p3", "p2d")


def test_floor_recovery_respects_both_floor_constraints() -> None:
    # restoring decode would take the only live prefill engine
    d = decide(
        snapshot(fleet("PD", d0={"decode_blocked": "drained"}), PREFILL_HEAVY),
        settled(NOW),
        NOW,
        config(),
    )
    assert (d.result, d.gate) == ("breach", "floor")
    # restoring prefill would take a decode engine below min_decode=2
    engines = fleet("PDD", p0={"prefill_blocked": "drained", "decode_blocked": "drained"})
    d = decide(snapshot(engines, PREFILL_HEAVY), settled(NOW), NOW, config(min_decode=2))
    assert (d.result, d.gate) == ("breach", "floor")


def test_both_floors_breached_keeps_the_split() -> None:
    drained = {"prefill_blocked": "drained", "decode_blocked": "drained"}
    engines = fleet("PPDD", p0=drained, p1=drained, d0=drained)
    d = decide(snapshot(engines, PREFILL_HEAVY), settled(NOW), NOW, config(min_decode=2))
    assert (d.result, d.gate) == ("breach", "floor")
    assert {b.pool for b in d.floors.breaches} == {"prefill", "decode"}


def test_breach_reports_the_safest_reachable_split() -> None:
    engines = fleet(
        "PPPPD", p0={"pinned": True}, p1={"pinned": True}, d0={"decode_blocked": "drained"}
    )
    d = decide(snapshot(engines, PREFILL_HEAVY), settled(NOW), NOW, config(min_decode=3))
    (breach,) = d.floors.breaches
    # two movable prefill engines; the prefill floor (1) leaves three spare
    assert (breach.live, breach.reachable, breach.floor) == (0, 2, 3)
    assert d.move is not None  # recovery still moves toward the reachable split


def test_advisory_mode_still_applies_to_floor_recovery() -> None:
    snap = snapshot(fleet("PPPD", d0={"decode_blocked": "drained"}), PREFILL_HEAVY)
    state = settled(NOW)
    d = decide(snap, state, NOW, config(advisory=True))
    assert (d.result, d.gate) == ("advisory", "advisory")
    assert d.move == Move("p0", "p2d")
    # nothing changed role: no dwell stamp, no cooldown clock, no evidence reset
    assert d.state.role_changed_at == ()
    assert d.state.last_p2d_at == state.last_p2d_at
    assert d.state.evidence == state.evidence


def test_every_applied_floor_recovery_records_a_dwell_timestamp() -> None:
    decode_case = snapshot(fleet("PPPD", d0={"decode_blocked": "drained"}), PREFILL_HEAVY)
    d = decide(decode_case, settled(NOW), NOW, config())
    assert d.state.changed_at("p0") == NOW
    drained = {"prefill_blocked": "drained", "decode_blocked": "drained"}
    prefill_case = snapshot(fleet("PDDD", p0=drained), PREFILL_HEAVY)
    d = decide(prefill_case, settled(NOW), NOW, config())
    assert d.state.changed_at("d0") == NOW


def test_floor_recovery_runs_every_pass_regardless_of_step() -> None:
    snap = snapshot(fleet("PPPD", d0={"decode_blocked": "drained"}), PREFILL_HEAVY)
    state = settled(NOW, last_scheduled_at=NOW - 0.5)
    d = decide(snap, state, NOW, config(step_s=5.0))
    assert d.caller == "floor-recovery"
    assert d.move is not None


def test_when_capacity_returns_the_split_reenters_the_adjacent_path() -> None:
    engines = fleet("PPDDDDDD")
    d = decide(snapshot(engines, PREFILL_HEAVY), settled(NOW), NOW, config())
    assert d.caller == "scheduled"
    assert not d.floors.breaches


def test_the_first_pass_after_a_breach_ends_evaluates_whatever_step_s_says() -> None:
    cfg = config(step_s=30.0)
    pinned = {"pinned": True}
    drained = {"decode_blocked": "drained"}
    breached = snapshot(fleet("PPDD", p0=pinned, p1=pinned, d0=drained, d1=drained), PREFILL_HEAVY)
    state = settled(NOW, last_scheduled_at=NOW - 1.0)
    d = decide(breached, state, NOW, cfg)
    assert (d.caller, d.result) == ("floor-recovery", "breach")
    restored = snapshot(fleet("PPDD", p0=pinned, p1=pinned), PREFILL_HEAVY)
    d = decide(restored, d.state, NOW + 1.0, cfg)
    assert d.caller == "scheduled"
    assert d.floors.breaches == ()
    assert d.state.last_scheduled_at == NOW + 1.0
    # and the schedule goes on from there
    d = decide(restored, d.state, NOW + 2.0, cfg)
    assert d.caller == "none"


def test_every_role_change_preserves_min_decode() -> None:
    d = decide(snapshot(fleet("PPDD"), PREFILL_HEAVY), settled(NOW), NOW, config(min_decode=2))
    assert d.proposed.prefill == 3
    assert (d.result, d.gate) == ("blocked", "floor")


def test_controller_moves_preserve_min_prefill() -> None:
    d = decide(snapshot(fleet("PPDDDD"), DECODE_URGENT), settled(NOW), NOW, config(min_prefill=2))
    assert d.proposed.decode == 5
    assert (d.result, d.gate) == ("blocked", "floor")


def test_both_role_engines_count_toward_both_floors_and_never_move() -> None:
    engines = fleet("BPD", p0={"prefill_blocked": "drained", "decode_blocked": "drained"})
    d = decide(snapshot(engines, PREFILL_HEAVY), settled(NOW), NOW, config())
    assert not d.floors.breaches
    assert (d.floors.live_prefill, d.floors.live_decode) == (1, 2)
    assert d.move is None or d.move.engine != "b0"


def test_single_engine_aggregate_topology_is_accepted_and_left_alone() -> None:
    d = decide(snapshot(fleet("B"), PREFILL_HEAVY), settled(NOW), NOW, config())
    assert not d.floors.breaches
    assert d.move is None
    assert (d.current.prefill, d.current.decode) == (0, 0)
