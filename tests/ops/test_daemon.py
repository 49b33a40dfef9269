"""The real daemon in a subprocess, operated with the real narwhalctl, signals and a
NOTIFY_SOCKET, in front of an in-process simulated fleet."""

from __future__ import annotations

import json
import re
import signal
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from narwhal.sim import Fleet, serve_fleet

from ..serving.conftest import MODEL
from ..support import fifo, open_sse
from .daemon import Launch, launcher

STREAM = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 8, "stream": True}


@pytest.fixture
async def launch(short_tmp: Path) -> AsyncIterator[Launch]:
    async with launcher(short_tmp) as start:
        yield start


async def start_fleet(nursery: trio.Nursery, engines: int, speed: float = 20.0) -> Fleet:
    fleet: Fleet = await nursery.start(
        partial(serve_fleet, engines=engines, speed=speed, model=MODEL)
    )
    return fleet


def document(fleet: Fleet, roles: list[str], **sections: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "engines": [
            {"id": f"{role[0]}{i}", "url": handle.url, "role": role, "model": MODEL}
            for i, (handle, role) in enumerate(zip(fleet, roles, strict=True))
            if role != "-"
        ],
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"host": "127.0.0.1", "port": 0},
        "serving": {"admission": "open"},
        "recovery": {"health": {"interval_s": 0.2}},
        # Operator actions are what these tests watch; the role controller would
        # (rightly) restore a drained decode floor underneath them.
        "controller": {"enabled": False},
    }
    doc.update(sections)
    return doc


async def read_all(reader: Any) -> list[str]:
    events = []
    while (event := await reader.event()) is not None:
        events.append(event)
    return events


def text(result: Any) -> tuple[int, str, str]:
    return result.returncode, result.stdout.decode(), result.stderr.decode()


async def test_narwhalctl_drains_pins_and_reports_state_of_a_running_daemon(
    nursery: trio.Nursery, launch: Launch
) -> None:
    fleet = await start_fleet(nursery, 3)
    daemon = await launch(document(fleet, ["prefill", "decode", "decode"]))

    code, out, err = text(await daemon.ctl("state"))
    assert code == 0, err
    assert re.search(r"^p0\s+prefill\s+yes\s+closed/closed\s+up\s+0/0\s+-$", out, re.MULTILINE), out
    assert f"  {daemon.url}  accepting" in out.splitlines()[0]

    # A stream resident on d1 (ties break by id) keeps going through the drain; its 3 s
    # pause leaves room for a slow narwhalctl start on a busy machine.
    fleet[1].set_faults(stall_after_tokens=2, stall_s=3.0, leg="decode", count=1)
    async with open_sse(daemon.url, "/v1/completions", STREAM) as reader:
        assert await reader.event() is not None
        code, out, err = text(await daemon.ctl("drain", "d1"))
        assert (code, out, err) == (0, "drained d1; 1 resident request(s) finish on it\n", "")
        async with httpx.AsyncClient(timeout=10) as client:
            for _ in range(3):
                response = await client.post(f"{daemon.url}/v1/completions", json=STREAM)
                assert response.status_code == 200
        events = await read_all(reader)
    assert events[-1] == "[DONE]"
    assert fleet[1].state()["counters"]["requests"]["decode"] == 1
    assert fleet[2].state()["counters"]["requests"]["decode"] == 3

    code, out, err = text(await daemon.ctl("pin", "d2", "prefill"))
    assert (code, err) == (0, "")
    assert out == (
        "pinned d2 as prefill (was decode)\n"
        "warning: new requests cannot be placed now: no decode engine is available "
        "(d1: drained)\n"
    )
    state = await daemon.state()
    d2 = next(e for e in state["engines"] if e["id"] == "d2")
    assert (d2["role"], d2["pinned"]) == ("prefill", True)
    assert state["recovery"]["engines"]["d1"]["drained"] is True
    assert text(await daemon.ctl("unpin", "d2"))[1] == (
        "unpinned d2 (role stays prefill)\n"
        "warning: new requests cannot be placed now: no decode engine is available "
        "(d1: drained)\n"
    )
    assert text(await daemon.ctl("undrain", "d1"))[1] == "undrained d1\n"
    code, out, err = text(await daemon.ctl("--json", "pin", "d2", "decode"))
    assert code == 0
    assert json.loads(out)["result"]["role"] == "decode"

    assert text(await daemon.ctl("drain", "nope")) == (
        1,
        "",
        "narwhalctl: no engine 'nope'; engines: p0, d1, d2\n",
    )
    code, out, err = text(await daemon.ctl("--json", "drain", "nope"))
    assert code == 1
    assert json.loads(out)["error"]["code"] == "unknown_engine"
    code, out, err = text(await daemon.ctl("pin", "d1", "both"))
    assert code == 2
    assert "invalid choice: 'both'" in err
    # The journal shows what was refused, and to whom it was done (narwhalctl refused
    # the pin itself: the daemon never saw it).
    assert [
        (e["level"], e["command"], e["engine"], e["outcome"]) for e in daemon.events("ctl")
    ] == [("warning", "drain", "nope", "unknown_engine")] * 2
    operator = daemon.events("operator")
    assert [(e["engine"], e["kind"], e["from"], e["to"]) for e in operator][:3] == [
        ("d1", "drained", False, True),
        ("d2", "role", "decode", "prefill"),
        ("d2", "pinned", False, True),
    ]
    daemon.signal(signal.SIGTERM)
    with trio.fail_after(10):
        assert await daemon.process.wait() == 0


