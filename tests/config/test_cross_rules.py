"""Cross-field rules: one test per rule, each asserting its exact messages."""

from __future__ import annotations

import inspect
from typing import Any

import attrs
import pytest

from narwhal.config import load_config
from narwhal.config._cross import CrossRule, cross_rules

from .helpers import document, engine, fleet, problems, with_value


@pytest.mark.parametrize("doc", [{}, {"engines": []}])
def test_engines_are_required(doc: dict[str, Any]) -> None:
    assert problems(doc) == ["engines: at least one engine is required"]


def test_engine_ids_are_unique() -> None:
    engines = fleet("prefill", "decode", "decode")
    engines[1]["id"] = engines[2]["id"] = "e0"
    assert problems(document(engines=engines)) == [
        "engines[1].id: duplicate id 'e0'",
        "engines[2].id: duplicate id 'e0'",
    ]


@pytest.mark.parametrize("blank", ["", "  "])
def test_engine_ids_are_not_blank(blank: str) -> None:
    doc = with_value(document(), "engines[0].id", blank)
    assert problems(doc) == [f"engines[0].id: {blank!r} must not be empty or blank"]


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("127.0.0.1:8100", "must start with http://"),
        ("ftp://h:8100", "must start with http://"),
        ("http://:8100", "has no host"),
        ("http://h:99999", "is not a valid url with a numeric port in 1..65535"),
        ("http://h:port", "is not a valid url with a numeric port in 1..65535"),
        ("http://h:0", "is not a valid url with a numeric port in 1..65535"),
        ("http://h:8100/v1", "must not have a path beyond '/' (got '/v1')"),
        ("http://h:8100/?a=1", "must not have a query or fragment"),
        ("http://h:8100#x", "must not have a query or fragment"),
        ("http://h :8100", "must not contain whitespace"),
        ("https://h:8443", "uses https, which the engine transport does not support yet"),
        ("", "must start with http://"),
    ],
)
def test_engine_urls_are_http_host_port(url: str, reason: str) -> None:
    doc = with_value(document(), "engines[1].url", url)
    assert problems(doc) == [f"engines[1].url: {url!r} {reason}"]


@pytest.mark.parametrize(
    "url", ["http://h:8100", "http://h:8100/", "http://h", "http://[::1]:8100"]
)
def test_engine_url_forms_accepted(url: str) -> None:
    load_config(with_value(document(), "engines[1].url", url))


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("http://127.0.0.1:8100", "http://127.0.0.1:8100/"),
        ("http://h", "http://H:80"),
    ],
)
def test_engine_urls_are_unique(first: str, second: str) -> None:
    doc = with_value(with_value(document(), "engines[0].url", first), "engines[1].url", second)
    assert problems(doc) == [f"engines[1].url: {second!r} is the same engine as engines[0].url"]


def test_one_dialect_per_fleet() -> None:
    doc = with_value(document(), "engines[1].dialect", "sglang")
    assert problems(doc) == [
        "engines[1].dialect: 'sglang' differs from 'vllm' (engines[0].dialect); "
        "kv handoff cannot cross engine dialects"
    ]


def test_one_model_per_fleet() -> None:
    doc = with_value(document(), "engines[1].model", "llama-70b")
    assert problems(doc) == [
        "engines[1].model: 'llama-70b' differs from 'default' (engines[0].model); "
        "all engines must serve one model"
    ]


def test_bootstrap_port_is_for_sglang_only() -> None:
    doc = with_value(document(), "engines[0].bootstrap_port", 8998)
    assert problems(doc) == [
        "engines[0].bootstrap_port: 8998 is only used by the sglang dialect (dialect is 'vllm')"
    ]


def test_sglang_bootstrap_port_may_be_left_to_the_default() -> None:
    engines = [engine(0, "prefill", dialect="sglang"), engine(1, "decode", dialect="sglang")]
    config = load_config(document(engines=engines))
    assert config.engines[0].bootstrap_port is None


