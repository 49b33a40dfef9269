"""The versioned store: round trip, atomic save, and every reported mismatch."""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path
from typing import Any, Literal

import attrs
import pytest
import trio

from narwhal.profiles import (
    SCHEMA_VERSION,
    MeasuredFacts,
    ProfileStore,
    _store,
    check_store,
    crossed_pairs,
    load_profiles,
    poor_fits,
    save_profiles,
    store_from_json,
    store_to_json,
    verify_builds,
)

from ..support import fifo
from .helpers import BUILD, MODEL, config_for, decode, engine, prefill, store_for

URLS = {"p0": "http://127.0.0.1:8100", "d0": "http://127.0.0.1:8101"}


def write(path: Path, document: Any) -> None:
    path.write_text(json.dumps(document))


def test_round_trip_and_atomic_save(tmp_path: Path) -> None:
    facts = MeasuredFacts(
        measured_at="2026-01-01T00:00:00+00:00",
        lease_s=29.9,
        lease_by_engine={"p0": 29.9, "d0": 30.0},
        crossed_handoff_p99_s=0.04,
        builds={"p0": BUILD, "d0": BUILD},
    )
    store = attrs.evolve(store_for(URLS), facts=facts)
    path = tmp_path / "deep" / "profiles.json"
    save_profiles(store, path)
    assert os.listdir(path.parent) == ["profiles.json"]  # no temp file left behind
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    document = json.loads(path.read_text())
    assert document["schema_version"] == SCHEMA_VERSION
    assert document["handoffs"][0]["buckets"][0]["tokens"] == 64
    parsed, problems = store_from_json(document)
    assert problems == []
    assert parsed == store
    check = load_profiles(path, config_for(URLS))
    assert check.ok
    assert check.usable == {"p0", "d0"}
    assert check.messages == ()
    assert check.profile("p0") == store.engines["p0"]
    assert check.store is not None
    assert check.store.facts == facts
    assert check.store.handoff("p0", "d0") == store.handoffs[("p0", "d0")]
    assert check.handoff("p0", "d0") == store.handoffs[("p0", "d0")]
    assert check.store.handoff("d0", "d0") is None


def test_save_replaces_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "profiles.json"
    path.write_text("old")
    save_profiles(store_for(URLS), path)
    assert json.loads(path.read_text())["schema_version"] == SCHEMA_VERSION


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "none.json"
    check = load_profiles(path, config_for(URLS))
    assert not check.ok
    assert check.usable == frozenset()
    assert check.store is None
    assert check.messages == (
        f"{path}: profile store is missing; run narwhal-profile --config FILE",
    )
    assert check.profile("p0") is None
    assert check.mean_profile() is None


async def test_a_fifo_is_reported_not_waited_for(tmp_path: Path) -> None:
    # A reload reads the store again: opening a FIFO to read waits for a writer.
    with fifo(tmp_path / "profiles.json") as path, trio.fail_after(5):
        load = partial(load_profiles, path, config_for(URLS))
        check = await trio.to_thread.run_sync(load, abandon_on_cancel=True)
    assert check.messages == (
        f"{path}: cannot read profile store: it is a named pipe, not a regular file",
    )


def test_a_store_over_the_size_limit_is_reported_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "profiles.json"
    save_profiles(store_for(URLS), path)
    monkeypatch.setattr(_store, "STORE_FILE_LIMIT", path.stat().st_size - 1)
    assert load_profiles(path, config_for(URLS)).messages == (
        f"{path}: cannot read profile store: larger than {path.stat().st_size - 1} bytes",
    )


