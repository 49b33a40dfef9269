"""The prefix-structured workload: shared prefixes really shared (in narwhal-sim's token
ids), turns that extend the last, lengths within the context, and determinism by seed."""

from __future__ import annotations

import itertools

import attrs
import numpy as np
from benchkit import sessions, workload as gw

from narwhal.sim import Tokenizer


def trace(n: int = 5000, seed: int = 3) -> gw.Trace:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(0.2, n))
    return gw.Trace(
        "conv",
        t - t[0],
        rng.integers(200, 4000, n).astype(np.int64),
        rng.integers(5, 400, n).astype(np.int64),
    )


PARAMS = sessions.SessionParams(sessions=40, tenants=3, system_tokens=300, seed=7)


def test_every_turn_extends_the_last_and_tenants_share_their_system_prompt() -> None:
    requests = sessions.build(trace(), PARAMS)
    tok = Tokenizer()
    by_session: dict[int, list[sessions.SessionRequest]] = {}
    for r in requests:
        by_session.setdefault(r.session, []).append(r)
    system: dict[int, list[int]] = {}
    assert any(len(turns) > 1 for turns in by_session.values())
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        assert [r.turn for r in turns] == list(range(len(turns)))
        assert [r.at_s for r in turns] == sorted(r.at_s for r in turns)
        for prev, nxt in itertools.pairwise(turns):
            a, b = tok.encode(prev.prompt), tok.encode(nxt.prompt)
            # Token for token, as the simulator sees them.
            assert b[: len(a)] == a
            assert nxt.shared_words == len(a) == prev.prompt_words
        first = tok.encode(turns[0].prompt)
        assert len(first) == turns[0].prompt_words
        head = first[: PARAMS.system_tokens]
        assert system.setdefault(turns[0].tenant, head) == head
    assert len(system) == PARAMS.tenants
    # Different tenants' system prompts differ from their first token block on.
    heads = [tuple(v[:16]) for v in system.values()]
    assert len(set(heads)) == len(heads)
    for r in requests:
        assert r.prompt_words + r.max_tokens < PARAMS.limits.max_model_len
    assert 0.5 < sessions.shared_fraction(requests) < 1.0


def test_the_same_seed_gives_the_same_workload_and_another_seed_another() -> None:
    one = sessions.build(trace(), PARAMS)
    assert sessions.build(trace(), PARAMS) == one
    other = sessions.build(trace(), attrs.evolve(PARAMS, seed=8))
    assert [r.prompt for r in other] != [r.prompt for r in one]
    assert PARAMS.to_json()["seed"] == 7
    assert PARAMS.to_json()["limits"]["max_model_len"] == 8192
