"""Dotted paths into a configuration document: `serving.max_attempts`, `engines[2].url`."""

from __future__ import annotations

import json
import re

Path = tuple[str | int, ...]
"""Object keys are `str`, list indices `int`."""

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def format_path(path: Path) -> str:
    # Keys an operator could not type after a dot (`"max attempts"`, `""`) are shown as
    # JSON strings in brackets, so a message always starts with an unambiguous path.
    out: list[str] = []
    for segment in path:
        if isinstance(segment, int):
            out.append(f"[{segment}]")
        elif _IDENT.fullmatch(segment):
            out.append(f".{segment}" if out else segment)
        else:
            out.append(f"[{json.dumps(segment)}]")
    return "".join(out)


def field_pattern(path: Path) -> str:
    """The path with list indices erased (`engines[].url`), as cross rules name their inputs."""
    out: list[str] = []
    for segment in path:
        if isinstance(segment, int):
            out.append("[]")
        else:
            out.append(f".{segment}" if out else segment)
    return "".join(out)
