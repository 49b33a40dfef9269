"""The live Controller: snapshot from EngineStates, decide, apply, history, exposure
(/narwhal/state section and Prometheus families). Time is trio's MockClock."""

from __future__ import annotations

import json
import math
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from narwhal._records import to_json
from narwhal.config import Config, EngineSpec
from narwhal.controller import Controller, Profile, prefill_work_s
from narwhal.fleet import EngineState, Fleet
from narwhal.metrics import Metrics

from ..support import claims
from .helpers import DECODE_URGENT, PREFILL_HEAVY, PROFILE, config


def setup(
    spec: str = "PPPPDDDD", *, profiles: bool = True, **overrides: Any
) -> tuple[Config, Fleet, Controller]:
    roles = {"P": "prefill", "D": "decode", "B": "both"}
    counts: dict[str, int] = {}
    engines = []
    for i, letter in enumerate(spec):
        n = counts.get(letter, 0)
        counts[letter] = n + 1
        engines.append(
            EngineSpec(
                id=f"{letter.lower()}{n}",
                url=f"http://127.0.0.1:{9100 + i}",
                role=roles[letter],  # type: ignore[arg-type]
            )
        )
    cfg = attrs.evolve(config(**overrides), engines=tuple(engines))
    fleet = Fleet(cfg)
    mean: Profile | None = PROFILE if profiles else None
    ctl = Controller(
        cfg,
        fleet,
        mean_profile=lambda: mean,
        engine_profiles=lambda engine_id: mean,
        started_at=0.0,
    )
    return cfg, fleet, ctl


def offer(ctl: Controller, shape: tuple[float, int, int], start: float, end: float) -> None:
    rate, prompt, output = shape
    n = round((end - start) * rate)
    for i in range(n):
        ctl.record_arrival(start + i / rate, prompt, output)


def get(fleet: Fleet, engine_id: str) -> EngineState:
    engine = fleet.get(engine_id)
    assert engine is not None
    return engine


async def test_on_pass_applies_the_move_and_records_the_flip(
    autojump_clock: trio.testing.MockClock,
) -> None:
    _, fleet, ctl = setup()
    await trio.sleep(200.0)
    offer(ctl, DECODE_URGENT, 80.0, 200.0)
    d = await ctl.on_pass()
    assert d is not None
    assert d.result == "move"
    assert d.move is not None
    assert get(fleet, d.move.engine).role == "decode"
    (record,) = list(ctl.history)
    assert record.applied
    assert record.caller == "scheduled"
    assert record.time == 200.0
    assert ctl.last_result == "applied"
    assert ctl.counters.flips[("p2d", "scheduled")] == 1


async def test_advisory_controller_keeps_roles_and_records_the_proposal(
    autojump_clock: trio.testing.MockClock,
) -> None:
    _, fleet, ctl = setup(advisory=True)
    await trio.sleep(200.0)
    offer(ctl, DECODE_URGENT, 80.0, 200.0)
    d = await ctl.on_pass()
    assert d is not None
    assert d.result == "advisory"
    assert [e.role for e in fleet] == ["prefill"] * 4 + ["decode"] * 4
    (record,) = list(ctl.history)
    assert not record.applied
    assert ctl.counters.proposals[("p2d", "scheduled")] == 1
    section = to_json(ctl.state_section())
    assert section["advisory"] is True
    assert section["result"] == "advisory"
    assert section["split"] == {
        "roles": {"prefill": 4, "decode": 4},
        "current": {"prefill": 4, "decode": 4},
        "proposed": {"prefill": 3, "decode": 5},
    }


