from __future__ import annotations

import pytest
import trio.testing


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Real-engine tests run last, so their engines (several GB, slow to start) are up
    only after the fast tier has run and never compete with its timing-sensitive tests."""
    items.sort(key=lambda item: item.get_closest_marker("real") is not None)


@pytest.fixture
def io_clock() -> trio.testing.MockClock:
    """A mock clock for tests that also do real socket I/O.

    Plain autojump jumps the clock whenever every task is blocked, and a task waiting
    on a loopback socket looks blocked, so connect and read deadlines would fire while
    bytes are in flight. Jumping only after 50 ms of real idleness lets I/O finish first.
    """
    return trio.testing.MockClock(autojump_threshold=0.05)
