"""Prometheus exposition of one engine, under vLLM's (or SGLang's) metric names.

Histograms are plain bucket arrays fed from the step loop (one observation per token, so
prometheus_client's locked objects would cost more than the simulated work); a custom
collector on the engine's own CollectorRegistry renders them at scrape time.

SGLang's series are 0.5.23's names and labels (the gauges per scheduler rank, the counters
per `is_streaming`); its load gauges appear only once its scheduler has reported
(`Gauges.published`), and a counter's series once it has counted, as prometheus_client
shows a labelled metric only from its first use. It has no request_success counter and no
process_start_time_seconds (its metrics are multiprocess).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

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


def count_streaming(counts: dict[str, int], stream: bool, value: int = 1) -> None:
    """Add to an SGLang counter's series for `is_streaming`."""
    key = "true" if stream else "false"
    counts[key] = counts.get(key, 0) + value


class _Collector:
    def __init__(
        self,
        metrics: EngineMetrics,
        gauges: Callable[[], Gauges],
        *,
        dialect: str,
        model: str,
        engine: str,
        cache_info: dict[str, str] | None = None,
        started_at: float | None = None,
        kv_connector: bool = True,
        engine_type: str = "unified",
    ) -> None:
        self._m = metrics
        self._kv_connector = kv_connector
        self._engine_type = engine_type
        self._gauges = gauges
        self._started_at = started_at
        self._sglang = dialect == "sglang"
        self._model = model
        self._engine = engine
        self._cache_info = dict(cache_info or {})

    def collect(self) -> Iterator[Any]:
        if self._sglang:
            yield from self._collect_sglang()
            return
        m = self._m
        g = self._gauges()
        labels = ["model_name", "engine"]
        values = [self._model, self._engine]
        p = "vllm:"

        def gauge(name: str, doc: str, value: float) -> Any:
            fam = GaugeMetricFamily(p + name, doc, labels=labels)
            fam.add_metric(values, value)
            return fam

        def counter(name: str, doc: str, value: float) -> Any:
            fam = CounterMetricFamily(p + name, doc, labels=labels)
            fam.add_metric(values, value)
            return fam

        def hist(name: str, doc: str, h: Histogram) -> Any:
            fam = HistogramMetricFamily(p + name, doc, labels=labels)
            fam.add_metric(values, h.cumulative(), h.sum)
            return fam

        yield gauge("num_requests_running", "Requests in execution batches.", g.running)
        yield gauge("num_requests_waiting", "Requests waiting to be processed.", g.waiting)
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", g.kv_usage)
        yield counter("num_preemptions", "Cumulative number of preemptions.", g.preemptions)
        if self._cache_info:
            # vLLM publishes its cache config as an info-style gauge whose labels carry
            # the values; capacity = num_gpu_blocks x block_size tokens.
            keys = sorted(self._cache_info)
            info = GaugeMetricFamily(
                p + "cache_config_info",
                "Information of the LLMEngine CacheConfig",
                labels=[*keys, "engine"],
            )
            info.add_metric([*(self._cache_info[k] for k in keys), self._engine], 1.0)
            yield info
        yield counter("prompt_tokens", "Number of prefill tokens processed.", m.prompt_tokens)
        yield counter(
            "generation_tokens", "Number of generation tokens processed.", m.generation_tokens
        )
        fam = CounterMetricFamily(
            p + "request_success",
            "Count of finished requests.",
            labels=[*labels, "finished_reason"],
        )
        for reason in sorted(m.success):
            fam.add_metric([*values, reason], m.success[reason])
        yield fam
        yield hist("time_to_first_token_seconds", "Time to first token in seconds.", m.ttft)
        yield hist("inter_token_latency_seconds", "Inter-token latency in seconds.", m.itl)
        yield hist("e2e_request_latency_seconds", "End-to-end request latency in seconds.", m.e2e)
        if self._kv_connector:
            # NixlConnector's own series: an engine without a connector has none.
            yield counter(
                "nixl_num_kv_expired_reqs",
                "Requests whose KV blocks expired before a decoder pulled them.",
                m.kv_expired,
            )
            yield counter(
                "nixl_num_failed_transfers", "Failed NIXL KV transfers.", m.failed_transfers
            )
            yield hist("nixl_xfer_time_seconds", "KV transfer time in seconds.", m.xfer)
        if self._started_at is not None:
            # vLLM with one API server serves prometheus_client's default registry,
            # whose process collector adds this (unprefixed, unlabelled). SGLang and
            # multi-API-server vLLM use multiprocess mode, which has no process metrics.
            yield GaugeMetricFamily(
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                value=self._started_at,
            )

    def _collect_sglang(self) -> Iterator[Any]:
        m = self._m
        g = self._gauges()
        model, kind = self._model, self._engine_type
        rank_labels = ["engine_type", "model_name", "moe_ep_rank", "pp_rank", "tp_rank"]
        rank = [kind, model, "0", "0", "0"]

        def gauge(name: str, doc: str, value: float) -> Any:
            fam = GaugeMetricFamily("sglang:" + name, doc, labels=rank_labels)
            fam.add_metric(rank, value)
            return fam

        yield gauge(
            "max_total_num_tokens",
            "Maximum total number of tokens in the KV cache pool.",
            g.capacity_tokens,
        )
        if g.published:
            yield gauge("num_running_reqs", "The number of running requests.", g.running)
            yield gauge("num_used_tokens", "The number of used tokens.", g.used_tokens)
            yield gauge("token_usage", "The token usage.", g.kv_usage)
            yield gauge("num_queue_reqs", "The number of requests in the waiting queue.", g.waiting)
        for name, doc, counts in (
            ("prompt_tokens", "Number of prefill tokens processed.", m.streaming_prompt_tokens),
            (
                "generation_tokens",
                "Number of generation tokens processed.",
                m.streaming_generation_tokens,
            ),
            ("num_requests", "Number of requests processed.", m.streaming_requests),
        ):
            fam = CounterMetricFamily(
                "sglang:" + name, doc, labels=["engine_type", "is_streaming", "model_name"]
            )
            for streaming in sorted(counts):
                fam.add_metric([kind, streaming, model], counts[streaming])
            yield fam
        labels = ["engine_type", "model_name"]
        for name, doc, h in (
            ("time_to_first_token_seconds", "Histogram of time to first token in seconds.", m.ttft),
            ("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", m.itl),
            (
                "e2e_request_latency_seconds",
                "Histogram of End-to-end request latency in seconds",
                m.e2e,
            ),
        ):
            histogram = HistogramMetricFamily("sglang:" + name, doc, labels=labels)
            if h.count:
                histogram.add_metric([kind, model], h.cumulative(), h.sum)
            yield histogram


def make_registry(
    metrics: EngineMetrics,
    gauges: Callable[[], Gauges],
    *,
    dialect: str,
    model: str,
    engine: str,
    cache_info: dict[str, str] | None = None,
    started_at: float | None = None,
    kv_connector: bool = True,
    engine_type: str = "unified",
) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        _Collector(
            metrics,
            gauges,
            dialect=dialect,
            model=model,
            engine=engine,
            cache_info=cache_info,
            started_at=started_at,
            kv_connector=kv_connector,
            engine_type=engine_type,
        )
    )
    return registry


def render(registry: CollectorRegistry) -> bytes:
    out: bytes = generate_latest(registry)
    return out
