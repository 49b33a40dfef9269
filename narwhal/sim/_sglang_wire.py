"""What a simulated SGLang engine sends back for a generation: chunks, bodies, logprobs
and the error event of a stream.

Owns: `SglangShapes` (the chunks and non-streaming body of one request), SGLang's
logprobs shapes, `usage_of` (its usage object), `error_event` (an error sent after a
stream's 200) and `SglangCollector` (its /metrics).
Invariants: every shape is SGLang 0.5.23's, as recorded in
tests/conformance/recorded-sglang.json; `_output.Shapes` fills the chunk templates
described here.
See: the real engine's python/sglang/srt/entrypoints/openai/serving_{completions,chat}.py.

- A chat stream opens each choice with a role chunk (content ""), sends its tokens
  without a finish_reason, and ends each choice with a chunk of its own
  (``delta: {reasoning_content: null}``, finish_reason, matched_stop) once every choice
  has finished. Every chat delta carries ``reasoning_content: null``.
- A completion's last token chunk carries its finish_reason and matched_stop.
- `continuous_usage_stats` adds the running usage to each token chunk, with or without
  `include_usage`; streamed ``n > 1`` choices each carry an id of their own.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from http import HTTPStatus
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ._metrics import Collector, EngineMetrics, Gauges
from ._output import Choice, Shapes, compact, slot

# The weight version an engine reports when nobody updated its weights.
_WEIGHT_VERSION = "default"


def usage_of(totals: dict[str, int]) -> dict[str, Any]:
    """SGLang's usage object: the counts, then its details, null unless asked for."""
    return {
        **totals,
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
        "completion_tokens_details": None,
    }


def completion_logprobs(choice: Choice, start: int, end: int, top: int) -> dict[str, Any]:
    """SGLang's completion logprobs for tokens [start, end): text offsets are not
    supported (-1), and each position's top logprobs are the `top` likeliest tokens,
    the sampled one not among them unless it is one of those."""
    tokens = [choice.text.token(i) for i in range(start, end)]
    return {
        "text_offset": [-1] * len(tokens),
        "token_logprobs": [choice.logprob(i, 0) for i in range(start, end)],
        "tokens": tokens,
        "top_logprobs": [
            {
                choice.text.alternative(i, rank): choice.logprob(i, rank)
                for rank in range(1, top + 1)
            }
            for i in range(start, end)
        ],
    }


def chat_logprobs(choice: Choice, start: int, end: int, top: int) -> dict[str, Any]:
    """SGLang's chat logprobs for tokens [start, end), `top` candidates at each."""
    content: list[dict[str, Any]] = []
    for i in range(start, end):
        token = choice.text.token(i)
        others = [
            (choice.text.alternative(i, rank), choice.logprob(i, rank))
            for rank in range(1, top + 1)
        ]
        content.append(
            {
                "token": token,
                "bytes": list(token.encode()),
                "logprob": choice.logprob(i, 0),
                "top_logprobs": [
                    {"token": t, "bytes": list(t.encode()), "logprob": lp} for t, lp in others
                ],
            }
        )
    return {"content": content}


def error_event(status: int, message: str) -> bytes:
    """An error after a stream's 200: json.dumps' spacing, the status's name as type."""
    error = {
        "object": "error",
        "message": message,
        "type": HTTPStatus(status).name,
        "param": None,
        "code": status,
    }
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