def test_a_configured_split_below_a_floor_is_the_controller_s_to_restore() -> None:
    # Manual 7.2 asks only that the floors together fit the configured fleet; these were
    # refused because fewer engines were configured in the role than its floor.
    config = load_config(
        document(engines=fleet("prefill", "decode", "decode"), controller={"min_prefill": 2})
    )
    assert config.controller.min_prefill == 2
    load_config(document(engines=fleet("prefill", "prefill", "both"), controller={"min_decode": 2}))


@pytest.mark.parametrize(
    ("controller", "dialect", "movable"),
    [
        ({"enabled": False}, "vllm", ""),
        ({"advisory": True}, "vllm", ""),
        ({}, "sglang", " or that the controller can move there"),
    ],
)
def test_a_floor_no_move_can_meet_is_refused(
    controller: dict[str, bool], dialect: str, movable: str
) -> None:
    engines = [engine(i, role, dialect=dialect) for i, role in enumerate(("prefill", "decode"))]
    engines.append(engine(2, "decode", dialect=dialect))
    doc = document(engines=engines, controller={"min_prefill": 2, **controller})
    assert problems(doc) == [
        f"controller.min_prefill: 2 exceeds the 1 engine(s) with role 'prefill' or 'both'{movable}"
    ]


def test_floors_together_fit_the_fleet() -> None:
    doc = document(
        engines=fleet("both", "both", "both"), controller={"min_prefill": 2, "min_decode": 2}
    )
    assert problems(doc) == [
        "controller: min_prefill + min_decode = 4 exceeds the 3 configured engine(s)"
    ]


def test_single_engine_with_role_both_serves_aggregate_inference() -> None:
    config = load_config({"engines": [engine(0, "both")]})
    assert config.controller.min_prefill == config.controller.min_decode == 1


def test_single_engine_of_one_role_cannot_meet_both_floors() -> None:
    assert problems({"engines": [engine(0, "prefill")]}) == [
        "controller: min_prefill + min_decode = 2 exceeds the 1 configured engine(s)",
    ]


def test_single_engine_exception_is_only_for_floors_of_one() -> None:
    doc = {"engines": [engine(0, "both")], "controller": {"min_prefill": 2}}
    assert problems(doc) == [
        "controller.min_prefill: 2 exceeds the 1 engine(s) with role 'prefill' or 'both' or "
        "that the controller can move there",
        "controller: min_prefill + min_decode = 3 exceeds the 1 configured engine(s)",
    ]


def test_retry_cap_is_at_least_the_base() -> None:
    doc = document(serving={"retry_base_s": 0.5, "retry_cap_s": 0.25})
    assert problems(doc) == [
        "serving.retry_cap_s: 0.25 must be at least the base value serving.retry_base_s=0.5"
    ]
    load_config(document(serving={"retry_base_s": 0.5, "retry_cap_s": 0.5}))


_QUEUEING = {"queue_capacity": 10, "queue_timeout_s": 1.0, "handoff_timeout_s": 5.0}


def test_queueing_needs_a_queue_timeout() -> None:
    doc = document(
        serving={
            **_QUEUEING,
            "queue_timeout_s": 0,
            "prefill_concurrency": 4,
            "decode_concurrency": 8,
        }
    )
    assert problems(doc) == [
        "serving.queue_timeout_s: 0.0 must be positive when queueing is enabled "
        "(serving.queue_capacity=10)"
    ]


def test_queueing_needs_phase_concurrency() -> None:
    assert problems(document(serving=_QUEUEING)) == [
        "serving.prefill_concurrency: 0 must be positive when queueing is enabled "
        "(serving.queue_capacity=10)",
        "serving.decode_concurrency: 0 must be positive when queueing is enabled "
        "(serving.queue_capacity=10)",
    ]


