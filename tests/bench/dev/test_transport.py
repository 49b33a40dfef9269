"""tools/bench/dev/transport.py: what it reports of a sweep."""

from __future__ import annotations

import transport


def test_transport_flatness_compares_512_with_16_in_flight() -> None:
    summary = [
        {"client": "narwhal-pool", "inflight": 16, "client_cpu_ms_per_request": 0.2},
        {"client": "narwhal-pool", "inflight": 512, "client_cpu_ms_per_request": 0.25},
        {"client": "httpx", "inflight": 16, "client_cpu_ms_per_request": 2.0},
        {"client": "httpx", "inflight": 512, "client_cpu_ms_per_request": 60.0},
    ]
    flat = transport.flatness(summary)
    assert flat["narwhal-pool"]["ratio_512_over_16"] == 1.25
    assert flat["httpx"]["ratio_512_over_16"] == 30.0
    assert "httpx-sharded" not in flat
