"""What a simulated vLLM engine sends back for a generation: chunks, bodies and logprobs.

Owns: `VllmShapes` (the stream chunks and non-streaming body of one request, as its vLLM
build sends them), vLLM's two logprobs shapes, and `VllmCollector` (its /metrics).
Invariants: a 0.29 build sends the shapes docs/design.md#engine-streams describes, a 0.32 build
the ones recorded on real vLLM 0.32 (tests/conformance/recorded.json); `_output.Shapes`
fills the chunk templates described here.
See: `_vllm_builds` for what differs between builds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ._metrics import Collector, EngineMetrics, Gauges, Histogram
from ._output import Choice, Shapes, compact, slot
from ._vllm_builds import VllmBuild


def completion_logprobs(choice: Choice, start: int, end: int, top: int) -> dict[str, Any]:
    """vLLM's completion logprobs for tokens [start, end): the sampled token and `top`
    others at each position (text_offset counts from the choice's first character)."""
    offsets: list[int] = []
    tokens: list[str] = []
    values: list[float] = []
    tops: list[dict[str, float]] = []
    offset = choice.chars
    for i in range(start, end):
        token = choice.text.token(i)
        offsets.append(offset)
        offset += len(token)
        tokens.append(token)
        values.append(choice.logprob(i, 0))
        entry = {token: values[-1]}
        for rank in range(1, top + 1):
            entry[choice.text.alternative(i, rank)] = choice.logprob(i, rank)
        tops.append(entry)
    return {
        "text_offset": offsets,
        "token_logprobs": values,
        "tokens": tokens,
        "top_logprobs": tops,
    }


def chat_logprobs(choice: Choice, start: int, end: int, top: int) -> dict[str, Any]:
    """vLLM's chat logprobs for tokens [start, end): `top` candidates at each position,
    the sampled one first."""
    content: list[dict[str, Any]] = []
    for i in range(start, end):
        token = choice.text.token(i)
        candidates = [(token, choice.logprob(i, 0))]
        candidates += [
            (choice.text.alternative(i, rank), choice.logprob(i, rank)) for rank in range(1, top)
        ]
        content.append(
            {
                "token": token,
                "logprob": candidates[0][1],
                "bytes": list(token.encode()),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode())}
                    for t, lp in candidates[:top]
                ],
            }
        )
    return {"content": content}