def test_queueing_counts_engine_overrides() -> None:
    engines = [
        engine(0, "prefill", prefill_concurrency=4, decode_concurrency=0),
        engine(1, "decode", prefill_concurrency=4),
    ]
    doc = document(engines=engines, serving={**_QUEUEING, "decode_concurrency": 8})
    assert problems(doc) == [
        "engines[0].decode_concurrency: 0 must be positive when queueing is enabled "
        "(serving.queue_capacity=10)"
    ]


def test_queueing_is_satisfied_when_every_engine_overrides() -> None:
    engines = [
        engine(i, role, prefill_concurrency=4, decode_concurrency=8)
        for i, role in enumerate(("prefill", "decode"))
    ]
    load_config(document(engines=engines, serving=_QUEUEING))


def test_queueing_needs_a_handoff_cap() -> None:
    serving = {
        **_QUEUEING,
        "handoff_timeout_s": 0,
        "prefill_concurrency": 4,
        "decode_concurrency": 8,
    }
    assert problems(document(serving=serving)) == [
        "serving.handoff_timeout_s: 0.0 must be positive when queueing is enabled "
        "(serving.queue_capacity=10)"
    ]


def test_retries_need_a_handoff_cap() -> None:
    assert problems(document(serving={"max_attempts": 2})) == [
        "serving.handoff_timeout_s: 0.0 must be positive when retries are enabled "
        "(serving.max_attempts=2)"
    ]


def test_queueing_and_retries_name_both_reasons_once() -> None:
    serving = {
        "queue_capacity": 5,
        "queue_timeout_s": 1,
        "prefill_concurrency": 4,
        "decode_concurrency": 8,
        "max_attempts": 3,
    }
    assert problems(document(serving=serving)) == [
        "serving.handoff_timeout_s: 0.0 must be positive when queueing and retries are enabled "
        "(serving.queue_capacity=5, serving.max_attempts=3)"
    ]


def test_handoff_cap_is_below_the_request_deadline() -> None:
    doc = document(serving={"handoff_timeout_s": 30, "request_timeout_s": 30})
    assert problems(doc) == [
        "serving.handoff_timeout_s: 30.0 must be below serving.request_timeout_s=30.0"
    ]


@pytest.mark.parametrize("body_timeout_s", [0.5, 30.0, 900.0])
def test_body_timeout_may_exceed_the_request_deadline(body_timeout_s: float) -> None:
    # Capped by it, like serving.queue_timeout_s and serving.prefill_timeout_s: a rule
    # would refuse every configuration that lowers the deadline below the default.
    config = load_config(
        document(serving={"body_timeout_s": body_timeout_s, "request_timeout_s": 20.0})
    )
    assert config.serving.body_timeout_s == body_timeout_s


@pytest.mark.parametrize("field", ["prefill_concurrency", "decode_concurrency"])
def test_serving_concurrency_within_max_connections(field: str) -> None:
    doc = document(serving={"max_connections": 64, field: 65})
    assert problems(doc) == [f"serving.{field}: 65 exceeds serving.max_connections=64"]
    load_config(document(serving={"max_connections": 64, field: 64}))


@pytest.mark.parametrize("field", ["prefill_concurrency", "decode_concurrency"])
def test_engine_concurrency_overrides_within_max_connections(field: str) -> None:
    doc = with_value(document(serving={"max_connections": 64}), f"engines[1].{field}", 100)
    assert problems(doc) == [f"engines[1].{field}: 100 exceeds serving.max_connections=64"]


@pytest.mark.parametrize("shrink", [1.0, 1.5])
def test_shrink_is_below_expand(shrink: float) -> None:
    doc = document(controller={"thresholds": {"expand": 1.0, "shrink": shrink}})
    assert problems(doc) == [
        f"controller.thresholds.shrink: {shrink!r} must be lower than "
        "controller.thresholds.expand=1.0"
    ]


def test_evidence_span_within_max_span() -> None:
    doc = document(controller={"reactive": {"evidence_span_s": 90, "evidence_max_span_s": 80}})
    assert problems(doc) == [
        "controller.reactive.evidence_span_s: 90.0 must be at most "
        "controller.reactive.evidence_max_span_s=80.0"
    ]


