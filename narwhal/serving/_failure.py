"""Engine leg failures: what went wrong, and what follows from it (docs/design.md#retries).

Owns
  `FailureKind`; the classifier that names the kind of an engine's error answer or
  error event (`classify_answer`, `classify_event`); `FAILURE_POLICY`, the table every
  leg failure is a row of; and `leg_failure`, the `EngineFailed` a row makes.

Invariants
  Pure: no I/O, no clock. A raise site says what happened (the kind, in the engine's
  words); the table alone says the client's status and code, whether Narwhal may retry,
  whether the failure is charged to the engine (its phase's breaker and quarantine, in
  recovery) and which engine a retry leaves out (`_retry.next_attempt` decides whether).
  A failure is the engine's whose leg failed, in that leg's phase: a prefill leg's
  failure is the prefill engine's, never its decode partner's.
  An engine refusing the request (its 4xx other than 408 and 429) is the client's error:
  its status and words, never retried nor charged.

See
  docs/client-contract.md#error-codes, the same table as a client reads it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

import attrs

from .._codes import ErrorCode
from .._errors import (
    ENGINE_AUTH_STATUSES,
    RETRYABLE_ENGINE_STATUSES,
    EngineFailed,
    Exclude,
    client_status_for_engine_status,
)
from ..engines import EngineErrorInfo
from ..fleet import names_model


class FailureKind(enum.Enum):
    # The transport.
    UNREACHABLE = "unreachable"  # no connection to the engine
    CONNECTION_LOST = "connection_lost"  # the engine closed it mid-answer
    # The engine's answer: an error status, or an error event in its 200 stream.
    KEY_REFUSED = "key_refused"  # its 401/403: Narwhal's API key, not the client's
    MODEL_MISSING = "model_missing"  # its 404 naming the model: launched under another name
    TRANSFER_FAILED = "transfer_failed"  # an SGLang pair's KV transfer
    REFUSED = "refused"  # its 4xx but 408 and 429: the request is at fault
    BUSY = "busy"  # its 429
    TIMED_OUT = "timed_out"  # its 408
    ENGINE_ERROR = "engine_error"  # its 500, 502, 503, 504
    UNEXPECTED_STATUS = "unexpected_status"  # any other status but 200
    STREAM_ERROR = "stream_error"  # an error event that is none of those
    # What the engine sent.
    TRUNCATED = "truncated"  # a stream that ended without [DONE]
    BAD_STREAM = "bad_stream"  # an event that is not JSON, or a line over the bound
    BAD_RESPONSE = "bad_response"  # a body that is not JSON, or JSON to a stream
    TOO_LARGE = "too_large"  # an answer over serving.max_response_bytes
    HELD_TOO_LARGE = "held_too_large"  # events before the first token over it
    # The leg's own timers (docs/design.md#deadlines).
    PREFILL_TIMEOUT = "prefill_timeout"
    DECODE_TIMEOUT = "decode_timeout"  # an unstreamed leg's timer
    FIRST_TOKEN_TIMEOUT = "first_token_timeout"
    DECODE_STALLED = "decode_stalled"
    HANDOFF_EXPIRED = "handoff_expired"  # no decode slot before serving.handoff_timeout_s


FROM_ENGINE: Final = None
"""A status column's value: the engine's status as a client sees it
(`client_status_for_engine_status`: 503 stays 503, 500 becomes 502, ...)."""


@attrs.frozen
class Rule:
    """What follows from one kind of leg failure.

    `status`: the client's (FROM_ENGINE: from the engine's). `retry`: transient, so
    Narwhal may retry it. `charge`: counted against the engine. `exclude`: what a retry
    leaves out. `client_error`: the engine judged the request; the envelope says
    `invalid_request_error` and passes the engine's `param` on."""

    code: ErrorCode
    status: int | None
    retry: bool
    charge: bool
    exclude: Exclude
    client_error: bool = False


_K = FailureKind
_Y, _N = True, False
_ENGINE, _NOTHING, _PREFILL = Exclude.ENGINE, Exclude.NOTHING, Exclude.PAIR_PREFILL

