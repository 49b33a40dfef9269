"""Structuring: exact JSON types, unknown keys, required keys, and every problem at once."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest

from narwhal.config import Config, ConfigError, config_to_dict, load_config

from .helpers import PATH_PREFIX, document, engine, problems, with_value


def test_minimal_document_loads() -> None:
    config = load_config({"engines": [{"id": "a", "url": "http://127.0.0.1:8100"}]})
    assert isinstance(config, Config)
    assert config.engines[0].role == "both"
    assert config.serving.max_attempts == 1


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("serving.max_attempts", "3", 'serving.max_attempts: expected an integer, got "3"'),
        ("serving.max_attempts", 3.0, "serving.max_attempts: expected an integer, got 3.0"),
        ("serving.max_attempts", 2.5, "serving.max_attempts: expected an integer, got 2.5"),
        ("serving.max_attempts", True, "serving.max_attempts: expected an integer, got true"),
        ("serving.max_attempts", None, "serving.max_attempts: expected an integer, got null"),
        (
            "serving.retry_budget",
            2**63,
            "serving.retry_budget: expected a 64-bit integer, got 9223372036854775808",
        ),
        (
            "serving.request_timeout_s",
            "30",
            'serving.request_timeout_s: expected a number, got "30"',
        ),
        (
            "serving.request_timeout_s",
            False,
            "serving.request_timeout_s: expected a number, got false",
        ),
        (
            "serving.request_timeout_s",
            math.nan,
            "serving.request_timeout_s: expected a finite number, got NaN",
        ),
        (
            "serving.request_timeout_s",
            math.inf,
            "serving.request_timeout_s: expected a finite number, got Infinity",
        ),
        (
            "serving.request_timeout_s",
            -math.inf,
            "serving.request_timeout_s: expected a finite number, got -Infinity",
        ),
        (
            "serving.request_timeout_s",
            10**400,
            "serving.request_timeout_s: expected a finite number, got "
            "1000000000000000000000000000000000000...",
        ),
        ("engine.tokenize", 1, "engine.tokenize: expected true or false, got 1"),
        ("engine.tokenize", "true", 'engine.tokenize: expected true or false, got "true"'),
        ("profiles.path", 3, "profiles.path: expected a string, got 3"),
        (
            "serving.admission",
            "Open",
            "serving.admission: expected one of 'predictive', 'open', got \"Open\"; "
            "did you mean 'open'?",
        ),
        (
            "log.level",
            2,
            "log.level: expected one of 'debug', 'info', 'warning', 'error', got 2",
        ),
        ("serving", [], "serving: expected an object, got []"),
        ("controller.thresholds", 1.0, "controller.thresholds: expected an object, got 1.0"),
        ("engines", {"id": "a"}, 'engines: expected a list, got {"id": "a"}'),
        ("engines", "e0", 'engines: expected a list, got "e0"'),
        ("engines[1]", "e1", 'engines[1]: expected an object, got "e1"'),
        (
            "engines[0].bootstrap_port",
            "8998",
            'engines[0].bootstrap_port: expected an integer or null, got "8998"',
        ),
        (
            "engines[1].role",
            "prefil",
            "engines[1].role: expected one of 'prefill', 'decode', 'both', got \"prefil\"; "
            "did you mean 'prefill'?",
        ),
    ],
)
def test_wrong_types_are_named_with_path_and_value(path: str, value: Any, message: str) -> None:
    assert problems(with_value(document(), path, value)) == [message]


def test_integers_are_accepted_for_numbers_and_become_floats() -> None:
    config = load_config(document(serving={"request_timeout_s": 30}))
    assert config.serving.request_timeout_s == 30.0
    assert type(config.serving.request_timeout_s) is float


def test_null_is_accepted_for_optional_fields() -> None:
    doc = with_value(document(), "engines[0].prefill_concurrency", None)
    assert load_config(doc).engines[0].prefill_concurrency is None


def test_long_values_are_shortened_in_messages() -> None:
    [message] = problems(document(ctl={"socket": list(range(100))}))
    assert message == "ctl.socket: expected a string, got [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11..."


def test_unknown_key_suggests_the_close_one() -> None:
    doc = document(serving={"max_attempt": 2})
    assert problems(doc) == ["serving.max_attempt: unknown key; did you mean 'max_attempts'?"]


def test_unknown_key_without_a_close_match() -> None:
    assert problems(document(comment="four engines")) == ["comment: unknown key"]


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({**document(), "engins": []}, "engins: unknown key; did you mean 'engines'?"),
        (
            with_value(document(), "engines[1].bootstrap", 1),
            "engines[1].bootstrap: unknown key; did you mean 'bootstrap_port'?",
        ),
        (
            with_value(document(), "controller.reactive.windows_s", 1),
            "controller.reactive.windows_s: unknown key; did you mean 'window_s'?",
        ),
        (
            document(serving={"max attempts": 2}),
            "serving[\"max attempts\"]: unknown key; did you mean 'max_attempts'?",
        ),
        (document(serving={"": 2}), 'serving[""]: unknown key'),
    ],
)
def test_unknown_keys_anywhere(doc: dict[str, Any], message: str) -> None:
    assert problems(doc) == [message]


def test_required_engine_keys() -> None:
    assert problems({"engines": [{"role": "prefill"}]}) == [
        "engines[0].id: required key is missing",
        "engines[0].url: required key is missing",
        # In the same pass: one prefill engine cannot meet both floors.
        "controller: min_prefill + min_decode = 2 exceeds the 1 configured engine(s)",
    ]


@pytest.mark.parametrize("root", [[], "x", 3, None, True])
def test_document_must_be_an_object(root: object) -> None:
    [message] = problems(root)
    assert message.startswith("<config>: expected an object, got ")


def test_source_names_the_whole_document() -> None:
    with pytest.raises(ConfigError) as info:
        load_config([], source="conf/x.json")
    assert info.value.messages == ["conf/x.json: expected an object, got []"]
    assert info.value.source == "conf/x.json"
    assert info.value.unchecked == []  # nothing of the file to check further


def test_three_mistakes_give_exactly_three_path_named_messages() -> None:
    doc = document(
        serving={"max_attempt": 2, "request_timeout_s": "30", "retry_replenish": 1.5},
    )
    assert problems(doc) == [
        "serving.max_attempt: unknown key; did you mean 'max_attempts'?",
        'serving.request_timeout_s: expected a number, got "30"',
        "serving.retry_replenish: 1.5 is outside 0.0..1.0",
    ]


def test_messages_follow_the_document_order() -> None:
    doc: dict[str, Any] = {
        "serving": {"retry_budget": -1, "max_attempts": "2"},
        "controller": {"reactive": {"utilization": 0}},
        "engines": [engine(0, bootstrap_port=0), {"id": "e1"}],
        "slo": {"ttft_s": 0},
    }
    assert problems(doc) == [
        "serving.retry_budget: -1 must be nonnegative",
        'serving.max_attempts: expected an integer, got "2"',
        "controller.reactive.utilization: 0.0 is outside (0.0, 1.0]",
        "engines[0].bootstrap_port: 0 is outside 1..65535",
        "engines[1].url: required key is missing",
        "slo.ttft_s: 0.0 must be positive",
    ]


def test_range_rules_still_run_beside_type_errors_in_broken_engines() -> None:
    doc = {
        "engines": [
            7,
            {"url": "http://h:1", "prefill_concurrency": "many"},
            engine(2, decode_concurrency=-3),
        ]
    }
    assert problems(doc) == [
        "engines[0]: expected an object, got 7",
        'engines[1].prefill_concurrency: expected an integer or null, got "many"',
        "engines[1].id: required key is missing",
        "engines[2].decode_concurrency: -3 must be nonnegative",
    ]


def test_a_cross_rule_waits_for_the_values_it_reads_to_be_valid() -> None:
    # shrink >= expand would be a cross-rule problem, but expand's type is wrong: the
    # default standing in for it must not produce a message about a value not in the file.
    doc = document(controller={"thresholds": {"expand": "1", "shrink": 2.0}})
    with pytest.raises(ConfigError) as info:
        load_config(doc)
    assert info.value.messages == ['controller.thresholds.expand: expected a number, got "1"']
    assert info.value.unchecked == ["controller.thresholds.expand"]


def test_cross_rules_run_beside_type_errors_on_the_repaired_document() -> None:
    # They waited for a fully typed document: one mistyped value hid every cross-field
    # problem until a second run.
    doc = document(
        serving={"request_timeout_s": "30", "retry_base_s": 2.0},
        controller={"thresholds": {"shrink": 1.5}},
        engines=[engine(0, "prefill"), engine(0, "decode")],
    )
    with pytest.raises(ConfigError) as info:
        load_config(doc)
    assert info.value.messages == [
        'serving.request_timeout_s: expected a number, got "30"',
        "engines[1].id: duplicate id 'e0'",
        "engines[1].url: 'http://127.0.0.1:8100' is the same engine as engines[0].url",
        "serving.retry_cap_s: 1.0 must be at least the base value serving.retry_base_s=2.0",
        "controller.thresholds.shrink: 1.5 must be lower than controller.thresholds.expand=1.0",
    ]
    # The request deadline's own rule (the handoff cap below it) waits for it.
    assert info.value.unchecked == ["serving.request_timeout_s"]


def test_a_mistyped_engine_hides_only_the_rules_that_read_engines() -> None:
    doc = document(engines=[7, engine(1, "decode")], admin={"port": 8000})
    with pytest.raises(ConfigError) as info:
        load_config(doc)
    assert info.value.messages == [
        "engines[0]: expected an object, got 7",
        "admin.port: 8000 is listen.port too, on 127.0.0.1; the admin listener needs a "
        "port of its own",
    ]
    assert "engines[]" in info.value.unchecked


def test_an_unknown_key_hides_the_rules_that_read_the_key_it_was_meant_as() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(document(serving={"max_attempt": 3}))
    assert info.value.unchecked == ["serving.max_attempts"]


def test_the_input_document_is_not_modified() -> None:
    doc = document(serving={"max_attempt": 2, "max_attempts": "x"}, engines=[{"id": 1}])
    before = copy.deepcopy(doc)
    problems(doc)
    assert doc == before


def test_config_error_prints_one_message_per_line() -> None:
    error = ConfigError(["a: one", "b: two"])
    assert str(error) == "a: one\nb: two"
    assert error.messages == ["a: one", "b: two"]


def test_effective_config_round_trips() -> None:
    config = load_config(document(serving={"max_attempts": 2, "handoff_timeout_s": 5}))
    assert load_config(config_to_dict(config)) == config


def test_every_message_starts_with_a_path() -> None:
    doc = {"engines": "x", "serving": {"max attempts": 1, "queue_capacity": -1}, "x": {}}
    assert all(PATH_PREFIX.match(message) for message in problems(doc))
