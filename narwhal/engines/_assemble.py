"""Rebuilding an engine's non-streaming answer from its event stream, without I/O.

The router sends a non-streaming client request's decode leg as a stream, so that the
first-token and decode-gap timers see it, and answers the client with the document the
engine would have sent had it been asked without streaming (docs/design.md#engine-streams).

vLLM and SGLang build both forms from the same generation state: a streamed choice's
text, logprobs and token ids are slices of the final ones, and the finishing chunk
carries finish_reason and stop_reason (vLLM) or matched_stop (SGLang). Chat deltas add
role, content, reasoning and tool-call fragments; a tool call's id, type and name come
once, its arguments in pieces, all keyed by the call's index. The non-streaming
response has fields no chunk carries; they are null for a request that streams, and are
filled in here per dialect, in the engine's order, so a client sees the same document
either way. vLLM's are those of 0.32 (checked against a real engine by
tests/real/test_vllm_defects.py): `ec_transfer_params`, `metrics`, each choice's
`routed_experts`, the usage's `completion_tokens_details`, and a chat message with
`reasoning` and no `tool_calls` key when it made no call. SGLang's are those of 0.5.23
(tests/conformance/recorded-sglang.json): each choice's `matched_stop`, a chat message's
`reasoning_content` (and `tool_calls` only when it made a call), and the usage's
`prompt_tokens_details` and `completion_tokens_details` around its `reasoning_tokens`. Its
top-level `metadata` (the weight versions that generated the first choice) is in no
chunk and no other answer: an assembled SGLang answer has none.

Some requests have a non-streaming answer a stream cannot give: see
`unassemblable_reason`.
"""

from __future__ import annotations

from typing import Literal

from ._dialects import EndpointKind, Json

# What a non-streaming response holds that its chunks do not, in the engine's order
# (vLLM 0.32's response models). A key the chunks did carry keeps the chunks' value;
# `choices` and `usage` are filled in where they stand.
_VLLM_COMPLETION_TOP = (
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
)
_VLLM_CHAT_TOP = (
    *_VLLM_COMPLETION_TOP[:8],
    "prompt_logprobs",
    "prompt_token_ids",
    "prompt_text",
    *_VLLM_COMPLETION_TOP[8:],
)
_VLLM_COMPLETION_CHOICE = (
    "index",
    "text",
    "logprobs",
    "finish_reason",
    "stop_reason",
    "token_ids",
    "prompt_logprobs",
    "prompt_token_ids",
    "routed_experts",
)
_VLLM_CHAT_CHOICE = (
    "index",
    "message",
    "logprobs",
    "finish_reason",
    "stop_reason",
    "token_ids",
    "routed_experts",
)
# `tool_calls` only when the message made a call (vLLM drops the empty list).
_VLLM_MESSAGE = (
    "role",
    "content",
    "refusal",
    "annotations",
    "audio",
    "function_call",
    "tool_calls",
    "reasoning",
)
_VLLM_USAGE = (
    "prompt_tokens",
    "total_tokens",
    "completion_tokens",
    "prompt_tokens_details",
    "completion_tokens_details",
)
_SGLANG_COMPLETION_CHOICE: Json = {"logprobs": None, "finish_reason": None, "matched_stop": None}
_SGLANG_CHAT_CHOICE: Json = _SGLANG_COMPLETION_CHOICE
_SGLANG_MESSAGE = ("role", "content", "reasoning_content", "tool_calls")
# 0.5.23's usage, whose streamed form leaves its null details out of a completion's; one
# without reasoning_tokens is an older build's, kept as it came with its prompt details.
_SGLANG_USAGE = (
    "prompt_tokens",
    "total_tokens",
    "completion_tokens",
    "prompt_tokens_details",
    "reasoning_tokens",
    "completion_tokens_details",
)

# Delta fields whose pieces are concatenated; any other delta field keeps its last
# non-null value.
_TEXT_DELTAS = ("content", "reasoning_content", "reasoning", "refusal")


def unassemblable_reason(kind: EndpointKind, body: Json) -> str | None:
    """Why a non-streaming request's answer cannot be rebuilt from a stream, or None.

    - prompt_logprobs (vLLM): only the non-streaming response carries them.
    - echo (completions): the prompt is prepended to the first chunk's text, but the
      streamed logprobs offsets of an echoed prompt have not been checked against the
      non-streaming ones; kept non-streaming until they are.
    - use_beam_search (vLLM): beam search picks its output at the end.
    - stream_options: vLLM refuses it without `stream: true` (400); streaming the leg
      would hide that answer from the client.
    """
    if body.get("prompt_logprobs") is not None:
        return "prompt_logprobs"
    if kind == "completions" and body.get("echo"):
        return "echo"
    if body.get("use_beam_search"):
        return "beam_search"
    if body.get("stream_options") is not None:
        return "stream_options"
    return None


