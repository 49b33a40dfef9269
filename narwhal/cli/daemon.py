"""`narwhal serve --config FILE` and `narwhal validate --config FILE`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ._common import not_implemented


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="narwhal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("serve", "run the router daemon"),
        ("validate", "check a config file and print the effective config"),
    ):
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("--config", required=True, help="path to the JSON config file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "validate":
        return not_implemented("narwhal validate", 2)
    return not_implemented("narwhal serve", 3)


if __name__ == "__main__":
    raise SystemExit(main())
