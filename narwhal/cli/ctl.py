"""narwhalctl: operate a running Narwhal over its control socket.

    narwhalctl [--socket PATH | --config FILE] [--json] [--timeout S] COMMAND

Commands: state | proposals | drain ENGINE | undrain ENGINE | pin ENGINE prefill|decode |
unpin ENGINE | reload.

The socket is found from any directory: --socket PATH, else ctl.socket of --config FILE
(the only setting read and checked there; a relative one taken from FILE's folder, as
the daemon takes it), else $NARWHAL_CTL_SOCKET, else ctl.socket of $NARWHAL_CONFIG (the
container image sets it), else the first that answers of the packaged default
/run/narwhal/narwhal.sock (conf/narwhal.json, the systemd unit, the container) and
runs/narwhal.sock in the current directory (a development daemon's default). A relative
--socket or $NARWHAL_CTL_SOCKET is the current directory's. When none answers, every
path tried is said with why: no such file (no narwhal listens there), not a socket,
permission denied (the socket is the service user's: run narwhalctl as that user), or
connection refused (a stale socket: the daemon is down).

Output is for people by default; --json prints the daemon's response object as is, or,
when there is none, one of the same shape: {"ok": false, "error": {"code":
"daemon_unreachable" | "protocol_error", "message": ...}}.

Exit codes:
  0  done
  1  the daemon refused the command (unknown engine, invalid config on reload, ...)
  2  usage error
  3  no daemon answers: socket missing, stale (connection refused), not a socket,
     permission denied (the JSON error's "tried" lists each path, its source and reason)
  4  the daemon did not answer properly (timeout, malformed or oversized response)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ..ctl import CtlProtocolError, CtlRequest, DaemonUnreachable, call
from ._common import add_version, closed_pipe_is_quiet, positive_seconds

# Tried in order when nothing names the socket: the packaged install's (conf/narwhal.json,
# conf/narwhal.service, the Dockerfile), then a development daemon's default ctl.socket.
PACKAGED_SOCKET = "/run/narwhal/narwhal.sock"
DEFAULT_SOCKET = "runs/narwhal.sock"
EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_PROTOCOL = 0, 1, 2, 3, 4


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="narwhalctl",
        description="Operate a running Narwhal over its control socket.",
        epilog="exit codes: 0 done, 1 refused by the daemon, 2 usage, "
        "3 daemon not running, 4 bad or no answer",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--socket", metavar="PATH", help="control socket path")
    where.add_argument(
        "--config",
        metavar="FILE",
        help="read ctl.socket from this config (default: $NARWHAL_CONFIG)",
    )
    parser.add_argument("--json", action="store_true", help="print the raw JSON response")
    parser.add_argument(
        "--timeout",
        # socket.settimeout raises on a negative or NaN timeout, and 0 makes the socket
        # non-blocking: each ended narwhalctl with a traceback or a misleading error.
        type=positive_seconds,
        default=30.0,
        metavar="S",
        help="answer timeout (default 30)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("state", help="engines, breakers, health, holds and more")
    sub.add_parser("proposals", help="advisory role control: the role changes it proposes")
    for name, text in (
        ("drain", "stop placing new work on ENGINE; resident work finishes"),
        ("undrain", "let ENGINE take new work again"),
        ("unpin", "let the controller move ENGINE again (the role stays)"),
    ):
        sub.add_parser(name, help=text).add_argument("engine", metavar="ENGINE")
    pin = sub.add_parser("pin", help="set ENGINE's role and keep the controller off it")
    pin.add_argument("engine", metavar="ENGINE")
    pin.add_argument("role", choices=("prefill", "decode"))
    sub.add_parser("reload", help="re-read the config file (like SIGHUP)")
    add_version(parser)
    return parser


def socket_candidates(
    args: argparse.Namespace, environ: Mapping[str, str] = os.environ
) -> list[tuple[str, str]]:
    """The socket paths to try, in order, each with where it came from (for messages):
    one when something names it, else the defaults."""
    if args.socket:
        return [(os.path.abspath(args.socket), "--socket")]
    if args.config:
        return [(_config_socket(args.config, "--config"), f"ctl.socket of {args.config}")]
    if environ.get("NARWHAL_CTL_SOCKET"):
        return [(os.path.abspath(environ["NARWHAL_CTL_SOCKET"]), "$NARWHAL_CTL_SOCKET")]
    if environ.get("NARWHAL_CONFIG"):
        config = environ["NARWHAL_CONFIG"]
        return [(_config_socket(config, "$NARWHAL_CONFIG"), f"ctl.socket of {config}")]
    return [
        (PACKAGED_SOCKET, "the packaged default"),
        (os.path.abspath(DEFAULT_SOCKET), f"{DEFAULT_SOCKET} in the current directory"),
    ]


def _config_socket(path: str, named_by: str) -> str:
    from ..config import ConfigError, load_ctl_socket

    try:
        # Only ctl.socket is read and checked: the rest of the file is the daemon's to
        # judge, so a broken file still reaches it (`systemctl reload` runs `narwhalctl
        # --config FILE reload`: a rejected file must be rejected by the daemon, which
        # reports every problem and keeps its configuration), and an operator need not
        # be able to read the engines' API key file.
        return load_ctl_socket(path)
    except ConfigError as exc:
        print(f"narwhalctl: cannot use {named_by} {path}:", file=sys.stderr)
        for message in exc.messages:
            print(f"  {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None


@closed_pipe_is_quiet
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    request = CtlRequest(args.command, getattr(args, "engine", None), getattr(args, "role", None))
    candidates = socket_candidates(args)
    tried: list[tuple[DaemonUnreachable, str]] = []
    for path, source in candidates:
        try:
            response = call(path, request, timeout_s=args.timeout)
        except DaemonUnreachable as exc:
            tried.append((exc, source))
            continue
        except CtlProtocolError as exc:
            return _failed(args.json, "protocol_error", str(exc), EXIT_PROTOCOL)
        break
    else:
        return _unreachable(args.json, tried)
    if args.json:
        print(json.dumps(response, indent=2))
        return EXIT_OK if response["ok"] else EXIT_REFUSED
    if not response["ok"]:
        _print_error(response.get("error") or {})
        return EXIT_REFUSED
    print(_human(args.command, response.get("result")))
    return EXIT_OK


def _failed(as_json: bool, code: str, message: str, status: int, **details: object) -> int:
    """No answer from the daemon: said on stderr and, for --json, as a response of the
    usual shape on stdout, so a script parsing stdout reads a failure, not nothing."""
    print(f"narwhalctl: {message}", file=sys.stderr)
    if as_json:
        error = {"code": code, "message": message, **details}
        print(json.dumps({"ok": False, "error": error}, indent=2))
    return status


def _unreachable(as_json: bool, tried: list[tuple[DaemonUnreachable, str]]) -> int:
    """Every path tried, where it came from and why nothing answered there."""
    if len(tried) == 1:
        ((exc, source),) = tried
        message = f"cannot reach narwhal ({source}): {exc}"
    else:
        lines = [f"  {exc.path} ({source}): {exc.detail}" for exc, source in tried]
        message = "\n".join(
            [
                "cannot reach narwhal; tried:",
                *lines,
                "name its socket with --config FILE (the daemon's config), --socket PATH or "
                "$NARWHAL_CTL_SOCKET",
            ]
        )
    details = [{"path": exc.path, "source": source, "reason": exc.reason} for exc, source in tried]
    return _failed(as_json, "daemon_unreachable", message, EXIT_UNREACHABLE, tried=details)


def _print_error(error: dict[str, Any]) -> None:
    print(f"narwhalctl: {error.get('message', 'refused')}", file=sys.stderr)
    details = error.get("details")
    if isinstance(details, dict):
        for problem in details.get("errors") or []:
            print(f"  {problem}", file=sys.stderr)


def _human(command: str, result: Any) -> str:
    if command == "state":
        return _human_state(result)
    if command == "proposals":
        return _human_proposals(result)
    if command == "reload":
        # Settings that need a restart are listed but not applied: counting them as
        # changes made a reload that applied nothing read like one that did.
        plan = result.get("plan") or {}
        head = f"reloaded {result['source']}: {len(plan.get('changes', []))} change(s) applied"
        restart = len(plan.get("restart_required", []))
        if restart:
            head += f", {restart} need a restart"
        lines = [head]
        lines.extend(f"  {change}" for change in result["changes"])
        return "\n".join(lines)
    engine = result["engine"]
    if command in ("drain", "undrain"):
        verb = "drained" if command == "drain" else "undrained"
        text = f"{verb} {engine}" if result["changed"] else f"{engine} was already {verb}"
        if command == "drain" and result["resident"]:
            text += f"; {result['resident']} resident request(s) finish on it"
    elif command == "pin":
        text = f"pinned {engine} as {result['role']}"
        if result["previous_role"] != result["role"]:
            text += f" (was {result['previous_role']})"
    else:
        text = f"unpinned {engine} (role stays {result['role']})"
        if result.get("previous_role") not in (None, result["role"]):
            text = (
                f"unpinned {engine}; its configured role {result['role']} applies now "
                f"(was {result['previous_role']})"
            )
        if not result["changed"]:
            text = f"{engine} was not pinned (role {result['role']})"
    if result.get("warning"):
        text += f"\nwarning: {result['warning']}"
    return text


def _human_proposals(view: dict[str, Any]) -> str:
    if not view["enabled"]:
        return "role control is off (controller.enabled is false): nothing is proposed"
    lines = []
    if not view["advisory"]:
        lines.append(
            "role control is not advisory: its changes are applied (see `narwhalctl state` "
            "or /narwhal/state controller.flips)"
        )
    proposals = view["proposals"]
    if not proposals and view["advisory"]:
        lines.append("no role change proposed yet")
    for p in proposals:
        before, after = p["before"], p["after"]
        lines.append(
            f"{p['wall_time']}  {p['engine']} {p['from']} -> {p['to']}  "
            f"{before['prefill']}P:{before['decode']}D -> {after['prefill']}P:{after['decode']}D  "
            f"{p['caller']}: {p['reason']}"
        )
        if p.get("detail"):
            lines.append(f"    {p['detail']}")
    now = view.get("now")
    if now is not None:
        split = now["split"]
        line = (
            f"last evaluated {now['wall_time']}: {split['current']['prefill']}P:"
            f"{split['current']['decode']}D, proposed {split['proposed']['prefill']}P:"
            f"{split['proposed']['decode']}D ({now['result']}"
        )
        lines.append(line + (f", {now['gate']})" if now.get("gate") else ")"))
    return "\n".join(lines)


def _human_state(state: dict[str, Any]) -> str:
    head = state["narwhal"]
    supervisor = state.get("supervisor") or {}
    recovery = (state.get("recovery") or {}).get("engines", {})
    listen = ", ".join(supervisor.get("listen") or []) or "?"
    admin = ", ".join(supervisor.get("admin") or []) or "?"
    status = "accepting" if head["accepting"] else "not accepting (shutting down)"
    lines = [
        f"narwhal {head['version']}  up {head['uptime_s']:.0f}s  {listen}  {status}  admin {admin}",
        f"degraded: {head['degraded'] or 'no'}",
        "",
    ]
    rows = [("ENGINE", "ROLE", "AVAILABLE", "BREAKERS P/D", "HEALTH", "LOAD P/D", "FLAGS")]
    for engine in state["engines"]:
        rec = recovery.get(engine["id"], {})
        breakers = rec.get("breakers", {})
        flags = [
            name
            for name, on in (
                ("drained", engine.get("drained")),
                ("pinned", engine.get("pinned")),
                ("held", (rec.get("hold") or {}).get("active")),
                ("unreachable", rec.get("unreachable") is not None),
                ("quarantined", (rec.get("quarantine") or {}).get("active")),
            )
            if on
        ]
        rows.append(
            (
                engine["id"],
                engine["role"],
                "yes" if engine["available"] else f"no: {engine['unavailable_reason']}",
                "/".join(breakers.get(p, {}).get("state", "?") for p in ("prefill", "decode")),
                (rec.get("health") or {}).get("verdict", "?"),
                f"{engine['prefill']['inflight']}/{engine['decode']['active']}",
                ",".join(flags) or "-",
            )
        )
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines.extend(
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )
    retiring = supervisor.get("retiring_engines") or []
    if retiring:
        lines.append("")
        lines.extend(f"retiring {e['id']}: {e['resident']} resident" for e in retiring)
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
