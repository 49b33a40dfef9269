from __future__ import annotations

from typing import Any

import pytest
import trio

from .campaign import Campaign, StartCampaign, start_campaign


@pytest.fixture
def start(nursery: trio.Nursery) -> StartCampaign:
    """A simulated fleet and Narwhal in front of it, ready for a campaign."""

    async def start(name: str, roles: list[str] | None = None, **kw: Any) -> Campaign:
        return await start_campaign(nursery, name, roles, **kw)

    return start
