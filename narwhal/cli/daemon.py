"""`narwhal serve --config FILE` and `narwhal validate --config FILE`."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence

import trio

from .. import _logging
from ..config import Config, ConfigError, config_to_dict, load_config_file
from ..supervisor import Supervisor


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


def _load(path: str) -> Config | None:
    try:
        return load_config_file(path)
    except ConfigError as exc:
        print(f"narwhal: {len(exc.messages)} problem(s) in {path}:", file=sys.stderr)
        for message in exc.messages:
            print(message, file=sys.stderr)
        return None


def _validate(path: str) -> int:
    config = _load(path)
    if config is None:
        return 1
    try:
        print(json.dumps(config_to_dict(config), indent=2))
    except BrokenPipeError:
        pass  # `narwhal validate ... | head` closed the pipe; not an error
    return 0


async def _serve(config: Config) -> None:
    supervisor = Supervisor(config)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                supervisor.request_shutdown()
                break
        # The supervisor drains and returns; a second signal is not waited for here.


def _run_serve(path: str) -> int:
    config = _load(path)
    if config is None:
        return 1
    _logging.configure(config.log.level)
    trio.run(_serve, config)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "validate":
        return _validate(args.config)
    return _run_serve(args.config)


if __name__ == "__main__":
    raise SystemExit(main())
