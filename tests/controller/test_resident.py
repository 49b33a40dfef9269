"""Manual 7.3: resident-work checks before turning decode capacity into prefill
capacity, and 7.7 flip_resident_guard."""

from __future__ import annotations

from typing import Any

import attrs

from narwhal.controller import AffineDecode, Move, StaticProfile, decide

from .helpers import PREFILL_HEAVY, PROFILE, config, fleet, settled, snapshot

NOW = 1000.0


def with_decode(**kw: Any) -> StaticProfile:
    return attrs.evolve(PROFILE, decode=attrs.evolve(PROFILE.decode, **kw))


def test_proposed_split_must_remain_inside_measured_profile_domain() -> None:
    narrow_mean = with_decode(max_active=10)
    busy = {"decode_active": 12, "decode_tokens": 1200}
    engines = fleet("PPDDDDDD", d1=busy, d2=busy, d3=busy, d4=busy, d5=busy)
    # 60 resident streams over the 5 decode engines left: 12 each, beyond 10
    d = decide(
        snapshot(engines, PREFILL_HEAVY, mean_profile=narrow_mean), settled(NOW), NOW, config()
    )
    assert (d.result, d.gate) == ("blocked", "profile_domain")
    assert d.loads.to_prefill is not None
    assert not d.loads.to_prefill.decode_projection.in_domain
    wide = decide(snapshot(engines, PREFILL_HEAVY), settled(NOW), NOW, config())
    assert wide.move == Move("d0", "d2p")


def test_resident_decode_batches_must_remain_inside_measured_profile_domain() -> None:
    own = with_decode(max_active=50)
    engines = fleet("PPDDDDDD", d3={"decode_active": 60, "decode_tokens": 600, "profile": own})
    d = decide(snapshot(engines, PREFILL_HEAVY), settled(NOW), NOW, config())
    assert (d.result, d.gate) == ("blocked", "resident_batches")
    assert "'d3'" in d.detail


def test_available_kv_capacity_must_hold_pending_handoffs() -> None:
    small = attrs.evolve(PROFILE, kv_capacity_tokens=5000)
    per = {"profile": small}
    engines = fleet(
        "PPDDDDDD",
        p0={"handoffs_pending": 100},
        d0=per,
        d1=per,
        d2=per,
        d3=per,
        d4=per,
        d5=per,
    )
    # 100 pending handoffs of 400-token prompts need 40 000 KV tokens; five engines of
    # 5 000 hold 25 000.
    d = decide(snapshot(engines, PREFILL_HEAVY), settled(NOW), NOW, config())
    assert (d.result, d.gate) == ("blocked", "kv_capacity")


def test_candidate_kv_must_hold_its_resident_work_and_a_prompt() -> None:
    engines = fleet(
        "PPDDDDDD",
        d0={"decode_active": 1, "decode_tokens": PROFILE.kv_capacity_tokens - 100},
        d1={"decode_active": 2, "decode_tokens": 100},
        d2={"decode_active": 2, "decode_tokens": 100},
        d3={"decode_active": 2, "decode_tokens": 100},
        d4={"decode_active": 2, "decode_tokens": 100},
        d5={"decode_active": 2, "decode_tokens": 100},
    )
    d = decide(snapshot(engines, PREFILL_HEAVY), settled(NOW), NOW, config())
    # d0 is preferred (fewest streams) but has no room for a 400-token prompt
    assert d.move == Move("d1", "d2p")


def test_an_idle_decode_engine_is_a_d2p_candidate() -> None:
    # Nothing resident is the idle point, inside every domain. When the profile's box
    # started at one request, an empty batch held every move from an idle engine (seen in
    # the goodput run: D->P held for 90 s of a prefill-heavy phase by `resident_batches`).
    engines = fleet("PPDDDDDD", d1={"decode_active": 2, "decode_tokens": 800})
    d = decide(snapshot(engines, PREFILL_HEAVY), settled(NOW), NOW, config())
    assert d.move == Move("d0", "d2p")
    assert d.gate is None


def test_d2p_candidate_has_fewest_resident_streams() -> None:
    engines = fleet(
        "PPDDDDDD",
        d0={"decode_active": 7},
        d1={"decode_active": 3, "decode_tokens": 900},
        d2={"decode_active": 3, "decode_tokens": 300},
        d3={"decode_active": 5},
        d4={"decode_active": 9},
        d5={"decode_active": 4},
    )
    d = decide(snapshot(engines, PREFILL_HEAVY), settled(NOW), NOW, config())
    assert d.move == Move("d2", "d2p")


