"""The replicas' shared loads, decided without etcd (narwhal.cluster._loads)."""

from __future__ import annotations

import math

import pytest

from narwhal.cluster._loads import (
    EngineWord,
    Heard,
    decode_word,
    encode_word,
    refresh_s,
    trust_s,
)


def test_a_word_survives_etcd_and_the_same_load_encodes_the_same() -> None:
    word = {
        "p1": EngineWord(
            booked_s=12.5,
            backlog_s=0.123456,
            prefill=2,
            prefill_tokens=900,
            decode=0,
            decode_tokens=0,
        ),
        "d0": EngineWord(
            booked_s=0.0, backlog_s=0.0, prefill=0, prefill_tokens=0, decode=3, decode_tokens=4200
        ),
    }
    value = encode_word(word)
    assert value == encode_word(dict(reversed(word.items())))
    back = decode_word(value)
    assert back["d0"] == word["d0"]
    assert (back["p1"].booked_s, back["p1"].backlog_s) == (12.5, 0.1235)  # to 0.1 ms
    assert decode_word(encode_word({})) == {}


@pytest.mark.parametrize(
    ("value", "names"),
    [
        (b"{", "not JSON"),
        (b"[]", '"engines"'),
        (b'{"engines": []}', '"engines"'),
        (b'{"engines": {"p0": [1, 0.1, 1, 10, 0]}}', "'p0'"),
        (b'{"engines": {"p0": [1, 0.1, -1, 10, 0, 0]}}', "non-negative"),
        (b'{"engines": {"p0": [1, 0.1, true, 10, 0, 0]}}', "'p0'"),
        (b'{"engines": {"p0": [NaN, 0.1, 1, 10, 0, 0]}}', "'p0'"),
    ],
)
def test_a_malformed_word_is_refused_naming_what_is_wrong(value: bytes, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        decode_word(value)


def test_a_word_is_trusted_for_two_and_a_half_repeats() -> None:
    assert (refresh_s(0.05), trust_s(0.05)) == (1.0, 2.5)
    assert (refresh_s(4.0), trust_s(4.0)) == (4.0, 10.0)


def _prefill(booked_s: float, backlog_s: float) -> EngineWord:
    return EngineWord(booked_s, backlog_s, prefill=1, prefill_tokens=100, decode=0, decode_tokens=0)


def test_the_others_load_stands_only_while_every_other_member_has_a_trusted_word() -> None:
    heard = Heard()
    heard.heard("b", {}, now=10.0)
    assert heard.trusted_until(["b"], 2.5) == 12.5
    # c joined and has said nothing yet: its legs would count as none.
    assert heard.trusted_until(["b", "c"], 2.5) == -math.inf
    heard.heard("c", {}, now=11.0)
    assert heard.trusted_until(["b", "c"], 2.5) == 12.5
    heard.gone("b")
    assert heard.trusted_until(["b", "c"], 2.5) == -math.inf
    assert heard.trusted_until([], 2.5) == math.inf


def test_what_another_replica_booked_is_taken_once_from_its_running_total() -> None:
    heard = Heard()
    # First heard: what it has left counts, not all it ever booked.
    assert heard.heard("b", {"p0": _prefill(50.0, 0.4)}, now=10.0) == {"p0": 0.4}
    assert heard.heard("b", {"p0": _prefill(50.3, 0.6)}, now=10.05) == {"p0": pytest.approx(0.3)}
    # Repeated unchanged: nothing new.
    assert heard.heard("b", {"p0": _prefill(50.3, 0.5)}, now=11.0) == {}
    # Words lost in an outage: the difference, at most what it has left plus the time
    # since its last word (the rest was worked off meanwhile).
    assert heard.heard("b", {"p0": _prefill(60.3, 1.0)}, now=14.0) == {"p0": pytest.approx(4.0)}
    assert heard.heard("b", {"p0": _prefill(61.3, 1.0)}, now=14.1) == {"p0": pytest.approx(1.0)}
    # Restarted: its total began again; what it has left counts.
    assert heard.heard("b", {"p0": _prefill(0.2, 0.2)}, now=15.0) == {"p0": 0.2}
    # Gone and back: first heard again.
    heard.gone("b")
    assert heard.heard("b", {"p0": _prefill(0.5, 0.1)}, now=16.0) == {"p0": 0.1}


def test_the_others_legs_on_an_engine_add_up() -> None:
    heard = Heard()
    heard.heard("b", {"p0": EngineWord(9.0, 0.5, 2, 1000, 0, 0)}, now=10.0)
    heard.heard(
        "c",
        {"p0": EngineWord(1.0, 0.1, 1, 2000, 0, 0), "d0": EngineWord(0.0, 0.0, 0, 0, 2, 3000)},
        now=10.2,
    )
    seen = heard.others_on("p0", ["b", "c"], until=12.5)
    assert (seen.source, seen.prefill, seen.decode, seen.until) == ("replicas", 3, 0, 12.5)
    assert seen.prefill_tokens == 1000  # (1000 + 2000) / 3 legs
    on_d0 = heard.others_on("d0", ["b", "c"], until=12.5)
    assert (on_d0.prefill, on_d0.decode, on_d0.decode_tokens) == (0, 2, 1500)
    # An engine no other member has load on: none, not unknown.
    nothing = heard.others_on("p9", ["b", "c"], until=12.5)
    assert (nothing.prefill, nothing.decode) == (0, 0)


def test_another_replica_is_busy_on_an_engine_while_it_says_it_has_work_booked_there() -> None:
    heard = Heard()
    assert heard.busy_on("p0", ["b"]) is True  # never heard: it may have
    heard.heard("b", {"p0": _prefill(1.0, 0.2), "p1": _prefill(3.0, 0.0)}, now=10.0)
    assert heard.busy_on("p0", ["b"]) is True
    assert heard.busy_on("p1", ["b"]) is False
    assert heard.busy_on("p2", ["b"]) is False
    assert heard.busy_on("p0", []) is False
