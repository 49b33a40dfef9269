"""Client-facing errors: each knows its HTTP status and its OpenAI-style envelope.

A few semantic classes rather than one per cause; `code` is the machine-readable
reason, a member of `ErrorCode` (narwhal/_codes.py: `queue_full`, `expired`, ...), and
the message names the limit and the value that was hit.

Messages are written for the operator and logged whole. One that names an engine (its
id or url), or what only the operator should see (a file path, the monitor's last
failure), carries `public` too: the same sentence without those, which is what a client
is told unless serving.expose_engine_details is on (`envelope(engine_details=...)`).
"""

from __future__ import annotations

import enum
import math
from typing import TYPE_CHECKING

from ._codes import ErrorCode

if TYPE_CHECKING:
    from .admission import PathQuote

Json = dict[str, object]


def os_reason(exc: OSError) -> str:
    """An OSError's reason for a message that names the path or setting itself
    ("permission denied", "not a directory"): its strerror, else its class name."""
    return (exc.strerror or type(exc).__name__).lower()


class NarwhalError(Exception):
    status = 500
    type = "server_error"
    default_code = ErrorCode.INTERNAL_ERROR

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
        final: bool = False,
        public: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        # `message` without engine ids, urls and other internals; None: it has none.
        self.public = public
        self.code = code or self.default_code
        self.param = param
        self.retry_after_s = retry_after_s
        # The same request cannot succeed later: only a change of config or profile would
        # make it pass. Said in `x-should-retry: false`, which OpenAI's (and Anthropic's)
        # SDKs obey; they retry every 429 otherwise, twice by default.
        self.final = final

    def __reduce__(self) -> tuple[object, ...]:
        # Pickled between the plane's processes (narwhal.plane): rebuilt from its fields,
        # whatever its class's __init__ asks for.
        return (_rebuilt, (type(self), self.args, self.__dict__))

    def note(self, text: str) -> None:
        """Append `text` (no internals in it) to the message a client gets, either form."""
        self.message += text
        if self.public is not None:
            self.public += text

    def envelope(self, *, engine_details: bool = False) -> Json:
        """The client's answer; with `engine_details`, the message the operator reads."""
        message = self.message if engine_details or self.public is None else self.public
        return {
            "error": {
                "message": message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> list[tuple[bytes, bytes]]:
        headers = []
        if self.retry_after_s is not None:
            # Retry-After takes whole seconds; round up so a client never comes back early.
            seconds = max(1, math.ceil(self.retry_after_s))
            headers.append((b"retry-after", str(seconds).encode()))
        if self.final:
            headers.append((b"x-should-retry", b"false"))
        return headers


class BadRequest(NarwhalError):
    status = 400
    type = "invalid_request_error"
    default_code = ErrorCode.INVALID_REQUEST


class MalformedRequest(NarwhalError):
    """HTTP/1.1 the server could not parse (h11's error), a version or an upgrade it does
    not speak; `status` is h11's hint (400, 431 for an oversized head, 501 for a
    Transfer-Encoding other than chunked) or 505 for a request of another HTTP version
    than 1.x (HTTP/2's connection preface among them). The connection closes after the
    answer."""

    type = "invalid_request_error"
    default_code = ErrorCode.MALFORMED_REQUEST

    def __init__(self, message: str, *, status: int, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.status = status


class NotFound(NarwhalError):
    status = 404
    type = "invalid_request_error"
    default_code = ErrorCode.NOT_FOUND


class Unauthorized(NarwhalError):
    """A request without the credentials its listener asks for (listen.api_keys for the
    client routes, admin.token for the admin surface): 401 with `WWW-Authenticate`
    (RFC 6750 3), as OpenAI answers a missing or wrong API key."""

    status = 401
    type = "invalid_request_error"
    default_code = ErrorCode.INVALID_API_KEY

    def __init__(self, message: str, *, code: str, invalid: bool) -> None:
        super().__init__(message, code=code)
        self.invalid = invalid

    def headers(self) -> list[tuple[bytes, bytes]]:
        challenge = b'Bearer realm="narwhal"'
        if self.invalid:
            challenge += b', error="invalid_token"'
        return [*super().headers(), (b"www-authenticate", challenge)]


class PayloadTooLarge(NarwhalError):
    status = 413
    type = "invalid_request_error"
    default_code = ErrorCode.REQUEST_TOO_LARGE


class RequestTimeout(NarwhalError):
    """The request body did not arrive in time (serving.body_timeout_s): the client's
    doing, answered 408 on a connection that then closes, its body unread."""

    status = 408
    type = "timeout_error"
    default_code = ErrorCode.BODY_TIMEOUT


class Refused(NarwhalError):
    """Admission said no: retained ceiling, queue full or timed out, TTFT budget."""

    status = 429
    type = "rate_limit_error"
    default_code = ErrorCode.OVERLOADED
    # Predictive admission's quote for the cheapest path, which missed the budget:
    # logged with the refusal (the `request` line), so over-refusal can be read off it.
    quote: PathQuote | None = None


class Unavailable(NarwhalError):
    """No engine can take the request right now, or Narwhal itself is degraded."""

    status = 503
    type = "service_unavailable_error"
    default_code = ErrorCode.NO_ENGINE_AVAILABLE


class Expired(NarwhalError):
    """The request's own deadline (serving.request_timeout_s) passed."""

    status = 504
    type = "timeout_error"
    default_code = ErrorCode.EXPIRED


class Exclude(enum.Enum):
    """What a retry of a failed leg leaves out, while another engine can take it."""

    ENGINE = "engine"  # the engine whose leg failed
    NOTHING = "nothing"  # no engine: the failure was not one's (an expired handoff)
    PAIR_PREFILL = "pair_prefill"  # the pair's prefill server (a failed KV transfer)


class EngineFailed(NarwhalError):
    """An engine leg failed; status is what the client should see for it.

    The request path makes these from its failure-policy table (serving/_failure.py), which
    decides `status`, `code`, `retryable` (docs/design.md#retries: transient, so retried
    before visible output), `counts_against_engine` and `exclude`. `engine_id` and `phase`
    say which leg, so the retry excludes that engine and only that phase's breaker counts
    it. `deadline_s`: the failure is a deadline of that many seconds that expired (recovery
    asks whether the router's own event loop explains it). `partner_id`: the other engine
    of the pair, set by the request path on a failed KV transfer, which either engine may
    have caused. `public` (required: the message names the engine) is the message without
    its id or url.
    """

    type = "server_error"
    default_code = ErrorCode.ENGINE_ERROR

    def __init__(
        self,
        message: str,
        *,
        status: int,
        engine_id: str,
        phase: str,
        retryable: bool,
        counts_against_engine: bool,
        code: str | None = None,
        param: str | None = None,
        error_type: str | None = None,
        public: str,
        exclude: Exclude = Exclude.ENGINE,
        deadline_s: float | None = None,
    ) -> None:
        super().__init__(message, code=code, param=param, public=public)
        self.exclude = exclude
        self.deadline_s = deadline_s
        self.status = status
        self.engine_id = engine_id
        self.phase = phase
        self.retryable = retryable
        self.counts_against_engine = counts_against_engine
        self.partner_id: str | None = None
        if error_type is not None:
            self.type = error_type


RETRYABLE_ENGINE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# What vLLM and SGLang answer when `--api-key` is set and Narwhal's key is missing or
# wrong (SGLang's admin routes answer 403): a router configuration error.
ENGINE_AUTH_STATUSES = frozenset({401, 403})


def client_status_for_engine_status(status: int) -> int:
    """What the client sees for an engine's HTTP error.

    Client errors keep their status (the engine judged the request). Overload keeps its
    meaning: an engine 429 stays 429 and 503 stays 503 (peers turn 429 into 500, which
    tells clients the wrong thing). An engine's 401/403 refused Narwhal's API key, not
    the client's: passed on, it would tell the client to fix its own credentials, so it is
    the upstream failing, 502. Other engine failures are the gateway's upstream failing:
    502, or 504 when the engine itself timed out.
    """
    if status in ENGINE_AUTH_STATUSES:
        return 502
    if status in (429, 503):
        return status
    if status in (408, 504):
        return 504
    if 400 <= status < 500:
        return status
    return 502


def _rebuilt(
    cls: type[NarwhalError], args: tuple[object, ...], fields: dict[str, object]
) -> NarwhalError:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(fields)
    return error
