from __future__ import annotations

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Real-engine tests run last, so their engines (several GB, slow to start) are up
    only after the fast tier has run and never compete with its timing-sensitive tests."""
    items.sort(key=lambda item: item.get_closest_marker("real") is not None)
