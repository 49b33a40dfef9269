"""conf/CONFIGURATION.md is generated from the model and must be current."""

from __future__ import annotations

from narwhal.config import describe_fields
from narwhal.config.reference import render

from .helpers import REPO


def test_committed_reference_is_current() -> None:
    committed = (REPO / "conf" / "CONFIGURATION.md").read_text(encoding="utf-8")
    assert committed == render(), (
        "conf/CONFIGURATION.md is stale: "
        "run `python -m narwhal.config.reference > conf/CONFIGURATION.md`"
    )


def test_reference_lists_every_field_and_cross_rule() -> None:
    text = render()
    for field in describe_fields():
        assert f"| `{field.path}` |" in text
    assert "16. `recovery.health.min_samples` is at most" in text
