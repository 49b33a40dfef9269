"""The request parser turns any bytes into a ClientRequest or a BadRequest, nothing else."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given, settings, strategies as st

from narwhal._errors import BadRequest
from narwhal.engines import SGLANG, VLLM, Dialect, EndpointKind
from narwhal.serving._request import (
    ClientRequest,
    context_overflow,
    parse_body,
    request_id_from_header,
    truncated_prompt,
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)
request_like = st.fixed_dictionaries(
    {},
    optional={
        "model": st.one_of(st.just("m"), json_values),
        "prompt": st.one_of(
            st.text(max_size=30), st.lists(st.integers(0, 100), max_size=5), json_values
        ),
        "messages": st.one_of(
            st.lists(
                st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=20)}),
                max_size=3,
            ),
            json_values,
        ),
        "stream": st.one_of(st.booleans(), json_values),
        "max_tokens": st.one_of(st.integers(-5, 100), json_values),
        "n": st.one_of(st.integers(0, 3), json_values),
    },
)


def parse(raw: bytes, kind: EndpointKind) -> ClientRequest | BadRequest:
    try:
        return parse_body(raw, kind=kind, request_id="r", models=("m",), arrival=0.0, deadline=1.0)
    except BadRequest as exc:
        return exc


@settings(max_examples=300)
@given(st.binary(max_size=200), st.sampled_from(["completions", "chat"]))
def test_arbitrary_bytes(raw: bytes, kind: EndpointKind) -> None:
    result = parse(raw, kind)
    assert isinstance(result, ClientRequest | BadRequest)
    if isinstance(result, BadRequest):
        assert result.status == 400
        assert result.message


@settings(max_examples=300)
@given(request_like, st.sampled_from(["completions", "chat"]))
def test_request_shaped_documents(document: dict[str, object], kind: EndpointKind) -> None:
    result = parse(json.dumps(document).encode(), kind)
    if isinstance(result, ClientRequest):
        # Absent or null means the one served model; any string (even "") is kept, and
        # the request path answers 404 for a model it does not serve.
        model = document.get("model")
        assert result.model == ("m" if model is None else model)
        assert isinstance(result.stream, bool)
        # A null `stream` or `n` is the default, and is not passed on to the engines.
        assert result.body == {
            k: v for k, v in document.items() if not (k in ("stream", "n") and v is None)
        }


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_a_null_stream_or_n_is_the_default(kind: EndpointKind) -> None:
    document = {"model": "m", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    result = parse(json.dumps({**document, "stream": None, "n": None}).encode(), kind)
    assert isinstance(result, ClientRequest), result
    assert result.stream is False
    assert result.body == document


@given(st.binary(max_size=200))
@example(b"-\n")  # `$` matches before a trailing newline; the whole id must match
def test_request_ids_are_kept_only_when_well_formed(raw: bytes) -> None:
    value = request_id_from_header(raw)
    assert 1 <= len(value) <= 128
    assert all(c.isalnum() or c in "._:-" for c in value)


@pytest.mark.parametrize(
    ("prompt", "ids"), [([7, 8, 9], 3), ([[7, 8, 9]], 3), (["seven"], None), ("seven", None)]
)
def test_a_prompt_of_one_is_taken_whole_as_text_or_token_ids(
    prompt: object, ids: int | None
) -> None:
    # A batch of one prompt ([[ids]] as [text]) is one prompt, counted as the engines do.
    result = parse(json.dumps({"model": "m", "prompt": prompt}).encode(), "completions")
    assert isinstance(result, ClientRequest), result
    assert result.prompt_token_ids == ids


@pytest.mark.parametrize("prompt", [[[1], [2]], [[]], [["a"]], [[1, "a"]], [[True]]])
def test_a_batch_or_a_malformed_id_list_is_refused(prompt: object) -> None:
    result = parse(json.dumps({"model": "m", "prompt": prompt}).encode(), "completions")
    assert isinstance(result, BadRequest)
    assert result.param == "prompt"


def request(**body: object) -> ClientRequest:
    result = parse(json.dumps({"model": "m", "prompt": "x", **body}).encode(), "completions")
    assert isinstance(result, ClientRequest), result
    return result


def chat_request(**body: object) -> ClientRequest:
    document = {"model": "m", "messages": [{"role": "user", "content": "x"}], **body}
    result = parse(json.dumps(document).encode(), "chat")
    assert isinstance(result, ClientRequest), result
    return result


@pytest.mark.parametrize(
    ("keep", "context", "runs"),
    [
        (None, 8192, 9000),  # absent or null: the whole prompt
        (1000, 8192, 1000),
        (10_000, 8192, 9000),  # keeps more than there is (vLLM refuses k > context itself)
        (-1, 8192, 8192),  # the context
        (-1, None, 9000),  # the context, not known: as counted
        (0, 8192, 9000),  # not a length vLLM keeps: the engine judges it
        (-2, 8192, 9000),
        (True, 8192, 9000),  # not an integer
        ("5", 8192, 9000),
    ],
)
def test_truncate_prompt_tokens_is_the_prompt_vllm_runs(
    keep: object, context: int | None, runs: int
) -> None:
    assert truncated_prompt(request(truncate_prompt_tokens=keep), 9000, context) == runs
    assert truncated_prompt(request(truncate_prompt_tokens=keep), 500, context) == min(500, runs)


@pytest.mark.parametrize("dialect", [VLLM, SGLANG])
def test_the_context_check_refuses_what_every_build_refuses(dialect: Dialect) -> None:
    # A prompt that fills the context, or output past it; a total equal to it passes
    # (older SGLang builds refused that too: the engine says so itself).
    assert context_overflow(request(max_tokens=100), 8092, 8192, dialect) is None
    assert context_overflow(request(max_tokens=None), 8191, 8192, dialect) is None
    output = context_overflow(request(max_tokens=101), 8092, 8192, dialect)
    assert output is not None
    assert (output.status, output.code, output.param) == (
        400,
        "context_length_exceeded",
        "max_tokens",
    )
    prompt = context_overflow(request(max_tokens=1), 8192, 8192, dialect)
    assert prompt is not None
    assert (prompt.code, prompt.param) == ("context_length_exceeded", "input_tokens")


def test_a_completion_without_max_tokens_is_bounded_by_the_engines_default() -> None:
    # Both engines stop it at 16 tokens; taken as unbounded, it was neither checked
    # against the context nor priced as the short request it is.
    default = request()
    assert (default.max_tokens_field, default.max_tokens) == ("max_tokens", 16)
    assert default.body == {"model": "m", "prompt": "x"}  # the engine applies it itself
    # vLLM's null is no bound (the context, or the model's generation config); SGLang
    # refuses a null itself. A chat has no default.
    assert request(max_tokens=None).max_tokens is None
    assert chat_request().max_tokens is None


@pytest.mark.parametrize(
    ("dialect", "message"),
    [
        (
            VLLM,
            "'max_tokens' is too large: 16. This model's maximum context length is 8192 tokens "
            "and your request has 8177 input tokens (16 > 8192 - 8177).",
        ),
        (
            SGLANG,
            "Requested token count exceeds the model's maximum context length of 8192 tokens. "
            "You requested a total of 8193 tokens: 8177 tokens from the input messages and 16 "
            "tokens for the completion. Please reduce the number of tokens in the input "
            "messages or the completion to fit within the limit.",
        ),
    ],
)
def test_the_context_check_counts_a_completions_default_output(
    dialect: Dialect, message: str
) -> None:
    assert context_overflow(request(), 8176, 8192, dialect) is None
    overflow = context_overflow(request(), 8177, 8192, dialect)
    assert overflow is not None
    assert (overflow.status, overflow.code, overflow.param, overflow.message) == (
        400,
        "context_length_exceeded",
        "max_tokens",
        message,
    )
    for unbounded in (chat_request(), request(max_tokens=None)):
        assert context_overflow(unbounded, 8191, 8192, dialect) is None


def test_a_completion_is_bounded_by_its_max_tokens_alone() -> None:
    # max_completion_tokens is chat's name: neither engine's completion request has the
    # field, and both ignore it there. Read first, it was checked against the context,
    # named in the refusal and priced, for a bound the engine never applies.
    both = request(max_completion_tokens=500, max_tokens=10)
    assert (both.max_tokens_field, both.max_tokens) == ("max_tokens", 10)
    assert context_overflow(both, 8000, 8192, VLLM) is None
    assert request(max_completion_tokens=0, max_tokens=10).max_tokens == 10
    assert request(max_completion_tokens=500).max_tokens == 16


def test_the_context_check_speaks_each_engines_words() -> None:
    chat = chat_request(max_completion_tokens=200)
    vllm, sglang = (context_overflow(chat, 8000, 8192, d) for d in (VLLM, SGLANG))
    assert vllm is not None
    assert sglang is not None
    assert vllm.param == sglang.param == "max_completion_tokens"
    assert vllm.message == (
        "'max_completion_tokens' is too large: 200. This model's maximum context length is "
        "8192 tokens and your request has 8000 input tokens (200 > 8192 - 8000)."
    )
    assert sglang.message == (
        "Requested token count exceeds the model's maximum context length of 8192 tokens. "
        "You requested a total of 8200 tokens: 8000 tokens from the input messages and 200 "
        "tokens for the completion. Please reduce the number of tokens in the input messages "
        "or the completion to fit within the limit."
    )
    long = (context_overflow(chat, 9000, 8192, d) for d in (VLLM, SGLANG))
    assert [e.message for e in long if e is not None] == [
        "This model's maximum context length is 8192 tokens. However, your request has 9000 "
        "input tokens. Please reduce the length of the input messages.",
        "The input (9000 tokens) is longer than the model's context length (8192 tokens).",
    ]
