"""Declarative per-field rules.

Each rule checks one value and returns a message fragment, or None when the value is
fine. The loader walks every field of the model and collects *all* failures, so an
operator sees every mistake in one pass instead of fixing them one at a time (attrs
validators raise on the first failure, which is why the rules are not validators).
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Protocol
from urllib.parse import urlsplit

import attrs

# sun_path holds 108 bytes on Linux, the terminating NUL included.
UNIX_PATH_MAX = 107


def _fmt(value: float | int) -> str:
    return repr(value) if isinstance(value, float) else str(value)


@attrs.frozen
class Positive:
    def check(self, value: float | int) -> str | None:
        if not math.isfinite(value) or value <= 0:
            return f"{_fmt(value)} must be positive"
        return None

    def describe(self) -> str:
        return "> 0"


@attrs.frozen
class NonNegative:
    def check(self, value: float | int) -> str | None:
        if not math.isfinite(value) or value < 0:
            return f"{_fmt(value)} must be nonnegative"
        return None

    def describe(self) -> str:
        return ">= 0"


@attrs.frozen
class AtLeast:
    minimum: float | int

    def check(self, value: float | int) -> str | None:
        if not math.isfinite(value) or value < self.minimum:
            return f"{_fmt(value)} must be at least {_fmt(self.minimum)}"
        return None

    def describe(self) -> str:
        return f">= {_fmt(self.minimum)}"


@attrs.frozen
class Between:
    """Closed range unless an end is marked open; message matches `5 is outside 1..3`."""

    low: float | int
    high: float | int
    low_open: bool = False
    high_open: bool = False

    def check(self, value: float | int) -> str | None:
        too_low = value <= self.low if self.low_open else value < self.low
        too_high = value >= self.high if self.high_open else value > self.high
        if not math.isfinite(value) or too_low or too_high:
            return f"{_fmt(value)} is outside {self.describe()}"
        return None

    def describe(self) -> str:
        if not self.low_open and not self.high_open:
            return f"{_fmt(self.low)}..{_fmt(self.high)}"
        left = "(" if self.low_open else "["
        right = ")" if self.high_open else "]"
        return f"{left}{_fmt(self.low)}, {_fmt(self.high)}{right}"


@attrs.frozen
class ZeroOrAtLeast:
    """`0` disables the feature; enabled values must reach the minimum."""

    minimum: float | int

    def check(self, value: float | int) -> str | None:
        if not math.isfinite(value) or (value != 0 and value < self.minimum):
            return f"{_fmt(value)} must be 0 (disabled) or at least {_fmt(self.minimum)}"
        return None

    def describe(self) -> str:
        return f"0 or >= {_fmt(self.minimum)}"


def _text(value: str) -> str:
    shown = json.dumps(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."


@attrs.frozen
class Text:
    """A name or path handed to the OS: an empty one fails only at startup, far from its
    setting, and a NUL byte raises ValueError instead of OSError wherever it is used."""

    def check(self, value: str) -> str | None:
        if not value.strip():
            return f"{_text(value)} must not be empty"
        if "\0" in value:
            return f"{_text(value)} must not contain a NUL character"
        return None

    def describe(self) -> str:
        return "non-empty"


@attrs.frozen
class SocketPath:
    """An AF_UNIX socket path, which the kernel bounds: the path as it is bound, so a
    relative one once taken from the config file's folder."""

    def check(self, value: str) -> str | None:
        problem = Text().check(value)
        if problem is not None:
            return problem
        size = len(os.fsencode(value))
        if size > UNIX_PATH_MAX:
            return (
                f"{_text(value)} is {size} bytes long; an AF_UNIX socket path holds at "
                f"most {UNIX_PATH_MAX}"
            )
        return None

    def describe(self) -> str:
        return f"non-empty, at most {UNIX_PATH_MAX} bytes"


@attrs.frozen
class ZmqEndpoint:
    """A ZeroMQ endpoint another process can reach: `tcp://HOST:PORT` (HOST `*` for a
    wildcard bind) or `ipc://PATH`. Not `inproc://`, which stays inside one process, nor
    port 0, which the publisher picks and tells nobody."""

    def check(self, value: str) -> str | None:
        shown = _text(value)
        if value.startswith("ipc://"):
            return None if value[len("ipc://") :].strip() else f"{shown} names no ipc path"
        if not value.startswith("tcp://"):
            return f"{shown} must be tcp://HOST:PORT or ipc://PATH"
        host, _, port = value[len("tcp://") :].rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            return f"{shown} must be tcp://HOST:PORT with a port in 1..65535"
        return None

    def describe(self) -> str:
        return "tcp://HOST:PORT, ipc://PATH"