async def test_a_configured_role_change_that_waited_for_unpin_applies_at_unpin(
    nursery: trio.Nursery, launch: Launch
) -> None:
    # The reload log says a pinned engine's configured role change "waits for unpin";
    # unpin used to keep the pinned role, and the change was lost for good (the next
    # reload of the same file sees no role change to apply).
    fleet = await start_fleet(nursery, 3)
    roles = ["prefill", "decode", "decode"]
    daemon = await launch(document(fleet, roles))
    assert text(await daemon.ctl("pin", "d2", "decode"))[1] == "pinned d2 as decode\n"
    changed = document(fleet, roles)
    changed["engines"][2]["role"] = "prefill"
    daemon.write_config(changed)
    code, out, err = text(await daemon.ctl("reload"))
    assert code == 0, err
    assert 'engines[d2].role: "decode" -> "prefill"' in out, out
    state = await daemon.state()
    d2 = next(e for e in state["engines"] if e["id"] == "d2")
    assert (d2["role"], d2["pinned"]) == ("decode", True)
    [held] = daemon.events("reload_role")
    assert held["outcome"] == "kept_pinned"

    code, out, err = text(await daemon.ctl("unpin", "d2"))
    assert (code, out, err) == (
        0,
        "unpinned d2; its configured role prefill applies now (was decode)\n",
        "",
    )
    state = await daemon.state()
    d2 = next(e for e in state["engines"] if e["id"] == "d2")
    assert (d2["role"], d2["pinned"]) == ("prefill", False)
    # New placement sees it: equal-cost prefill engines break ties by id, d2 before p0.
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.post(
            f"{daemon.url}/v1/completions", json={**STREAM, "stream": False}
        )
    assert response.status_code == 200
    assert fleet[2].state()["counters"]["requests"]["prefill"] == 1
    # Applied once: a second unpin, or a reload of the same file, changes nothing.
    assert text(await daemon.ctl("unpin", "d2"))[1] == "d2 was not pinned (role prefill)\n"
    code, out, err = text(await daemon.ctl("reload"))
    assert code == 0, err
    state = await daemon.state()
    d2 = next(e for e in state["engines"] if e["id"] == "d2")
    assert d2["role"] == "prefill"
    daemon.signal(signal.SIGTERM)
    with trio.fail_after(10):
        assert await daemon.process.wait() == 0


@attrs.define
class Load:
    """Streaming clients in a loop; every request's span and outcome is recorded."""

    url: str
    body: dict[str, Any]
    spans: list[tuple[float, float]] = attrs.Factory(list)
    failures: list[str] = attrs.Factory(list)
    stop: trio.Event = attrs.Factory(trio.Event)

    async def client(self) -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            while not self.stop.is_set():
                started = trio.current_time()
                async with client.stream(
                    "POST", f"{self.url}/v1/completions", json=self.body
                ) as response:
                    raw = b"".join([chunk async for chunk in response.aiter_raw()])
                body = raw.decode()
                if response.status_code != 200 or not body.endswith("data: [DONE]\n\n"):
                    self.failures.append(f"{response.status_code}: {body[-200:]}")
                elif '"error"' in body:
                    self.failures.append(body[-200:])
                self.spans.append((started, trio.current_time()))

    def in_flight_at(self, instant: float) -> int:
        return sum(1 for start, end in self.spans if start < instant < end)


