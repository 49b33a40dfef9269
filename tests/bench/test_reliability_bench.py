"""Reading the soak's reload outcomes from /metrics (tools/bench/reliability.py)."""

from __future__ import annotations

import reliability
from prometheus_client import CollectorRegistry, Counter, generate_latest


def test_reload_counts_reads_each_outcome_and_nothing_else() -> None:
    registry = CollectorRegistry()
    reloads = Counter("narwhal_reloads", "reloads", ["outcome"], registry=registry)
    reloads.labels("applied").inc(2)
    reloads.labels("rejected").inc()
    # Another counter with the same label must not be mistaken for reloads.
    Counter("narwhal_refusals", "refusals", ["outcome"], registry=registry).labels("applied").inc(7)
    page = generate_latest(registry).decode()
    assert reliability.reload_counts(page) == {"applied": 2, "rejected": 1}
    assert reliability.reload_counts("") == {}