def test_evidence_max_span_within_window() -> None:
    doc = document(controller={"reactive": {"evidence_max_span_s": 150, "window_s": 120}})
    assert problems(doc) == [
        "controller.reactive.evidence_max_span_s: 150.0 must be at most "
        "controller.reactive.window_s=120.0"
    ]


def test_evidence_spans_may_be_equal() -> None:
    reactive = {"evidence_span_s": 60, "evidence_max_span_s": 60, "window_s": 60}
    load_config(document(controller={"reactive": reactive}))


def test_decode_correction_bounds_are_ordered() -> None:
    reactive = {"decode_correction_min": 1.5, "decode_correction_max": 1.2}
    assert problems(document(controller={"reactive": reactive})) == [
        "controller.reactive.decode_correction_max: 1.2 must be at least "
        "controller.reactive.decode_correction_min=1.5"
    ]


def test_health_min_samples_fit_the_window() -> None:
    doc = document(
        recovery={"health": {"min_samples": 40, "window_s": 30}},
        controller={"monitor_interval_s": 1},
    )
    assert problems(doc) == [
        "recovery.health.min_samples: 40 exceeds floor(recovery.health.window_s / "
        "controller.monitor_interval_s) = floor(30.0 / 1.0) = 30"
    ]


def test_health_min_samples_bound_uses_decimal_division() -> None:
    # In binary floating point 0.3 / 0.1 is 2.9999999999999996.
    doc = document(
        recovery={"health": {"min_samples": 3, "window_s": 0.3}},
        controller={"monitor_interval_s": 0.1},
    )
    load_config(doc)
    assert problems(with_value(doc, "recovery.health.min_samples", 4)) == [
        "recovery.health.min_samples: 4 exceeds floor(recovery.health.window_s / "
        "controller.monitor_interval_s) = floor(0.3 / 0.1) = 3"
    ]


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (
            {"serving": {"retry_base_s": -1, "retry_cap_s": 0.05}},
            "serving.retry_base_s: -1.0 must be positive",
        ),
        (
            {"controller": {"reactive": {"evidence_max_span_s": -1}}},
            "controller.reactive.evidence_max_span_s: -1.0 must be positive",
        ),
        (
            {"controller": {"monitor_interval_s": 0}},
            "controller.monitor_interval_s: 0.0 must be positive",
        ),
        (
            {"serving": {"queue_capacity": -1}},
            "serving.queue_capacity: -1 must be nonnegative",
        ),
    ],
)
def test_a_value_outside_its_own_range_is_reported_once(
    sections: dict[str, Any], message: str
) -> None:
    assert problems(document(**sections)) == [message]


def test_all_cross_rule_problems_are_reported_together() -> None:
    doc = document(
        serving={"max_attempts": 2, "retry_base_s": 2.0},
        controller={"thresholds": {"shrink": 1.0}},
    )
    assert problems(doc) == [
        "serving.retry_cap_s: 1.0 must be at least the base value serving.retry_base_s=2.0",
        "serving.handoff_timeout_s: 0.0 must be positive when retries are enabled "
        "(serving.max_attempts=2)",
        "controller.thresholds.shrink: 1.0 must be lower than controller.thresholds.expand=1.0",
    ]


def test_open_connections_exceed_the_retained_request_ceiling() -> None:
    serving = {"max_connections": 8, "queue_capacity": 4, "queue_timeout_s": 1.0}
    serving |= {"prefill_concurrency": 1, "decode_concurrency": 1, "handoff_timeout_s": 5.0}
    doc = document(listen={"max_open_connections": 12}, serving=serving)
    assert problems(doc) == [
        "listen.max_open_connections: 12 must exceed serving.max_connections + "
        "serving.queue_capacity = 12, the retained-request ceiling"
    ]
    load_config(document(listen={"max_open_connections": 13}, serving=serving))