def test_flip_record_counts_decode_legs_placed_on_the_engine_before_the_move() -> None:
    # The request path books a decode leg on its engine when it places the request, a
    # whole prefill before the leg starts (`decode_pending`); after a move to prefill the
    # leg still starts there. d0 holds no stream but four such legs, d1 one stream.
    _, fleet, ctl = setup("PPDDDD")
    claims(get(fleet, "d0").load.decode_placed, 4, 1600)
    claims(get(fleet, "d1").load.decode, 1, 400)
    for engine_id in ("d2", "d3"):
        claims(get(fleet, engine_id).load.decode, 6, 2400)
    offer(ctl, PREFILL_HEAVY, 0.0, 200.0)
    d = ctl.step(200.0)
    assert d is not None
    assert d.move is not None
    assert (d.move.engine, d.move.direction, ctl.last_result) == ("d1", "d2p", "applied")
    (record,) = list(ctl.history)
    assert record.resident_streams == 1
    snap = ctl.last_snapshot
    assert snap is not None
    d0 = snap.engine("d0")
    assert d0 is not None
    assert (d0.decode_pending, d0.decode_pending_tokens, d0.decode_resident) == (4, 1600, 4)


def test_advisory_record_counts_decode_legs_placed_on_the_engine() -> None:
    _, fleet, ctl = setup("PPDD", advisory=True)
    for engine_id in ("d0", "d1"):
        claims(get(fleet, engine_id).load.decode_placed, 2)
    offer(ctl, PREFILL_HEAVY, 0.0, 200.0)
    d = ctl.step(200.0)
    assert d is not None
    assert d.result == "advisory"
    (record,) = list(ctl.history)
    assert not record.applied
    assert record.resident_streams == 2


def busy_decoders(fleet: Fleet, *engine_ids: str) -> None:
    for engine_id in engine_ids:
        claims(get(fleet, engine_id).load.decode, 3, 1200)


def moves_of(ctl: Controller, engine_id: str, times: range) -> list[float]:
    """Passes every `times.step` seconds under prefill-heavy demand; when `engine_id` moved."""
    out = []
    for t in times:
        offer(ctl, PREFILL_HEAVY, float(t - times.step), float(t))
        d = ctl.step(float(t))
        assert d is not None
        if d.move is not None and d.move.engine == engine_id and d.result == "move":
            out.append(float(t))
    return out


def test_dwell_holds_an_engine_an_operator_pin_moved_after_it_is_unpinned() -> None:
    # 4P2D is balanced. The operator pins p0 as decode, then unpins it: the controller
    # wants 4P2D back and p0 is the idlest decode engine, but p0 changed role when the
    # 185 s pass first saw it, so dwell_s (60 s) keeps it a decode engine until 245 s,
    # as after a move of the controller's own (without this it went back at 195 s).
    _, fleet, ctl = setup("PPPPDD", dwell_s=60.0)
    busy_decoders(fleet, "d0", "d1")
    offer(ctl, PREFILL_HEAVY, 0.0, 180.0)
    d = ctl.step(180.0)
    assert d is not None
    assert d.result == "hold"
    p0 = get(fleet, "p0")
    p0.role = "decode"  # narwhalctl pin p0 decode
    p0.operator_pin()
    assert moves_of(ctl, "p0", range(185, 195, 5)) == []
    p0.operator_unpin()  # narwhalctl unpin p0
    assert moves_of(ctl, "p0", range(195, 245, 5)) == []
    assert p0.role == "decode"
    snap = ctl.last_snapshot
    assert snap is not None
    seen = snap.engine("p0")
    assert seen is not None
    assert seen.since_role_change_s == 240.0 - 185.0


def test_dwell_holds_an_engine_a_reload_moved() -> None:
    _, fleet, ctl = setup("PPPPDD", dwell_s=60.0)
    busy_decoders(fleet, "d0", "d1")
    offer(ctl, PREFILL_HEAVY, 0.0, 180.0)
    ctl.step(180.0)
    get(fleet, "p0").role = "decode"  # a reload's configured role change
    assert moves_of(ctl, "p0", range(185, 245, 5)) == []


