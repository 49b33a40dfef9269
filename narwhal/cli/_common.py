from __future__ import annotations

import sys


def not_implemented(command: str, issue: int) -> int:
    """Placeholder for a command whose issue has not landed: a clear message, exit 2."""
    print(f"{command}: not implemented yet (tracked in issue {issue})", file=sys.stderr)
    return 2