async def test_reload_under_load_valid_and_invalid_with_zero_failed_requests(
    nursery: trio.Nursery, launch: Launch
) -> None:
    fleet = await start_fleet(nursery, 3, speed=1.0)
    initial = document(fleet, ["prefill", "decode", "-"])
    daemon = await launch(initial)
    load = Load(daemon.url, {**STREAM, "max_tokens": 60})
    reloads: list[float] = []
    async with trio.open_nursery() as clients:
        for _ in range(6):
            clients.start_soon(load.client)
        await trio.sleep(0.5)

        # 1. valid, by SIGHUP: smaller gate, new timeouts, one engine added.
        added = {**initial, "serving": {"admission": "open", "max_connections": 48}}
        added["engines"] = [
            *initial["engines"],
            {"id": "p2", "url": fleet[2].url, "role": "prefill", "model": MODEL},
        ]
        added["engine"] = {"first_token_timeout_s": 3.0}
        daemon.write_config(added)
        daemon.signal(signal.SIGHUP)
        reloading = await daemon.message("RELOADING=1")
        assert re.search(r"^MONOTONIC_USEC=\d+$", reloading, re.MULTILINE)
        await daemon.message("READY=1")
        reloads.append(trio.current_time())
        state = await daemon.state()
        assert [e["id"] for e in state["engines"]] == ["p0", "d1", "p2"]
        assert state["admission"]["max_admitted"] == 48
        last = state["supervisor"]["reloads"][-1]
        assert (last["applied"], last["trigger"]) == (True, "SIGHUP")
        assert "engine.first_token_timeout_s: 2.5 -> 3.0" in last["changes"]
        await trio.sleep(0.3)

        # 2. invalid, by narwhalctl --config, as `systemctl reload` runs it: the file
        # reaches the daemon, which refuses it with every problem; nothing changes.
        daemon.write_config({**added, "serving": {"max_connections": 0}, "bogus": True})
        code, out, err = text(await daemon.ctl("reload", via_config=True))
        reloads.append(trio.current_time())
        await daemon.message("RELOADING=1")
        await daemon.message("READY=1")  # after a rejected reload too
        assert code == 1
        assert err == (
            f"narwhalctl: reload of {daemon.config_path} rejected; the running configuration "
            "is kept\n"
            "  serving.max_connections: 0 must be at least 1\n"
            "  bogus: unknown key\n"
        )
        assert [e["problem"] for e in daemon.events("reload_error")] == [
            "serving.max_connections: 0 must be at least 1",
            "bogus: unknown key",
        ]
        assert (await daemon.state())["admission"]["max_admitted"] == 48
        await trio.sleep(0.3)

        # 3. valid, by narwhalctl: p0 removed while requests are resident on it.
        removed = {**added, "engines": added["engines"][1:]}
        daemon.write_config(removed)
        code, out, err = text(await daemon.ctl("reload"))
        reloads.append(trio.current_time())
        await daemon.message("RELOADING=1")
        await daemon.message("READY=1")
        assert (code, err) == (0, "")
        assert out.splitlines()[:2] == [
            f"reloaded {daemon.config_path}: 1 change(s) applied",
            '  engines[p0]: "present" -> "removed"',
        ]
        await trio.sleep(0.5)
        load.stop.set()
    assert load.failures == []
    assert len(load.spans) >= 20
    for instant in reloads:
        assert load.in_flight_at(instant) >= 1, "a reload happened with nothing in flight"
    assert [e["outcome"] for e in daemon.events("reload") if e["outcome"] != "started"] == [
        "applied",
        "rejected",
        "applied",
    ]
    assert daemon.events("engine_retired")[0]["engine"] == "p0"
    assert daemon.events("ctl") == []  # the rejected reload was logged by the reload, once
    assert sum(m.startswith("RELOADING=1") for m in daemon.messages) == 3
    assert sum(m.startswith("READY=1") for m in daemon.messages) == 4  # startup + 3
    daemon.signal(signal.SIGTERM)
    with trio.fail_after(10):
        assert await daemon.process.wait() == 0