def test_state_stops_reporting_a_floor_breach_at_the_pass_after_it_ends() -> None:
    # Both decode engines drained for 4 s with step_s 30: /narwhal/state and the gauges
    # showed the breach (live decode 0) for the 20 s after the undrain, until the next
    # scheduled evaluation.
    _, fleet, ctl = setup("PPDD", step_s=30.0, min_decode=2)
    for engine_id in ("p0", "p1"):
        get(fleet, engine_id).operator_pin()
    offer(ctl, PREFILL_HEAVY, 0.0, 100.0)
    d = ctl.step(100.0)
    assert d is not None
    assert d.move is None
    for engine_id in ("d0", "d1"):
        get(fleet, engine_id).operator_drain()
    ctl.step(104.0)
    section = to_json(ctl.state_section())
    assert (section["caller"], section["result"]) == ("floor-recovery", "breach")
    for engine_id in ("d0", "d1"):
        get(fleet, engine_id).operator_undrain()
    ctl.step(108.0)
    section = to_json(ctl.state_section())
    assert section["result"] != "breach"
    floors = section["floors"]
    assert isinstance(floors, dict)
    assert (floors["live_decode"], floors["breaches"]) == (2, [])
    gauges = {
        name: {labels[0]: value for labels, value in samples}
        for name, _, _, samples in ctl.gauges()
        if name.endswith(("_live_engines", "_breached"))
    }
    assert gauges["narwhal_controller_live_engines"]["decode"] == 2
    assert gauges["narwhal_controller_floor_breached"]["decode"] == 0


def test_state_section_exposes_every_manual_field() -> None:
    _, fleet, ctl = setup()
    get(fleet, "d0").operator_drain()
    offer(ctl, PREFILL_HEAVY, 0.0, 100.0)
    ctl.step(100.0)
    section = to_json(ctl.state_section())
    json.dumps(section, allow_nan=False)  # plain JSON: no inf/nan
    for key in (
        "enabled",
        "advisory",
        "split",
        "caller",
        "reason",
        "detail",
        "result",
        "gate",
        "confirmations",
        "loads",
        "demand",
        "evidence",
        "floors",
        "cooldown",
        "flips",
        "last_pass",
    ):
        assert key in section, key
    demand = section["demand"]
    assert isinstance(demand, dict)
    assert demand["short"]["horizon_s"] == 60.0
    assert demand["long"]["horizon_s"] == 120.0
    assert demand["long"]["arrivals"] == 400
    evidence = section["evidence"]
    assert isinstance(evidence, dict)
    assert evidence["state"] in ("open", "closed")
    floors = section["floors"]
    assert isinstance(floors, dict)
    assert floors["live_decode"] == 3


def test_floor_recovery_is_recorded_in_flip_history() -> None:
    _, fleet, ctl = setup("PPPD")
    get(fleet, "d0").operator_drain()
    d = ctl.step(1.0)
    assert d is not None
    assert d.caller == "floor-recovery"
    (record,) = list(ctl.history)
    assert record.caller == "floor-recovery"
    assert record.reason == "floor_recovery_decode"
    assert get(fleet, record.engine).role == "decode"
    # the applied recovery recorded a dwell timestamp the next snapshot reports
    snap = ctl.snapshot(31.0)
    moved = snap.engine(record.engine)
    assert moved is not None
    assert moved.since_role_change_s == 30.0


def test_a_configured_split_below_a_floor_is_restored_from_the_first_pass() -> None:
    # The loader accepts it (manual 7.2 asks only that the floors fit the fleet together).
    _, fleet, ctl = setup("PPPD", min_decode=2)
    d = ctl.step(1.0)
    assert d is not None
    assert d.caller == "floor-recovery"
    assert sorted(e.role for e in fleet) == ["decode", "decode", "prefill", "prefill"]
    ctl.step(2.0)
    assert ctl.history.total == 1  # the floor is met: no second recovery move


def test_flip_history_limit_applies_to_recovery_and_ordinary_changes() -> None:
    _, fleet, ctl = setup("PPPPD", flip_history=2, min_decode=3, dwell_s=0.0)
    get(fleet, "d0").operator_drain()
    for t in (1.0, 2.0, 3.0):
        ctl.step(t)
    assert ctl.history.total == 3
    assert len(ctl.history) == 2
    assert [r.time for r in ctl.history] == [2.0, 3.0]
    ctl.reconfigure(
        attrs.evolve(ctl.config, controller=attrs.evolve(ctl.config.controller, flip_history=1))
    )
    assert [r.time for r in ctl.history] == [3.0]