# The longest key or token taken: an OpenAI key is about 170 characters.
CREDENTIAL_MAX = 1024
# What vLLM and SGLang compare after "Bearer ", and what an HTTP header carries unchanged:
# visible ASCII. Spaces and other whitespace would be trimmed or split by HTTP parsers on
# the way, control characters and line breaks would inject headers, and non-ASCII text is
# decoded differently by the two ends.
CREDENTIAL_CHARS = frozenset(range(0x21, 0x7F))


def credential_problem(raw: bytes) -> str | None:
    """Why `raw` cannot be a key or token sent as `Authorization: Bearer`, in words that
    never quote it; None when it can."""
    if not raw:
        return "is empty"
    if not CREDENTIAL_CHARS.issuperset(raw):
        return (
            "holds a character that cannot be sent in an HTTP header (space, line break, "
            "control or non-ASCII character); expected printable ASCII"
        )
    if len(raw) > CREDENTIAL_MAX:
        return f"is {len(raw)} characters long; at most {CREDENTIAL_MAX}"
    return None


class _Revealable(Protocol):
    def reveal(self) -> str: ...


@attrs.frozen
class Credential:
    """A key or token (a `Secret`): what `credential_problem` takes, and never shown."""

    def check(self, value: _Revealable) -> str | None:
        problem = credential_problem(value.reveal().encode())
        return None if problem is None else f"the credential {problem}"

    def describe(self) -> str:
        return f"printable ASCII without spaces, 1..{CREDENTIAL_MAX} characters"


def url_problem(
    url: str, client: str = "the engine transport"
) -> tuple[str | None, tuple[str, str, int] | None]:
    """A problem with a plain-HTTP origin URL (an engine's, an etcd member's: `client`
    names what would speak to it), or None and its (scheme, host, port) identity."""
    if any(ch.isspace() for ch in url):
        return "must not contain whitespace", None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        # urlsplit raises for out-of-range or non-numeric ports and malformed IPv6 hosts.
        return "is not a valid url with a numeric port in 1..65535", None
    if parts.scheme == "https":
        # The clients speak plain HTTP/1.1; accepting https here would fail only at the
        # first request.
        return f"uses https, which {client} does not support yet", None
    if parts.scheme != "http":
        return "must start with http://", None
    host = parts.hostname
    if not host:
        return "has no host", None
    if port == 0:
        return "is not a valid url with a numeric port in 1..65535", None
    if parts.path not in ("", "/"):
        return f"must not have a path beyond '/' (got {parts.path!r})", None
    if parts.query or parts.fragment:
        return "must not have a query or fragment", None
    if port is None:
        port = 80
    return None, (parts.scheme, host, port)


@attrs.frozen
class HttpOrigin:
    """`http://HOST[:PORT]` with no path, query or fragment; `client` names what would
    speak to it, for a refused https."""

    client: str

    def check(self, value: str) -> str | None:
        problem, _ = url_problem(value, self.client)
        return None if problem is None else f"{_text(value)} {problem}"

    def describe(self) -> str:
        return "http://HOST:PORT"


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


@attrs.frozen
class ReplicaName:
    """Empty (derived), or 1-64 of letters, digits and `._:-`: it is part of an etcd key
    and a metric label."""

    def check(self, value: str) -> str | None:
        if value == "" or _NAME.fullmatch(value):
            return None
        return f"{_text(value)} must be empty or 1-64 of letters, digits and ._:-"

    def describe(self) -> str:
        return "empty, or 1-64 of [A-Za-z0-9._:-]"


@attrs.frozen
class KeyPrefix:
    """An etcd key prefix: starts and ends with `/`, visible ASCII only."""

    def check(self, value: str) -> str | None:
        if not (len(value) >= 2 and value.startswith("/") and value.endswith("/")):
            return f"{_text(value)} must start and end with '/' (e.g. \"/narwhal/\")"
        if any(not 0x21 <= ord(ch) < 0x7F for ch in value):
            return f"{_text(value)} must be visible ASCII, no spaces"
        return None

    def describe(self) -> str:
        return "/.../"


Rule = (
    Positive
    | NonNegative
    | AtLeast
    | Between
    | ZeroOrAtLeast
    | Text
    | SocketPath
    | Credential
    | ZmqEndpoint
    | HttpOrigin
    | ReplicaName
    | KeyPrefix
)
