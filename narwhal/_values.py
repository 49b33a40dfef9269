"""Reading values out of decoded JSON."""

from __future__ import annotations


def json_int(value: object) -> int | None:
    """`value` when it is a JSON integer, else None.

    JSON's true and false decode to Python bools, which are ints: a field that must be a
    count would otherwise take `true` as 1.
    """
    return value if isinstance(value, int) and not isinstance(value, bool) else None
