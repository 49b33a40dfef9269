"""The `narwhal` command: `narwhal.cli.daemon`, imported so that a hypercorn release the
HTTP server does not support is one line of error, not a traceback (the check runs as
the server module is imported, before hypercorn's private names are)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .._hypercorn_pin import UnsupportedHypercorn


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from .daemon import main as daemon_main
    except UnsupportedHypercorn as exc:
        print(f"narwhal: {exc}", file=sys.stderr)
        return 1
    return daemon_main(argv)
