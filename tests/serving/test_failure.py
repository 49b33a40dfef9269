"""The failure classifier and the failure-policy table, without sockets: what an engine
did on a leg, what kind of failure that is, and what the client and recovery get for it
(docs/design.md#retries, docs/client-contract.md#error-codes)."""

from __future__ import annotations

import attrs
import pytest

from narwhal._errors import EngineFailed, Exclude
from narwhal.engines import EngineErrorInfo
from narwhal.serving._failure import (
    FAILURE_POLICY,
    FailureKind,
    classify_answer,
    classify_event,
    leg_failure,
)

K = FailureKind
ENGINE, NOTHING, PAIR_PREFILL = Exclude.ENGINE, Exclude.NOTHING, Exclude.PAIR_PREFILL
TRANSFER_WORDS = (
    "Decode transfer failed for request x with exception KVTransferError(bootstrap_room=7): "
    "Failed to get kvcache from prefill instance, it might be dead"
)


@attrs.frozen
class Expected:
    """What a client and recovery see: the envelope's status, code and type, whether
    Narwhal may retry, whether the engine is charged, what a retry leaves out."""

    status: int
    code: str
    retry: bool
    charge: bool
    exclude: Exclude = ENGINE
    type: str = "server_error"


# (engine's status, its message, its param, the leg is an SGLang pair's) -> kind, outcome
ANSWERS = [
    (401, "Unauthorized", None, False, K.KEY_REFUSED, Expected(502, "engine_auth_failed", True, False)),
    (403, "Forbidden", None, True, K.KEY_REFUSED, Expected(502, "engine_auth_failed", True, False)),
    (404, "The model `m` does not exist.", "model", False, K.MODEL_MISSING,
     Expected(502, "engine_model_missing", True, False)),
    (404, "Not Found", None, False, K.REFUSED,
     Expected(404, "engine_rejected_request", False, False, type="invalid_request_error")),
    (400, "prompt is too long", "messages", False, K.REFUSED,
     Expected(400, "engine_rejected_request", False, False, type="invalid_request_error")),
    (422, "bad field", None, True, K.REFUSED,
     Expected(422, "engine_rejected_request", False, False, type="invalid_request_error")),
    # A client error that merely mentions a transfer is still the client's.
    (400, TRANSFER_WORDS, None, True, K.REFUSED,
     Expected(400, "engine_rejected_request", False, False, type="invalid_request_error")),
    (429, "busy", None, False, K.BUSY, Expected(429, "engine_http_429", True, False)),
    (408, "timeout", None, False, K.TIMED_OUT, Expected(504, "engine_http_408", True, True)),
    (500, "boom", None, False, K.ENGINE_ERROR, Expected(502, "engine_http_500", True, True)),
    (502, "bad gateway", None, False, K.ENGINE_ERROR, Expected(502, "engine_http_502", True, True)),
    (503, "queue full", None, False, K.ENGINE_ERROR, Expected(503, "engine_http_503", True, True)),
    (504, "timeout", None, False, K.ENGINE_ERROR, Expected(504, "engine_http_504", True, True)),
    # The same words from a leg of no SGLang pair: an ordinary 500.
    (500, TRANSFER_WORDS, None, False, K.ENGINE_ERROR,
     Expected(502, "engine_http_500", True, True)),
    (500, TRANSFER_WORDS, None, True, K.TRANSFER_FAILED,
     Expected(502, "kv_transfer_failed", True, False, PAIR_PREFILL)),
    (501, "not implemented", None, False, K.UNEXPECTED_STATUS,
     Expected(502, "engine_http_501", False, True)),
    (507, "insufficient storage", None, False, K.UNEXPECTED_STATUS,
     Expected(502, "engine_http_507", False, True)),
    (302, "moved", None, False, K.UNEXPECTED_STATUS,
     Expected(502, "engine_http_302", False, True)),
]  # fmt: skip

# (the event's status from its `code`, its message, SGLang pair) -> kind, outcome
EVENTS = [
    (None, "engine error", False, K.STREAM_ERROR, Expected(502, "engine_stream_error", True, True)),
    (500, "KV load failed", False, K.STREAM_ERROR,
     Expected(502, "engine_stream_error", True, True)),
    (None, {"detail": "not a string"}, True, K.STREAM_ERROR,
     Expected(502, "engine_stream_error", True, True)),
    (400, "logprobs must be at most 20", False, K.REFUSED,
     Expected(400, "engine_rejected_request", False, False, type="invalid_request_error")),
    # A 401 inside a stream is a refusal like any 4xx, shown as 502 like any engine's 401.
    (401, "no", False, K.REFUSED,
     Expected(502, "engine_rejected_request", False, False, type="invalid_request_error")),
    (429, "busy", False, K.BUSY, Expected(429, "engine_http_429", True, False)),
    (408, "timeout", False, K.TIMED_OUT, Expected(504, "engine_http_408", True, True)),
    (None, TRANSFER_WORDS, True, K.TRANSFER_FAILED,
     Expected(502, "kv_transfer_failed", True, False, PAIR_PREFILL)),
    # In an event, the transfer's words win over the code SGLang gives it.
    (400, "KVTransferError(bootstrap_room=7)", True, K.TRANSFER_FAILED,
     Expected(502, "kv_transfer_failed", True, False, PAIR_PREFILL)),
    (None, TRANSFER_WORDS, False, K.STREAM_ERROR, Expected(502, "engine_stream_error", True, True)),
]  # fmt: skip

