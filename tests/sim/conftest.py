from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import httpx
import pytest
import trio

from narwhal.sim import Fleet, serve_fleet

from ..support import StartFleet


@pytest.fixture
def start_fleet(nursery: trio.Nursery) -> StartFleet:
    async def start(**kwargs: Any) -> Fleet:
        fleet: Fleet = await nursery.start(partial(serve_fleet, **kwargs))
        return fleet

    return start


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0) as c:
        yield c
