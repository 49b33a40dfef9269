"""Applying a decision: only the named engine's role changes, never for an engine that
is pinned or unavailable; resident work stays; new placement sees the role at once;
the flip history is bounded by controller.flip_history."""

from __future__ import annotations

import math

import attrs
import pytest

from narwhal._records import to_json
from narwhal.config import Config, EngineSpec
from narwhal.controller import (
    FlipHistory,
    Move,
    MoveRejected,
    apply_move,
    decide,
    flip_entry,
    flip_record,
)
from narwhal.controller._decide import Decision
from narwhal.fleet import EngineState, Fleet
from narwhal.placement import Placement, choose

from ..support import claims
from .helpers import PREFILL_HEAVY, config, fleet, settled, snapshot

NOW = 1000.0


def live_fleet(spec: str = "PPDDDDDD") -> Fleet:
    engines = tuple(
        EngineSpec(
            id=e.id,
            url=f"http://127.0.0.1:{9000 + i}",
            role=e.role,
        )
        for i, e in enumerate(fleet(spec))
    )
    return Fleet(Config(engines=engines))


def d2p_decision() -> Decision:
    d = decide(snapshot(fleet("PPDDDDDD"), PREFILL_HEAVY), settled(NOW), NOW, config())
    assert d.result == "move"
    assert d.move == Move("d0", "d2p")
    return d


def engine(f: Fleet, engine_id: str) -> EngineState:
    e = f.get(engine_id)
    assert e is not None
    return e


def test_apply_changes_only_the_chosen_engines_role() -> None:
    f = live_fleet()
    record = apply_move(engine(f, "d0"), d2p_decision())
    assert [e.role for e in f] == ["prefill"] * 3 + ["decode"] * 5
    assert engine(f, "d0").role == "prefill"
    assert (record.engine, record.from_role, record.to_role, record.applied) == (
        "d0",
        "decode",
        "prefill",
        True,
    )
    assert (record.before.prefill, record.after.prefill) == (2, 3)


class OpenBreaker:
    def blocked(self, now: float) -> str | None:
        return "decode breaker open"


def _pin(e: EngineState) -> None:
    e.operator_pin()


def _drain(e: EngineState) -> None:
    e.operator_drain()


def _remove(e: EngineState) -> None:
    e.reload_remove()


def _eject(e: EngineState) -> None:
    e.recovery_eject("latency residual")


def _hold(e: EngineState) -> None:
    e.recovery_hold()


def _quarantine(e: EngineState) -> None:
    e.recovery_quarantine(NOW + 5.0)


def _breaker(e: EngineState) -> None:
    e.phase_gates["decode"] = OpenBreaker()


@pytest.mark.parametrize(
    "make_unmovable",
    [_pin, _drain, _remove, _eject, _hold, _quarantine, _breaker],
    ids=["pinned", "drained", "removed", "ejected", "restart-hold", "quarantined", "breaker"],
)
def test_apply_never_moves_a_pinned_or_unavailable_engine(make_unmovable: object) -> None:
    f = live_fleet()
    d0 = engine(f, "d0")
    make_unmovable(d0)  # type: ignore[operator]
    with pytest.raises(MoveRejected):
        apply_move(d0, d2p_decision())
    assert d0.role == "decode"


def test_apply_never_moves_an_sglang_engine() -> None:
    # Even a decision made without the gate (a stale or hand-built one) is refused: an
    # SGLang server's role is its launch mode.
    engines = tuple(attrs.evolve(e.spec, dialect="sglang") for e in live_fleet())
    f = Fleet(Config(engines=engines))
    d0 = engine(f, "d0")
    with pytest.raises(
        MoveRejected, match=r"^engine 'd0' cannot change role: an sglang server's role is fixed"
    ):
        apply_move(d0, d2p_decision())
    assert d0.role == "decode"


def test_apply_refuses_a_stale_role_or_a_non_move() -> None:
    f = live_fleet()
    d0 = engine(f, "d0")
    d0.role = "prefill"
    with pytest.raises(MoveRejected, match="has role 'prefill'"):
        apply_move(d0, d2p_decision())
    advisory = attrs.evolve(d2p_decision(), result="advisory")
    with pytest.raises(MoveRejected, match="not 'move'"):
        apply_move(engine(live_fleet(), "d0"), advisory)
    with pytest.raises(MoveRejected, match="names engine"):
        apply_move(engine(live_fleet(), "d1"), d2p_decision())


def test_role_change_affects_new_placement_immediately_and_never_moves_resident_work() -> None:
    f = live_fleet("PDD")
    p0, d0, d1 = engine(f, "p0"), engine(f, "d0"), engine(f, "d1")
    claims(d0.load.decode, 3, 1200)
    claims(d1.load.decode, 5, 2000)
    p0.load.prefill(5000)  # p0 busier, so a new prefill prefers d0 once it may
    assert choose(f.views(NOW)) == Placement("disaggregated", "p0", "d0")
    snap = snapshot(
        fleet(
            "PDD",
            d0={"decode_active": 3, "decode_tokens": 1200},
            d1={"decode_active": 5, "decode_tokens": 2000},
        ),
        PREFILL_HEAVY,
    )
    d = decide(snap, settled(NOW), NOW, config())
    assert d.move == Move("d0", "d2p")
    apply_move(d0, d)
    # resident decode streams stay where they are and finish there
    assert (d0.load.decode_active, d0.load.decode_tokens) == (3, 1200)
    # the very next placement sends prefill to d0 and decode only to d1
    assert choose(f.views(NOW)) == Placement("disaggregated", "d0", "d1")


def test_flip_history_is_bounded_by_controller_flip_history() -> None:
    history = FlipHistory(3)
    d = d2p_decision()
    for i in range(5):
        history.append(flip_record(attrs.evolve(d, now=float(i)), resident_streams=0, applied=True))
    assert [r.time for r in history] == [2.0, 3.0, 4.0]
    assert history.total == 5
    assert len(history) == 3
    history.resize(2)
    assert [r.time for r in history] == [3.0, 4.0]
    assert history.limit == 2
    history.resize(10)
    assert [r.time for r in history] == [3.0, 4.0]


def test_flip_record_serialises_plainly() -> None:
    record = flip_record(d2p_decision(), resident_streams=2, applied=False)
    out = to_json(flip_entry(record))
    assert out["from"] == "decode"
    assert out["to"] == "prefill"
    assert out["applied"] is False
    assert out["before"] == {"prefill": 2, "decode": 6}
    assert out["after"] == {"prefill": 3, "decode": 5}
    assert all(not isinstance(v, float) or math.isfinite(v) for v in out.values())


def test_an_applied_move_is_reported_to_the_fleet_s_watcher() -> None:
    # Recovery watches the fleet: a role change may leave a waiting engine the last of
    # its role (the floors keep the controller from emptying a role itself).
    f = live_fleet()
    seen: list[tuple[str, str]] = []
    f.watch(lambda e: seen.append((e.id, e.role)))
    apply_move(engine(f, "d0"), d2p_decision())
    assert seen == [("d0", "prefill")]