def test_default_path_comes_from_the_config(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    save_profiles(store_for(URLS), path)
    assert load_profiles(None, config_for(URLS, profiles=str(path))).ok


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[]", "expected a JSON object, got a list"),
        ('{"schema_version": 0}', "schema_version is 0; this Narwhal reads schema_version 1"),
        ('{"schema_version": "1"}', "schema_version is '1'"),
        ('{"schema_version": true}', "schema_version is True"),
        ('{"engines": {}}', "schema_version is None"),
        ('{"schema_version": 2, "engines": {}}', "schema_version is 2"),
    ],
)
def test_unreadable_or_wrong_schema_is_reported_not_raised(
    tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "profiles.json"
    path.write_text(content)
    check = load_profiles(path, config_for(URLS))
    assert check.store is None
    assert check.usable == frozenset()
    (only,) = check.messages
    assert only.startswith(f"{path}: ")
    assert message in only


def test_engine_missing_from_store_and_store_engine_not_configured(tmp_path: Path) -> None:
    path = tmp_path / "profiles.json"
    save_profiles(store_for({"p0": URLS["p0"], "x9": "http://127.0.0.1:9000"}), path)
    check = load_profiles(path, config_for(URLS))
    assert check.usable == {"p0"}
    assert not check.ok
    assert check.messages == (
        "engine 'd0': no profile in the store; run narwhal-profile",
        "engine 'x9': profiled in the store but not in the config (ignored)",
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"url": "http://127.0.0.1:9999"},
            "engine 'p0': url is 'http://127.0.0.1:8100' in the config but "
            "'http://127.0.0.1:9999' in the profile",
        ),
        (
            {"model": "other-model"},
            f"engine 'p0': model is {MODEL!r} in the config but 'other-model' in the profile",
        ),
        (
            {"dialect": "sglang"},
            "engine 'p0': dialect is 'vllm' in the config but 'sglang' in the profile",
        ),
    ],
)
def test_mismatched_engine_is_not_usable(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    store = store_for(URLS)
    engines = dict(store.engines)
    engines["p0"] = attrs.evolve(engines["p0"], **change)
    path = tmp_path / "profiles.json"
    save_profiles(attrs.evolve(store, engines=engines), path)
    check = load_profiles(path, config_for(URLS))
    assert check.usable == {"d0"}
    assert check.messages == (message,)
    assert check.profile("p0") is None
    assert check.profile("d0") is not None


def test_trailing_slash_in_url_is_not_a_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "profiles.json"
    save_profiles(store_for({"p0": URLS["p0"] + "/"}), path)
    assert load_profiles(path, config_for({"p0": URLS["p0"]})).ok


def test_malformed_entries_are_left_out_and_named(tmp_path: Path) -> None:
    document = store_to_json(store_for(URLS))
    engines = document["engines"]
    assert isinstance(engines, dict)
    engines["p0"]["prefill"]["a_s"] = "fast"
    del engines["d0"]["decode"]["t0_s"]
    engines["d0"]["color"] = "blue"
    handoffs = document["handoffs"]
    assert isinstance(handoffs, list)
    handoffs[0]["buckets"][1]["p99_s"] = -1.0
    document["facts"] = {"lease_s": "long"}
    path = tmp_path / "profiles.json"
    write(path, document)
    check = load_profiles(path, config_for(URLS))
    assert check.usable == frozenset()
    assert check.store is not None
    assert len(check.store.handoffs) == 1  # one of the two pairs survived
    assert check.store.facts is None
    text = "\n".join(check.messages)
    assert "engines.p0.prefill.a_s: expected a number, got 'fast'" in text
    assert "engines.d0.decode.t0_s: missing" in text
    assert "engines.d0: unknown field(s) color ignored" in text
    assert "handoffs[0] (d0 -> p0).buckets[1]: p99_s is -1.0; must be finite and >= 0" in text
    assert "facts: malformed" in text
    assert "engine 'p0': no profile in the store" in text


def test_fields_a_newer_sweep_added_are_ignored_and_named(tmp_path: Path) -> None:
    # A rollback to this Narwhal after a newer narwhal-profile rewrote the store: its
    # additions must not take every engine's profile, and predictive admission, away.
    document = store_to_json(store_for(URLS))
    engines = document["engines"]
    assert isinstance(engines, dict)
    engines["p0"]["gpu"] = "H100"
    engines["p0"]["prefill"]["cache_hit_a_s"] = 0.001
    path = tmp_path / "profiles.json"
    write(path, document)
    check = load_profiles(path, config_for(URLS))
    assert "p0" in check.usable
    assert check.usable == load_profiles(_plain(tmp_path), config_for(URLS)).usable
    assert [m for m in check.messages if "unknown" in m] == [
        f"{path}: engines.p0: unknown field(s) gpu ignored (a store written by a newer "
        "narwhal-profile?)",
        f"{path}: engines.p0.prefill: unknown field(s) cache_hit_a_s ignored (a store "
        "written by a newer narwhal-profile?)",
    ]


def _plain(tmp_path: Path) -> Path:
    path = tmp_path / "plain.json"
    write(path, store_to_json(store_for(URLS)))
    return path


def test_verify_builds_reports_a_changed_build(tmp_path: Path) -> None:
    path = tmp_path / "profiles.json"
    save_profiles(store_for(URLS), path)
    check = load_profiles(path, config_for(URLS))
    assert check.store is not None
    other = BUILD.replace("narwhal-sim test", "narwhal-sim next")
    problems = verify_builds(check.store, {"p0": other, "d0": BUILD, "zz": BUILD})
    assert problems == [
        f"engine 'p0': build is {other!r} but the profile was measured on {BUILD!r}; "
        "the profile is stale, run narwhal-profile again",
        f"engine 'zz': no profile to compare build {BUILD!r} against",
    ]
    after = check.with_builds({"p0": other, "d0": BUILD})
    assert after.usable == {"d0"}
    assert not after.ok
    assert after.profile("p0") is None
    assert check.with_builds({"p0": BUILD, "d0": BUILD}).ok


def test_mean_profile_averages_coefficients_over_the_common_domain() -> None:
    a = engine("a", "http://a:1", prefill=prefill(a=0.004, b=1e-5), decode=decode(t0=0.004))
    b = engine(
        "b",
        "http://b:1",
        prefill=attrs.evolve(prefill(a=0.008, b=3e-5), min_tokens=16, max_tokens=4000),
        decode=attrs.evolve(decode(t0=0.008), max_active=32, max_kv_tokens=60000),
        chars_per_token=3.5,
    )
    fleet = ProfileStore(engines={"a": a, "b": b})
    mean = fleet.mean_profile()
    assert mean is not None
    for n in (16, 1000, 4000):
        expected = (a.prefill.prefill_s(n) + b.prefill.prefill_s(n)) / 2
        assert mean.prefill.prefill_s(n) == pytest.approx(expected)
    expected_decode = (a.decode.interval_s(8, 5000) + b.decode.interval_s(8, 5000)) / 2
    assert mean.decode.interval_s(8, 5000) == pytest.approx(expected_decode)
    assert mean.decode.idle_floor_s == pytest.approx((0.004 + 0.008) / 2 + 1e-5)
    assert (mean.prefill.min_tokens, mean.prefill.max_tokens) == (16, 4000)
    assert (mean.decode.max_active, mean.decode.max_kv_tokens) == (32, 60000)
    assert mean.chars_per_token == pytest.approx(4.0)
    assert mean.id == "mean"
    only_a = fleet.mean_profile(["a", "missing"])
    assert only_a is not None
    assert only_a.prefill.prefill_s(100) == pytest.approx(a.prefill.prefill_s(100))
    assert fleet.mean_profile([]) is None
    assert ProfileStore(handoffs={}).max_handoff_p99_s() is None


def test_engine_cap_round_trips_and_stores_without_it_load_as_unknown() -> None:
    store = store_for(URLS)
    capped = attrs.evolve(
        store.engines["p0"], max_num_seqs=128, max_num_seqs_source="observed: test"
    )
    store = attrs.evolve(store, engines={**store.engines, "p0": capped})
    document: Any = store_to_json(store)
    parsed, problems = store_from_json(document)
    assert problems == []
    assert parsed == store
    assert parsed is not None
    assert parsed.engines["p0"].max_num_seqs == 128
    # A store written before the fields existed.
    for fields in document["engines"].values():
        del fields["max_num_seqs"], fields["max_num_seqs_source"]
    old, problems = store_from_json(document)
    assert problems == []
    assert old is not None
    assert {p.max_num_seqs for p in old.engines.values()} == {0}
    # The mean has a cap only when every engine's is known.
    one_unknown = store.mean_profile()
    assert one_unknown is not None
    assert one_unknown.max_num_seqs == 0
    both = attrs.evolve(
        store,
        engines={
            "p0": capped,
            "d0": attrs.evolve(store.engines["d0"], max_num_seqs=64),
        },
    )
    mean = both.mean_profile()
    assert mean is not None
    assert mean.max_num_seqs == 96


def test_fit_quality_round_trips_and_stores_without_it_load_unjudged() -> None:
    store = store_for(URLS)
    measured = attrs.evolve(
        store.engines["d0"],
        decode=attrs.evolve(decode(), residual_p90=0.4, residual_max=0.6, points=8, spread_p90=0.5),
    )
    store = attrs.evolve(store, engines={**store.engines, "d0": measured})
    document: Any = store_to_json(store)
    parsed, problems = store_from_json(document)
    assert problems == []
    assert parsed == store
    assert parsed is not None
    assert [(f.engine, f.phase) for f in poor_fits(parsed.engines["d0"])] == [("d0", "decode")]
    # A store written before model error and spread were separated: its residuals mixed
    # both (the demo store's decode p90 was 30-80 %), so it loads, and is not judged.
    for fields in document["engines"].values():
        for phase in ("prefill", "decode"):
            for name in ("points", "spread_p50", "spread_p90", "spread_max"):
                del fields[phase][name]
    old, problems = store_from_json(document)
    assert problems == []
    assert old is not None
    assert old.engines["d0"].decode.residual_p90 == 0.4
    assert {(p.prefill.points, p.decode.points) for p in old.engines.values()} == {(0, 0)}
    assert all(poor_fits(p) == [] for p in old.engines.values())
    mean = old.mean_profile()
    assert mean is not None
    assert (mean.decode.points, mean.decode.residual_p90) == (0, 0.4)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-1, "engines.p0: max_num_seqs is -1; must be >= 0"),
        ("256", "engines.p0.max_num_seqs: expected int, got '256'"),
        (True, "engines.p0.max_num_seqs: expected int, got True"),
    ],
)
def test_bad_engine_cap_is_reported(value: object, message: str) -> None:
    document: Any = store_to_json(store_for(URLS))
    document["engines"]["p0"]["max_num_seqs"] = value
    _, problems = store_from_json(document)
    assert any(message in problem for problem in problems), problems


