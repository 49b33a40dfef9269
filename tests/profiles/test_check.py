"""narwhal-check against the simulator: a healthy fleet passes, each misconfiguration fails."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import attrs
import pytest
import trio

from narwhal.config import Config
from narwhal.probe import (
    CheckPlan,
    CheckReport,
    CheckRow,
    EngineClient,
    SweepFailed,
    SweepPlan,
    format_table,
    metrics_row,
    profile_fleet,
    run_check,
)
from narwhal.profiles import read_store, save_profiles
from narwhal.sim import Fleet, SimEngineSpec, SimTiming

from ..support import StartFleet
from .helpers import config_for, prefill, store_for

Role = Literal["prefill", "decode", "both"]
PLAN = CheckPlan(handoff_samples=1, handoff_sizes=(64, 2048), lease_max_s=5.0, lease_poll_s=0.01)


async def build_of(config: Config, index: int = 0) -> str:
    client = EngineClient(config.engines[index], config.engine)
    try:
        return (await client.identity()).build_identity
    finally:
        await client.aclose()


async def setup(
    fleet: Fleet, tmp_path: Path, *, profile: bool = True, build: str | None = None, **sections: Any
) -> Config:
    urls = {f"e{i}": handle.url for i, handle in enumerate(fleet)}
    path = tmp_path / "profiles.json"
    config = config_for(urls, profiles=str(path), **sections)
    if profile:
        save_profiles(store_for(urls, build=build or await build_of(config)), path)
    return config


def rows(report: CheckReport, check: str) -> dict[str, CheckRow]:
    return {row.target: row for row in report.rows if row.check == check}


def statuses(report: CheckReport, check: str) -> dict[str, str]:
    return {target: row.status for target, row in rows(report, check).items()}


async def test_healthy_fleet_passes(start_fleet: StartFleet, tmp_path: Path) -> None:
    fleet = await start_fleet(engines=2, speed=1.0, lease_s=0.5)
    config = await setup(fleet, tmp_path, serving={"handoff_timeout_s": 0.2})
    progress: list[str] = []
    report = await run_check(config, PLAN, progress=progress.append)
    assert not report.failed, format_table(report.rows)
    assert [row.status for row in report.rows] == ["pass"] * len(report.rows)
    assert [(r.check, r.target) for r in report.rows] == [
        ("health", "e0"),
        ("health", "e1"),
        ("tokenize", "e0"),
        ("tokenize", "e1"),
        ("metrics", "e0"),
        ("metrics", "e1"),
        ("profile", "e0"),
        ("profile", "e1"),
        ("handoff", "e0 -> e1"),
        ("handoff", "e1 -> e0"),
        ("lease", "e0"),
        ("lease", "e1"),
        ("handoff-wait", "e0 -> e1"),
        ("handoff-wait", "e1 -> e0"),
        ("first-token", "fleet"),
    ]
    assert len(progress) == len(report.rows)
    # The lease is a lower bound of the lease the engine kept: below the configured 0.5 s
    # by a poll period plus however late this busy process ran its polls, and above it by
    # however late the simulator (in this process) ran its expiry (0.50008 s seen once).
    for lease in report.lease_by_engine.values():
        assert 0.3 <= lease < 0.75
    assert report.lease_s == min(report.lease_by_engine.values())
    assert rows(report, "lease")["e0"].limit == "> 0.2 s (serving.handoff_timeout_s)"
    assert rows(report, "handoff-wait")["e0 -> e1"].measured.startswith("decode ok after 2")
    tokenize = rows(report, "tokenize")["e0"]
    assert tokenize.note.startswith("= usage.prompt_tokens ")
    metrics = rows(report, "metrics")["e0"]
    assert metrics.measured == "running 0, waiting 0"
    assert metrics.note == "restart signals: process_start_time_seconds, prompt_tokens_total"
    assert report.crossed_p99_s is not None
    assert report.crossed_p99_s < 0.2
    first = rows(report, "first-token")["fleet"]
    assert first.limit == "< 2.5 s (engine.first_token_timeout_s)"
    assert "from check" in first.note
    assert "and profile" in first.note
    facts = report.facts()
    assert facts.lease_s == report.lease_s
    assert facts.builds == report.builds
    table = format_table(report.rows)
    # The limits name their settings: no room for notes beside them, so they go under.
    assert " ".join(table.splitlines()[:2]).split() == [
        "check",
        "engine/pair",
        "result",
        "measured",
        "limit",
        "note",
    ]
    assert "handoff-wait  e0 -> e1     PASS" in table


async def test_handoff_cap_above_the_lease_fails(start_fleet: StartFleet, tmp_path: Path) -> None:
    fleet = await start_fleet(engines=2, speed=1.0, lease_s=0.2)
    config = await setup(fleet, tmp_path, serving={"handoff_timeout_s": 0.5})
    report = await run_check(config, PLAN)
    assert report.failed
    lease = rows(report, "lease")
    assert {row.status for row in lease.values()} == {"fail"}
    assert lease["e0"].note == "set serving.handoff_timeout_s below the lease"
    assert lease["e0"].measured.startswith("verified >= ")
    assert lease["e0"].value is not None
    assert lease["e0"].value < 0.2
    assert report.lease_s is not None
    assert report.lease_s < 0.5
    assert statuses(report, "handoff-wait") == {"e0 -> e1": "skip", "e1 -> e0": "skip"}
    # Everything else is fine: only the lease rows fail.
    failing = {(r.check, r.target) for r in report.rows if r.status == "fail"}
    assert failing == {("lease", "e0"), ("lease", "e1")}


async def test_without_a_cap_the_request_deadline_is_compared(
    start_fleet: StartFleet, tmp_path: Path
) -> None:
    fleet = await start_fleet(engines=1, speed=1.0, lease_s=0.3)
    config = await setup(fleet, tmp_path, serving={"request_timeout_s": 30.0})
    report = await run_check(config, PLAN)
    assert not report.failed, format_table(report.rows)
    (lease,) = rows(report, "lease").values()
    assert lease.status == "warn"
    assert "no positive serving.handoff_timeout_s" in lease.note
    assert statuses(report, "handoff-wait") == {"e0 -> e0": "skip"}
    # One engine: the self pair is verified.
    assert statuses(report, "handoff") == {"e0 -> e0": "pass"}


async def test_too_low_first_token_timeout_fails(start_fleet: StartFleet, tmp_path: Path) -> None:
    # A 2.5 GB/s KV link: a 7000-token handoff takes ~370 ms, a short one ~15 ms, so short
    # verification legs pass a 250 ms limit while the p99 over the context range does not.
    # (With 100 ms against ~10 ms, a loaded CI box once pushed a short leg over.)
    slow_link = SimTiming(kv_link_bytes_per_s=2.5e9)
    fleet = await start_fleet(engines=2, speed=1.0, lease_s=0.5, timing=slow_link)
    config = await setup(fleet, tmp_path, engine={"first_token_timeout_s": 0.25})
    report = await run_check(config, attrs.evolve(PLAN, handoff_sizes=(64, 7000)))
    assert report.failed
    first = rows(report, "first-token")["fleet"]
    assert first.status == "fail"
    assert first.value is not None
    assert first.value > 0.3
    assert first.note.endswith("raise engine.first_token_timeout_s above it")
    assert first.limit == "< 0.25 s (engine.first_token_timeout_s)"
    assert statuses(report, "handoff") == {"e0 -> e1": "pass", "e1 -> e0": "pass"}


async def test_first_token_timeout_below_every_leg_fails_the_pairs(
    start_fleet: StartFleet, tmp_path: Path
) -> None:
    fleet = await start_fleet(engines=2, speed=1.0, lease_s=0.5)
    config = await setup(fleet, tmp_path, engine={"first_token_timeout_s": 0.001})
    report = await run_check(config, attrs.evolve(PLAN, measure_lease=False))
    assert statuses(report, "handoff") == {"e0 -> e1": "fail", "e1 -> e0": "fail"}
    assert rows(report, "handoff")["e0 -> e1"].measured == "prefill > 0.001 s"
    assert statuses(report, "lease") == {"e0": "skip", "e1": "skip"}


async def test_engine_whose_handoff_fails(start_fleet: StartFleet, tmp_path: Path) -> None:
    fleet = await start_fleet(engines=2, speed=1.0, lease_s=0.5)
    fleet[1].set_faults(kv_pull_fail=True, leg="decode")
    config = await setup(fleet, tmp_path, serving={"handoff_timeout_s": 0.2})
    report = await run_check(config, PLAN)
    assert report.failed
    assert statuses(report, "handoff") == {"e0 -> e1": "fail", "e1 -> e0": "pass"}
    bad = rows(report, "handoff")["e0 -> e1"]
    assert bad.note == "decode on e1: Internal server error"
    assert statuses(report, "handoff-wait") == {"e0 -> e1": "fail", "e1 -> e0": "pass"}
    assert "decode on e1" in rows(report, "handoff-wait")["e0 -> e1"].note
    assert statuses(report, "health") == {"e0": "pass", "e1": "pass"}


async def test_engine_down(start_fleet: StartFleet, tmp_path: Path) -> None:
    fleet = await start_fleet(engines=2, speed=1.0, lease_s=0.5)
    config = await setup(fleet, tmp_path, serving={"handoff_timeout_s": 0.2})
    await fleet[1].go_down()
    report = await run_check(config, PLAN)
    assert report.failed
    health = rows(report, "health")
    assert health["e0"].status == "pass"
    assert health["e1"].status == "fail"
    assert health["e1"].measured == "unreachable"
    assert "connection refused" in health["e1"].note
    assert statuses(report, "tokenize") == {"e0": "pass", "e1": "fail"}
    assert statuses(report, "metrics") == {"e0": "pass", "e1": "fail"}
    assert rows(report, "metrics")["e1"].note == "unhealthy"
    assert statuses(report, "handoff") == {"e0 -> e1": "fail", "e1 -> e0": "fail"}
    assert rows(report, "handoff")["e0 -> e1"].note == "e1 unhealthy"
    assert statuses(report, "lease") == {"e0": "pass", "e1": "fail"}
    assert statuses(report, "profile") == {"e0": "pass", "e1": "fail"}


@pytest.mark.parametrize("case", ["missing", "stale"])
async def test_profile_missing_or_stale(start_fleet: StartFleet, tmp_path: Path, case: str) -> None:
    fleet = await start_fleet(engines=2, speed=4.0, build="build-2")
    if case == "missing":
        config = await setup(fleet, tmp_path, profile=False)
    else:
        old = "vllm 0.29.0 [build-1] model=sim-llama-3-8b max_model_len=8192"
        config = await setup(fleet, tmp_path, build=old)
    report = await run_check(config, attrs.evolve(PLAN, measure_lease=False))
    profile = rows(report, "profile")
    assert {row.status for row in profile.values()} == {"fail"}
    if case == "missing":
        assert profile["e0"].measured == "no store"
        assert "profile store is missing" in profile["e0"].note
    else:
        assert profile["e0"].measured == "stale"
        assert profile["e0"].note == (
            "engine build is 'vllm 0.32.0 [build-2] model=sim-llama-3-8b max_model_len=8192', "
            "profiled on 'vllm 0.29.0 [build-1] model=sim-llama-3-8b max_model_len=8192'; "
            "run narwhal-profile again"
        )
    # Without a usable store the p99 still comes from the check's own handoffs.
    assert statuses(report, "first-token") == {"fleet": "pass"}


async def test_a_poor_fit_is_a_warning(start_fleet: StartFleet, tmp_path: Path) -> None:
    fleet = await start_fleet(engines=2, speed=4.0)
    config = await setup(fleet, tmp_path)
    store, _ = read_store(config.profiles.path)
    assert store is not None
    poor = attrs.evolve(prefill(), residual_p90=0.3, residual_max=0.35, points=10)
    e1 = attrs.evolve(store.engines["e1"], prefill=poor)
    save_profiles(attrs.evolve(store, engines={**store.engines, "e1": e1}), config.profiles.path)
    report = await run_check(config, attrs.evolve(PLAN, measure_lease=False))
    assert not report.failed
    profile = rows(report, "profile")
    assert statuses(report, "profile") == {"e0": "pass", "e1": "warn"}
    assert profile["e1"].measured == "poor fit"
    assert profile["e1"].note.startswith(
        "engine 'e1': prefill fit residual p90 30.0% (max 35.0% over 10 measured points) is "
        "above 25%: the model misses its own measurements by that much, so this engine's "
        "predicted prefill time, which admission's TTFT projections and prefill load are "
        "made of, can be that far off"
    )


def sglang_config(
    fleet: Fleet, tmp_path: Path, roles: list[Role] | None = None, **sections: Any
) -> Config:
    """The config of an SGLang fleet; `roles` None keeps config_for's."""
    urls = {f"e{i}": handle.url for i, handle in enumerate(fleet)}
    config = config_for(
        urls,
        profiles=str(tmp_path / "profiles.json"),
        serving={"handoff_timeout_s": 0.5},
        **sections,
    )
    # The simulator's bootstrap port is the prefill engine's own HTTP port, which the
    # config loader rejects for a real fleet; set it past the loader.
    engines = tuple(
        attrs.evolve(
            spec,
            dialect="sglang",
            bootstrap_port=handle.port,
            role=spec.role if roles is None else roles[i],
        )
        for i, (spec, handle) in enumerate(zip(config.engines, fleet, strict=True))
    )
    return attrs.evolve(config, engines=engines)