def streamed_leg_body(body: Json) -> Json:
    """A non-streaming request's body, asked as a stream with its final usage chunk
    (a non-streaming response always reports usage)."""
    leg = dict(body)
    leg["stream"] = True
    leg["stream_options"] = {"include_usage": True}
    return leg


class ResponseAssembler:
    """Feed each stream chunk's JSON document; `result()` is the whole response."""

    __slots__ = ("_choices", "_dialect", "_kind", "_top", "_usage")

    def __init__(self, kind: EndpointKind, dialect: Literal["vllm", "sglang"]) -> None:
        self._kind = kind
        self._dialect = dialect
        self._top: Json = {}
        self._choices: dict[int, Json] = {}
        self._usage: object = None

    def add(self, chunk: Json) -> None:
        for key, value in chunk.items():
            if key == "choices":
                continue
            if key == "usage":
                if isinstance(value, dict):
                    self._usage = value  # continuous usage: the last one is the total
                continue
            _keep(self._top, key, value)
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", 0)
            if not isinstance(index, int):
                index = 0
            merged = self._choices.setdefault(index, {"index": index})
            if self._kind == "chat":
                _merge_chat(merged, choice)
            else:
                _merge_completion(merged, choice)

    def result(self) -> Json:
        out: Json = {}
        for key in ("id", "object", "created", "model"):
            if key in self._top:
                out[key] = self._top[key]
        if out.get("object") == "chat.completion.chunk" or self._kind == "chat":
            out["object"] = "chat.completion"
        else:
            out["object"] = "text_completion"
        out.update({k: v for k, v in self._top.items() if k not in out})
        out["choices"] = [_joined(self._choice(self._choices[i])) for i in sorted(self._choices)]
        vllm = self._dialect == "vllm"
        if isinstance(self._usage, dict):
            if vllm:
                out["usage"] = _in_order(self._usage, _VLLM_USAGE)
            elif "reasoning_tokens" in self._usage:
                out["usage"] = _in_order(self._usage, _SGLANG_USAGE)
            else:
                out["usage"] = _in_order(self._usage, _SGLANG_USAGE[:4])
        if not vllm:
            return out
        return _in_order(out, _VLLM_CHAT_TOP if self._kind == "chat" else _VLLM_COMPLETION_TOP)

    def _choice(self, merged: Json) -> Json:
        vllm = self._dialect == "vllm"
        if self._kind != "chat":
            choice = dict(merged)
            choice.setdefault("text", "")
            if vllm:
                return _in_order(choice, _VLLM_COMPLETION_CHOICE)
            _defaults(choice, _SGLANG_COMPLETION_CHOICE)
            return choice
        choice = {k: v for k, v in merged.items() if k not in ("delta", "calls")}
        delta = merged.get("delta")
        message: Json = dict(delta) if isinstance(delta, dict) else {}
        message.setdefault("role", "assistant")
        message.setdefault("content", None)
        calls = merged.get("calls")
        if isinstance(calls, dict) and calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
        choice["message"] = message
        if vllm:
            choice["message"] = _in_order(message, _VLLM_MESSAGE, omit=("tool_calls",))
            return _in_order(choice, _VLLM_CHAT_CHOICE)
        choice["message"] = _in_order(message, _SGLANG_MESSAGE, omit=("tool_calls",))
        ordered: Json = {"index": choice.pop("index"), "message": choice.pop("message")}
        ordered.update(choice)
        _defaults(ordered, _SGLANG_CHAT_CHOICE)
        return ordered


def _in_order(document: Json, keys: tuple[str, ...], omit: tuple[str, ...] = ()) -> Json:
    """`document` with `keys` first, in that order, each null where it had none (but
    those in `omit`, left out then), and its other keys after them."""
    out: Json = {}
    for key in keys:
        if key in document:
            out[key] = document[key]
        elif key not in omit:
            out[key] = None
    for key, value in document.items():
        if key not in out:
            out[key] = value
    return out


def _keep(target: Json, key: str, value: object) -> None:
    """The last non-null value of a field, or null if it never had one."""
    if value is not None or key not in target:
        target[key] = value


