"""The serving.workers paper model (tools/bench/workers_model.py) from overhead.py's cells."""

from __future__ import annotations

from typing import Any

import workers_model


def cell(concurrency: int, **values: float) -> dict[str, Any]:
    return {"target": "narwhal-w2", "mode": "stream", "concurrency": concurrency, **values}


def test_the_workers_share_is_the_routers_cpu_less_the_cores_per_chunk() -> None:
    document = {
        "summary": [
            cell(
                64,
                router_cpu_us_per_chunk=200.0,
                chunks_per_stream=32.0,
                router_core_cpu_ms_per_request=1.6,
            ),
            cell(
                512,
                router_cpu_us_per_chunk=220.0,
                chunks_per_stream=32.0,
                router_core_cpu_ms_per_request=1.8,
            ),
            {**cell(64, router_cpu_us_per_chunk=1.0), "mode": "non-stream"},
        ]
    }
    inputs = workers_model.measured(document, "narwhal-w2", [64, 512])
    # Medians: 210 us a chunk, 1.7 ms of core a request, 32 chunks: 6.72 ms a request in
    # all, of which 5.02 ms the worker's, 156.9 us a chunk.
    assert inputs["router_cpu_ms_per_request"] == 6.72
    assert inputs["core_ms_per_request"] == 1.7
    assert inputs["worker_us_per_chunk"] == 156.9


def test_capacity_grows_with_the_workers_until_the_core_bounds_it() -> None:
    inputs = {"worker_us_per_chunk": 100.0, "core_ms_per_request": 2.0}
    one = workers_model.capacity(inputs, 1, tokens=32)
    assert (one["chunks_per_s"], one["bound"]) == (10_000, "workers")
    # The core answers 500 requests/s: 16,000 chunks/s of 32-token streams, whatever W.
    eight = workers_model.capacity(inputs, 8, tokens=32)
    assert (eight["chunks_per_s"], eight["bound"]) == (16_000, "decision core")
    assert eight["core_cpu_share"] == 1.0
    # Longer streams ask the core less per chunk: the workers bound it again.
    long = workers_model.capacity(inputs, 8, tokens=1024)
    assert (long["chunks_per_s"], long["bound"]) == (80_000, "workers")
    result = workers_model.model(inputs, engine_tokens_per_s=1000.0)
    assert result["per_worker_core"] == {"chunks_per_s": 10_000, "decode_engines": 10.0}
