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
from ..ctl import ControlSocketError
from ..serving import DescriptorLimitError
from ..supervisor import ListenError, Notifier, ProfilesUnavailable, Supervisor
from ._common import add_version, closed_pipe_is_quiet


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="narwhal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("serve", "run the router daemon"),
        ("validate", "check a config file and print the effective config"),
    ):
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("--config", required=True, help="path to the JSON config file")
    add_version(parser)
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
    print(json.dumps(config_to_dict(config), indent=2))
    return 0


async def _serve(config: Config, path: str) -> None:
    supervisor = Supervisor(
        config, config_path=path, serve_ctl=True, notifier=Notifier.from_environ()
    )
    # Signals are received from before startup, so none is lost while engines are probed.
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async with trio.open_nursery() as nursery:

            async def dispatch() -> None:
                async for signum in signals:
                    if signum == signal.SIGHUP:
                        nursery.start_soon(supervisor.reload, "SIGHUP")
                    else:
                        supervisor.request_shutdown()

            nursery.start_soon(dispatch)
            await supervisor.run()
            nursery.cancel_scope.cancel()


def _run_serve(path: str) -> int:
    config = _load(path)
    if config is None:
        return 1
    _logging.configure(config.log.level)
    problems: list[str] = []
    try:
        trio.run(_serve, config, path)
    except* (ControlSocketError, ProfilesUnavailable, DescriptorLimitError, ListenError) as group:
        problems.extend(str(exc) for exc in _leaves(group))
    except* OSError as group:
        # Binding an address is a ListenError, which names its settings.
        problems.extend(str(exc) for exc in _leaves(group))
    for problem in problems:
        print(f"narwhal: {problem}", file=sys.stderr)
    return 1 if problems else 0


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


@closed_pipe_is_quiet
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "validate":
        return _validate(args.config)
    return _run_serve(args.config)


if __name__ == "__main__":
    raise SystemExit(main())
