from __future__ import annotations

from typing import Any

import pytest
import trio

from .campaign import Campaign, StartCampaign, start_campaign


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Long campaigns are opt-in: without a -m expression, `slow` items are deselected
    (the default run is CI's; `pytest -m slow tests/reliability` runs the long ones)."""
    if config.option.markexpr:
        return
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]


@pytest.fixture
def start(nursery: trio.Nursery) -> StartCampaign:
    """A simulated fleet and Narwhal in front of it, ready for a campaign."""

    async def start(name: str, roles: list[str] | None = None, **kw: Any) -> Campaign:
        return await start_campaign(nursery, name, roles, **kw)

    return start
