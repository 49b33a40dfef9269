"""prefix_goodput.py's pure pieces: the workload at a rate, what run_one replays, which
vllm-router policies go on past the first rate, and the summary's goals."""

from __future__ import annotations

from typing import Any

import goodput
import prefix_goodput as pg
import pytest
from benchkit import sessions


def test_a_rate_multiplies_the_arrival_rate_and_the_sessions_of_the_window() -> None:
    base = sessions.SessionParams(sessions_per_s=2.0, think_s=5.0, seed=3)
    at = pg.params_at(base, 1.5, 40.0)
    assert (at.sessions_per_s, at.sessions) == (3.0, 120)
    assert (at.think_s, at.seed, at.system_tokens) == (5.0, 3, base.system_tokens)
    assert pg.params_at(base, 0.001, 10.0).sessions == 1


def _request(at: float, words: int, turn: int = 0) -> sessions.SessionRequest:
    return sessions.SessionRequest(at, 0, turn, 0, " w" * words, words, 0, 7)


def test_replayable_keeps_the_texts_and_ends_the_phase_past_the_last_arrival() -> None:
    rows, prompts, bounds = pg.replayable([_request(0.5, 3), _request(12.25, 5, 1)])
    assert [(r.t, r.prompt, r.output) for r in rows] == [(0.5, 3, 7), (12.25, 5, 7)]
    assert prompts == [" w w w", " w w w w w"]
    assert bounds == [("sessions", 0.0, 13.0)]


def _run(rate: float, attainment: float | None, per_s: float = 10.0) -> dict[str, Any]:
    if attainment is None:
        return {"rate": rate, "status": "failed", "reason": "boom"}
    return {"rate": rate, "status": "ran", "attainment": attainment, "offered_per_s": per_s}


def test_finalists_are_the_peers_best_at_their_first_rate() -> None:
    sweeps = {
        "narwhal-aware": [_run(1.0, 1.0)],
        "vllm-router-random": [_run(1.0, 0.80)],
        "vllm-router-round_robin": [_run(1.0, 0.85), _run(0.5, 0.99)],
        "vllm-router-cache_aware": [_run(1.0, 0.85)],
        "vllm-router-kv_aware": [_run(1.0, None)],
    }
    # Ties go by name; Narwhal's configurations are never among them.
    assert pg.finalists(sweeps, 2) == ["vllm-router-cache_aware", "vllm-router-round_robin"]
    assert pg.finalists(sweeps, 5)[-1] == "vllm-router-kv_aware"


def test_the_summary_compares_aware_with_blind_and_with_the_best_policy() -> None:
    sweeps = {
        "narwhal-blind": [_run(1.0, 0.95, 10.0), _run(1.5, 0.85, 15.0)],
        "narwhal-aware": [_run(1.0, 0.99, 10.0), _run(1.5, 0.97, 15.0), _run(2.0, 0.93, 20.0)],
        "vllm-router-round_robin": [_run(1.0, 0.5, 10.0)],
        "vllm-router-cache_aware": [_run(1.0, 0.92, 10.0), _run(1.5, 0.7, 15.0)],
    }
    s = pg.summary(sweeps, 0.9)
    assert s["goodput"]["narwhal-blind"] == {"rate": 1.25, "per_s": 12.5, "kind": "interpolated"}
    assert s["goodput"]["narwhal-aware"]["kind"] == "at_least"
    assert s["best_peer"] == "vllm-router-cache_aware"
    assert s["aware_vs_blind"] == {"ratio": 1.6, "kind": "at_least"}
    assert s["aware_vs_best_peer"]["ratio"] == pytest.approx(2.0 / 1.0455, abs=1e-3)


def test_blind_and_aware_are_narwhal_full_apart_from_the_cache_section() -> None:
    blind, aware = pg.narwhal_configs(2)
    full = next(c for c in goodput.CONFIGURATIONS if c.name == "narwhal-full")
    for cfg in (blind, aware):
        assert (cfg.admission, cfg.controller, cfg.prepare, cfg.split) == (
            full.admission,
            full.controller,
            full.prepare,
            2,
        )
    assert blind.narwhal_extra == {
        "cache": {"approximate_ttl_s": 0, "affinity": 0.0, "local_prefill_share": 1.0}
    }
    assert aware.narwhal_extra == {}
    assert pg.peer_config("cache_aware", 2).policy == "cache_aware"


def test_a_request_log_turns_on_narwhal_s_log_and_the_engines_cached_tokens() -> None:
    plain = pg.parse_args(["--traces", "t"])
    logged = pg.parse_args(["--traces", "t", "--request-log"])
    assert "--enable-prompt-tokens-details" not in pg.sim_args(plain)
    assert "--enable-prompt-tokens-details" in pg.sim_args(logged)
    assert (plain.request_log, logged.request_log) == (False, True)