class SglangShapes(Shapes):
    """The chunks and body of one request as SGLang 0.5.23 sends them."""

    def __init__(self, *, chat: bool, model: str, ids: Sequence[str], created: int) -> None:
        super().__init__(chat=chat, model=model, ids=ids, created=created)
        # A chat choice's finish_reason comes in a chunk of its own (`finish_chunks`).
        self.finish_in_token_chunk = not chat

    def logprobs(self, choice: Choice, start: int, end: int, top: int) -> dict[str, Any]:
        make = chat_logprobs if self.chat else completion_logprobs
        return make(choice, start, end, top)

    @staticmethod
    def _choice(
        index: int,
        fields: dict[str, Any],
        logprobs: Any = None,
        finish_reason: str | None = None,
        matched_stop: str | None = None,
    ) -> dict[str, Any]:
        return {
            "index": index,
            **fields,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "matched_stop": matched_stop,
        }

    # -- stream chunks ------------------------------------------------------------------
    def _role_chunk(self, index: int, with_usage: bool) -> dict[str, Any]:
        # No usage on a role chunk, continuous or not.
        delta = {"reasoning_content": None, "role": "assistant", "content": ""}
        return {**self._head(index), "choices": [self._choice(index, {"delta": delta})]}

    def _token_chunk(self, choice: Choice, final: bool, with_usage: bool) -> dict[str, Any]:
        if self.chat:
            fields: dict[str, Any] = {"delta": {"reasoning_content": None, "content": slot("text")}}
        else:
            fields = {"text": slot("text")}
        body = self._choice(
            choice.index,
            fields,
            slot("logprobs"),
            choice.finish_reason if final else None,
            choice.stop if final else None,
        )
        chunk: dict[str, Any] = {**self._head(choice.index), "choices": [body]}
        if with_usage:
            chunk["usage"] = slot("usage")
        elif not self.chat:
            chunk["usage"] = None
        return chunk

    def _usage_json(self, so_far: dict[str, int] | None) -> str:
        return "null" if so_far is None else compact(usage_of(so_far))

    def finish_chunks(self, choices: Sequence[Choice]) -> str:
        """A chat stream's last events, one per choice: its finish_reason and matched
        stop string. A completion's ride on its last token chunk: none."""
        if not self.chat:
            return ""
        out = []
        for choice in choices:
            body = self._choice(
                choice.index,
                {"delta": {"reasoning_content": None}},
                finish_reason=choice.finish_reason,
                matched_stop=choice.stop,
            )
            chunk = {**self._head(choice.index), "choices": [body]}
            out.append(f"data: {compact(chunk)}\n\n")
        return "".join(out)

    def usage_chunk(self, totals: dict[str, int]) -> str:
        # A completion's is dumped without its null fields; a chat's with them.
        counts: dict[str, Any] = (
            usage_of(totals) if self.chat else {**totals, "reasoning_tokens": 0}
        )
        return compact({**self._head(0), "choices": [], "usage": counts})

    # -- non-streaming body -------------------------------------------------------------
    def body(
        self,
        choices: Sequence[tuple[Choice, str, dict[str, Any] | None]],
        totals: dict[str, int],
        kv_transfer_params: dict[str, Any] | None,
    ) -> bytes:
        parts = []
        for choice, text, logprobs in choices:
            if self.chat:
                message = {"role": "assistant", "content": text, "reasoning_content": None}
                fields: dict[str, Any] = {"message": message}
            else:
                fields = {"text": text}
            parts.append(
                self._choice(choice.index, fields, logprobs, choice.finish_reason, choice.stop)
            )
        # The tokens generated under the one weight version: a choice's, all of them
        # (a body is sent once every choice has run to its end).
        generated = choices[0][0].limit if choices else 0
        out = {
            **self._head(0),
            "object": "chat.completion" if self.chat else "text_completion",
            "choices": parts,
            "usage": usage_of(totals),
            "metadata": {
                "weight_version": _WEIGHT_VERSION,
                "weight_versions": [{"version": _WEIGHT_VERSION, "start": 0, "end": generated}],
            },
        }
        return compact(out).encode()


class SglangCollector(Collector):
    """SGLang 0.5.23's /metrics: the gauges per scheduler rank, the counters per
    `is_streaming`. Its load gauges appear only once its scheduler has reported
    (`Gauges.published`), and a counter's series once it has counted, as
    prometheus_client shows a labelled metric only from its first use. It has no
    request_success counter and no process_start_time_seconds (its metrics are
    multiprocess). `engine_type` is its server mode's label."""

    def __init__(
        self,
        metrics: EngineMetrics,
        gauges: Callable[[], Gauges],
        *,
        model: str,
        engine: str,
        engine_type: str,
    ) -> None:
        super().__init__(metrics, gauges, model=model, engine=engine)
        self._engine_type = engine_type

    def collect(self) -> Iterator[Any]:
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
