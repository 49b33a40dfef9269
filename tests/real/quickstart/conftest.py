"""Quick start B, run as the README gives it: first in the real tier, before any fleet of
the tier's own is up, since it launches its own pair on the README's fixed ports."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The root conftest then moves the real tier last, keeping this order.
    items.sort(key=lambda item: HERE not in Path(item.fspath).parents)
