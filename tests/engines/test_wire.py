from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, strategies as st

from narwhal.engines import SGLANG, VLLM, Dialect, SseKind, SseScanner, parse_error_body
from narwhal.engines._dialects import (
    ChatTokenizeRefusals,
    TokenizeScan,
    card_context,
    chat_tokenize_refused,
    lists_model,
    sglang_pd_body,
    tokenize_body,
    tokenize_count,
    truncates_requests,
    usage_tokens,
    vllm_decode_body,
    vllm_kv_params,
    vllm_prefill_body,
    with_usage_report,
)

VLLM_STREAM = (
    b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" Paris"}]}\n\n'
    b'data: {"id":"cmpl-1","object":"text_completion","choices":[],"usage":{"completion_tokens":1}}\n\n'
    b"data: [DONE]\n\n"
)


def test_scanner_splits_events_and_recognises_the_terminator() -> None:
    kinds = [event.kind for event in SseScanner().feed(VLLM_STREAM)]
    assert kinds == [SseKind.DATA, SseKind.DATA, SseKind.DONE]


@given(st.lists(st.integers(min_value=1, max_value=len(VLLM_STREAM) - 1), max_size=8))
def test_scanner_is_indifferent_to_transport_chunking(cuts: list[int]) -> None:
    scanner = SseScanner()
    bounds = [0, *sorted(set(cuts)), len(VLLM_STREAM)]
    events = []
    for start, end in itertools.pairwise(bounds):
        events.extend(scanner.feed(VLLM_STREAM[start:end]))
    assert [e.payload for e in events] == [e.payload for e in SseScanner().feed(VLLM_STREAM)]
    assert scanner.pending == 0


def test_partial_line_is_held_back() -> None:
    scanner = SseScanner()
    assert scanner.feed(b'data: {"id":"x"') == []
    assert scanner.pending == len(b'data: {"id":"x"')


@pytest.mark.parametrize(
    "frame",
    [
        # vLLM >= 0.10.1 (nested, compact and with json.dumps spacing)
        b'data: {"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}\n\n',
        b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", "code": 500}}\n\n',
        # SGLang / old vLLM flat object inside the error key
        b'data: {"error": {"object": "error", "message": "Internal server error", "code": 500}}\n\n',
        b'data:{"error":{"message":"Internal server error"}}\r\n\r\n',
    ],
)
def test_mid_stream_error_events_are_detected(frame: bytes) -> None:
    (event,) = SseScanner().feed(frame)
    assert event.kind is SseKind.ERROR
    assert event.error is not None
    assert event.error["message"] == "Internal server error"


def test_comment_lines_are_not_data() -> None:
    (event,) = SseScanner().feed(b": keep-alive\n\n")
    assert event.kind is SseKind.OTHER


@pytest.mark.parametrize(
    ("body", "message", "kind"),
    [
        (
            b'{"error":{"message":"The model `foo` does not exist.","type":"NotFoundError","param":"model","code":404}}',
            "The model `foo` does not exist.",
            "NotFoundError",
        ),
        (
            b'{"object":"error","message":"bad","type":"BadRequestError","param":null,"code":400}',
            "bad",
            "BadRequestError",
        ),
        (b"<html>502 Bad Gateway</html>", "<html>502 Bad Gateway</html>", None),
        (b"", "engine returned HTTP 503 with no body", None),
    ],
)
def test_error_bodies_in_every_shape(body: bytes, message: str, kind: str | None) -> None:
    info = parse_error_body(503, body)
    assert (info.status, info.message, info.type) == (503, message, kind)


def test_vllm_prefill_leg_rewrites_exactly_what_the_protocol_needs() -> None:
    client = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 200,
        "max_completion_tokens": 200,
        "min_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.3,
    }
    leg = vllm_prefill_body(client)
    assert leg == {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "min_tokens": 1,
        "stream": False,
        "temperature": 0.3,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    assert client["max_tokens"] == 200, "the client body must not be mutated"


def test_vllm_decode_leg_passes_params_through_verbatim() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "future_key": {"x": 1}}
    prefill_response = {"choices": [], "kv_transfer_params": params}
    body = {"model": "m", "prompt": "hi", "stream": True}
    leg = vllm_decode_body(body, vllm_kv_params(prefill_response))
    assert leg["kv_transfer_params"] is params
    assert {k: v for k, v in leg.items() if k != "kv_transfer_params"} == body
    assert vllm_decode_body(body, vllm_kv_params({"kv_transfer_params": None})) is body


