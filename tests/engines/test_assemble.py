"""Rebuilding a non-streaming answer from recorded vLLM and SGLang chunk shapes."""

from __future__ import annotations

import json
from typing import Any

from narwhal.engines._assemble import ResponseAssembler, unassemblable_reason

HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 17, "model": "m"}
CHEAD = {"id": "cmpl-1", "object": "text_completion", "created": 17, "model": "m"}


def assemble(kind: Any, dialect: Any, chunks: list[dict[str, Any]]) -> dict[str, Any]:
    assembler = ResponseAssembler(kind, dialect)
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.result()


def delta(d: dict[str, Any], **choice: Any) -> dict[str, Any]:
    return {**HEAD, "choices": [{"index": 0, "delta": d, "logprobs": None, **choice}]}


def test_vllm_chat_tool_call_is_merged_by_index() -> None:
    call = {"index": 0, "id": "chatcmpl-tool-a", "type": "function"}
    chunks = [
        delta({"role": "assistant", "content": ""}, finish_reason=None),
        delta({"reasoning": "need "}),
        delta({"reasoning": "weather"}),
        delta({"tool_calls": [{**call, "function": {"name": "get_weather"}}]}),
        delta({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        delta(
            {
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "chatcmpl-tool-b",
                        "type": "function",
                        "function": {"name": "now", "arguments": "{}"},
                    }
                ]
            }
        ),
        delta({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
        delta({}, finish_reason="tool_calls", stop_reason=None),
        {
            **HEAD,
            "choices": [],
            "usage": {"prompt_tokens": 5, "total_tokens": 9, "completion_tokens": 4},
        },
    ]
    document = assemble("chat", "vllm", chunks)
    # vLLM 0.32's non-streaming answer, field for field and in its order.
    assert json.dumps(document) == json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 17,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": "",
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "tool_calls": [
                            {
                                "id": "chatcmpl-tool-a",
                                "type": "function",
                                "function": {
                                    "name": "get_weather",
                                    "arguments": '{"city": "Paris"}',
                                },
                            },
                            {
                                "id": "chatcmpl-tool-b",
                                "type": "function",
                                "function": {"name": "now", "arguments": "{}"},
                            },
                        ],
                        "reasoning": "need weather",
                    },
                    "logprobs": None,
                    "finish_reason": "tool_calls",
                    "stop_reason": None,
                    "token_ids": None,
                    "routed_experts": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {
                "prompt_tokens": 5,
                "total_tokens": 9,
                "completion_tokens": 4,
                "prompt_tokens_details": None,
                "completion_tokens_details": None,
            },
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
    )


def test_a_vllm_chat_message_without_a_call_has_no_tool_calls_key() -> None:
    chunks = [
        delta({"role": "assistant", "content": ""}, token_ids=None),
        delta({"content": "Par"}, token_ids=[7]),
        delta({"content": "is"}, token_ids=[8, 9], finish_reason="stop", stop_reason=None),
    ]
    (choice,) = assemble("chat", "vllm", chunks)["choices"]
    assert choice["message"] == {
        "role": "assistant",
        "content": "Paris",
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    assert choice["token_ids"] == [7, 8, 9]


def test_vllm_chat_logprobs_content_is_concatenated() -> None:
    first = {"token": "Par", "logprob": -0.1, "bytes": [80], "top_logprobs": []}
    second = {"token": "is", "logprob": -0.2, "bytes": [105], "top_logprobs": []}
    chunks = [
        delta({"role": "assistant", "content": ""}),
        delta({"content": "Par"}, logprobs={"content": [first]}),
        delta(
            {"content": "is"}, logprobs={"content": [second]}, finish_reason="stop", stop_reason=13
        ),
    ]
    choice = assemble("chat", "vllm", chunks)["choices"][0]
    assert choice["message"]["content"] == "Paris"
    assert choice["logprobs"] == {"content": [first, second]}
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", 13)


def test_vllm_completion_text_logprobs_and_token_ids_are_concatenated() -> None:
    def chunk(text: str, n: int, finish: str | None = None) -> dict[str, Any]:
        logprobs = {
            "text_offset": [n],
            "token_logprobs": [-n / 10],
            "tokens": [text],
            "top_logprobs": [{text: -n / 10}],
        }
        choice = {
            "index": 0,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": None,
            "prompt_token_ids": None,
            "token_ids": [n],
        }
        return {**CHEAD, "choices": [choice], "usage": None}

    usage = {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}
    document = assemble(
        "completions",
        "vllm",
        [chunk(" a", 1), chunk(" b", 2, "length"), {**CHEAD, "choices": [], "usage": usage}],
    )
    assert document["object"] == "text_completion"
    (choice,) = document["choices"]
    # vLLM 0.32's choice, in its order.
    assert json.dumps(choice) == json.dumps(
        {
            "index": 0,
            "text": " a b",
            "logprobs": {
                "text_offset": [1, 2],
                "token_logprobs": [-0.1, -0.2],
                "tokens": [" a", " b"],
                "top_logprobs": [{" a": -0.1}, {" b": -0.2}],
            },
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": [1, 2],
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "routed_experts": None,
        }
    )
    assert document["usage"] == {
        **usage,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    assert list(document) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "service_tier",
        "system_fingerprint",
        "usage",
        "kv_transfer_params",
        "ec_transfer_params",
        "metrics",
    ]


def test_sglang_chat_keeps_matched_stop_and_its_own_message_fields() -> None:
    # SGLang 0.5.23's chunks (tests/conformance/recorded-sglang.json): every delta has
    # reasoning_content null, the finish_reason comes in a chunk of its own.
    def chunk(d: dict[str, Any], **choice: Any) -> dict[str, Any]:
        body = {"index": 0, "delta": {"reasoning_content": None, **d}, "logprobs": None}
        return {
            **HEAD,
            "choices": [{**body, "finish_reason": None, "matched_stop": None, **choice}],
        }

    usage = {"prompt_tokens": 5, "total_tokens": 6, "completion_tokens": 1}
    details = {"prompt_tokens_details": None, "reasoning_tokens": 0}
    chunks = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "hi"}),
        chunk({}, finish_reason="stop", matched_stop=2),
        {**HEAD, "choices": [], "usage": {**usage, **details, "completion_tokens_details": None}},
    ]
    document = assemble("chat", "sglang", chunks)
    assert document == {
        **HEAD,
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi", "reasoning_content": None},
                "logprobs": None,
                "finish_reason": "stop",
                "matched_stop": 2,
            }
        ],
        "usage": {**usage, **details, "completion_tokens_details": None},
    }
    assert "tool_calls" not in document["choices"][0]["message"]  # no call made