SGLANG_PLAN = attrs.evolve(
    SweepPlan.fast(),
    prefill_sizes=(16, 1024),
    decode_active=(1, 4),
    decode_contexts=(256,),
    handoff_sizes=(64, 512),
    handoff_repeats=1,
)


async def test_sglang_fleet_profiles_and_checks(start_fleet: StartFleet, tmp_path: Path) -> None:
    fleet = await start_fleet(engines=2, speed=4.0, dialect="sglang")
    config = sglang_config(fleet, tmp_path)
    store = await profile_fleet(config, SGLANG_PLAN)
    save_profiles(store, config.profiles.path)
    assert store.chars_per_token.keys() == {"sglang"}
    for profile in store.engines.values():
        assert profile.build.startswith("sglang 0.5.23 [")
        assert profile.kv_capacity_source == "sglang /get_server_info max_total_num_tokens"
        assert profile.max_num_seqs == SimTiming().max_num_seqs
        assert profile.max_num_seqs_source == "sglang /get_server_info max_running_requests"
    for handoff in store.handoffs.values():
        for bucket in handoff.buckets:
            # Concurrent legs: the decode's first token waits for the prefill too.
            assert bucket.first_token_p50_s >= bucket.p50_s
    report = await run_check(config, PLAN)
    assert not report.failed, format_table(report.rows)
    # SGLang serves prometheus multiprocess mode: no process metrics, a counter only.
    assert rows(report, "metrics")["e0"].note == "restart signals: prompt_tokens_total"
    assert statuses(report, "lease") == {"e0": "skip", "e1": "skip"}
    assert statuses(report, "handoff-wait") == {"e0": "skip", "e1": "skip"}
    assert statuses(report, "handoff") == {"e0 -> e1": "pass", "e1 -> e0": "pass"}


