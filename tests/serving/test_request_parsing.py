"""The request parser turns any bytes into a ClientRequest or a BadRequest, nothing else."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given, settings, strategies as st

from narwhal._errors import BadRequest
from narwhal.engines import EndpointKind
from narwhal.serving._request import (
    ClientRequest,
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


@pytest.mark.parametrize(
    ("prompt", "vocab_size", "refused"),
    [
        ([1, 31999], 32000, None),
        (
            [1, 32000],
            32000,
            "token id 32000 at index 1 is outside the vocabulary: ids must be "
            "0..31999 (engine.vocab_size 32000)",
        ),
        ([[5, 999999]], 32000, "token id 999999 at index 1"),
        ([1, 999999], None, None),  # unknown vocabulary: the engine's to check
        ([3, -1], None, "token id -1 at index 1 is outside the vocabulary: ids must be >= 0"),
        ([-7], 32000, "token id -7 at index 0"),
    ],
)
def test_a_token_id_outside_the_vocabulary_never_reaches_an_engine(
    prompt: list[object], vocab_size: int | None, refused: str | None
) -> None:
    # SGLang 0.5.23's scheduler dies on an id its embedding lacks (the server exits).
    raw = json.dumps({"model": "m", "prompt": prompt}).encode()
    try:
        result: ClientRequest | BadRequest = parse_body(
            raw,
            kind="completions",
            request_id="r",
            models=("m",),
            arrival=0.0,
            deadline=1.0,
            vocab_size=vocab_size,
        )
    except BadRequest as exc:
        result = exc
    if refused is None:
        assert isinstance(result, ClientRequest), result
    else:
        assert isinstance(result, BadRequest)
        assert result.param == "prompt"
        assert refused in result.message


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


def test_a_completion_is_bounded_by_its_max_tokens_alone() -> None:
    # max_completion_tokens is chat's name: neither engine's completion request has the
    # field, and both ignore it there. Read first, it was checked against the context,
    # named in the refusal and priced, for a bound the engine never applies.
    both = request(max_completion_tokens=500, max_tokens=10)
    assert (both.max_tokens_field, both.max_tokens) == ("max_tokens", 10)
    assert request(max_completion_tokens=0, max_tokens=10).max_tokens == 10
    assert request(max_completion_tokens=500).max_tokens == 16