def test_kv_role_is_for_vllm_only() -> None:
    engines = [engine(0, "prefill", dialect="sglang"), engine(1, "decode", dialect="sglang")]
    engines[0]["kv_role"] = "kv_producer"
    assert problems(document(engines=engines)) == [
        "engines[0].kv_role: 'kv_producer' is only used by the vllm dialect (dialect is 'sglang')"
    ]


@pytest.mark.parametrize(
    ("role", "kv_role", "wants"),
    [("decode", "kv_producer", "prefill"), ("both", "kv_consumer", "decode")],
)
def test_an_explicit_kv_role_matches_the_engines_role(role: str, kv_role: str, wants: str) -> None:
    doc = with_value(document(), "engines[0].role", role)
    doc = with_value(doc, "engines[0].kv_role", kv_role)
    assert (
        f"engines[0].kv_role: {kv_role!r} fixes the engine's role to {wants!r}, but its role is {role!r}"
        in problems(doc)
    )


def test_engines_launched_with_explicit_kv_roles_are_not_counted_as_movable() -> None:
    engines = [engine(0, "prefill"), engine(1, "decode")]
    engines[0]["kv_role"] = "kv_producer"
    engines[1]["kv_role"] = "kv_consumer"
    load_config(document(engines=engines, controller={"min_prefill": 1, "min_decode": 1}))
    movable = [engine(0, "prefill"), engine(1, "decode"), engine(2, "decode")]
    doc = document(engines=movable, controller={"min_prefill": 2, "min_decode": 1})
    load_config(doc)
    for entry in movable[1:]:
        entry["kv_role"] = "kv_consumer"
    assert problems(doc) == [
        "controller.min_prefill: 2 exceeds the 1 engine(s) with role 'prefill' or 'both' "
        "or that the controller can move there"
    ]


class _Recorder:
    """A section of a `Config` that records the field pattern of every value read
    through it (properties are run on the recorder, so what they read counts too)."""

    def __init__(self, node: object, path: str, seen: set[str]) -> None:
        self._node, self._path, self._seen = node, path, seen

    def __getattr__(self, name: str) -> Any:
        static = inspect.getattr_static(self._node, name)
        if isinstance(static, property) and static.fget is not None:
            return static.fget(self)
        value = getattr(self._node, name)
        here = f"{self._path}.{name}" if self._path else name
        if attrs.has(type(value)):
            return _Recorder(value, here, self._seen)
        if isinstance(value, tuple) and value and attrs.has(type(value[0])):
            return tuple(_Recorder(item, f"{here}[]", self._seen) for item in value)
        self._seen.add(here)
        return value


_SAMPLES = [
    document(),
    document(
        engines=[
            engine(0, "prefill", dialect="sglang", bootstrap_port=9000, prefill_concurrency=2),
            engine(1, "decode", dialect="sglang", decode_concurrency=3),
        ],
        serving={
            "queue_capacity": 8,
            "queue_timeout_s": 1.0,
            "prefill_concurrency": 4,
            "decode_concurrency": 4,
            "max_attempts": 2,
            "handoff_timeout_s": 5.0,
        },
        admin={"token": "t0123456789"},
    ),
    document(
        engines=[engine(0, "prefill", kv_role="kv_producer"), engine(1, "decode")],
        controller={"advisory": True},
    ),
]


@pytest.mark.parametrize("rule", cross_rules(), ids=lambda rule: rule.check.__name__)
def test_every_rule_names_every_field_it_reads(rule: CrossRule) -> None:
    # The loader skips a rule while a value it reads is invalid only if `reads` names it:
    # a field left out would be judged at the default standing in for the file's value.
    for sample in _SAMPLES:
        seen: set[str] = set()
        rule.check(_Recorder(load_config(sample), "", seen))  # type: ignore[arg-type]
        assert seen <= set(rule.reads), sorted(seen - set(rule.reads))