@pytest.mark.parametrize("newer", [False, True], ids=["older", "newer"])
async def test_the_tokenize_row_says_whether_an_sglang_build_counts_chat(
    start_fleet: StartFleet, tmp_path: Path, newer: bool
) -> None:
    spec = SimEngineSpec(dialect="sglang", tokenize_messages=newer)
    fleet = await start_fleet(engines=1, speed=4.0, spec=spec)
    config = sglang_config(fleet, tmp_path)
    # The vocabulary row rides along: only a fleet without engine.vocab_size gets it.
    vocab_size = 32000 if newer else None
    config = attrs.evolve(config, engine=attrs.evolve(config.engine, vocab_size=vocab_size))
    report = await run_check(config, attrs.evolve(PLAN, measure_lease=False), store_problems=[])
    row = rows(report, "tokenize")["e0"]
    assert row.status == "pass", format_table(report.rows)
    if vocab_size is None:
        vocabulary = rows(report, "vocabulary")["e0"]
        assert (vocabulary.status, vocabulary.measured) == ("warn", "token ids unchecked")
        assert "set engine.vocab_size" in vocabulary.note
    else:
        assert rows(report, "vocabulary") == {}
    prompt_note, chat_note = row.note.split("; ")
    assert prompt_note.startswith("= usage.prompt_tokens ")
    if newer:
        assert chat_note.startswith("chat: exact, ")
        assert chat_note.endswith(" tokens from /tokenize's messages form")
    else:
        assert chat_note == (
            "chat: estimated at the chars ratio: this SGLang build's /tokenize takes no "
            "messages (HTTP 400)"
        )


