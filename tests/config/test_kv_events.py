"""An engine's KV events in the configuration: the keys of vLLM's --kv-events-config, each
endpoint one another process can reach, and the cache index's bound."""

from __future__ import annotations

import pytest

from narwhal.config import KvEvents, load_config

from .helpers import document, engine, problems, with_value


def test_the_keys_of_vllms_kv_events_config_are_taken_as_they_are() -> None:
    engines = [
        engine(
            0,
            kv_events={
                "endpoint": "tcp://*:5557",
                "replay_endpoint": "tcp://*:5558",
                "topic": "kv",
            },
        ),
        engine(1, kv_events={"endpoint": "tcp://127.0.0.1:5560"}),
    ]
    config = load_config(document(engines=engines, cache={"max_blocks_per_engine": 1000}))
    assert config.engines[0].kv_events == KvEvents(
        endpoint="tcp://*:5557", replay_endpoint="tcp://*:5558", topic="kv"
    )
    assert config.engines[1].kv_events.enabled
    assert config.cache.max_blocks_per_engine == 1000
    assert not load_config(document()).engines[0].kv_events.enabled


@pytest.mark.parametrize(
    ("endpoint", "problem"),
    [
        ("inproc://cache", '"inproc://cache" must be tcp://HOST:PORT or ipc://PATH'),
        ("tcp://*:0", '"tcp://*:0" must be tcp://HOST:PORT with a port in 1..65535'),
        ("tcp://host", '"tcp://host" must be tcp://HOST:PORT with a port in 1..65535'),
        ("ipc://", '"ipc://" names no ipc path'),
    ],
)
def test_an_endpoint_no_other_process_can_reach_is_refused(endpoint: str, problem: str) -> None:
    doc = with_value(document(), "engines[0].kv_events", {"endpoint": endpoint})
    assert problems(doc) == [f"engines[0].kv_events.endpoint: {problem}"]
    doc = with_value(
        document(),
        "engines[0].kv_events",
        {"endpoint": "tcp://*:5557", "replay_endpoint": endpoint},
    )
    assert problems(doc) == [f"engines[0].kv_events.replay_endpoint: {problem}"]


def test_a_replay_endpoint_needs_an_endpoint() -> None:
    doc = with_value(document(), "engines[0].kv_events", {"replay_endpoint": "tcp://*:5558"})
    assert problems(doc) == [
        "engines[0].kv_events.replay_endpoint: set without kv_events.endpoint; an engine "
        "without events has nothing to replay"
    ]


def test_two_engines_cannot_publish_to_one_endpoint_narwhal_binds() -> None:
    engines = [
        engine(i, kv_events={"endpoint": endpoint})
        for i, endpoint in enumerate(
            ["tcp://127.0.0.1:5560", "tcp://*:5557", "tcp://127.0.0.1:5560", "tcp://*:5557"]
        )
    ]
    assert problems(document(engines=engines)) == [
        "engines[2].kv_events.endpoint: 'tcp://127.0.0.1:5560' is also engines[0]'s; "
        "Narwhal binds it once, for one engine"
    ]


def test_the_index_bound_is_at_least_one_block() -> None:
    assert problems(document(cache={"max_blocks_per_engine": 0})) == [
        "cache.max_blocks_per_engine: 0 is outside 1..100000000"
    ]
