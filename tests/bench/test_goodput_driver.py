from __future__ import annotations

from typing import Any

import goodput
import pytest
from benchkit import harness, workload as gw

from narwhal.config import load_config


def test_assign_roles_spreads_each_pool_over_the_sim_processes() -> None:
    groups = [["a0", "a1", "a2", "a3"], ["b0", "b1", "b2", "b3"]]
    for prefill in range(1, 8):
        urls, roles = harness.assign_roles(groups, prefill)
        assert sorted(urls) == sorted(groups[0] + groups[1])
        assert roles.count("prefill") == prefill
        per_proc = [
            sum(r == "prefill" for u, r in zip(urls, roles, strict=True) if u[0] == g) for g in "ab"
        ]
        assert abs(per_proc[0] - per_proc[1]) <= 1
    with pytest.raises(ValueError, match=r"must be within 0\.\.8"):
        harness.assign_roles(groups, 9)


def test_narwhal_config_is_valid_and_in_wall_time() -> None:
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(8)]
    roles = ["prefill"] * 3 + ["decode"] * 5
    doc = harness.narwhal_config(
        urls,
        roles,
        port=8999,
        speed=0.25,
        admission="open",
        controller=False,
        ttft_slo_s=0.5,
        tpot_slo_s=0.05,
        socket_path="runs/tmp/x.sock",
        extra={"serving": {"max_connections": 1024}},
    )
    config = load_config(doc)
    assert config.slo.ttft_s == 2.0
    assert config.slo.tpot_s == 0.2
    assert config.engine.first_token_timeout_s == 10.0
    assert config.serving.admission == "open"
    assert config.serving.max_connections == 1024
    assert not config.controller.enabled
    assert [e.role for e in config.engines] == roles


def test_configurations_cover_the_issue() -> None:
    names = {c.name for c in goodput.CONFIGURATIONS}
    assert {f"narwhal-static-{p}p{8 - p}d" for p in range(1, 8)} <= names
    assert {"narwhal-open", "vllm-router-best", "vllm-router-4p4d", "narwhal-full"} <= names
    assert "narwhal-predictive" in names
    needs = {c.name: set(c.requires) for c in goodput.CONFIGURATIONS}
    assert needs["narwhal-full"] == {"predictive_admission", "controller"}
    assert set(goodput.FEATURES) == {"predictive_admission", "controller"}
    with pytest.raises(SystemExit, match=r"unknown configuration"):
        goodput.select("narwhal-static-9p0d")


def test_modelled_fit_is_one_for_the_modelled_best() -> None:
    cap = gw.MixCapacity("p", 4, 100.0, 100.0, 25.0, 25.0, 100)
    assert goodput.modelled_fit(4, [cap]) == 1.0
    assert goodput.modelled_fit(1, [cap]) == 0.25


def _ran(split: str, goodputs: dict[str, float]) -> dict[str, Any]:
    phases = {
        p: {"goodput_per_s": g, "attainment": g / 10, "passing": int(g * 10)}
        for p, g in goodputs.items()
    }
    return {"status": "ran", "split": split, "phases": phases}


def test_summary_finds_the_bar_and_the_per_phase_oracle() -> None:
    results = {
        "narwhal-static-3p5d": _ran("3P5D", {"a": 9.0, "b": 2.0, "all": 5.5}),
        "narwhal-static-6p2d": _ran("6P2D", {"a": 4.0, "b": 8.0, "all": 6.0}),
        "vllm-router-best": _ran("6P2D", {"a": 3.0, "b": 6.0, "all": 4.5}),
        "narwhal-full": {"status": "skipped", "reason": "not available yet"},
    }
    s = goodput.summary(results, ["a", "b"])
    assert s["best_static"] == "narwhal-static-6p2d"
    assert s["best_static_per_phase"] == {"a": "narwhal-static-3p5d", "b": "narwhal-static-6p2d"}
    assert s["per_phase_oracle_passing"] == 90 + 80
    assert s["goodput_vs_best_static"]["vllm-router-best"]["all"] == 0.75
    assert "narwhal-full" not in s["goodput_vs_best_static"]


def test_role_changes_count_engine_flips() -> None:
    samples = [
        {"roles": ["prefill", "decode", "decode"]},
        {"roles": ["prefill", "decode", "decode"]},
        {"roles": ["prefill", "prefill", "decode"]},
        {"roles": ["decode", "decode", "decode"]},
    ]
    assert goodput.role_changes(samples) == 3
    assert goodput.role_changes(samples[:1]) == 0


def test_pool_series_sums_each_pool() -> None:
    samples = [
        {
            "t": 1.0,
            "roles": ["prefill", "decode", "decode"],
            "engines": [[2, 5, 0.1], [30, 0, 0.4], None],
        }
    ]
    series = goodput.pool_series(samples)
    assert series["prefill_engines"] == [1]
    assert series["prefill_waiting"] == [5]
    assert series["decode_running"] == [30]
    assert series["decode_kv_usage"] == [0.4]


def test_a_configuration_needing_a_disabled_feature_is_skipped_with_its_reason() -> None:
    full = goodput.select("narwhal-full")[0]
    off = dict.fromkeys(goodput.FEATURES, False)
    skipped = goodput.unavailable(full, off, "goodput")
    assert skipped is not None
    assert skipped["status"] == "skipped"
    assert "predictive_admission, controller" in skipped["reason"]
    assert goodput.unavailable(full, dict.fromkeys(goodput.FEATURES, True), "goodput") is None


def test_sampler_keeps_the_controllers_verdicts_only_when_they_change() -> None:
    sampler = harness.Sampler([], [], "http://127.0.0.1:1", speed=0.25, every_s=2.0)

    def section(reason: str, gate: str | None, proposed: dict[str, int]) -> dict[str, Any]:
        return {
            "enabled": True,
            "caller": "monitor",
            "reason": reason,
            "result": "held" if gate else "moved",
            "gate": gate,
            "rule": "prefill_queue",
            "split": {"current": {"prefill": 4, "decode": 4}, "proposed": proposed},
            "loads": {"measured": {"prefill": 0.9}},  # not part of a verdict
        }

    sampler._decision(0.0, {"enabled": True})  # no pass yet: nothing to record
    sampler._decision(4.0, section("grow prefill", "evidence_open", {"prefill": 5, "decode": 3}))
    sampler._decision(8.0, section("grow prefill", "evidence_open", {"prefill": 5, "decode": 3}))
    sampler._decision(12.0, section("grow prefill", None, {"prefill": 5, "decode": 3}))
    assert [(d["t"], d["gate"], d["result"]) for d in sampler.decisions] == [
        (1.0, "evidence_open", "held"),
        (3.0, None, "moved"),
    ]
    assert sampler.decisions[0]["proposed"] == {"prefill": 5, "decode": 3}