async def test_sigterm_drains_in_flight_streams_refuses_new_work_and_notifies(
    nursery: trio.Nursery, launch: Launch
) -> None:
    fleet = await start_fleet(nursery, 2)
    doc = document(fleet, ["prefill", "decode"])
    doc["recovery"] = {**doc["recovery"], "shutdown_grace_s": 30.0}
    daemon = await launch(doc, env={"WATCHDOG_USEC": "200000"})
    assert daemon.messages[-1].split("\n")[0] == "READY=1"
    await daemon.message("WATCHDOG=1", within_s=2)
    # The stalled stream holds the drain open while the test sends new work.
    fleet[1].set_faults(stall_after_tokens=2, stall_s=6.0, leg="decode", count=1)
    async with open_sse(daemon.url, "/v1/completions", STREAM) as reader:
        assert await reader.event() is not None
        daemon.signal(signal.SIGTERM)
        stopping = await daemon.message("STOPPING=1")
        assert "STATUS=draining 1 request(s) for up to 30.0s" in stopping
        async with httpx.AsyncClient(timeout=10) as client:
            refused = await client.post(f"{daemon.url}/v1/completions", json=STREAM)
            health = await client.get(f"{daemon.url}/health")
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shutting_down"
        # Refused unread, so not reusable: the /health below takes a new connection.
        assert refused.headers["connection"] == "close"
        assert health.json() == {"status": "unavailable", "reason": "shutting down"}
        events = await read_all(reader)
    assert events[-1] == "[DONE]"
    with trio.fail_after(10):
        assert await daemon.process.wait() == 0
    assert not daemon.ctl_path.exists()
    assert [e["outcome"] for e in daemon.events("shutdown")] == ["draining", "drained"]
    assert sum(m == "WATCHDOG=1" for m in daemon.messages) >= 1


async def test_a_reload_that_meets_a_named_pipe_is_rejected_and_the_daemon_stays_operable(
    nursery: trio.Nursery, launch: Launch
) -> None:
    # The reload opened the FIFO to read it and waited for a writer, forever: later
    # SIGHUPs queued behind it, narwhalctl reload got no answer, and SIGTERM did not end
    # the process.
    fleet = await start_fleet(nursery, 2)
    doc = document(fleet, ["prefill", "decode"])
    daemon = await launch(doc)
    with fifo(daemon.directory / "key") as key:
        piped = {**doc, "engine": {"api_key_file": key}}
        problem = (
            f"engine.api_key_file: {json.dumps(key)}: cannot read file: it is a named pipe, "
            "not a regular file"
        )
        daemon.write_config(piped)
        daemon.signal(signal.SIGHUP)
        await daemon.message("RELOADING=1")
        await daemon.message("READY=1")
        code, _, err = text(await daemon.ctl("reload"))
        await daemon.message("RELOADING=1")
        await daemon.message("READY=1")
        assert code == 1
        assert err == (
            f"narwhalctl: reload of {daemon.config_path} rejected; the running configuration "
            f"is kept\n  {problem}\n"
        )
        daemon.write_config({**doc, "serving": {"admission": "open", "max_connections": 48}})
        daemon.signal(signal.SIGHUP)
        await daemon.message("RELOADING=1")
        await daemon.message("READY=1")
        assert (await daemon.state())["admission"]["max_admitted"] == 48
        daemon.write_config(piped)
        daemon.signal(signal.SIGHUP)
        daemon.signal(signal.SIGTERM)
        with trio.fail_after(10):
            assert await daemon.process.wait() == 0
    assert [e["problem"] for e in daemon.events("reload_error")][:2] == [problem, problem]


async def test_daemon_refuses_to_start_on_a_control_path_that_is_not_a_socket(
    launch: Launch, short_tmp: Path
) -> None:
    path = short_tmp / "precious"
    path.write_text("keep me")
    assert await refused_start(launch, path) == (
        f"narwhal: ctl.socket '{path}' exists and is not a socket; refusing to start"
    )
    assert path.read_text() == "keep me"


