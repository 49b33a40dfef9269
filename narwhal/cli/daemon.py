"""`narwhal serve --config FILE` and `narwhal validate --config FILE`."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence

import trio

from .. import _logging
from ..cluster import ClusterUnavailable
from ..config import Config, ConfigError, config_to_dict, load_config_file
from ..ctl import ControlSocketError
from ..serving import DescriptorLimitError
from ..supervisor import (
    ListenError,
    Notifier,
    Preflight,
    ProfilesUnavailable,
    Supervisor,
    preflight,
)
from ._common import add_version, closed_pipe_is_quiet

EXIT_OK, EXIT_INVALID, EXIT_WARNINGS = 0, 1, 2

_VALIDATE = """\
Check a config file as `narwhal serve` loads it: every problem at once, field rules and
cross-field rules in one pass (a rule that reads an invalid value waits for it, and the
last line names those values). A valid file is printed as the daemon would run it, every
default filled in and every relative path taken from the file's folder. Then, unless
--file-only, what `narwhal serve` would meet on this host, as this user, is reported as
warnings, each naming its setting and the fix: reasons it would refuse to start (no
usable profile store under predictive admission, a control socket path it may not use,
an address it cannot bind, an open-file limit with no room for the retained requests)
and reasons it would start degraded (profile store problems, fewer client connections
than listen.max_open_connections, an admin listener off loopback without a token). When
a narwhal already answers on ctl.socket the file is for a reload there, and its ports are
not probed."""

_VALIDATE_EXIT = """\
exit status:
  0  valid, and serve would start with it here, undegraded
  1  invalid: every problem is listed, nothing is printed on stdout
  2  valid (printed), but serve here would refuse to start or start degraded: see the
     warnings"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="narwhal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the router daemon")
    serve.add_argument("--config", required=True, help="path to the JSON config file")
    validate = sub.add_parser(
        "validate",
        help="check a config file and print the effective config",
        description=_VALIDATE,
        epilog=_VALIDATE_EXIT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    validate.add_argument("--config", required=True, help="path to the JSON config file")
    validate.add_argument(
        "--file-only",
        action="store_true",
        help="check the file alone, not what serve would meet on this host (for CI, or "
        "a machine other than the daemon's)",
    )
    add_version(parser)
    return parser


def _load(path: str) -> Config | None:
    try:
        return load_config_file(path)
    except ConfigError as exc:
        print(f"narwhal: {len(exc.messages)} problem(s) in {path}:", file=sys.stderr)
        for message in exc.messages:
            print(message, file=sys.stderr)
        if exc.unchecked:
            print(
                f"narwhal: the cross-field rules that read {', '.join(exc.unchecked)} run "
                "once those values are valid",
                file=sys.stderr,
            )
        return None


def _validate(path: str, *, file_only: bool) -> int:
    config = _load(path)
    if config is None:
        return EXIT_INVALID
    print(json.dumps(config_to_dict(config), indent=2))
    if file_only:
        return EXIT_OK
    checked = preflight(config)
    _report(path, checked)
    return EXIT_WARNINGS if checked.findings else EXIT_OK


def _report(path: str, checked: Preflight) -> None:
    if checked.running is not None:
        print(
            f"narwhal: a narwhal answers on ctl.socket {checked.running}: this file is for a "
            f"reload there (narwhalctl --config {path} reload); its ports are not probed",
            file=sys.stderr,
        )
    for findings, outcome in (
        (checked.refusals, "refuse to start"),
        (checked.degraded, "start degraded"),
    ):
        if findings:
            print(
                f"narwhal: {len(findings)} warning(s): `narwhal serve` here would {outcome}:",
                file=sys.stderr,
            )
            for finding in findings:
                print(finding.text, file=sys.stderr)


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
    except* (
        ControlSocketError,
        ProfilesUnavailable,
        DescriptorLimitError,
        ListenError,
        ClusterUnavailable,
    ) as group:
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
        return _validate(args.config, file_only=args.file_only)
    return _run_serve(args.config)


if __name__ == "__main__":
    raise SystemExit(main())