def test_flip_resident_guard_limits_resident_streams_on_a_d2p_candidate() -> None:
    busy = {"decode_active": 5}
    engines = fleet("PPDDDDDD", d0=busy, d1=busy, d2=busy, d3=busy, d4=busy, d5=busy)
    d = decide(snapshot(engines, PREFILL_HEAVY), settled(NOW), NOW, config(flip_resident_guard=3))
    assert (d.result, d.gate) == ("blocked", "resident_guard")
    engines = fleet(
        "PPDDDDDD", d0=busy, d1=busy, d2=busy, d3={"decode_active": 3}, d4=busy, d5=busy
    )
    d = decide(snapshot(engines, PREFILL_HEAVY), settled(NOW), NOW, config(flip_resident_guard=3))
    assert d.move == Move("d3", "d2p")


def test_flip_resident_guard_zero_disables_the_guard() -> None:
    busy = {"decode_active": 500}
    engines = fleet("PPDDDDDD", d0=busy, d1=busy, d2=busy, d3=busy, d4=busy, d5=busy)
    cfg = config(flip_resident_guard=0)
    wide = attrs.evolve(
        PROFILE, decode=AffineDecode(t0=0.01, per_kv=0.0, per_seq=1e-5, max_active=4096)
    )
    snap = snapshot(engines, PREFILL_HEAVY, mean_profile=wide)
    snap = attrs.evolve(snap, engines=tuple(attrs.evolve(e, profile=wide) for e in snap.engines))
    d = decide(snap, settled(NOW), NOW, cfg)
    assert d.move is not None
    assert d.move.direction == "d2p"


def test_prefill_floor_recovery_still_runs_resident_work_checks() -> None:
    own = with_decode(max_active=50)
    engines = fleet(
        "PDD",
        p0={"prefill_blocked": "drained", "decode_blocked": "drained"},
        d1={"decode_active": 60, "decode_tokens": 600, "profile": own},
    )
    d = decide(snapshot(engines, PREFILL_HEAVY), settled(NOW), NOW, config())
    assert (d.caller, d.result, d.gate) == ("floor-recovery", "breach", "resident_batches")


def test_prefill_floor_recovery_skips_checks_without_a_profile() -> None:
    engines = fleet(
        "PDD",
        p0={"prefill_blocked": "drained", "decode_blocked": "drained", "profile": None},
        d0={"profile": None},
        d1={"profile": None},
    )
    snap = snapshot(engines, PREFILL_HEAVY, mean_profile=None)
    d = decide(snap, settled(NOW), NOW, config())
    assert (d.caller, d.result) == ("floor-recovery", "move")
    assert d.move == Move("d0", "d2p")


def test_prefill_floor_recovery_is_not_blocked_by_flip_resident_guard() -> None:
    busy = {"decode_active": 9}
    engines = fleet(
        "PDDD",
        p0={"prefill_blocked": "drained", "decode_blocked": "drained"},
        d0=busy,
        d1={"decode_active": 7},
        d2=busy,
    )
    d = decide(snapshot(engines, PREFILL_HEAVY), settled(NOW), NOW, config(flip_resident_guard=3))
    assert (d.caller, d.result) == ("floor-recovery", "move")
    assert d.move == Move("d1", "d2p")


def test_decode_legs_placed_but_not_started_are_resident_work_of_a_d2p_candidate() -> None:
    # d0 streams once now but has five decode legs placed on it whose prefills are
    # running: they keep their engine through a move to prefill (manual 5), so d0 is the
    # busier engine and d1 the one to move.
    engines = fleet(
        "PPDDDDDD",
        d0={"decode_active": 1, "decode_pending": 5, "decode_pending_tokens": 2000},
        d1={"decode_active": 2},
        **{f"d{i}": {"decode_active": 9} for i in range(2, 6)},
    )
    d = decide(snapshot(engines, PREFILL_HEAVY), settled(NOW), NOW, config())
    assert d.move == Move("d1", "d2p")


def test_flip_resident_guard_counts_decode_legs_placed_but_not_started() -> None:
    busy = {"decode_active": 5}
    waiting = {"decode_pending": 6, "decode_pending_tokens": 2400}
    engines = fleet("PPDDDDDD", d0=busy, d1=busy, d2=busy, d3=waiting, d4=busy, d5=busy)
    d = decide(snapshot(engines, PREFILL_HEAVY), settled(NOW), NOW, config(flip_resident_guard=3))
    assert (d.result, d.gate) == ("blocked", "resident_guard")


def test_placed_decode_legs_count_against_the_candidates_kv_room() -> None:
    # 999,700 of 1,000,000 KV tokens are promised to the legs placed on d1: no room
    # for a 400-token prompt once it prefills.
    full = {"decode_pending": 3, "decode_pending_tokens": 999_700}
    engines = fleet("PPDD", d0={"decode_active": 9}, d1=full)
    cfg = config(flip_resident_guard=0)
    d = decide(snapshot(engines, PREFILL_HEAVY), settled(NOW), NOW, cfg)
    assert d.move != Move("d1", "d2p")