def test_sglang_completion_usage_has_the_null_details_its_stream_leaves_out() -> None:
    choice = {"index": 0, "text": "hi", "logprobs": None}
    chunks = [
        {**CHEAD, "choices": [{**choice, "finish_reason": "length", "matched_stop": None}]},
        # A completion's usage chunk is dumped without its null fields.
        {
            **CHEAD,
            "choices": [],
            "usage": {
                "prompt_tokens": 5,
                "completion_tokens": 1,
                "total_tokens": 6,
                "reasoning_tokens": 0,
            },
        },
    ]
    usage = assemble("completions", "sglang", chunks)["usage"]
    assert list(usage.items()) == [
        ("prompt_tokens", 5),
        ("total_tokens", 6),
        ("completion_tokens", 1),
        ("prompt_tokens_details", None),
        ("reasoning_tokens", 0),
        ("completion_tokens_details", None),
    ]
    # An older build's usage has no reasoning_tokens: its shape is kept.
    older = {"prompt_tokens": 5, "total_tokens": 6, "completion_tokens": 1}
    chunks[1] = {**CHEAD, "choices": [], "usage": older}
    assert assemble("completions", "sglang", chunks)["usage"] == {
        **older,
        "prompt_tokens_details": None,
    }


def test_requests_a_stream_cannot_answer() -> None:
    assert unassemblable_reason("completions", {"prompt": "x"}) is None
    assert unassemblable_reason("chat", {"messages": [], "logprobs": True}) is None
    assert unassemblable_reason("completions", {"prompt_logprobs": 0}) == "prompt_logprobs"
    assert unassemblable_reason("completions", {"echo": True}) == "echo"
    assert unassemblable_reason("chat", {"echo": True}) is None
    assert unassemblable_reason("chat", {"use_beam_search": True}) == "beam_search"
    assert unassemblable_reason("chat", {"stream_options": {}}) == "stream_options"


def test_a_long_answer_is_assembled_whole_and_no_chunk_is_changed() -> None:
    # Pieces are joined once at the end (per-chunk concatenation was quadratic), and the
    # lists are extended in place: the chunks' own lists must stay as they were sent.
    assembler = ResponseAssembler("completions", "vllm")
    chunks: list[dict[str, Any]] = [
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "choices": [
                {
                    "index": 0,
                    "text": f"t{i} ",
                    "token_ids": [i],
                    "logprobs": {"tokens": [f"t{i}"], "token_logprobs": [-0.5]},
                    "finish_reason": "length" if i == 19_999 else None,
                }
            ],
        }
        for i in range(20_000)
    ]
    for chunk in chunks:
        assembler.add(chunk)
    choices = assembler.result()["choices"]
    assert isinstance(choices, list)
    choice = choices[0]
    assert choice["text"] == "".join(f"t{i} " for i in range(20_000))
    assert choice["token_ids"] == list(range(20_000))
    assert choice["logprobs"]["tokens"][-1] == "t19999"
    assert len(choice["logprobs"]["token_logprobs"]) == 20_000
    assert choice["finish_reason"] == "length"
    assert chunks[0]["choices"][0]["token_ids"] == [0]
    assert chunks[0]["choices"][0]["logprobs"]["tokens"] == ["t0"]
