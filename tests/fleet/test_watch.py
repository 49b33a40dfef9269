"""The fleet's watcher hears of every change to an engine that may leave a role without an
engine in placement, whoever makes it (recovery's readmission shortcuts start then)."""

from __future__ import annotations

import pytest

from narwhal.config import Config, EngineSpec
from narwhal.fleet import EngineState, Fleet, key_refused, model_refused


def watched() -> tuple[Fleet, list[tuple[str, str]]]:
    fleet = Fleet(
        Config(
            engines=(
                EngineSpec(id="p0", url="http://127.0.0.1:9", role="prefill"),
                EngineSpec(id="d0", url="http://127.0.0.1:10", role="decode"),
            )
        )
    )
    seen: list[tuple[str, str]] = []
    fleet.watch(lambda engine: seen.append((engine.id, repr(engine))))
    return fleet, seen


def get(fleet: Fleet, engine_id: str) -> EngineState:
    engine = fleet.get(engine_id)
    assert engine is not None
    return engine


def test_role_changes_drains_removals_and_refusals_are_reported_once_each() -> None:
    fleet, seen = watched()
    d0 = get(fleet, "d0")
    d0.role = "decode"  # unchanged: nothing to report
    d0.operator_undrain()
    assert seen == []
    d0.role = "prefill"
    d0.operator_drain()
    d0.operator_undrain()  # an undrained engine may be the last of its role now
    assert [engine_id for engine_id, _ in seen] == ["d0"] * 3
    # The watcher sees the change made: the engine as it is after it.
    assert seen[0][1] == "<EngineState d0 prefill [prefill 0, decode 0]>"
    assert seen[1][1] == "<EngineState d0 prefill [prefill 0, decode 0, drained]>"
    seen.clear()
    key_refused(d0, 401, "Unauthorized", Config(engines=(d0.spec,)))
    key_refused(d0, 401, "Unauthorized", Config(engines=(d0.spec,)))  # still refused
    d0.recovery_key_accepted()  # back in placement: nothing leaves
    assert [engine_id for engine_id, _ in seen] == ["d0"]
    seen.clear()
    model_refused(d0, "The model `m` does not exist.", Config(engines=(d0.spec,)))
    model_refused(d0, "The model `m` does not exist.", Config(engines=(d0.spec,)))
    d0.recovery_model_listed()
    assert [engine_id for engine_id, _ in seen] == ["d0"]
    seen.clear()
    retired = fleet.retire("p0")
    assert retired is not None
    assert [engine_id for engine_id, _ in seen] == ["p0"]
    assert list(fleet) == [d0]  # out of the fleet when the watcher hears of it


def test_an_added_engine_is_watched_and_a_forgotten_one_no_longer() -> None:
    fleet, seen = watched()
    spec = EngineSpec(id="d1", url="http://127.0.0.1:11", role="decode")
    d1 = EngineState(spec, Config(engines=(spec,)))
    d1.operator_drain()  # not in the fleet yet
    fleet.add(d1)
    d1.operator_undrain()
    fleet.retire("d1")
    fleet.forget(d1)
    d1.role = "prefill"
    assert [engine_id for engine_id, _ in seen] == ["d1", "d1"]


def test_the_fleet_has_one_watcher() -> None:
    fleet, _ = watched()
    with pytest.raises(ValueError, match=r"^the fleet has a watcher already$"):
        fleet.watch(lambda engine: None)
