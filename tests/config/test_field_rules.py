"""Per-field range rules from the model metadata, at the manual's boundaries."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.config import load_config

from .helpers import document, problems, with_value

# Cross-field rules that would otherwise fire for some of the values below.
_BASE = document(
    serving={"handoff_timeout_s": 5.0},
    engines=[
        {"id": "p", "url": "http://h:8100", "role": "prefill", "dialect": "sglang"},
        {"id": "d", "url": "http://h:8101", "role": "decode", "dialect": "sglang"},
    ],
)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("serving.max_attempts", 5, "serving.max_attempts: 5 is outside 1..3"),
        ("serving.max_attempts", 0, "serving.max_attempts: 0 is outside 1..3"),
        ("serving.request_timeout_s", -1, "serving.request_timeout_s: -1.0 must be positive"),
        ("serving.prefill_timeout_s", 0, "serving.prefill_timeout_s: 0.0 must be positive"),
        ("serving.body_timeout_s", 0, "serving.body_timeout_s: 0.0 must be positive"),
        ("serving.body_timeout_s", -5, "serving.body_timeout_s: -5.0 must be positive"),
        ("serving.admission_margin", -0.1, "serving.admission_margin: -0.1 must be nonnegative"),
        ("serving.max_connections", 0, "serving.max_connections: 0 must be at least 1"),
        ("serving.queue_capacity", -1, "serving.queue_capacity: -1 must be nonnegative"),
        ("serving.queue_timeout_s", -0.5, "serving.queue_timeout_s: -0.5 must be nonnegative"),
        ("serving.prefill_concurrency", -1, "serving.prefill_concurrency: -1 must be nonnegative"),
        ("serving.decode_concurrency", -2, "serving.decode_concurrency: -2 must be nonnegative"),
        ("serving.handoff_timeout_s", -1, "serving.handoff_timeout_s: -1.0 must be nonnegative"),
        ("serving.retry_base_s", 0, "serving.retry_base_s: 0.0 must be positive"),
        ("serving.retry_budget", -1, "serving.retry_budget: -1 must be nonnegative"),
        ("serving.retry_replenish", 1.5, "serving.retry_replenish: 1.5 is outside 0.0..1.0"),
        ("serving.retry_replenish", -0.1, "serving.retry_replenish: -0.1 is outside 0.0..1.0"),
        ("serving.max_request_bytes", 0, "serving.max_request_bytes: 0 must be at least 1"),
        ("serving.max_response_bytes", 0, "serving.max_response_bytes: 0 must be at least 1"),
        (
            "serving.max_pending_bodies_per_client",
            -1,
            "serving.max_pending_bodies_per_client: -1 must be nonnegative",
        ),
        ("engine.control_connections", -1, "engine.control_connections: -1 must be nonnegative"),
        (
            "engine.decode_read_timeout_s",
            -1,
            "engine.decode_read_timeout_s: -1.0 must be nonnegative",
        ),
        ("engine.first_token_timeout_s", 0, "engine.first_token_timeout_s: 0.0 must be positive"),
        ("engine.chars_per_token", 0, "engine.chars_per_token: 0.0 must be positive"),
        ("slo.ttft_s", 0, "slo.ttft_s: 0.0 must be positive"),
        ("slo.percentile", 0, "slo.percentile: 0.0 is outside (0.0, 1.0]"),
        ("listen.port", 65536, "listen.port: 65536 is outside 0..65535"),
        (
            "listen.max_open_connections",
            0,
            "listen.max_open_connections: 0 must be at least 1",
        ),
        (
            "listen.max_open_connections_per_client",
            -1,
            "listen.max_open_connections_per_client: -1 must be nonnegative",
        ),
        ("controller.monitor_interval_s", 0, "controller.monitor_interval_s: 0.0 must be positive"),
        (
            "controller.monitor_failure_limit",
            0,
            "controller.monitor_failure_limit: 0 must be at least 1",
        ),
        ("controller.min_prefill", 0, "controller.min_prefill: 0 must be at least 1"),
        ("controller.min_decode", 0, "controller.min_decode: 0 must be at least 1"),
        ("controller.flip_history", 0, "controller.flip_history: 0 must be at least 1"),
        ("controller.thresholds.expand", 0, "controller.thresholds.expand: 0.0 must be positive"),
        (
            "controller.thresholds.shrink",
            -0.1,
            "controller.thresholds.shrink: -0.1 must be nonnegative",
        ),
        (
            "controller.thresholds.panic_ratio",
            0.5,
            "controller.thresholds.panic_ratio: 0.5 must be 0 (disabled) or at least 1",
        ),
        (
            "controller.thresholds.sustained_intervals",
            0,
            "controller.thresholds.sustained_intervals: 0 must be at least 1",
        ),
        (
            "controller.thresholds.flip_resident_guard",
            -1,
            "controller.thresholds.flip_resident_guard: -1 must be nonnegative",
        ),
        (
            "controller.reactive.utilization",
            0,
            "controller.reactive.utilization: 0.0 is outside (0.0, 1.0]",
        ),
        (
            "controller.reactive.utilization",
            1.01,
            "controller.reactive.utilization: 1.01 is outside (0.0, 1.0]",
        ),
        (
            "controller.reactive.movement_margin",
            1,
            "controller.reactive.movement_margin: 1.0 is outside [0.0, 1.0)",
        ),
        (
            "controller.reactive.decode_correction_alpha",
            0,
            "controller.reactive.decode_correction_alpha: 0.0 is outside (0.0, 1.0]",
        ),
        (
            "controller.reactive.demand_rise_tolerance",
            -0.25,
            "controller.reactive.demand_rise_tolerance: -0.25 must be nonnegative",
        ),
        (
            "controller.reactive.decode_correction_min_samples",
            0,
            "controller.reactive.decode_correction_min_samples: 0 must be at least 1",
        ),
        (
            "recovery.failure_quarantine_s",
            -1,
            "recovery.failure_quarantine_s: -1.0 must be nonnegative",
        ),
        ("recovery.health.min_samples", 0, "recovery.health.min_samples: 0 must be at least 1"),
        (
            "recovery.health.eject_ratio",
            0.5,
            "recovery.health.eject_ratio: 0.5 must be at least 1.0",
        ),
        ("recovery.breaker.open_s", 0, "recovery.breaker.open_s: 0.0 must be positive"),
        ("engines[0].bootstrap_port", 0, "engines[0].bootstrap_port: 0 is outside 1..65535"),
        (
            "engines[1].bootstrap_port",
            65536,
            "engines[1].bootstrap_port: 65536 is outside 1..65535",
        ),
        (
            "engines[0].prefill_concurrency",
            -1,
            "engines[0].prefill_concurrency: -1 must be nonnegative",
        ),
        (
            "engines[1].decode_concurrency",
            -1,
            "engines[1].decode_concurrency: -1 must be nonnegative",
        ),
    ],
)
def test_value_outside_its_range(path: str, value: Any, message: str) -> None:
    assert problems(with_value(_BASE, path, value)) == [message]


_LONG_SOCKET = "/run/narwhal/" + "x" * 95  # 108 bytes: one past sun_path


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        # Each of these used to pass validation and fail only at startup or on use.
        ("ctl.socket", "", 'ctl.socket: "" must not be empty'),
        ("ctl.socket", "  ", 'ctl.socket: "  " must not be empty'),
        (
            "ctl.socket",
            "run/a\0b.sock",
            'ctl.socket: "run/a\\u0000b.sock" must not contain a NUL character',
        ),
        (
            "ctl.socket",
            _LONG_SOCKET,
            'ctl.socket: "/run/narwhal/xxxxxxxxxxxxxxxxxxxxxxx... is 108 bytes long; '
            "an AF_UNIX socket path holds at most 107",
        ),
        ("listen.host", "", 'listen.host: "" must not be empty'),
        ("profiles.path", "", 'profiles.path: "" must not be empty'),
        (
            "profiles.path",
            "a\0b",
            'profiles.path: "a\\u0000b" must not contain a NUL character',
        ),
        (
            "engine.api_key_file",
            "key\0file",
            'engine.api_key_file: "key\\u0000file": a path cannot contain a NUL character',
        ),
    ],
)
def test_names_and_paths_the_daemon_hands_to_the_os(path: str, value: str, message: str) -> None:
    assert problems(with_value(_BASE, path, value)) == [message]


def test_a_socket_path_of_the_longest_length_is_accepted() -> None:
    load_config(with_value(_BASE, "ctl.socket", _LONG_SOCKET[:-1]))


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("serving.max_attempts", 1),
        ("serving.max_attempts", 3),
        ("serving.retry_replenish", 0),
        ("serving.retry_replenish", 1),
        ("engine.decode_read_timeout_s", 0),
        ("recovery.failure_quarantine_s", 0),
        ("controller.thresholds.panic_ratio", 0),
        ("controller.thresholds.panic_ratio", 1),
        ("controller.thresholds.shrink", 0),
        ("controller.reactive.utilization", 1),
        ("controller.reactive.movement_margin", 0),
        ("controller.reactive.decode_correction_alpha", 1),
        ("slo.percentile", 1),
        ("listen.port", 0),
        ("engines[0].bootstrap_port", 1),
        ("engines[0].bootstrap_port", 65535),
        ("engines[0].prefill_concurrency", 0),
    ],
)
def test_value_at_the_edge_of_its_range(path: str, value: Any) -> None:
    load_config(with_value(_BASE, path, value))


def test_all_range_problems_are_reported_together() -> None:
    doc = document(
        serving={"max_attempts": 5, "request_timeout_s": -1},
        controller={"reactive": {"utilization": 2}},
    )
    assert problems(doc) == [
        "serving.max_attempts: 5 is outside 1..3",
        "serving.request_timeout_s: -1.0 must be positive",
        "controller.reactive.utilization: 2.0 is outside (0.0, 1.0]",
    ]