def test_metrics_row_names_what_the_monitor_could_not_read() -> None:
    gauges = b"vllm:num_requests_running 2\nvllm:num_requests_waiting 1\n"
    plain = metrics_row("e0", "vllm", 200, gauges)
    assert (plain.status, plain.measured) == ("warn", "running 2, waiting 1")
    assert plain.note.startswith("no restart signal: a restart quicker than ")
    stats_off = metrics_row("e0", "vllm", 200, b"process_start_time_seconds 1.7e9\n")
    assert (stats_off.status, stats_off.measured) == ("fail", "no load gauges")
    assert stats_off.note == (
        "GET /metrics lacks vllm:num_requests_running, vllm:num_requests_waiting; the monitor "
        "would report this engine missing every pass (vLLM publishes them unless started "
        "with --disable-log-stats)"
    )
    fresh = metrics_row("e1", "sglang", 200, b'sglang:max_total_num_tokens{tp_rank="0"} 8192.0\n')
    assert (fresh.status, fresh.measured) == ("pass", "not yet published")
    assert fresh.note.startswith("a fresh SGLang server publishes its running and waiting ")
    sglang = metrics_row("e1", "sglang", 200, b"")
    assert sglang.status == "fail"
    assert sglang.note.endswith("(SGLang publishes them when started with --enable-metrics)")
    missing = metrics_row("e0", "sglang", 404, b"not found")
    assert (missing.status, missing.measured) == ("fail", "HTTP 404")
    assert missing.note == (
        "the monitor would report this engine missing every pass (SGLang publishes them when "
        "started with --enable-metrics)"
    )


