from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import trio

from narwhal.sim import Fleet, serve_fleet

from ..support import StartFleet
from .helpers import MODEL


@pytest.fixture
def start_fleet(nursery: trio.Nursery) -> StartFleet:
    """A simulated fleet on loopback serving the tests' model name."""

    async def start(**kwargs: Any) -> Fleet:
        kwargs.setdefault("model", MODEL)
        fleet: Fleet = await nursery.start(partial(serve_fleet, **kwargs))
        return fleet

    return start