class VllmShapes(Shapes):
    """The chunks and body of one request, as its vLLM build sends them."""

    def __init__(
        self,
        *,
        build: VllmBuild,
        chat: bool,
        model: str,
        response_id: str,
        created: int,
        fingerprint: str | None,
        include_usage: bool,
    ) -> None:
        super().__init__(chat=chat, model=model, ids=[response_id], created=created)
        self.new = build.wire_032
        self.fingerprint = fingerprint
        self.include_usage = include_usage

    def logprobs(self, choice: Choice, start: int, end: int, top: int) -> dict[str, Any]:
        make = chat_logprobs if self.chat else completion_logprobs
        return make(choice, start, end, top)

    # -- stream chunks ------------------------------------------------------------------
    def _role_chunk(self, index: int, with_usage: bool) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            **self._head(index),
            "choices": [
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
        if with_usage:
            chunk["usage"] = slot("usage")
        if self.new:
            chunk.update({"prompt_token_ids": None, "prompt_text": None})
        return chunk

    def _token_chunk(self, choice: Choice, final: bool, with_usage: bool) -> dict[str, Any]:
        stop = choice.stop if final else None
        finish = choice.finish_reason if final else None
        body: dict[str, Any] = {"index": choice.index}
        if self.chat:
            body["delta"] = {"content": slot("text")}
        else:
            body["text"] = slot("text")
        body["logprobs"] = slot("logprobs")
        body["finish_reason"] = finish
        chunk: dict[str, Any] = {**self._head(choice.index), "choices": [body]}
        if not self.chat:
            # Completion choices carry every field, nulls included (docs/design.md#engine-streams).
            body.update({"stop_reason": stop, "prompt_token_ids": None, "token_ids": None})
        elif final:
            body["stop_reason"] = stop
        if self.chat and self.new:
            body["token_ids"] = None
        if not self.new and not self.chat:
            chunk["usage"] = None
        if with_usage:
            chunk["usage"] = slot("usage")
        if self.new and final and not self.include_usage and self.fingerprint is not None:
            # 0.32 stamps its fingerprint on a choice's last chunk unless a usage chunk
            # follows, which then carries it.
            chunk["system_fingerprint"] = self.fingerprint
        return chunk

    def usage_chunk(self, totals: dict[str, Any]) -> str:
        chunk: dict[str, Any] = {**self._head(0), "choices": [], "usage": totals}
        if self.new and self.fingerprint is not None:
            chunk["system_fingerprint"] = self.fingerprint
        return compact(chunk)

    def _usage_json(self, so_far: dict[str, int] | None) -> str:
        """Continuous usage as each build dumps it: a 0.29 completion chunk replaces its
        null usage with one that has a null prompt_tokens_details; a 0.32 chat chunk's
        usage has a null completion_tokens_details; the others have the counts only."""
        if so_far is None:
            return "null"
        if self.new and self.chat:
            return compact({**so_far, "completion_tokens_details": None})
        if not self.new and not self.chat:
            return compact({**so_far, "prompt_tokens_details": None})
        return compact(so_far)

    # -- non-streaming body -------------------------------------------------------------
    def body(
        self,
        choices: Sequence[tuple[Choice, str, dict[str, Any] | None]],
        totals: dict[str, Any],
        kv_transfer_params: dict[str, Any] | None,
    ) -> bytes:
        out: dict[str, Any] = {
            **self._head(0),
            "object": "chat.completion" if self.chat else "text_completion",
        }
        out["choices"] = [self._body_choice(c, text, lp) for c, text, lp in choices]
        out["service_tier"] = None
        out["system_fingerprint"] = self.fingerprint
        details: dict[str, Any] = {"prompt_tokens_details": totals.get("prompt_tokens_details")}
        if self.new:
            details["completion_tokens_details"] = None
        out["usage"] = {**totals, **details}
        if self.chat:
            out["prompt_logprobs"] = None
            if self.new:
                out.update({"prompt_token_ids": None, "prompt_text": None})
        out["kv_transfer_params"] = kv_transfer_params
        if self.new:
            out.update({"ec_transfer_params": None, "metrics": None})
        return compact(out).encode()

    def _body_choice(
        self, choice: Choice, text: str, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        out: dict[str, Any] = {"index": choice.index}
        if self.chat:
            message: dict[str, Any] = {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
            }
            if self.new:
                # 0.32 leaves an empty tool_calls out and names the field reasoning.
                message["reasoning"] = None
            else:
                message.update({"tool_calls": [], "reasoning_content": None})
            out["message"] = message
        else:
            out["text"] = text
        out["logprobs"] = logprobs
        out["finish_reason"] = choice.finish_reason
        out["stop_reason"] = choice.stop
        if not self.chat:
            # CompletionResponseChoice dumps every field; the streamed choices carry
            # the same token_ids/prompt_token_ids keys (docs/design.md#engine-streams).
            out.update({"token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None})
        elif self.new:
            out["token_ids"] = None
        if self.new:
            out["routed_experts"] = None
        return out


class VllmCollector(Collector):
    """vLLM's /metrics: ``vllm:`` series labelled by model and engine, NixlConnector's
    only with a KV connector, and the process start time of a one-API-server vLLM."""

    def __init__(
        self,
        metrics: EngineMetrics,
        gauges: Callable[[], Gauges],
        *,
        model: str,
        engine: str,
        cache_info: dict[str, str],
        started_at: float,
        kv_connector: bool,
    ) -> None:
        super().__init__(metrics, gauges, model=model, engine=engine)
        self._cache_info = dict(cache_info)
        self._started_at = started_at
        self._kv_connector = kv_connector

    def collect(self) -> Iterator[Any]:
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
        if g.prefix_queries is not None:
            yield counter(
                "prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                g.prefix_queries,
            )
            yield counter(
                "prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                g.prefix_hits,
            )
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
        # vLLM with one API server serves prometheus_client's default registry, whose
        # process collector adds this (unprefixed, unlabelled). SGLang and
        # multi-API-server vLLM use multiprocess mode, which has no process metrics.
        yield GaugeMetricFamily(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            value=self._started_at,
        )
