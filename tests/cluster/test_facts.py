"""Shared fleet facts (narwhal.cluster._facts): their keys and values, and applying
another replica's facts to this replica's engines, without etcd."""

from __future__ import annotations

import pytest

from narwhal.cluster._facts import (
    Fact,
    Hold,
    apply,
    decode,
    encode,
    fact_of,
    key_of,
    parse_key,
)
from narwhal.config import Config, EngineSpec
from narwhal.fleet import EngineState, Fleet

PREFIX = b"/narwhal/"


def _fleet() -> tuple[Fleet, list[str]]:
    fleet = Fleet(
        Config(
            engines=(
                EngineSpec(id="e/0", url="http://127.0.0.1:9", role="prefill"),
                EngineSpec(id="sg", url="http://127.0.0.1:10", role="decode", dialect="sglang"),
            )
        )
    )
    seen: list[str] = []
    fleet.watch(lambda engine: seen.append(engine.id))
    return fleet, seen


def _get(fleet: Fleet, engine_id: str) -> EngineState:
    engine = fleet.get(engine_id)
    assert engine is not None
    return engine


def test_a_fact_round_trips_through_its_key_and_value() -> None:
    fleet, _ = _fleet()
    engine = _get(fleet, "e/0")
    fact = fact_of(engine, "role", by="r1")
    key = key_of(PREFIX, "e/0", "role")
    assert key == b"/narwhal/facts/e/0/role"
    assert parse_key(PREFIX, key) == ("e/0", "role")  # an id with a slash
    assert decode(PREFIX, key, encode(fact)) == Fact("e/0", "role", "prefill", "r1")


@pytest.mark.parametrize("value", [Hold("3 failed probes", 1796620000.25), False])
def test_a_verdict_round_trips_as_a_hold_or_its_release(value: Hold | bool) -> None:
    key = key_of(PREFIX, "e/0", "ejected")
    fact = Fact("e/0", "ejected", value, "r1")
    assert decode(PREFIX, key, encode(fact)) == fact


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        (b"/narwhal/facts/e0/colour", b'{"value": true, "by": "r"}', "is not <prefix>facts/"),
        (b"/narwhal/facts/role", b'{"value": "decode", "by": "r"}', "is not <prefix>facts/"),
        (b"/narwhal/facts/e0/role", b"{", "not JSON"),
        (b"/narwhal/facts/e0/role", b"[]", "not a JSON object"),
        (b"/narwhal/facts/e0/role", b'{"value": "both2", "by": "r"}', "is not one of"),
        (b"/narwhal/facts/e0/drained", b'{"value": 1, "by": "r"}', "is not true or false"),
        (b"/narwhal/facts/e0/pinned", b'{"value": true}', "is not a replica name"),
        (b"/narwhal/facts/e0/ejected", b'{"value": true, "by": "r"}', "not false or an object"),
        (b"/narwhal/facts/e0/ejected", b'{"value": {"until": 5}, "by": "r"}', "not a string"),
        (
            b"/narwhal/facts/e0/quarantined",
            b'{"value": {"reason": "x", "until": "soon"}, "by": "r"}',
            "is not a time",
        ),
    ],
)
def test_a_malformed_fact_is_refused_whole_naming_the_problem(
    key: bytes, value: bytes, problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        decode(PREFIX, key, value)


def test_applying_facts_goes_through_the_engines_owner_methods() -> None:
    fleet, seen = _fleet()
    engine = _get(fleet, "e/0")
    assert apply(engine, Fact("e/0", "drained", True, "r2")) == (False, True)
    assert engine.drained
    assert seen == ["e/0"]  # recovery hears of it
    assert apply(engine, Fact("e/0", "drained", True, "r2")) is None  # no change
    assert apply(engine, Fact("e/0", "pinned", True, "r2")) == (False, True)
    assert engine.pinned
    assert apply(engine, Fact("e/0", "role", "decode", "r2")) == ("prefill", "decode")
    assert engine.role == "decode"
    assert apply(engine, Fact("e/0", "drained", False, "r2")) == (True, False)
    assert not engine.drained


def test_a_role_the_engines_launch_fixes_is_never_changed_by_a_fact() -> None:
    fleet, _ = _fleet()
    sglang = _get(fleet, "sg")
    assert apply(sglang, Fact("sg", "role", "prefill", "r2")) is None
    assert sglang.role == "decode"
    assert apply(sglang, Fact("sg", "drained", True, "r2")) == (False, True)