def test_metrics_families_render_on_the_router_registry() -> None:
    _, _, ctl = setup()
    offer(ctl, DECODE_URGENT, 0.0, 100.0)
    ctl.step(100.0)
    metrics = Metrics()
    metrics.add_live_gauges(ctl.gauges)
    metrics.registry.register(ctl.collector())
    text = metrics.render().decode()
    for line in (
        'narwhal_controller_engines{kind="proposed",pool="decode"} 5.0',
        'narwhal_controller_caller{caller="scheduled"} 1.0',
        'narwhal_controller_result{result="applied"} 1.0',
        'narwhal_controller_reason{reason="expand_decode"} 1.0',
        'narwhal_controller_gate{gate="cooldown"} 0.0',
        "narwhal_controller_evidence_closed 1.0",
        'narwhal_controller_demand_requests_per_second{horizon="long"} 20.0',
        'narwhal_controller_floor_breached{pool="decode"} 0.0',
        'narwhal_controller_flips_total{caller="scheduled",direction="p2d"} 1.0',
        "narwhal_controller_apply_failures_total 0.0",
    ):
        assert line in text, line


def test_first_token_timeouts_reset_the_evidence_window_through_the_controller() -> None:
    _, _, ctl = setup("PPDDDDDD")
    offer(ctl, PREFILL_HEAVY, 0.0, 200.0)
    ctl.record_first_token_timeout()
    d = ctl.step(200.0)
    assert d is not None
    assert d.gate == "evidence"
    assert d.state.evidence.opened_at == 200.0
    # consumed: the next pass does not reset again
    d = ctl.step(206.0)
    assert d is not None
    assert d.state.evidence.opened_at == 200.0


def test_ttft_breach_signal_allows_one_breach_step() -> None:
    _, _, ctl = setup("PPDDDDDD")
    offer(ctl, PREFILL_HEAVY, 0.0, 200.0)
    ctl.record_first_token_timeout()
    ctl.step(200.0)  # scheduled; evidence reset keeps D-to-P blocked
    ctl.signal_ttft_breach()
    d = ctl.step(201.0)
    assert d is not None
    assert d.caller == "breach-step"
    d = ctl.step(202.0)
    assert d is not None
    assert d.caller == "none"


def test_decode_intervals_feed_the_measured_decode_load() -> None:
    _, fleet, ctl = setup()
    claims(get(fleet, "d0").load.decode, 4)
    ctl.observe_decode_interval("d0", 0.02)
    ctl.observe_decode_interval("d0", 0.04)  # mean 30 ms: load (0.03 - 0.01) / 0.04
    d = ctl.step(1.0)
    assert d is not None
    assert d.loads.measured_decode == pytest.approx((0.5 + 0 + 0 + 0) / 4)


def test_prefills_waiting_for_a_router_slot_are_measured_prefill_work() -> None:
    # Under serving.prefill_concurrency the queue is the router's, not the engine's: the
    # pressure counted only legs in flight, so a capped pool looked idle however long
    # its queue (and the controller never moved an engine to prefill for it).
    cfg, fleet, _ = setup("PPDD")
    ctl = Controller(cfg, fleet, mean_profile=lambda: PROFILE, started_at=0.0)
    p0 = fleet.get("p0")
    assert p0 is not None
    claims(p0.load.prefill, 1, 400)
    idle = ctl.snapshot(1.0)
    claims(p0.load.prefill_queue, 3, 1200)
    queued = ctl.snapshot(1.0)
    assert queued.engines[0].prefill_work_s == pytest.approx(prefill_work_s(PROFILE, 4, 1600))
    assert queued.prefill_pressure == pytest.approx(4 * idle.prefill_pressure)
    assert p0.resident_work == 4