def test_check_mean_profile_uses_only_usable_engines(tmp_path: Path) -> None:
    store = store_for(URLS)
    engines = dict(store.engines)
    engines["d0"] = attrs.evolve(engines["d0"], model="other", prefill=prefill(a=1.0))
    path = tmp_path / "profiles.json"
    save_profiles(attrs.evolve(store, engines=engines), path)
    check = load_profiles(path, config_for(URLS))
    mean = check.mean_profile()
    assert mean is not None
    assert mean.prefill.a_s == pytest.approx(0.006)


def test_missing_handoff_pair_is_reported(tmp_path: Path) -> None:
    store = store_for(URLS)
    path = tmp_path / "profiles.json"
    save_profiles(attrs.evolve(store, handoffs={("p0", "d0"): store.handoffs[("p0", "d0")]}), path)
    check = load_profiles(path, config_for(URLS))
    assert check.usable == {"p0", "d0"}
    assert check.messages == (
        "pair 'd0' -> 'p0': no crossed-handoff profile in the store; run narwhal-profile",
    )
    assert not check.ok
    assert check.handoff("d0", "p0") is None
    single = tmp_path / "single.json"
    save_profiles(store_for({"p0": URLS["p0"]}), single)
    assert load_profiles(single, config_for({"p0": URLS["p0"]})).ok