# The kinds a raise site names itself (a timer, the transport, a malformed stream).
NAMED = [
    (K.UNREACHABLE, Expected(502, "engine_unreachable", True, True)),
    (K.CONNECTION_LOST, Expected(502, "engine_connection_lost", True, True)),
    (K.TRUNCATED, Expected(502, "engine_stream_truncated", True, True)),
    (K.BAD_STREAM, Expected(502, "engine_bad_stream", False, True)),
    (K.BAD_RESPONSE, Expected(502, "engine_bad_response", False, True)),
    (K.TOO_LARGE, Expected(502, "response_too_large", False, False)),
    (K.HELD_TOO_LARGE, Expected(502, "response_too_large", False, True)),
    (K.PREFILL_TIMEOUT, Expected(504, "prefill_timeout", True, True)),
    (K.DECODE_TIMEOUT, Expected(504, "decode_timeout", True, True)),
    (K.FIRST_TOKEN_TIMEOUT, Expected(504, "first_token_timeout", True, True)),
    (K.DECODE_STALLED, Expected(504, "decode_stalled", True, True)),
    (K.HANDOFF_EXPIRED, Expected(503, "handoff_expired", True, False, NOTHING)),
]


def outcome(failure: EngineFailed) -> Expected:
    return Expected(
        failure.status,
        failure.code,
        failure.retryable,
        failure.counts_against_engine,
        failure.exclude,
        failure.type,
    )


def fail(kind: FailureKind, status: int | None = None, param: str | None = None) -> EngineFailed:
    return leg_failure(
        kind,
        "prefill engine p0: it failed",
        public="prefill engine: it failed",
        engine_id="p0",
        phase="prefill",
        engine_status=status,
        param=param,
    )


@pytest.mark.parametrize(("status", "message", "param", "pair", "kind", "expected"), ANSWERS)
def test_an_engine_answer_is_classified_and_answered_as_its_row_says(
    status: int,
    message: str,
    param: str | None,
    pair: bool,
    kind: FailureKind,
    expected: Expected,
) -> None:
    info = EngineErrorInfo(status, message, param=param)
    assert classify_answer(info, bootstrap_pair=pair) is kind
    failure = fail(kind, status, param)
    assert outcome(failure) == expected
    # The engine's `param` reaches the client only when the request is at fault.
    assert failure.param == (param if kind is K.REFUSED else None)


@pytest.mark.parametrize(("status", "message", "pair", "kind", "expected"), EVENTS)
def test_a_stream_error_event_is_classified_and_answered_as_its_row_says(
    status: int | None, message: object, pair: bool, kind: FailureKind, expected: Expected
) -> None:
    assert classify_event(status, message, bootstrap_pair=pair) is kind
    assert outcome(fail(kind, status)) == expected


@pytest.mark.parametrize(("kind", "expected"), NAMED)
def test_a_named_failure_is_answered_as_its_row_says(kind: FailureKind, expected: Expected) -> None:
    failure = fail(kind)
    assert outcome(failure) == expected
    assert failure.param is None


def test_every_kind_is_a_row_of_the_table_and_a_case_here() -> None:
    assert set(FAILURE_POLICY) == set(FailureKind)
    cases = {c[-2] for c in ANSWERS} | {c[-2] for c in EVENTS} | {kind for kind, _ in NAMED}
    assert cases == set(FailureKind)


def test_a_failure_keeps_the_leg_and_the_words_the_site_gave() -> None:
    failure = leg_failure(
        K.FIRST_TOKEN_TIMEOUT,
        "decode engine d0: no first token",
        public="decode engine: no first token",
        engine_id="d0",
        phase="decode",
        deadline_s=2.5,
    )
    assert (failure.engine_id, failure.phase, failure.deadline_s) == ("d0", "decode", 2.5)
    assert failure.message == "decode engine d0: no first token"
    assert failure.envelope()["error"] == {
        "message": "decode engine: no first token",
        "type": "server_error",
        "param": None,
        "code": "first_token_timeout",
    }


@pytest.mark.parametrize(
    "kind", [kind for kind, rule in FAILURE_POLICY.items() if rule.status is None]
)
def test_a_row_that_passes_the_engine_status_on_needs_it(kind: FailureKind) -> None:
    with pytest.raises(AssertionError):
        fail(kind)
