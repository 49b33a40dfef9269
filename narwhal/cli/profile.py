from __future__ import annotations

from collections.abc import Sequence

from ._common import not_implemented


def main(argv: Sequence[str] | None = None) -> int:
    return not_implemented("narwhal-profile", 4)


if __name__ == "__main__":
    raise SystemExit(main())