async def test_sglang_pd_fleet_profiles_and_checks_in_bootstrap_pairs(
    start_fleet: StartFleet, tmp_path: Path
) -> None:
    modes: list[Role] = ["prefill", "decode", "decode"]
    fleet = await start_fleet(engines=3, speed=4.0, dialect="sglang", disaggregation_modes=modes)
    config = sglang_config(fleet, tmp_path, modes)
    lines: list[str] = []
    store = await profile_fleet(config, SGLANG_PLAN, progress=lines.append)
    save_profiles(store, config.profiles.path)
    # Only prefill -> decode pairs exist on a P/D fleet.
    assert set(store.handoffs) == {("e0", "e1"), ("e0", "e2")}
    p0, d1, d2 = (store.engines[e] for e in ("e0", "e1", "e2"))
    assert p0.prefill_source.startswith("bootstrap pairs with decode partner 'e1': ")
    assert "includes the bootstrap handshake and the KV transfer" in p0.prefill_source
    # A prefill server never decodes: its decode model is its partner's, and says so.
    assert p0.decode == d1.decode
    assert p0.decode_source == "decode partner 'e1''s model: an SGLang prefill server never decodes"
    for d in (d1, d2):
        assert d.prefill == p0.prefill
        assert d.prefill_source.startswith("prefill partner 'e0''s model")
        assert d.decode_source.startswith("bootstrap pairs with prefill partner 'e0': ")
        assert d.decode.samples > 0
    said = [line.split("] ", 1)[1] for line in lines]
    assert "e1: prefill not measured: an SGLang decode server computes no prompt" in said
    assert "e0: decode not measured: an SGLang prefill server never decodes" in said
    # The sources survive the store's JSON.
    reread = await trio.to_thread.run_sync(read_store, config.profiles.path)
    assert reread[0] is not None
    assert reread[0].engines["e0"].decode_source == p0.decode_source
    report = await run_check(config, PLAN)
    assert not report.failed, format_table(report.rows)
    assert statuses(report, "launch-mode") == {"e0": "pass", "e1": "pass", "e2": "pass"}
    assert rows(report, "launch-mode")["e1"].measured == "decode"
    assert statuses(report, "tokenize") == {"e0": "pass", "e1": "pass", "e2": "pass"}
    assert statuses(report, "handoff") == {"e0 -> e1": "pass", "e0 -> e2": "pass"}
    # Nothing waits between SGLang's legs: no pair to name, least of all a decode server
    # first (the rotation would give e1 -> e2 and e2 -> e0).
    wait = rows(report, "handoff-wait")
    assert statuses(report, "handoff-wait") == {"e0": "skip", "e1": "skip", "e2": "skip"}
    assert wait["e1"].note == "SGLang sends both legs at once; no handoff waits between them"
    assert wait["e1"].limit == "decode ok 0.5 s after prefill start (serving.handoff_timeout_s)"
    # The simulator served no plain generation request: every one came in a pair.
    refused = [o for h in fleet for o in h.state()["outcomes"] if o["status"] == 400]
    assert refused == []