def _defaults(target: Json, defaults: Json) -> None:
    for key, value in defaults.items():
        target.setdefault(key, value)


def _merge_completion(merged: Json, choice: Json) -> None:
    for key, value in choice.items():
        if key == "index":
            continue
        if key == "text":
            if isinstance(value, str):
                _append_text(merged, "text", value)
            continue
        if key == "token_ids":
            _extend_list(merged, key, value)
            continue
        if key == "logprobs" and isinstance(value, dict):
            _merge_logprobs(merged, value)
            continue
        _keep(merged, key, value)


def _merge_chat(merged: Json, choice: Json) -> None:
    for key, value in choice.items():
        if key == "index":
            continue
        if key == "delta":
            if isinstance(value, dict):
                _merge_delta(merged, value)
            continue
        if key == "logprobs" and isinstance(value, dict):
            _merge_logprobs(merged, value)
            continue
        if key == "token_ids":
            _extend_list(merged, key, value)
            continue
        _keep(merged, key, value)


def _merge_logprobs(merged: Json, part: Json) -> None:
    """Both logprobs shapes are lists per key, concatenated chunk by chunk: completions'
    parallel lists (tokens, token_logprobs, top_logprobs, text_offset), chat's `content`
    (and `refusal`) lists of token entries."""
    logprobs = merged.get("logprobs")
    if not isinstance(logprobs, dict):
        logprobs = merged["logprobs"] = {}
    for name, value in part.items():
        _extend_list(logprobs, name, value)


def _merge_delta(merged: Json, delta: Json) -> None:
    message = merged.get("delta")
    if not isinstance(message, dict):
        message = merged["delta"] = {}
    for key, value in delta.items():
        if key in _TEXT_DELTAS:
            if isinstance(value, str):
                _append_text(message, key, value)
            else:
                message.setdefault(key, None)
        elif key == "role":
            if value is not None and message.get("role") is None:
                message["role"] = value
        elif key == "tool_calls":
            if isinstance(value, list):
                calls = merged.get("calls")
                if not isinstance(calls, dict):
                    calls = merged["calls"] = {}
                for part in value:
                    if isinstance(part, dict):
                        _merge_tool_call(calls, part)
        elif key == "function_call":
            if isinstance(value, dict):
                current = message.get("function_call")
                if not isinstance(current, dict):
                    current = message["function_call"] = {}
                _merge_function(current, value)
        else:
            _keep(message, key, value)


def _merge_tool_call(calls: dict[int, Json], part: Json) -> None:
    index = part.get("index", len(calls))
    if not isinstance(index, int):
        index = len(calls)
    call = calls.get(index)
    if call is None:
        call = calls[index] = {"id": None, "type": "function", "function": {}}
    if part.get("id") is not None and call["id"] is None:
        call["id"] = part["id"]
    if part.get("type") is not None:
        call["type"] = part["type"]
    function = part.get("function")
    if isinstance(function, dict):
        target = call["function"]
        assert isinstance(target, dict)
        _merge_function(target, function)


def _merge_function(target: Json, part: Json) -> None:
    name = part.get("name")
    if name is not None and target.get("name") is None:
        target["name"] = name
    arguments = part.get("arguments")
    if isinstance(arguments, str):
        _append_text(target, "arguments", arguments)
    for key, value in part.items():
        if key not in ("name", "arguments"):
            _keep(target, key, value)
    target.setdefault("name", None)
    target.setdefault("arguments", "")


def _extend_list(target: Json, key: str, value: object) -> None:
    # In place: copying the list per chunk would make a long answer quadratic. The
    # first piece is copied, so no chunk's own list is ever extended.
    if isinstance(value, list):
        current = target.get(key)
        if isinstance(current, list):
            current.extend(value)
        else:
            target[key] = list(value)
    else:
        target.setdefault(key, value)


class _Text(list[str]):
    """A text field's pieces, joined once in `result()`: concatenating per chunk would
    copy the text so far on every token."""


def _append_text(target: Json, key: str, piece: str) -> None:
    current = target.get(key)
    if isinstance(current, _Text):
        current.append(piece)
    else:
        target[key] = _Text([current, piece] if isinstance(current, str) else [piece])


def _joined(value: object) -> object:
    """`value` with every `_Text` joined into its string."""
    if isinstance(value, _Text):
        return "".join(value)
    if isinstance(value, dict):
        return {k: _joined(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_joined(v) for v in value]
    return value