def test_sglang_prefill_decode_servers_pair_only_prefill_to_decode() -> None:
    urls = {e: f"http://127.0.0.1:{8100 + i}" for i, e in enumerate(("p0", "d0", "d1", "a0"))}
    config = config_for(urls)
    roles: dict[str, Literal["prefill", "decode", "both"]] = {
        "p0": "prefill",
        "d0": "decode",
        "d1": "decode",
        "a0": "both",
    }
    sglang = attrs.evolve(
        config,
        engines=tuple(
            attrs.evolve(spec, dialect="sglang", role=roles[spec.id]) for spec in config.engines
        ),
    )
    # The aggregate server joins no bootstrap room, and no pair runs decode -> prefill.
    assert crossed_pairs(sglang.engines) == [("p0", "d0"), ("p0", "d1")]
    # vLLM roles are request shapes only: every ordered pair, as before.
    vllm = attrs.evolve(
        config,
        engines=tuple(attrs.evolve(spec, role=roles[spec.id]) for spec in config.engines),
    )
    assert len(crossed_pairs(vllm.engines)) == 12
    lone = attrs.evolve(sglang, engines=sglang.engines[:1])
    assert crossed_pairs(lone.engines) == []
    # A store with exactly those pairs is complete: no decode -> prefill pair is asked for.
    store = store_for({e: urls[e] for e in ("p0", "d0", "d1")})
    store = attrs.evolve(
        store,
        engines={e: attrs.evolve(p, dialect="sglang") for e, p in store.engines.items()},
        handoffs={k: v for k, v in store.handoffs.items() if k[0] == "p0"},
    )
    three = attrs.evolve(sglang, engines=sglang.engines[:3])
    check = check_store(store, [], three)
    assert check.messages == ()
    assert check.usable == {"p0", "d0", "d1"}