def test_decode_correction_is_clamped_to_configured_bounds() -> None:
    cfg, fleet, _ = setup()
    ctl = Controller(
        cfg,
        fleet,
        mean_profile=lambda: PROFILE,
        decode_correction=lambda engine_id: 9.0,
        started_at=0.0,
    )
    snap = ctl.snapshot(1.0)
    assert {e.decode_correction for e in snap.engines} == {
        cfg.controller.reactive.decode_correction_max
    }


def test_snapshots_carry_the_routers_decode_slots_and_the_state_shows_them() -> None:
    cfg, _, _ = setup("PPDD")
    engines = (*cfg.engines[:3], attrs.evolve(cfg.engines[3], decode_concurrency=4))
    cfg = attrs.evolve(
        cfg, serving=attrs.evolve(cfg.serving, decode_concurrency=8), engines=engines
    )
    ctl = Controller(
        cfg,
        Fleet(cfg),
        mean_profile=lambda: PROFILE,
        engine_profiles=lambda engine_id: PROFILE,
        started_at=0.0,
    )
    assert [e.decode_slots for e in ctl.snapshot(1.0).engines] == [8, 8, 8, 4]
    offer(ctl, DECODE_URGENT, 0.0, 100.0)
    ctl.step(100.0)
    loads = to_json(ctl.state_section())["loads"]
    assert isinstance(loads, dict)
    assert loads["decode_slots_per_engine"] == 7.0
    # Without serving.decode_concurrency nothing bounds the batch, and the state says so.
    _, _, free = setup("PPDD")
    offer(free, DECODE_URGENT, 0.0, 100.0)
    free.step(100.0)
    loads = to_json(free.state_section())["loads"]
    assert isinstance(loads, dict)
    assert loads["decode_slots_per_engine"] is None


def test_an_engines_own_max_num_seqs_bounds_its_decode_slots() -> None:
    # The engine queues streams beyond its own cap however many the router lets through:
    # the smaller cap is the one the projections use.
    cfg, _, _ = setup("PPDD")
    cfg = attrs.evolve(cfg, serving=attrs.evolve(cfg.serving, decode_concurrency=8))
    caps = {"p0": 6, "p1": 0, "d0": 16, "d1": 6}

    def profiles(engine_id: str) -> Profile:
        return attrs.evolve(PROFILE, max_num_seqs=caps[engine_id])

    ctl = Controller(
        cfg, Fleet(cfg), mean_profile=lambda: PROFILE, engine_profiles=profiles, started_at=0.0
    )
    assert [e.decode_slots for e in ctl.snapshot(1.0).engines] == [6, 8, 8, 6]
    # With the router unbounded, the engine's cap alone binds; an unknown cap (0) does not.
    plain, _, _ = setup("PPDD")
    free = Controller(
        plain, Fleet(plain), mean_profile=lambda: PROFILE, engine_profiles=profiles, started_at=0.0
    )
    assert [e.decode_slots for e in free.snapshot(1.0).engines] == [6, math.inf, 16, 6]


def test_snapshots_count_the_kv_non_streaming_decode_legs_have_made() -> None:
    _, fleet, ctl = setup()
    d0 = get(fleet, "d0")
    claims(d0.load.decode, 1, 1_000)
    with d0.load.unstreamed_decode(10_000, since=0.0):
        snap = ctl.snapshot(10.0)
        step = PROFILE.decode.interval_s(1, 1_000)  # correction 1: nothing observed yet
        (seen,) = [e for e in snap.engines if e.id == "d0"]
        assert seen.decode_tokens == 1_000 + round(10.0 / step)
        assert seen.decode_tokens > 1_000
    (after,) = [e for e in ctl.snapshot(10.0).engines if e.id == "d0"]
    assert after.decode_tokens == 1_000


def test_profile_reload_reprices_the_demand_window() -> None:
    cfg, fleet, _ = setup()
    current: list[Profile | None] = [None]
    ctl = Controller(cfg, fleet, mean_profile=lambda: current[0], started_at=0.0)
    offer(ctl, DECODE_URGENT, 0.0, 100.0)
    d = ctl.step(100.0)
    assert d is not None
    assert d.gate == "no_profile"
    current[0] = PROFILE
    d = ctl.step(105.0)
    assert d is not None
    assert d.gate != "no_profile"
    assert ctl.last_snapshot is not None
    assert ctl.last_snapshot.long.priced