def test_sglang_legs_carry_the_bootstrap_triple() -> None:
    leg = sglang_pd_body({"prompt": "x"}, host="10.0.0.5", port=8998, room=42)
    assert leg == {
        "prompt": "x",
        "bootstrap_host": "10.0.0.5",
        "bootstrap_port": 8998,
        "bootstrap_room": 42,
    }


MESSAGES = [{"role": "user", "content": "x"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_vllm_chat_tokenize_takes_what_shapes_the_prompt() -> None:
    assert tokenize_body(VLLM, "chat", {"model": "m", "messages": MESSAGES}) == {
        "model": "m",
        "messages": MESSAGES,
    }
    shaping = {
        "tools": TOOLS,
        "chat_template": "{{ messages }}",
        "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": False,
        "continue_final_message": True,
        "add_special_tokens": True,
    }
    body = {
        "model": "m",
        "messages": MESSAGES,
        **shaping,
        "max_tokens": 9,
        "stream": True,
        "tool_choice": "auto",
        "temperature": 0.5,
    }
    assert tokenize_body(VLLM, "chat", body) == {"model": "m", "messages": MESSAGES, **shaping}


def test_sglang_chat_tokenize_takes_what_its_chat_completions_render_with() -> None:
    # Newer SGLang's TokenizeRequest (protocol.py@004c82e0) turns a messages body into the
    # ChatCompletionRequest its chat completions render, without add_special_tokens; its
    # chat requests have no add_generation_prompt or chat_template field.
    assert tokenize_body(SGLANG, "chat", {"model": "m", "messages": MESSAGES}) == {
        "model": "m",
        "messages": MESSAGES,
    }
    shaping = {
        "tools": TOOLS,
        "tool_choice": "none",
        "reasoning_effort": "low",
        "reasoning": {"enabled": True},
        "chat_template_kwargs": {"enable_thinking": False},
        "continue_final_message": True,
    }
    body = {
        "model": "m",
        "messages": MESSAGES,
        **shaping,
        "add_generation_prompt": False,
        "add_special_tokens": True,
        "chat_template": "{{ messages }}",
        # A stream flag would send SGLang's /tokenize down its streaming path (501).
        "stream": True,
        "max_tokens": 9,
    }
    assert tokenize_body(SGLANG, "chat", body) == {"model": "m", "messages": MESSAGES, **shaping}


@pytest.mark.parametrize("dialect", [VLLM, SGLANG], ids=["vllm", "sglang"])
def test_completion_tokenize_sends_one_prompt_as_a_string(dialect: Dialect) -> None:
    assert tokenize_body(dialect, "completions", {"model": "m", "prompt": ["x y"]}) == {
        "model": "m",
        "prompt": "x y",
    }


def test_completion_tokenize_adds_special_tokens_as_the_completion_will() -> None:
    # vLLM's CompletionRequest and TokenizeCompletionRequest both take add_special_tokens
    # (default true), so the count follows the request's.
    plain = {"prompt": "x", "add_special_tokens": False}
    assert tokenize_body(VLLM, "completions", plain) == plain
    # SGLang's CompletionRequest has no such field: its completions always add them,
    # which is what its /tokenize does by default.
    assert tokenize_body(SGLANG, "completions", plain) == {"prompt": "x"}


OLD_SGLANG_REFUSAL = (
    "[{'type': 'missing', 'loc': ('body', 'prompt'), 'msg': 'Field required', "
    "'input': {'model': 'm', 'messages': [{'role': 'user', 'content': 'x'}]}}]"
)


@pytest.mark.parametrize(
    ("status", "message", "refused"),
    [
        # SGLang before chat tokenize: `prompt` is required, FastAPI's validation error
        # goes through SGLang's handler (400, flat) or FastAPI's own (422, detail).
        (400, OLD_SGLANG_REFUSAL, True),
        (400, f"1 validation error:\n  {OLD_SGLANG_REFUSAL[1:-1]} {OLD_SGLANG_REFUSAL}", True),
        (422, '{"detail":[{"loc":["body","prompt"],"msg":"field required"}]}', True),
        (400, "Invalid prompt type: <class 'NoneType'>. Expected str or List[str].", True),
        # SGLang before /tokenize: FastAPI's answer for a path without a route.
        (404, '{"detail":"Not Found"}', True),
        (404, "The model `m` does not exist.", False),
        # A newer build refusing this body, not the form: the request's own problem.
        (400, "Value error, Exactly one of 'prompt' or 'messages' must be provided.", False),
        (400, "'role' must be one of 'system', 'assistant' (case-insensitive).", False),
        (500, "Internal server error during tokenization: boom", False),
    ],
)
def test_an_sglang_build_without_chat_tokenize_is_recognised(
    status: int, message: str, refused: bool
) -> None:
    assert chat_tokenize_refused(SGLANG, status, message) is refused
    # vLLM's /tokenize has taken messages as long as it has existed.
    assert chat_tokenize_refused(VLLM, status, message) is False


def test_chat_refusals_are_remembered_until_the_engine_may_have_changed() -> None:
    a, b = object(), object()
    config, reloaded = object(), object()
    refusals: ChatTokenizeRefusals[object] = ChatTokenizeRefusals(recheck_s=60.0)
    assert not refusals.known(a, config, now=0.0)
    assert refusals.refused(a, now=1.0) is True
    assert refusals.refused(a, now=2.0) is False  # already known: logged once
    assert refusals.known(a, config, now=30.0)
    assert not refusals.known(b, config, now=30.0)
    # Asked again once recheck_s has passed since the refusal (an upgrade may have come);
    # the same answer then is no news.
    assert not refusals.known(a, config, now=62.0)
    assert refusals.refused(a, now=62.0) is False
    assert refusals.known(a, config, now=63.0)
    # An engine that left placement (restart hold, ejection, drain) is asked again.
    assert refusals.forget(a) is True
    assert refusals.forget(a) is False
    assert not refusals.known(a, config, now=64.0)
    assert refusals.refused(a, now=64.0) is True
    # So is every engine after a reload.
    assert not refusals.known(a, reloaded, now=65.0)
    assert refusals.refused(a, now=65.0) is True
    assert refusals.known(a, reloaded, now=66.0)
    # One that counts a chat when asked again has been upgraded.
    assert not refusals.known(a, reloaded, now=200.0)
    assert refusals.forget(a) is True


def test_tokenize_count_reads_one_integer() -> None:
    assert tokenize_count(json.loads('{"count":3,"max_model_len":8192,"tokens":[1,2,3]}')) == 3
    assert tokenize_count({"count": True}) is None
    # SGLang's answer to a list prompt: one count per prompt, not a prompt's count.
    assert tokenize_count({"count": [3]}) is None
    assert tokenize_count({"count": [3, 4]}) is None


def scan(answer: bytes, cuts: list[int]) -> TokenizeScan:
    scanner = TokenizeScan()
    at = 0
    for cut in [*cuts, len(answer)]:
        scanner.feed(answer[at:cut])
        at = cut
    return scanner


VLLM_TOKENIZE = json.dumps(
    {"count": 12345, "max_model_len": 131072, "tokens": list(range(128000, 140345))},
    separators=(",", ":"),
).encode()
SGLANG_TOKENIZE = json.dumps(
    {"tokens": list(range(128000, 140345)), "count": 12345, "max_model_len": -1}
).encode()


@given(st.lists(st.integers(0, len(VLLM_TOKENIZE)), max_size=6))
def test_a_tokenize_answer_is_scanned_whatever_its_chunks(cuts: list[int]) -> None:
    # A long prompt's answer (here 86 KB, 12,345 ids) arrives in many reads; a key or a
    # number cut between two must still be read whole, never as its first digits.
    scanner = scan(VLLM_TOKENIZE, sorted(cuts))
    assert (scanner.count(), scanner.context(VLLM), scanner.context(SGLANG)) == (
        12345,
        131072,
        None,  # SGLang's max_model_len is its tokenizer's, not the server's context
    )
    every_byte = scan(SGLANG_TOKENIZE, list(range(1, len(SGLANG_TOKENIZE), 997)))
    assert (every_byte.count(), every_byte.context(VLLM)) == (12345, None)  # -1: unknown


def test_a_tokenize_answer_without_one_count_has_none() -> None:
    assert scan(b'{"count":[3,4],"max_model_len":8192}', []).count() is None
    assert scan(b'{"detail":"Not Found"}', []).count() is None
    assert scan(b'{"count":-1}', []).count() is None


def test_usage_counts_are_read_from_the_usage_object_only() -> None:
    answer = json.loads('{"choices":[],"usage":{"prompt_tokens":15,"completion_tokens":2}}')
    assert usage_tokens(answer, "prompt_tokens") == 15
    assert usage_tokens(answer, "completion_tokens") == 2
    assert usage_tokens({"usage": {"completion_tokens": True}}, "completion_tokens") is None
    assert usage_tokens({"usage": None}, "prompt_tokens") is None
    assert usage_tokens({"completion_tokens": 3}, "completion_tokens") is None
    assert usage_tokens([1, 2], "prompt_tokens") is None


@pytest.mark.parametrize(
    ("options", "dialect", "sent", "ours"),
    [
        # Absent (or null): neither engine would send usage; the router asks, and keeps it.
        (None, VLLM, {"include_usage": True}, True),
        (None, SGLANG, {"include_usage": True}, True),
        # Present and empty: neither SGLang nor vLLM 0.32 sends usage (include_usage
        # defaults off); the router asks and keeps it. Older vLLM builds default it on.
        ({}, VLLM, {"include_usage": True}, True),
        ({}, SGLANG, {"include_usage": True}, True),
        ({"include_usage": True}, SGLANG, {"include_usage": True}, False),
        # Asked not to: ask anyway, without continuous stats the client did not get.
        (
            {"include_usage": False, "continuous_usage_stats": True},
            VLLM,
            {"include_usage": True},
            True,
        ),
        ({"include_usage": True, "continuous_usage_stats": True}, VLLM, None, False),
        # Not an object: the engine's to refuse, untouched.
        ("yes", VLLM, "yes", False),
    ],
)
def test_streamed_legs_ask_for_the_usage_chunk(
    options: object, dialect: Dialect, sent: object, ours: bool
) -> None:
    body: dict[str, object] = {"prompt": "x", "stream": True}
    if options is not None:
        body["stream_options"] = options
    before = json.dumps(body)
    leg, own = with_usage_report(body, dialect)
    assert json.dumps(body) == before  # the client's body is not touched
    assert own is ours
    assert leg["stream_options"] == (options if sent is None else sent)
    assert leg["prompt"] == "x"


@pytest.mark.parametrize(
    ("version", "by_default"),
    [("0.29.0", True), ("0.31.2", True), ("0.32.0", False), ("0.33.1rc1", False), (None, False)],
)
def test_an_empty_stream_options_asks_older_vllm_builds_for_usage(
    version: str | None, by_default: bool
) -> None:
    body = {"prompt": "x", "stream": True, "stream_options": {}}
    leg, own = with_usage_report(body, VLLM, version)
    assert own is not by_default
    assert leg["stream_options"] == ({} if by_default else {"include_usage": True})


def test_the_context_length_is_the_served_models_card() -> None:
    cards = {
        "object": "list",
        "data": [
            {"id": "lora-a", "object": "model", "max_model_len": None, "parent": "m"},
            {"id": "m", "object": "model", "owned_by": "sglang", "max_model_len": 32768},
        ],
    }
    assert card_context(cards, "m") == 32768
    assert card_context(cards, "lora-a") == (
        "its /v1/models card for 'lora-a' has no positive max_model_len (None)"
    )
    assert card_context(cards, "x") == (
        "its /v1/models answer lists no model 'x' (it lists 'lora-a', 'm')"
    )
    assert card_context({"data": []}, "x") == (
        "its /v1/models answer lists no model 'x' (it lists none)"
    )
    assert lists_model(cards, "lora-a") is True
    assert lists_model(cards, "x") is False
    assert lists_model({"detail": "Not Found"}, "m") is None
    assert card_context({"detail": "Not Found"}, "m") == "its /v1/models answer has no `data` list"
    bad = {"data": [{"id": "m", "max_model_len": True}]}
    assert (
        card_context(bad, "m") == "its /v1/models card for 'm' has no positive max_model_len (True)"
    )


def test_an_sglang_server_says_whether_it_truncates() -> None:
    # allow_auto_truncate is one of the server args /get_server_info lists; builds older
    # than the flag list none, and refuse over-long requests.
    assert truncates_requests({"allow_auto_truncate": True, "context_length": None}) is True
    assert truncates_requests({"allow_auto_truncate": False}) is False
    assert truncates_requests({"model_path": "m"}) is False
    assert truncates_requests([]) == "its /get_server_info answer is not a JSON object"
    assert truncates_requests({"allow_auto_truncate": "yes"}) == (
        "its /get_server_info allow_auto_truncate is not a boolean ('yes')"
    )
