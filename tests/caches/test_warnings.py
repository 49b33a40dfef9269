"""Engines whose KV events text prompts cannot be matched against are named, at start and
by `narwhal validate`, not left for the operator to find in the pricing."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from narwhal.caches import events_without_ids_warning
from narwhal.config import load_config
from narwhal.supervisor import Supervisor, preflight

from ..config.helpers import document, engine
from ..tokenizer.model import write_model

EVENTS = {"endpoint": "tcp://127.0.0.1:5560"}
WARNING = (
    "engines[e0, e2].kv_events: their events name blocks by token ids, and without "
    "engine.tokenizer_path Narwhal has ids only for prompts sent as ids: prompts sent as text "
    "are priced and placed there as uncached; set engine.tokenizer_path to the model's "
    "tokenizer"
)


def fleet(**engine_section: str) -> dict[str, object]:
    engines = [
        engine(0, kv_events=EVENTS),
        engine(1),
        engine(2, kv_events={"endpoint": "tcp://127.0.0.1:5561"}),
    ]
    return document(engines=engines, engine=engine_section)


def test_engines_with_events_and_no_tokenizer_are_named(tmp_path: Path) -> None:
    assert events_without_ids_warning(load_config(fleet())) == WARNING
    # With the tokenizer the router has every prompt's ids; without events there is
    # nothing to match.
    write_model(tmp_path / "model")
    assert (
        events_without_ids_warning(load_config(fleet(tokenizer_path=str(tmp_path / "model"))))
        is None
    )
    assert events_without_ids_warning(load_config(document())) is None


def test_the_daemon_warns_at_start_and_validate_reports_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = load_config(fleet())
    with caplog.at_level(logging.WARNING, logger="narwhal.supervisor"):
        Supervisor._warn_events_without_ids(config)
    events = [r for r in caplog.records if getattr(r, "event", None) == "cache_events_without_ids"]
    assert [r.getMessage() for r in events] == [WARNING]
    assert WARNING in [f.text for f in preflight(config).degraded]
