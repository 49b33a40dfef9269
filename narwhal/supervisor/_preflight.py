"""What `narwhal serve` would make of a valid configuration on this host, before it runs.

Owns: `preflight(config)`, every reason the daemon would refuse to start with it here
(`Finding.refuses`) or would start degraded, each naming its setting and the fix, for
`narwhal validate` to report as warnings. The daemon decides each at its own step of
startup with the same functions, so the two cannot drift:

- the open-file limit: `OpenFileLimit.plan` (serve: `fit`, which then raises the soft
  limit) and `capped_warning`;
- the profile store: `profiles_refusal` under predictive admission (serve:
  `require_profiles`), and the store's problems and poor fits, which serve logs;
- the control socket: `narwhal.ctl.inspect_path` (serve: `prepare_path`, which then
  creates its folder and binds: whether it may is asked here with access(2));
- the listeners: a bind of each address as serve binds it, worded by `listen_refusal`;
- the admin listener off loopback without a token: `open_admin_warning`;
- engines' KV events that text prompts cannot be matched against (no
  `engine.tokenizer_path`): `narwhal.caches.events_without_ids_warning`.

Invariants: changes nothing (a probe listener is closed at once, no file or folder is
made); contacts no engine (a profile's build is compared with the live engine's by
serve and narwhal-check only); blocking. A daemon already answering on `ctl.socket` is
not a finding: the file is then for a reload, and the ports are that daemon's, so they
are not probed (`Preflight.running`).
"""

from __future__ import annotations

import os

import attrs
import trio

from ..caches import events_without_ids_warning
from ..config import Config
from ..ctl import ControlSocketError, inspect_path
from ..profiles import load_profiles
from ..serving import DescriptorLimitError, OpenFileLimit, capped_warning
from ._control import fleet_profiles, profiles_refusal
from ._supervisor import listen_refusal, open_admin_warning


@attrs.frozen
class Finding:
    """A reason `narwhal serve` would refuse to start (`refuses`) or start degraded.
    `text` starts with the setting it names and ends with the fix."""

    text: str
    refuses: bool


@attrs.frozen
class Preflight:
    findings: tuple[Finding, ...]
    # The control socket a live process answers on (a running narwhal), or None.
    running: str | None = None

    @property
    def refusals(self) -> list[Finding]:
        return [f for f in self.findings if f.refuses]

    @property
    def degraded(self) -> list[Finding]:
        return [f for f in self.findings if not f.refuses]


def preflight(config: Config, *, open_files: OpenFileLimit | None = None) -> Preflight:
    """Every finding of serve's startup checks for `config` on this host, as this user."""
    findings: list[Finding] = []
    findings.extend(_open_files(config, open_files or OpenFileLimit()))
    findings.extend(_profiles(config))
    socket_findings, running = _control_socket(config.ctl.socket)
    findings.extend(socket_findings)
    if running is None:
        findings.extend(_listeners(config))
    warning = open_admin_warning(config)
    if warning is not None:
        findings.append(Finding(f"admin.host: {warning}", refuses=False))
    warning = events_without_ids_warning(config)
    if warning is not None:
        findings.append(Finding(warning, refuses=False))
    return Preflight(tuple(findings), running)


def _open_files(config: Config, limit: OpenFileLimit) -> list[Finding]:
    # This process's limit, which is the daemon's only when it is started from here:
    # under systemd the unit's LimitNOFILE= is.
    where = " (this shell's limit; under systemd the unit's LimitNOFILE= applies)"
    try:
        budget = limit.plan(config)
    except DescriptorLimitError as exc:
        return [Finding(f"listen.max_open_connections: {exc}{where}", refuses=True)]
    if budget.capped:
        return [Finding(capped_warning(budget) + where, refuses=False)]
    return []


def _profiles(config: Config) -> list[Finding]:
    check = load_profiles(None, config)
    profiles = fleet_profiles(config, check)
    refusal = profiles_refusal(config, usable=profiles is not None, problems=check.messages)
    if refusal is not None and config.cluster.enabled:
        # The cluster's store, read as the replica joins, may give one (narwhal.cluster).
        key = f"{config.cluster.prefix}profiles"
        started = f"serve starts all the same if etcd key {key} holds a usable store"
        return [Finding(f"{refusal} ({started})", refuses=False)]
    if refusal is not None:
        return [Finding(refusal, refuses=True)]
    out = [Finding(f"profiles.path: {message}", refuses=False) for message in check.messages]
    if profiles is not None:
        out.extend(
            Finding(f"profiles.path: {fit.message()}", refuses=False)
            for fit in profiles.poor_fits()
        )
    return out


def _control_socket(path: str) -> tuple[list[Finding], str | None]:
    try:
        state = inspect_path(path)
    except ControlSocketError as exc:
        text = str(exc).removesuffix("; refusing to start")
        return [Finding(f"{text}; set ctl.socket to a path of the daemon's own", True)], None
    if state == "live":
        return [], path
    if state == "stale":
        return [], None  # serve replaces it
    problem = _uncreatable(path)
    if problem is None:
        return [], None
    return [
        Finding(
            f"ctl.socket {path!r}: {problem}, as uid {os.geteuid()}; create that folder "
            "for the daemon's user (systemd: RuntimeDirectory=) or set ctl.socket to a "
            "path in a folder it may write",
            refuses=True,
        )
    ], None


def _uncreatable(path: str) -> str | None:
    """Why the daemon could not create its socket at the absent `path` (making its
    folder first if need be, as `prepare_path` does), or None."""
    folder = os.path.dirname(os.path.abspath(path))
    missing = ""
    while not os.path.lexists(folder):
        missing = folder
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return f"{folder!r} is not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        what = f"its folder {missing!r} cannot be made in" if missing else "cannot be made in"
        return f"{what} {folder!r}: permission denied"
    return None


def _listeners(config: Config) -> list[Finding]:
    out: list[Finding] = []
    for section, address in (("listen", config.listen), ("admin", config.admin)):
        if address.port == 0:
            continue  # any free port will do
        try:
            trio.run(_bind, address.host, address.port)
        except OSError as exc:
            refusal = listen_refusal(section, address.host, address.port, exc)
            out.append(
                Finding(
                    f"{section}.port: {refusal}; free the port or choose another "
                    f"{section}.host or {section}.port",
                    refuses=True,
                )
            )
    return out


async def _bind(host: str, port: int) -> None:
    # As serve_app binds (trio.open_tcp_listeners: SO_REUSEADDR, every address of host).
    for listener in await trio.open_tcp_listeners(port, host=host):
        await listener.aclose()
