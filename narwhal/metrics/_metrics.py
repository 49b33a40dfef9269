"""Prometheus metrics on Narwhal's own registry (never the global REGISTRY).

Counters and histograms are updated where things happen; gauges of live state are
read at scrape time by a collector over the router's statistics, so nothing has to be
kept in sync.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
    5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
TOKEN_BUCKETS = (
    0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0,
)  # fmt: skip

# (projected - observed) / observed: -0.5 means the prediction was half the observed TTFT.
PREDICTION_ERROR_BUCKETS = (
    -0.9, -0.75, -0.5, -0.3, -0.2, -0.1, -0.05, 0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0,
)  # fmt: skip

# A gauge family produced at scrape time: (name, help, labels, samples[(labelvalues, value)]).
GaugeSource = Callable[[], Iterable[tuple[str, str, list[str], list[tuple[list[str], float]]]]]


M = TypeVar("M", Counter, Histogram)


class Children(Generic[M]):
    """`metric.labels(*values)` for the request path, remembered per label tuple.

    prometheus_client's labels() validates and stringifies the values and takes a lock
    on every call (several µs, a few times per request); children are never removed, so
    the first one returned for a tuple stays the one to update.
    """

    __slots__ = ("_cache", "_metric")

    def __init__(self, metric: M) -> None:
        self._metric: M = metric
        self._cache: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._cache.get(values)
        if child is None:
            child = self._cache[values] = self._metric.labels(*values)
        return child


class _LiveGauges(Collector):
    def __init__(self, source: GaugeSource) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        for name, help_text, labels, samples in self._source():
            family = GaugeMetricFamily(name, help_text, labels=labels)
            for label_values, value in samples:
                family.add_metric(label_values, value)
            yield family


class Metrics:
    def __init__(self) -> None:
        registry = CollectorRegistry(auto_describe=True)
        self.registry = registry
        # process_cpu_seconds_total and friends (Linux): one process, one event loop, so
        # its CPU is the capacity to watch (README, Sizing).
        ProcessCollector(registry=registry)
        self.requests = Counter(
            "narwhal_requests",
            "Completion requests by endpoint and final outcome (ok or an error code).",
            ["endpoint", "outcome"],
            registry=registry,
        )
        self.refusals = Counter(
            "narwhal_refusals",
            "Requests refused before reaching an engine, by reason.",
            ["reason"],
            registry=registry,
        )
        self.engine_failures = Counter(
            "narwhal_engine_failures",
            "Failed engine legs by engine, phase and failure code.",
            ["engine", "phase", "code"],
            registry=registry,
        )
        self.token_counts = Counter(
            "narwhal_token_counts",
            "Prompt length determinations by method: local (engine.tokenizer_path's "
            "tokenizer in the router), exact (an engine's /tokenize), or fallback.",
            ["method"],
            registry=registry,
        )
        self.token_fallbacks = Counter(
            "narwhal_token_count_fallbacks",
            "Fallback prompt length estimates by why the count is not exact: disabled "
            "(engine.tokenize false), no_engine, unsupported (a chat request when every "
            "available engine's /tokenize refused messages: older SGLang builds), timeout, "
            "engine_auth (401/403: the engine refused narwhal's API key), engine_model (404: "
            "the engine does not serve engines[].model), engine_error (another non-200 "
            "answer), unreachable, bad_answer (no integer count).",
            ["reason"],
            registry=registry,
        )
        self.token_local_misses = Counter(
            "narwhal_token_count_local_misses",
            "Prompts engine.tokenizer_path's tokenizer left to the engines' /tokenize, by "
            "why: prompt (not one text), dialect (an SGLang engine would count it otherwise), "
            "no_template, template_parts (the template loops over content parts), fields "
            "(tools, chat_template_kwargs, ...), messages (tool, developer or multimodal "
            "ones), template_error.",
            ["reason"],
            registry=registry,
        )
        self.context_checks = Counter(
            "narwhal_context_checks",
            "Requests with an exact prompt length (engine count or token ids) by the check "
            "of prompt plus max_tokens against the engines' context length: passed, "
            "refused (400 context_length_exceeded), unknown (no available engine reports "
            "its context length; see each engine's context in /narwhal/state: the engine "
            "refuses an over-long request itself).",
            ["result"],
            registry=registry,
        )
        self.slo_requests = Counter(
            "narwhal_slo_requests",
            "Offered completion requests by how they count for SLO attainment: met (TTFT "
            "and TPOT within slo.*), missed (late, or failed on the service's side), "
            "refused (counted as a miss: docs/design.md#evidence-gate), unmeasured (served, "
            "no first token seen). Requests that failed through the client's own fault are not "
            "offered.",
            ["result"],
            registry=registry,
        )
        self.unstreamed_legs = Counter(
            "narwhal_unstreamed_decode_legs",
            "Decode legs of non-streaming requests sent as non-streaming engine requests "
            "(without first-token and decode-gap timers), by why the answer cannot be "
            "assembled from a stream: prompt_logprobs, echo, beam_search, stream_options.",
            ["reason"],
            registry=registry,
        )
        self.retries = Counter(
            "narwhal_retries",
            "Retries started, by the failure code that caused them.",
            ["code"],
            registry=registry,
        )
        self.client_connection_limit_reached = Counter(
            "narwhal_client_connection_limit_reached",
            "Times a new client connection found listen.max_open_connections open (it "
            "then took the longest-idle one's place, or waited in the listen backlog).",
            registry=registry,
        )
        self.client_connections_shed = Counter(
            "narwhal_client_connections_shed",
            "Idle client connections closed to make room for a new one at "
            "listen.max_open_connections.",
            registry=registry,
        )
        self.client_connections_refused = Counter(
            "narwhal_client_connections_refused",
            "Client connections answered 429 connections_per_client and closed at accept: "
            "their address had listen.max_open_connections_per_client open already, none "
            "of them idle.",
            registry=registry,
        )
        self.client_accept_failures = Counter(
            "narwhal_client_accept_failures",
            "accept() calls on the HTTP listener that failed for want of descriptors or "
            "memory, by errno (EMFILE, ENFILE, ENOMEM, ENOBUFS); retried every 0.1 s while "
            "connections wait.",
            ["errno"],
            registry=registry,
        )
        self.client_protocol_errors = Counter(
            "narwhal_client_protocol_errors",
            "Client requests answered with an error before reaching Narwhal's routes, by "
            "status: HTTP/1.1 that could not be parsed (400), a request head over 16 kB "
            "(431), a Transfer-Encoding other than chunked (501), a websocket upgrade (400), "
            "a request of another HTTP version than 1.x or HTTP/2's connection preface (505).",
            ["status"],
            registry=registry,
        )
        self.unserved_placements = Counter(
            "narwhal_unserved_placements",
            "Placements where every candidate missed its projected SLO (least-cost fallback).",
            registry=registry,
        )
        self.local_prefills = Counter(
            "narwhal_local_prefills",
            "Requests placed on a prefill/decode pair whose decode engine prefilled the "
            "prompt itself, holding at least cache.local_prefill_share of it cached.",
            ["engine"],
            registry=registry,
        )
        self.cached_prompt_tokens = Counter(
            "narwhal_cached_prompt_tokens",
            "Prompt tokens priced as cached on the engine that ran the request's prefill "
            "(its KV events, or the prompts Narwhal routed there: caches.engines[].source).",
            ["engine"],
            registry=registry,
        )
        self.engine_cached_prompt_tokens = Counter(
            "narwhal_engine_cached_prompt_tokens",
            "Prompt tokens the engine that computed the prompt reported found in its prefix "
            "cache (usage.prompt_tokens_details.cached_tokens): against "
            "narwhal_cached_prompt_tokens, how far Narwhal's cache estimate is off.",
            ["engine"],
            registry=registry,
        )
        self.ttft = Histogram(
            "narwhal_ttft_seconds",
            "Time from ingress to the first generated token relayed to the client.",
            ["mode"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.ttft_prediction_error = Histogram(
            "narwhal_ttft_prediction_error_ratio",
            "Relative error of predictive admission's projected TTFT, (projected - observed)"
            " / observed, per admitted streaming request that produced a first token.",
            buckets=PREDICTION_ERROR_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "narwhal_tpot_seconds",
            "Mean time per output token after the first, per streamed request.",
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "narwhal_queue_wait_seconds",
            "Time admitted requests waited in the admission queue.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.request_duration = Histogram(
            "narwhal_request_duration_seconds",
            "Time from ingress to the end of the response, by endpoint.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )

        self.requests_by = Children(self.requests)
        self.token_counts_by = Children(self.token_counts)
        self.token_fallbacks_by = Children(self.token_fallbacks)
        self.token_local_misses_by = Children(self.token_local_misses)
        self.context_checks_by = Children(self.context_checks)
        self.unstreamed_legs_by = Children(self.unstreamed_legs)
        self.ttft_by = Children(self.ttft)
        self.request_duration_by = Children(self.request_duration)

    def add_live_gauges(self, source: GaugeSource) -> None:
        self.registry.register(_LiveGauges(source))

    def render(self) -> bytes:
        return generate_latest(self.registry)
