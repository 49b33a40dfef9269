"""The defaults and ranges are the product manual's tables (chapters 4, 6 and 7).

The table below is the specification, written out by hand: a change to a default or a
range in the model must be a change to this table too. Rows marked `(model)` are not in
the manual's tables and record the lead's schema.
"""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.config import Config, config_to_dict, describe_fields, load_config
from narwhal.config._load import field_problems
from narwhal.fleet import control_share

from .helpers import document

# path: (default, allowed range as the reference renders it)
SPEC: dict[str, tuple[Any, str]] = {
    "engines": ([], ""),
    # (model) engine entries
    "engines[].id": (None, ""),
    "engines[].url": (None, ""),
    "engines[].dialect": ("vllm", '"vllm", "sglang"'),
    "engines[].role": ("both", '"prefill", "decode", "both"'),
    "engines[].model": ("default", ""),
    "engines[].bootstrap_port": (None, "1..65535"),
    "engines[].kv_role": (None, '"kv_both", "kv_producer", "kv_consumer", null'),
    "engines[].prefill_concurrency": (None, ">= 0"),
    "engines[].decode_concurrency": (None, ">= 0"),
    "engines[].api_key_file": (None, ""),
    "engines[].kv_events.endpoint": (None, "tcp://HOST:PORT, ipc://PATH"),
    "engines[].kv_events.replay_endpoint": (None, "tcp://HOST:PORT, ipc://PATH"),
    "engines[].kv_events.topic": ("", ""),
    # (model)
    "slo.ttft_s": (0.5, "> 0"),
    "slo.tpot_s": (0.05, "> 0"),
    "slo.percentile": (0.9, "(0.0, 1.0]"),
    "listen.host": ("127.0.0.1", "non-empty"),
    "listen.port": (8000, "0..65535"),
    "listen.max_open_connections": (4096, ">= 1"),  # (model) open client sockets
    # (model) issue 29 item 5: client keys and the admin listener
    "listen.api_keys": ([], "printable ASCII without spaces, 1..1024 characters"),
    "listen.api_keys_file": (None, "non-empty"),
    "admin.host": ("127.0.0.1", "non-empty"),
    "admin.port": (8001, "0..65535"),
    "admin.token": (None, "printable ASCII without spaces, 1..1024 characters"),
    "admin.token_file": (None, "non-empty"),
    "listen.max_open_connections_per_client": (0, ">= 0"),  # (model) 0 derives
    "ctl.socket": ("runs/narwhal.sock", "non-empty, at most 107 bytes"),
    "log.level": ("info", '"debug", "info", "warning", "error"'),
    # manual 4.1
    "serving.admission": ("predictive", '"predictive", "open"'),
    "serving.admission_margin": (0.0, ">= 0"),
    "serving.max_connections": (512, ">= 1"),
    "serving.workers": (1, "0..256"),  # (model) the all-cores issue's data plane
    # manual 4.2
    "serving.queue_capacity": (0, ">= 0"),
    "serving.queue_timeout_s": (0.0, ">= 0"),
    "serving.prefill_concurrency": (0, ">= 0"),
    "serving.decode_concurrency": (0, ">= 0"),
    "serving.handoff_timeout_s": (0.0, ">= 0"),
    "serving.max_attempts": (1, "1..3"),
    "serving.retry_base_s": (0.1, "> 0"),
    "serving.retry_cap_s": (1.0, "> 0"),
    "serving.retry_budget": (10, ">= 0"),
    "serving.retry_replenish": (0.1, "0.0..1.0"),
    "serving.max_request_bytes": (4194304, ">= 1"),
    "serving.max_response_bytes": (16777216, ">= 1"),
    "serving.client_stall_s": (0.5, "> 0"),  # (model) manual 4.3 client backpressure
    "serving.body_timeout_s": (30.0, "> 0"),  # (model) manual 4.2 bodies being read
    "serving.max_pending_bodies_per_client": (0, ">= 0"),  # (model) 0 derives
    # manual 6
    "serving.request_timeout_s": (600.0, "> 0"),
    "serving.prefill_timeout_s": (120.0, "> 0"),
    "serving.expose_engine_details": (False, "true, false"),  # (model) issue 29 item 5
    # manual 4.1
    "engine.control_connections": (0, ">= 0"),
    # manual 6
    "engine.decode_read_timeout_s": (60.0, ">= 0"),
    "engine.first_token_timeout_s": (2.5, "> 0"),
    "engine.tokenize": (True, "true, false"),
    "engine.tokenize_timeout_s": (2.0, "> 0"),
    "engine.tokenizer_path": (None, "non-empty"),  # (model) prompts counted in the router
    "engine.vocab_size": (None, "1..100000000"),
    "engine.chars_per_token": (3.8, "> 0"),
    # (model) prefill backlog pricing
    "engine.prefill_chunk_tokens": (2048, ">= 1"),
    "engine.pool_timeout_s": (5.0, "> 0"),
    "engine.connect_timeout_s": (10.0, "> 0"),
    "engine.health_timeout_s": (5.0, "> 0"),
    "engine.api_key_file": (None, ""),  # (model) engines started with --api-key
    # manual 7 ((model): enabled)
    "controller.enabled": (True, "true, false"),
    "controller.advisory": (False, "true, false"),
    "controller.monitor_interval_s": (1.0, "> 0"),
    "controller.monitor_failure_limit": (5, ">= 1"),
    "controller.min_prefill": (1, ">= 1"),
    "controller.min_decode": (1, ">= 1"),
    "controller.flip_history": (1000, ">= 1"),
    "controller.thresholds.expand": (1.0, "> 0"),
    "controller.thresholds.shrink": (0.5, ">= 0"),
    "controller.thresholds.cooldown_s": (10.0, ">= 0"),
    "controller.thresholds.sustained_intervals": (3, ">= 1"),
    "controller.thresholds.dwell_s": (0.0, ">= 0"),
    "controller.thresholds.panic_ratio": (0.0, "0 or >= 1"),
    "controller.thresholds.flip_resident_guard": (0, ">= 0"),
    # manual 7.7
    "controller.reactive.window_s": (120.0, "> 0"),
    "controller.reactive.confirmations": (2, ">= 1"),
    "controller.reactive.utilization": (0.8, "(0.0, 1.0]"),
    "controller.reactive.min_arrivals": (10, ">= 1"),
    "controller.reactive.demand_floor": (0.5, "> 0"),
    "controller.reactive.movement_margin": (0.05, "[0.0, 1.0)"),
    "controller.reactive.step_s": (5.0, "> 0"),
    "controller.reactive.evidence_span_s": (60.0, "> 0"),
    "controller.reactive.evidence_max_span_s": (120.0, "> 0"),
    "controller.reactive.evidence_min_arrivals": (10, ">= 1"),
    "controller.reactive.demand_rise_tolerance": (0.25, ">= 0"),
    "controller.reactive.decode_correction_min": (0.5, "> 0"),
    "controller.reactive.decode_correction_max": (2.0, "> 0"),
    "controller.reactive.decode_correction_alpha": (0.2, "(0.0, 1.0]"),
    "controller.reactive.decode_correction_min_samples": (8, ">= 1"),
    # manual 6 ((model): the rest of recovery)
    "recovery.failure_quarantine_s": (0.0, ">= 0"),
    "recovery.restart_hold_s": (5.0, ">= 0"),
    "recovery.shutdown_grace_s": (30.0, ">= 0"),
    "recovery.health.interval_s": (2.0, "> 0"),
    "recovery.health.window_s": (30.0, "> 0"),
    "recovery.health.min_samples": (5, ">= 1"),
    "recovery.health.eject_ratio": (3.0, ">= 1.0"),
    "recovery.health.failure_threshold": (3, ">= 1"),
    "recovery.health.readmit_successes": (2, ">= 1"),
    "recovery.breaker.failure_threshold": (5, ">= 1"),
    "recovery.breaker.window_s": (30.0, "> 0"),
    "recovery.breaker.failure_ratio": (0.5, "(0.0, 1.0]"),
    "recovery.breaker.open_s": (10.0, "> 0"),
    # (model) the cache index
    "cache.max_blocks_per_engine": (262_144, "1..100000000"),
    "cache.replay_timeout_s": (2.0, "> 0"),
    "cache.approximate_ttl_s": (300.0, "0.0..86400.0"),
    "cache.affinity": (1.0, "0..10"),
    "cache.local_prefill_share": (0.9, "(0, 1]"),
    "cluster.endpoints": ([], "http://HOST:PORT"),
    "cluster.prefix": ("/narwhal/", "/.../"),
    "cluster.replica_id": ("", "empty, or 1-64 of [A-Za-z0-9._:-]"),
    "cluster.lease_ttl_s": (10, "2..600"),
    "cluster.request_timeout_s": (2.0, "> 0"),
    "cluster.isolated_share": (0.5, "0..1"),
    "cluster.load_interval_s": (0.05, "0..10"),
    # manual 6
    "profiles.path": ("runs/profiles.json", "non-empty"),
}


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else key, out)
    else:
        out[prefix] = value


