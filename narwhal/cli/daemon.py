"""`narwhal serve --config FILE` and `narwhal validate --config FILE`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ..config import ConfigError, config_to_dict, load_config_file
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


def _validate(path: str) -> int:
    try:
        config = load_config_file(path)
    except ConfigError as exc:
        print(f"narwhal: {len(exc.messages)} problem(s) in {path}:", file=sys.stderr)
        for message in exc.messages:
            print(message, file=sys.stderr)
        return 1
    print(json.dumps(config_to_dict(config), indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "validate":
        return _validate(args.config)
    return not_implemented("narwhal serve", 3)


if __name__ == "__main__":
    raise SystemExit(main())