# Why the rows say what they say:
# - An engine refusing Narwhal's key (KEY_REFUSED) or a model it was launched without
#   (MODEL_MISSING) is the router's configuration at fault, neither the client's (a 401
#   passed on would tell it to fix its own key) nor a fault the breaker should count:
#   502, and another engine may take the retry.
# - A failed KV transfer says that it failed, not which server made it fail. Mostly the
#   prefill did (SGLang's words: "it might be dead"): when a prefill server dies, its
#   decoders' transfers fail at once and their reports often reach Narwhal before the
#   prefill leg's own broken connection does. So it is charged to neither server (a dead
#   one fails its own legs and probes; recovery's TransferAttribution may find the
#   culprit over many), and a retry leaves out the pair's prefill server only, and only
#   while another one can take it.
# - An expired handoff waited for a decode slot, which is no engine's fault: the same
#   decode engine may have room by the time the fresh prefill is done.
# - An engine's 429 is busy, not broken. Timeouts and broken streams are transient.
# - An answer too large for serving.max_response_bytes is what the request asked for,
#   no fault of the engine's.
# fmt: off
FAILURE_POLICY: Mapping[FailureKind, Rule] = {
    #                            code                               status      retry charge exclude
    _K.UNREACHABLE:         Rule(ErrorCode.ENGINE_UNREACHABLE,      502,         _Y, _Y, _ENGINE),
    _K.CONNECTION_LOST:     Rule(ErrorCode.ENGINE_CONNECTION_LOST,  502,         _Y, _Y, _ENGINE),
    _K.KEY_REFUSED:         Rule(ErrorCode.ENGINE_AUTH_FAILED,      502,         _Y, _N, _ENGINE),
    _K.MODEL_MISSING:       Rule(ErrorCode.ENGINE_MODEL_MISSING,    502,         _Y, _N, _ENGINE),
    _K.TRANSFER_FAILED:     Rule(ErrorCode.KV_TRANSFER_FAILED,      502,         _Y, _N, _PREFILL),
    _K.REFUSED:             Rule(ErrorCode.ENGINE_REJECTED_REQUEST, FROM_ENGINE, _N, _N, _ENGINE,
                                 client_error=True),
    _K.BUSY:                Rule(ErrorCode.ENGINE_HTTP,             429,         _Y, _N, _ENGINE),
    _K.TIMED_OUT:           Rule(ErrorCode.ENGINE_HTTP,             504,         _Y, _Y, _ENGINE),
    _K.ENGINE_ERROR:        Rule(ErrorCode.ENGINE_HTTP,             FROM_ENGINE, _Y, _Y, _ENGINE),
    _K.UNEXPECTED_STATUS:   Rule(ErrorCode.ENGINE_HTTP,             502,         _N, _Y, _ENGINE),
    _K.STREAM_ERROR:        Rule(ErrorCode.ENGINE_STREAM_ERROR,     502,         _Y, _Y, _ENGINE),
    _K.TRUNCATED:           Rule(ErrorCode.ENGINE_STREAM_TRUNCATED, 502,         _Y, _Y, _ENGINE),
    _K.BAD_STREAM:          Rule(ErrorCode.ENGINE_BAD_STREAM,       502,         _N, _Y, _ENGINE),
    _K.BAD_RESPONSE:        Rule(ErrorCode.ENGINE_BAD_RESPONSE,     502,         _N, _Y, _ENGINE),
    _K.TOO_LARGE:           Rule(ErrorCode.RESPONSE_TOO_LARGE,      502,         _N, _N, _ENGINE),
    _K.HELD_TOO_LARGE:      Rule(ErrorCode.RESPONSE_TOO_LARGE,      502,         _N, _Y, _ENGINE),
    _K.PREFILL_TIMEOUT:     Rule(ErrorCode.PREFILL_TIMEOUT,         504,         _Y, _Y, _ENGINE),
    _K.DECODE_TIMEOUT:      Rule(ErrorCode.DECODE_TIMEOUT,          504,         _Y, _Y, _ENGINE),
    _K.FIRST_TOKEN_TIMEOUT: Rule(ErrorCode.FIRST_TOKEN_TIMEOUT,     504,         _Y, _Y, _ENGINE),
    _K.DECODE_STALLED:      Rule(ErrorCode.DECODE_STALLED,          504,         _Y, _Y, _ENGINE),
    _K.HANDOFF_EXPIRED:     Rule(ErrorCode.HANDOFF_EXPIRED,         503,         _Y, _N, _NOTHING),
}
# fmt: on