def test_disabled_controller_does_nothing() -> None:
    _, fleet, ctl = setup(enabled=False)
    offer(ctl, DECODE_URGENT, 0.0, 100.0)
    assert ctl.step(100.0) is None
    assert [e.role for e in fleet] == ["prefill"] * 4 + ["decode"] * 4
    assert to_json(ctl.state_section()) == {
        "enabled": False,
        "advisory": False,
        "flips": {"total": 0, "retained": 0, "limit": 1000, "history": []},
    }


def test_advisory_history_keeps_the_first_of_identical_proposals() -> None:
    _, _, ctl = setup(advisory=True)
    offer(ctl, DECODE_URGENT, 0.0, 200.0)
    for t in (100.0, 105.0, 110.0):
        ctl.step(t)
    assert ctl.counters.proposals[("p2d", "scheduled")] == 3
    (record,) = list(ctl.history)
    assert record.time == 100.0
    assert not record.applied


def test_repr_names_split_proposal_and_gate() -> None:
    _, _, ctl = setup()
    assert repr(ctl) == "<Controller (no evaluation yet)>"
    offer(ctl, DECODE_URGENT, 0.0, 100.0)
    ctl.step(100.0)
    assert repr(ctl) == "<Controller 4P:4D proposed 3P:5D | scheduled applied>"
    ctl.step(105.0)
    assert repr(ctl) == "<Controller 3P:5D proposed 2P:6D | scheduled blocked (cooldown)>"


def sglang_setup(spec: str) -> tuple[Fleet, Controller]:
    cfg, _, _ = setup(spec)
    engines = tuple(attrs.evolve(e, dialect="sglang") for e in cfg.engines)
    cfg = attrs.evolve(cfg, engines=engines)
    fleet = Fleet(cfg)
    ctl = Controller(
        cfg,
        fleet,
        mean_profile=lambda: PROFILE,
        engine_profiles=lambda engine_id: PROFILE,
        started_at=0.0,
    )
    return fleet, ctl


async def test_an_sglang_fleet_keeps_its_launch_roles_and_says_why(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The demand that moves a vLLM prefill engine to decode (the first test) is held on
    # an SGLang fleet at the fixed_role gate, with the proposal still reported.
    fleet, ctl = sglang_setup("PPPPDDDD")
    await trio.sleep(200.0)
    offer(ctl, DECODE_URGENT, 80.0, 200.0)
    d = await ctl.on_pass()
    assert d is not None
    assert (d.result, d.gate, d.move) == ("blocked", "fixed_role", None)
    assert (d.proposed.prefill, d.proposed.decode) == (3, 5)
    assert d.detail.startswith(
        "no prefill engine can change role (p0, p1, p2, p3): an sglang server's role is "
        "fixed when it is launched (--disaggregation-mode prefill|decode"
    )
    assert [e.role for e in fleet] == ["prefill"] * 4 + ["decode"] * 4
    assert not list(ctl.history)
    section = to_json(ctl.state_section())
    assert section["gate"] == "fixed_role"
    assert section["result"] == "blocked"
    assert all(not e.movable for e in ctl.snapshot(201.0).engines)


def test_floor_recovery_never_flips_an_sglang_engine() -> None:
    fleet, ctl = sglang_setup("PPPD")
    get(fleet, "d0").operator_drain()
    d = ctl.step(1.0)
    assert d is not None
    assert (d.caller, d.result, d.reason, d.gate) == (
        "floor-recovery",
        "breach",
        "floor_breach",
        "fixed_role",
    )
    (breach,) = d.floors.breaches
    assert (breach.pool, breach.live, breach.reachable) == ("decode", 0, 0)
    assert [e.role for e in fleet] == ["prefill"] * 3 + ["decode"]
    assert not list(ctl.history)