async def refused_start(launch: Launch, ctl_socket: Path) -> str:
    """The last line of a daemon that must refuse to start on this ctl.socket."""
    daemon = await launch(
        {"engines": [{"id": "a", "url": "http://127.0.0.1:9"}], "ctl": {"socket": str(ctl_socket)}},
        ready=False,
    )
    with trio.fail_after(20):
        assert await daemon.process.wait() == 1
    return daemon.log_path.read_text().splitlines()[-1]


async def test_a_control_socket_that_cannot_be_created_is_reported_as_ctl_socket(
    launch: Launch, short_tmp: Path
) -> None:
    blocker = short_tmp / "file"
    blocker.write_text("")
    path = blocker / "ctl.sock"
    # It used to read "cannot listen on 127.0.0.1:8000: [Errno 20] Not a directory".
    assert await refused_start(launch, path) == (
        f"narwhal: ctl.socket '{path}' cannot be checked: not a directory; refusing to start"
    )


def _small(fleet: Fleet) -> dict[str, Any]:
    """A daemon that needs 840 descriptors: 600 client connections, and a reserve of 240
    (two engines' serving pools of 16 and control pools of 4, and 200 for the rest)."""
    return document(
        fleet,
        ["prefill", "decode"],
        listen={"host": "127.0.0.1", "port": 0, "max_open_connections": 600},
        serving={"admission": "open", "max_connections": 16},
    )


def _open_files_limit(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open-file limit in /proc/<pid>/limits")


async def test_the_daemon_raises_a_low_soft_open_file_limit_to_what_it_needs(
    nursery: trio.Nursery, launch: Launch
) -> None:
    fleet = await start_fleet(nursery, 2)
    daemon = await launch(_small(fleet), open_files=(256, None))
    soft, hard = _open_files_limit(daemon.process.pid)
    assert soft == 840
    state = await daemon.state()
    assert state["connections"]["limit"] == state["connections"]["configured_limit"] == 600
    assert state["connections"]["open_files"] == {
        "soft": 840,
        "hard": hard,
        "needed": 840,
        "reserve": 240,
        "raised_from": 256,
        "note": None,
    }
    (event,) = daemon.events("open_file_limit")
    assert (event["level"], event["outcome"], event["previous_soft"], event["soft"]) == (
        "info",
        "raised",
        256,
        840,
    )


async def test_under_a_low_hard_open_file_limit_the_daemon_serves_fewer_connections(
    nursery: trio.Nursery, launch: Launch
) -> None:
    fleet = await start_fleet(nursery, 2)
    daemon = await launch(_small(fleet), open_files=(300, 300))
    state = await daemon.state()
    assert (state["connections"]["limit"], state["connections"]["configured_limit"]) == (60, 600)
    async with httpx.AsyncClient(timeout=10) as client:
        metrics = (await client.get(f"{daemon.admin_url}/metrics")).text
    assert "narwhal_client_connection_limit 60.0" in metrics
    assert "narwhal_client_connection_limit_configured 600.0" in metrics
    (event,) = daemon.events("open_file_limit")
    assert (event["level"], event["message"]) == (
        "warning",
        "listen.max_open_connections=600 does not fit the open-file limit (RLIMIT_NOFILE, "
        "hard 300): with 240 descriptors for engine pools, sockets and files, at most 60 "
        "client connections are kept open; raise the hard limit (LimitNOFILE= in the unit, "
        "ulimit -Hn) to 840 for all of them",
    )


async def test_the_daemon_refuses_to_start_without_descriptors_for_its_retained_requests(
    nursery: trio.Nursery, launch: Launch
) -> None:
    fleet = await start_fleet(nursery, 2)
    daemon = await launch(_small(fleet), open_files=(200, 200), ready=False)
    with trio.fail_after(20):
        assert await daemon.process.wait() == 1
    assert daemon.log_path.read_text().splitlines()[-1] == (
        "narwhal: the hard open-file limit (RLIMIT_NOFILE) is 200: with 240 descriptors for "
        "engine pools, sockets and files, it leaves room for 0 client connections, which "
        "must exceed serving.max_connections + serving.queue_capacity = 16; "
        "listen.max_open_connections=600 needs 840 in all: raise the hard limit "
        "(LimitNOFILE= in the unit, ulimit -Hn) to at least that"
    )
