"""The error codes a client can be answered with: their one source.

Owns
  `ErrorCode`, every `code` of an error envelope (and of a stream's terminal error
  event); `ENGINE_HTTP` is a template that `with_status` fills with an engine's status.

Invariants
  A code is written here once and named everywhere else (`ErrorCode.EXPIRED`), in the
  request path, admission, recovery and the failure-policy table alike: the docs tests
  read this enum and refuse a code written as a string literal anywhere in the daemon,
  so docs/client-contract.md and the source cannot drift apart.
  Members are `str`s: an envelope, a metric label or a log field shows the value.

See
  docs/client-contract.md#error-codes: what each code means to a client.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    # Credentials, asked before anything else.
    MISSING_API_KEY = "missing_api_key"
    INVALID_API_KEY = "invalid_api_key"
    MISSING_TOKEN = "missing_token"
    INVALID_TOKEN = "invalid_token"
    # The request itself.
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    INVALID_JSON = "invalid_json"
    INVALID_REQUEST = "invalid_request"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    REQUEST_TOO_LARGE = "request_too_large"
    BODY_TIMEOUT = "body_timeout"
    # HTTP/1.1 the server cannot serve.
    MALFORMED_REQUEST = "malformed_request"
    REQUEST_INCOMPLETE = "request_incomplete"
    REQUEST_HEAD_TOO_LARGE = "request_head_too_large"
    UNSUPPORTED_TRANSFER_ENCODING = "unsupported_transfer_encoding"
    UPGRADE_UNSUPPORTED = "upgrade_unsupported"
    HTTP_VERSION_NOT_SUPPORTED = "http_version_not_supported"
    # Refusals: limits and admission.
    RETAINED_CEILING = "retained_ceiling"
    PENDING_BODIES_PER_CLIENT = "pending_bodies_per_client"
    CONNECTIONS_PER_CLIENT = "connections_per_client"
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    TTFT_BUDGET = "ttft_budget"
    PROMPT_EXCEEDS_TTFT_TARGET = "prompt_exceeds_ttft_target"
    OVERLOADED = "overloaded"  # `Refused`'s default; every refusal names its own
    # Nothing can serve the request now.
    NO_PRICED_PATH = "no_priced_path"
    NO_PROFILE = "no_profile"
    NO_ENGINE_AVAILABLE = "no_engine_available"
    DEGRADED = "degraded"
    SHUTTING_DOWN = "shutting_down"
    POOL_EXHAUSTED = "pool_exhausted"
    # An engine leg failed (serving/_failure.py FAILURE_POLICY).
    HANDOFF_EXPIRED = "handoff_expired"
    ENGINE_UNREACHABLE = "engine_unreachable"
    ENGINE_CONNECTION_LOST = "engine_connection_lost"
    ENGINE_AUTH_FAILED = "engine_auth_failed"
    ENGINE_MODEL_MISSING = "engine_model_missing"
    ENGINE_HTTP = "engine_http_<status>"  # a template: `with_status` fills it
    ENGINE_REJECTED_REQUEST = "engine_rejected_request"
    KV_TRANSFER_FAILED = "kv_transfer_failed"
    ENGINE_STREAM_ERROR = "engine_stream_error"
    ENGINE_STREAM_TRUNCATED = "engine_stream_truncated"
    ENGINE_BAD_STREAM = "engine_bad_stream"
    ENGINE_BAD_RESPONSE = "engine_bad_response"
    RESPONSE_TOO_LARGE = "response_too_large"
    PREFILL_TIMEOUT = "prefill_timeout"
    FIRST_TOKEN_TIMEOUT = "first_token_timeout"
    DECODE_STALLED = "decode_stalled"
    DECODE_TIMEOUT = "decode_timeout"
    ENGINE_ERROR = "engine_error"  # `EngineFailed`'s default; every leg failure names its own
    # The request's own deadline, and Narwhal's bugs.
    EXPIRED = "expired"
    INTERNAL_ERROR = "internal_error"

    def with_status(self, status: int) -> str:
        """The code with an engine's HTTP status in it: `engine_http_503` for
        ENGINE_HTTP; a code without `<status>` is itself."""
        return self.replace("<status>", str(status))
