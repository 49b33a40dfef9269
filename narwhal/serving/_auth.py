"""Bearer credentials on Narwhal's own listeners: the clients' API keys, the admin token.

Owns: `BearerCheck`, which says whether a request's `Authorization` header carries one
of the credentials the configuration in force asks for, and the 401 to answer if not.

Invariants: a presented credential is compared with every configured one, each in
constant time (`hmac.compare_digest` of SHA-256 digests, so neither the content nor the
length of a configured credential shows in the timing), with no early exit. The digests
are made once per configuration: a reload installs a new `Config`, and the next request
sees its credentials. Nothing here logs, keeps or returns a presented credential.

Errors: `Unauthorized` (401). `missing_*`: no `Authorization: Bearer` header (none, or
another scheme such as Basic, or an empty token); `invalid_*`: a bearer token that
matches no configured one, or more than one `Authorization` header.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Sequence

import attrs

from .._codes import ErrorCode
from .._errors import Unauthorized
from ..config import Config, Secret


@attrs.frozen
class Wording:
    """How a listener names its credential to a client that lacks it."""

    missing_code: str
    missing: str
    invalid_code: str
    invalid: str


CLIENT_KEYS = Wording(
    ErrorCode.MISSING_API_KEY,
    "an API key is required: send it as `Authorization: Bearer KEY`",
    ErrorCode.INVALID_API_KEY,
    "incorrect API key provided",
)
ADMIN_TOKEN = Wording(
    ErrorCode.MISSING_TOKEN,
    "the admin routes require a token: send it as `Authorization: Bearer TOKEN`",
    ErrorCode.INVALID_TOKEN,
    "incorrect admin token provided",
)


def _digest(text: bytes) -> bytes:
    return hashlib.sha256(text).digest()


class BearerCheck:
    """`credentials(config)` are what a request must present one of; none asks nothing."""

    def __init__(self, credentials: Callable[[Config], Sequence[Secret]], wording: Wording) -> None:
        self._credentials = credentials
        self._wording = wording
        self._config: Config | None = None
        self._digests: tuple[bytes, ...] = ()

    def _digests_for(self, config: Config) -> tuple[bytes, ...]:
        if config is not self._config:
            found = {_digest(secret.reveal().encode()) for secret in self._credentials(config)}
            self._digests = tuple(found)
            self._config = config
        return self._digests

    def refusal(
        self, config: Config, headers: Sequence[tuple[bytes, bytes]]
    ) -> Unauthorized | None:
        """None when `config` asks no credential or `headers` carry one it takes."""
        digests = self._digests_for(config)
        if not digests:
            return None
        values = [value for name, value in headers if name == b"authorization"]
        wording = self._wording
        if len(values) > 1:
            return Unauthorized(wording.invalid, code=wording.invalid_code, invalid=True)
        scheme, _, token = values[0].strip().partition(b" ") if values else (b"", b"", b"")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            return Unauthorized(wording.missing, code=wording.missing_code, invalid=False)
        presented = _digest(token)
        matched = False
        for digest in digests:
            # `|` rather than `or`: every comparison runs, wherever the match is.
            matched |= hmac.compare_digest(presented, digest)
        if matched:
            return None
        return Unauthorized(wording.invalid, code=wording.invalid_code, invalid=True)
