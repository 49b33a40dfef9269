"""goodput.py's --narwhal-extra: config sections merged into every Narwhal run."""

from __future__ import annotations

import argparse

import goodput
import pytest


def test_extra_sections_merge_key_by_key_over_the_configurations_own() -> None:
    cfg = goodput.Configuration(
        "n", "narwhal", 4, narwhal_extra={"cache": {"affinity": 1.0, "approximate_ttl_s": 9}}
    )
    out = goodput.with_narwhal_extra(cfg, {"cache": {"affinity": 0}, "log": {"level": "info"}})
    assert out.narwhal_extra == {
        "cache": {"affinity": 0, "approximate_ttl_s": 9},
        "log": {"level": "info"},
    }
    assert cfg.narwhal_extra["cache"]["affinity"] == 1.0
    peer = goodput.Configuration("v", "vllm-router", 4)
    assert goodput.with_narwhal_extra(peer, {"cache": {"affinity": 0}}) is peer


def test_the_option_takes_an_object_of_sections() -> None:
    assert goodput.json_sections('{"cache": {"affinity": 0}}') == {"cache": {"affinity": 0}}
    for bad in ("[1]", '{"cache": 0}', "{"):
        with pytest.raises(argparse.ArgumentTypeError):
            goodput.json_sections(bad)
