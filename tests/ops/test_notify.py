"""sd_notify datagrams, the watchdog cadence and the systemd unit file."""

from __future__ import annotations

import configparser
import os
import re
import secrets
from pathlib import Path

import trio
import trio.testing

from narwhal.config import Recovery
from narwhal.supervisor import CLEANUP_S, Notifier

REPO = Path(__file__).resolve().parents[2]


async def receiver(address: str | bytes) -> trio.socket.SocketType:
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_DGRAM)
    await sock.bind(address)
    return sock


async def test_messages_reach_a_path_socket(short_tmp: Path) -> None:
    path = short_tmp / "notify.sock"
    sock = await receiver(str(path))
    with sock:
        notifier = Notifier.from_environ({"NOTIFY_SOCKET": str(path)})
        notifier.ready("listening on http://127.0.0.1:8000; 2/2 engines available")
        notifier.reloading()
        notifier.stopping("draining 3 request(s)\nfor up to 30.0s")
        with trio.fail_after(2):
            ready, reloading, stopping = [(await sock.recv(4096)).decode() for _ in range(3)]
        notifier.close()
    assert ready == "READY=1\nSTATUS=listening on http://127.0.0.1:8000; 2/2 engines available"
    assert re.fullmatch(
        r"RELOADING=1\nMONOTONIC_USEC=\d+\nSTATUS=reloading configuration", reloading
    )
    assert stopping == "STOPPING=1\nSTATUS=draining 3 request(s) for up to 30.0s"  # one line


async def test_abstract_namespace_socket() -> None:
    name = f"narwhal-test-{secrets.token_hex(6)}"
    sock = await receiver(b"\0" + name.encode())
    with sock:
        notifier = Notifier(f"@{name}")
        notifier.status("degraded: monitor")
        with trio.fail_after(2):
            assert await sock.recv(4096) == b"STATUS=degraded: monitor"
        notifier.close()


async def test_without_notify_socket_nothing_is_sent_and_nothing_fails() -> None:
    notifier = Notifier.from_environ({})
    assert not notifier.enabled
    assert notifier.notify("READY=1") is False
    with trio.fail_after(1):
        await notifier.watchdog()  # returns at once: no watchdog configured


async def test_a_vanished_socket_is_logged_not_fatal(short_tmp: Path) -> None:
    notifier = Notifier(str(short_tmp / "gone.sock"))
    assert notifier.notify("READY=1") is False
    notifier.close()


def test_watchdog_settings_come_from_the_environment() -> None:
    pid = str(os.getpid())
    assert (
        Notifier.from_environ({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "30000000"}).watchdog_usec
        == 30_000_000
    )
    ours = {"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": pid}
    assert Notifier.from_environ(ours).watchdog_usec == 1000
    theirs = {**ours, "WATCHDOG_PID": str(os.getpid() + 1)}
    assert Notifier.from_environ(theirs).watchdog_usec is None
    assert Notifier.from_environ({"WATCHDOG_USEC": "nonsense"}).watchdog_usec is None


async def test_watchdog_pings_at_half_the_interval(
    nursery: trio.Nursery, short_tmp: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = short_tmp / "notify.sock"
    sock = await receiver(str(path))
    notifier = Notifier(str(path), watchdog_usec=4_000_000)
    await nursery.start(notifier.watchdog)
    start = trio.current_time()
    times = []
    with sock:
        for _ in range(4):
            assert await sock.recv(4096) == b"WATCHDOG=1"
            times.append(trio.current_time() - start)
    assert times == [0.0, 2.0, 4.0, 6.0]
    assert notifier.sent == []  # pings are not kept for the state document
    nursery.cancel_scope.cancel()
    notifier.close()


def test_systemd_unit_is_type_notify_with_reload_watchdog_and_a_stop_timeout_over_the_grace() -> (
    None
):
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(REPO / "conf" / "narwhal.service")
    service = unit["Service"]
    assert service["Type"] == "notify"
    assert service["NotifyAccess"] == "main"
    assert service["ExecStart"].endswith("narwhal serve --config /etc/narwhal/narwhal.json")
    # A reload through narwhalctl, so that a rejected file fails `systemctl reload`
    # (exit 1); SIGHUP reported success whatever the daemon made of the file.
    assert service["ExecReload"] == (
        "/opt/narwhal/.venv/bin/narwhalctl --config /etc/narwhal/narwhal.json reload"
    )
    assert service["KillSignal"] == "SIGTERM"
    assert int(service["WatchdogSec"]) > 0
    stop = int(service["TimeoutStopSec"])
    assert stop > Recovery().shutdown_grace_s + CLEANUP_S
    assert service["RuntimeDirectoryMode"] == "0700"