async def test_sglang_engine_launched_in_another_mode_fails_the_check(
    start_fleet: StartFleet, tmp_path: Path
) -> None:
    fleet = await start_fleet(
        engines=3, speed=4.0, dialect="sglang", disaggregation_modes=["prefill", "decode", "null"]
    )
    config = sglang_config(fleet, tmp_path, ["prefill", "decode", "decode"])
    uncapped = attrs.evolve(config.serving, handoff_timeout_s=0.0)
    report = await run_check(
        attrs.evolve(config, serving=uncapped), attrs.evolve(PLAN, handoff_samples=0)
    )
    assert report.failed
    assert statuses(report, "launch-mode") == {"e0": "pass", "e1": "pass", "e2": "fail"}
    # Without a cap the rows still say why SGLang has nothing to wait for.
    skipped = (
        "serving.handoff_timeout_s=0",
        "SGLang sends both legs at once; no handoff waits between them",
    )
    wait = {r.target: (r.limit, r.note) for r in report.rows if r.check == "handoff-wait"}
    assert wait == dict.fromkeys(("e0", "e1", "e2"), skipped)
    # Not paired: e2 would not join the bootstrap room, and e0 would wait out its timeout.
    assert rows(report, "handoff")["e0 -> e2"].note == "e2 failed its launch-mode check"
    assert rows(report, "tokenize")["e2"].note == "failed its launch-mode check"
    assert rows(report, "launch-mode")["e2"].note == (
        "engine 'e2' has role 'decode' in the config but reports disaggregation_mode='null'; "
        "launch it with --disaggregation-mode decode or change its role"
    )
    with pytest.raises(SweepFailed, match=r"^engine 'e2' has role 'decode' in the config but "):
        await profile_fleet(config, SGLANG_PLAN)


async def test_a_tokenize_count_the_engine_does_not_charge_fails_the_row(
    start_fleet: StartFleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Exact counts price admission, placement and KV: one that disagrees with what the
    # engine charges for the same prompt (usage.prompt_tokens) is a failure, not a pass.
    fleet = await start_fleet(engines=2, speed=20.0)
    config = await setup(fleet, tmp_path)
    exact = EngineClient.tokenize

    async def one_off(self: EngineClient, text: str) -> tuple[int | None, object]:
        count, doc = await exact(self, text)
        if self.id == "e1" and count is not None:
            count += 1
            assert isinstance(doc, dict)
            doc = {**doc, "tokens": [*doc["tokens"], 0]}
        return count, doc

    monkeypatch.setattr(EngineClient, "tokenize", one_off)
    report = await run_check(config, PLAN)
    assert statuses(report, "tokenize") == {"e0": "pass", "e1": "fail"}
    row = rows(report, "tokenize")["e1"]
    counted = int(row.measured.removesuffix(" tokens"))
    assert row.note == f"the engine charged usage.prompt_tokens={counted - 1} for the same prompt"
