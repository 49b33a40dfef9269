"""Grouping py-spy samples and parsing config variants in tools/bench/profile_narwhal.py."""

from __future__ import annotations

import argparse

import profile_narwhal
import pytest

_ROOT = "run (trio/_core/_run.py:2532);unrolled_run (trio/_core/_run.py:2866)"
_FLOW = "Exchange.run (narwhal/serving/_exchange.py:120)"


def test_samples_go_to_the_nearest_categorised_frame() -> None:
    lines = [
        f"{_ROOT};_handle (hypercorn/trio/task_group.py:28);{_FLOW};"
        "ConnectionPool._send (narwhal/engines/_transport.py:290);"
        "send_all (trio/_highlevel_socket.py:122) 3",
        f"{_ROOT};{_FLOW};count_tokens (narwhal/serving/_tokens.py:57);"
        "dumps (json/__init__.py:238) 1",
        f"{_ROOT};_handle (hypercorn/trio/task_group.py:28);{_FLOW};"
        "Logger.info (logging/__init__.py:1489) 2",
        f"{_ROOT} 4",
    ]
    result = profile_narwhal.classify(lines)
    assert result["samples"] == 10
    assert result["percent_by_category"] == {
        profile_narwhal.SCHEDULER: 40.0,
        "engine transport (ConnectionPool, HTTP/1.1 client)": 30.0,
        "logging": 20.0,
        "json encode/decode": 10.0,
    }
    assert result["percent_inclusive"]["count_tokens"] == 10.0
    assert result["percent_inclusive"]["Logger.info"] == 20.0


def test_variants_patch_config_sections() -> None:
    assert profile_narwhal.parse_variant("quiet=log.level=warning,engine.tokenize=false") == (
        "quiet",
        {"log": {"level": "warning"}, "engine": {"tokenize": False}},
    )
    with pytest.raises(argparse.ArgumentTypeError):
        profile_narwhal.parse_variant("broken=tokenize=false")
