"""The hypercorn releases Narwhal's HTTP server is known to work with.

Owns: `HYPERCORN_RANGE`, the releases `_server` was checked against, and the check that
the installed one is among them. `_server` subclasses and patches hypercorn's private
classes (its docstring lists them), which any minor release may change; the check runs
as `_server` is imported, before those imports, so a release outside the range stops
startup with one message naming it and the range, not an ImportError or AttributeError
from inside hypercorn. pyproject.toml pins the same range (tests/serving/test_hypercorn_pin.py
holds the two together); the check is for installs that bypass the resolver
(`pip install --no-deps`, a distribution's package, a vendored copy).

Invariants: this module imports nothing of hypercorn (only its distribution's metadata);
no module but `_server` imports hypercorn (tests/serving/test_hypercorn_pin.py).
Widening the range means running tests/serving/test_server.py on the new release.

Errors: `UnsupportedHypercorn` (an ImportError: the server cannot be imported).
"""

from __future__ import annotations

import importlib.metadata
import re

# (lowest supported, first unsupported) major.minor. 0.17.0 and 0.18.0 pass
# tests/serving/test_server.py; 0.19 is not out, and is refused until it has been checked.
HYPERCORN_RANGE = ((0, 17), (0, 19))


class UnsupportedHypercorn(ImportError):
    """The installed hypercorn is outside `HYPERCORN_RANGE`."""


def supported_text() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = HYPERCORN_RANGE
    return f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"


def hypercorn_refusal(version: str | None) -> UnsupportedHypercorn | None:
    """Why hypercorn `version` (None: not installed as a distribution) cannot serve, or
    None when it is in the range."""
    match = re.match(r"(\d+)\.(\d+)", version or "")
    if match is not None:
        lowest, first_unsupported = HYPERCORN_RANGE
        if lowest <= (int(match[1]), int(match[2])) < first_unsupported:
            return None
    installed = f"hypercorn {version} is" if version else "no hypercorn distribution is"
    return UnsupportedHypercorn(
        f"{installed} installed; narwhal's HTTP server supports hypercorn {supported_text()} "
        "only (it relies on hypercorn internals checked against those releases): "
        f"pip install 'hypercorn{supported_text()}'"
    )


def installed_hypercorn() -> str | None:
    try:
        return importlib.metadata.version("hypercorn")
    except importlib.metadata.PackageNotFoundError:
        return None


def require_supported_hypercorn() -> None:
    """Raise UnsupportedHypercorn unless the installed hypercorn is in the range."""
    refusal = hypercorn_refusal(installed_hypercorn())
    if refusal is not None:
        raise refusal