def test_engines_without_a_kv_connector_are_in_no_pair(tmp_path: Path) -> None:
    # vLLM engines that answered the router's prefill leg with kv_transfer_params: null
    # (an aggregate engine): each is profiled on itself, and no handoff is asked for.
    urls = {e: f"http://127.0.0.1:{8100 + i}" for i, e in enumerate(("a0", "a1", "p0", "d0"))}
    config = config_for(urls)
    assert crossed_pairs(config.engines, no_connector={"a0", "a1"}) == [
        ("p0", "d0"),
        ("d0", "p0"),
    ]
    assert crossed_pairs(config.engines, no_connector=set(urls)) == []
    # The self pair is a one-engine fleet's, not what is left of a larger one.
    assert crossed_pairs(config.engines, no_connector={"a0", "a1", "d0"}) == []
    lone = config_for({"a0": urls["a0"]})
    assert crossed_pairs(lone.engines) == [("a0", "a0")]
    assert crossed_pairs(lone.engines, no_connector={"a0"}) == []
    aggregate = {e: urls[e] for e in ("a0", "a1")}
    store = store_for(aggregate)
    store = attrs.evolve(
        store,
        engines={e: attrs.evolve(p, kv_connector="none") for e, p in store.engines.items()},
        handoffs={},
    )
    path = tmp_path / "profiles.json"
    save_profiles(store, path)
    assert json.loads(path.read_text())["engines"]["a0"]["kv_connector"] == "none"
    check = load_profiles(path, config_for(aggregate))
    assert check.ok, check.messages
    assert check.store == store
    # Not known (an older store, or the field left out): every pair is asked for.
    document: Any = store_to_json(store)
    for fields in document["engines"].values():
        del fields["kv_connector"]
    old, problems = store_from_json(document)
    assert problems == []
    assert old is not None
    assert {p.kv_connector for p in old.engines.values()} == {""}
    assert check_store(old, [], config_for(aggregate)).messages == (
        "pair 'a0' -> 'a1': no crossed-handoff profile in the store; run narwhal-profile",
        "pair 'a1' -> 'a0': no crossed-handoff profile in the store; run narwhal-profile",
    )
    document["engines"]["a0"]["kv_connector"] = "maybe"
    bad, problems = store_from_json(document)
    assert bad is not None
    assert set(bad.engines) == {"a1"}
    assert problems == [
        "profile store: engines.a0: kv_connector is 'maybe'; must be 'present', 'none' or ''"
    ]