def test_default_values_are_the_manual_tables() -> None:
    config = load_config(document(engines=[{"id": "a", "url": "http://h:1"}]))
    as_dict = config_to_dict(config)
    actual: dict[str, Any] = {}
    _flatten({**as_dict, "engines": []}, "", actual)
    _flatten(as_dict["engines"][0], "engines[]", actual)
    actual["engines[].id"] = actual["engines[].url"] = None  # required: no default
    assert actual == {path: default for path, (default, _) in SPEC.items()}
    assert Config().engines == ()


def test_defaults_are_typed_as_declared() -> None:
    serving = Config().serving
    assert isinstance(serving.request_timeout_s, float)
    assert isinstance(serving.max_attempts, int)


def test_ranges_are_the_manual_ranges() -> None:
    described = {field.path: field.allowed for field in describe_fields()}
    assert described == {path: allowed for path, (_, allowed) in SPEC.items()}


def test_every_default_satisfies_its_own_rule() -> None:
    assert field_problems(Config()) == []


def test_every_field_has_a_meaning() -> None:
    undocumented = [field.path for field in describe_fields() if not field.doc.strip()]
    assert undocumented == []


@pytest.mark.parametrize(
    ("engines", "configured", "total", "each"),
    [
        (1, 0, 4, 4),  # two per engine, with a minimum of four
        (2, 0, 4, 2),
        (3, 0, 6, 2),
        (8, 0, 16, 2),
        (3, 5, 5, 2),  # an explicit pool is split, rounded up
    ],
)
def test_control_connections_zero_derives_two_per_engine_with_a_minimum_of_four(
    engines: int, configured: int, total: int, each: int
) -> None:
    roles = ["prefill", "decode", *["decode"] * (engines - 2)] if engines > 1 else ["both"]
    config = load_config(
        {
            "engines": [
                {"id": f"e{i}", "url": f"http://127.0.0.1:{8100 + i}", "role": role}
                for i, role in enumerate(roles)
            ],
            "engine": {"control_connections": configured},
        }
    )
    assert config.engine.control_pool_size(engines) == total
    assert control_share(config) == each


@pytest.mark.parametrize(
    ("listen", "serving", "connections", "bodies"),
    [
        # The defaults: twice the retained-request ceiling of 512, an eighth of it.
        ({}, {}, 1024, 64),
        # A connection table smaller than twice the ceiling bounds the derivation.
        ({"max_open_connections": 1500}, {"max_connections": 1000}, 1500, 125),
        # A small ceiling: floors of 64 and 8.
        ({}, {"max_connections": 16}, 64, 8),
        ({"max_open_connections": 40}, {"max_connections": 16}, 40, 8),
        # Explicit values are taken as they are.
        (
            {"max_open_connections_per_client": 7},
            {"max_pending_bodies_per_client": 3},
            7,
            3,
        ),
    ],
)
def test_per_client_limits_zero_derives_from_the_retained_ceiling(
    listen: dict[str, int], serving: dict[str, int], connections: int, bodies: int
) -> None:
    config = load_config(
        document(engines=[{"id": "a", "url": "http://h:1"}], listen=listen, serving=serving)
    )
    assert config.connections_per_client() == connections
    assert config.serving.pending_bodies_per_client() == bodies