# How SGLang reports that a bootstrap pair's KV transfer failed, on either server: its
# KVTransferError, in the decode server's abort ("Decode transfer failed for request
# ... with exception KVTransferError(bootstrap_room=...): Failed to get kvcache from
# prefill instance, it might be dead") and in the prefill server's.
_SGLANG_TRANSFER_FAILURE = ("KVTransferError", "Decode transfer failed")


def _transfer_failed(message: str, bootstrap_pair: bool) -> bool:
    return bootstrap_pair and any(words in message for words in _SGLANG_TRANSFER_FAILURE)


def classify_status(status: int) -> FailureKind:
    """An engine's error status, answered or in a stream's error event."""
    if status == 429:
        return _K.BUSY
    if status == 408:
        return _K.TIMED_OUT
    if 400 <= status < 500:
        return _K.REFUSED
    if status in RETRYABLE_ENGINE_STATUSES:
        return _K.ENGINE_ERROR
    return _K.UNEXPECTED_STATUS


def classify_answer(info: EngineErrorInfo, *, bootstrap_pair: bool) -> FailureKind:
    """An engine's answer with a status other than 200. `bootstrap_pair`: the leg is one of
    an SGLang pair's two (whose servers report a failed KV transfer in their words)."""
    status = info.status
    if status in ENGINE_AUTH_STATUSES:
        return _K.KEY_REFUSED
    if names_model(status, info):
        return _K.MODEL_MISSING
    if status >= 500 and _transfer_failed(info.message, bootstrap_pair):
        return _K.TRANSFER_FAILED
    return classify_status(status)


def classify_event(status: int | None, message: object, *, bootstrap_pair: bool) -> FailureKind:
    """An error event inside a 200 stream (docs/design.md#streaming-failures), with the
    status its `code` gives, if any. One with a client error's status is the engine
    refusing the request as its HTTP 4xx would (vLLM 0.32 sends a streamed request's
    validation error so, SGLang its ValueErrors); anything else is transient like the
    HTTP 500 the engine sends when not streaming (a KV load failure, say)."""
    if isinstance(message, str) and _transfer_failed(message, bootstrap_pair):
        return _K.TRANSFER_FAILED
    if status is not None and 400 <= status < 500:
        return classify_status(status)
    return _K.STREAM_ERROR


def leg_failure(
    kind: FailureKind,
    message: str,
    *,
    public: str,
    engine_id: str,
    phase: str,
    engine_status: int | None = None,
    param: str | None = None,
    deadline_s: float | None = None,
) -> EngineFailed:
    """The failure `FAILURE_POLICY` makes of `kind` on `engine_id`'s `phase` leg.

    `engine_status`: the engine's status, for the kinds that pass it on (required by
    FROM_ENGINE and ENGINE_HTTP rows). `param` reaches the client only for a client
    error. `deadline_s`: the leg's deadline that expired, for recovery's loop-lag excuse.
    """
    rule = FAILURE_POLICY[kind]
    if engine_status is None:
        assert rule.status is not None, kind
        assert rule.code is not ErrorCode.ENGINE_HTTP, kind
        status = rule.status
    else:
        status = rule.status or client_status_for_engine_status(engine_status)
    return EngineFailed(
        message,
        public=public,
        status=status,
        engine_id=engine_id,
        phase=phase,
        retryable=rule.retry,
        counts_against_engine=rule.charge,
        code=rule.code if engine_status is None else rule.code.with_status(engine_status),
        param=param if rule.client_error else None,
        error_type="invalid_request_error" if rule.client_error else None,
        exclude=rule.exclude,
        deadline_s=deadline_s,
    )
