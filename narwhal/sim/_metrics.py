"""What one engine measures for /metrics, and the registry that exposes it.

Owns: `EngineMetrics` (histograms and counters fed by the engine), `Gauges` (its load at
scrape time), `Collector` (the base of a dialect's exposition: `_vllm_wire.VllmCollector`,
`_sglang_wire.SglangCollector` hold the metric names), `make_registry`, `render`.
Invariants: histograms are plain bucket arrays fed from the step loop (one observation per
token, so prometheus_client's locked objects would cost more than the simulated work); a
collector on the engine's own CollectorRegistry renders them at scrape time, never a
global registry.
"""

from __future__ import annotations

import abc
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
from prometheus_client import CollectorRegistry, generate_latest

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
XFER_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 5.0)


class Histogram:
    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip(self.buckets, self.counts, strict=False):
            running += n
            out.append((repr(float(bound)), float(running)))
        out.append(("+Inf", float(self.count)))
        return out


@attrs.define
class EngineMetrics:
    ttft: Histogram = attrs.Factory(lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = attrs.Factory(lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = attrs.Factory(lambda: Histogram(E2E_BUCKETS))
    xfer: Histogram = attrs.Factory(lambda: Histogram(XFER_BUCKETS))
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # SGLang's counters by is_streaming ("true", "false"): the series seen so far.
    streaming_prompt_tokens: dict[str, int] = attrs.Factory(dict)
    streaming_generation_tokens: dict[str, int] = attrs.Factory(dict)
    streaming_requests: dict[str, int] = attrs.Factory(dict)
    # finished_reason -> count ("length", "abort", "error").
    success: dict[str, int] = attrs.Factory(dict)
    kv_expired: int = 0
    failed_transfers: int = 0


@attrs.frozen
class Gauges:
    running: int
    waiting: int
    kv_usage: float
    preemptions: int
    used_tokens: int = 0
    capacity_tokens: int = 0
    # SGLang: whether its scheduler has reported its load yet (a fresh server has not).
    published: bool = True
    # Prompt tokens looked up in the prefix cache and found there; None without a cache.
    prefix_queries: int | None = None
    prefix_hits: int = 0


def count_streaming(counts: dict[str, int], stream: bool, value: int = 1) -> None:
    """Add to an SGLang counter's series for `is_streaming`."""
    key = "true" if stream else "false"
    counts[key] = counts.get(key, 0) + value


class Collector(abc.ABC):
    """A dialect's /metrics: its series, rendered from the engine's measures at scrape
    time. `model` and `engine` are the engine's model name and label."""

    def __init__(
        self, metrics: EngineMetrics, gauges: Callable[[], Gauges], *, model: str, engine: str
    ) -> None:
        self._m = metrics
        self._gauges = gauges
        self._model = model
        self._engine = engine

    @abc.abstractmethod
    def collect(self) -> Iterator[Any]: ...


def make_registry(collector: Collector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    out: bytes = generate_latest(registry)
    return out
