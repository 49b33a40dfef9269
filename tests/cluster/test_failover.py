"""Replicas as real daemons (`narwhal serve` subprocesses) on a real three-member etcd:
what a `kill -9` of one costs, and how the daemon refuses to start without its cluster
(issue 34)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import h11
import httpx
import pytest
import trio

from narwhal.config import Config

from ..ops.conftest import short_tmp as short_tmp
from ..ops.daemon import Daemon, Launch, launcher
from ..ops.test_daemon import document, start_fleet
from ..serving.conftest import MODEL
from ..support import SseReader, open_sse
from .conftest import EtcdCluster

TTL_S = 2
MONITOR_S = 0.1
STREAM = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 60, "stream": True}


@pytest.fixture
async def launch(short_tmp: Path) -> AsyncIterator[Launch]:
    async with launcher(short_tmp) as start:
        yield start


async def _cluster(daemon: Daemon) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.get(f"{daemon.admin_url}/narwhal/state")
    section: dict[str, Any] = response.json()["cluster"]
    return section


async def _until(daemon: Daemon, test: Any, *, within_s: float) -> dict[str, Any]:
    with trio.fail_after(within_s):
        while True:
            section = await _cluster(daemon)
            if test(section):
                return section
            await trio.sleep(0.05)


async def _stream(reader: SseReader) -> tuple[int, str]:
    """Events read to the end, and how it ended: `[DONE]`, or why it stopped short."""
    events = 0
    try:
        while (event := await reader.event()) is not None:
            events += 1
            if event == "[DONE]":
                return events, "done"
    except (h11.RemoteProtocolError, trio.BrokenResourceError, OSError) as exc:
        return events, f"cut: {type(exc).__name__}"
    return events, "ended without [DONE]"


async def test_a_killed_replica_loses_only_its_own_requests_and_the_leadership_moves(
    nursery: trio.Nursery, launch: Launch, etcd_three: EtcdCluster
) -> None:
    fleet = await start_fleet(nursery, 2, speed=5.0)

    def config(name: str) -> dict[str, Any]:
        return document(
            fleet,
            ["prefill", "decode"],
            controller={"enabled": True, "monitor_interval_s": MONITOR_S},
            cluster={
                "endpoints": etcd_three.endpoints,
                "replica_id": name,
                "lease_ttl_s": TTL_S,
                "request_timeout_s": 0.5,
            },
        )

    replicas = {name: await launch(config(name)) for name in ("a", "b")}
    for daemon in replicas.values():
        await _until(daemon, lambda s: s["members"] == ["a", "b"], within_s=15)
    states = {name: await _cluster(daemon) for name, daemon in replicas.items()}
    whole = Config().serving.max_connections
    assert sorted(state["max_admitted"] for state in states.values()) == [whole // 2] * 2
    (leader,) = [name for name, state in states.items() if state["leading"]]
    (other,) = [name for name in replicas if name != leader]

    outcomes: dict[str, list[tuple[int, str]]] = {leader: [], other: []}
    first_events = trio.Semaphore(0)

    async def client(name: str) -> None:
        async with open_sse(replicas[name].url, "/v1/completions", STREAM) as reader:
            assert reader.status == 200
            first = await reader.event()
            assert first is not None
            first_events.release()
            events, end = await _stream(reader)
            outcomes[name].append((events + 1, end))

    with trio.fail_after(60):
        async with trio.open_nursery() as clients:
            for name in (leader, other) * 3:
                clients.start_soon(client, name)
            for _ in range(6):
                await first_events.acquire()
            # Every stream is under way on its replica: kill -9 the leader.
            replicas[leader].process.kill()
            killed_at = trio.current_time()
            state = await _until(replicas[other], lambda s: s["leading"], within_s=TTL_S + 10)
            moved_s = trio.current_time() - killed_at
    assert [end for _, end in outcomes[other]] == ["done"] * 3, outcomes
    assert all(end != "done" for _, end in outcomes[leader]), outcomes
    assert state["members"] == [other]
    # Within the lease TTL, one monitor interval, and this box's scheduling slack.
    assert moved_s < TTL_S + MONITOR_S + 1.5, moved_s
    print(f"leadership moved {moved_s:.2f} s after the kill")
    # The survivor takes the whole capacity back.
    assert state["max_admitted"] == whole


def test_without_its_cluster_the_daemon_does_not_start_and_says_why(tmp_path: Path) -> None:
    path = tmp_path / "narwhal.json"
    path.write_text(
        '{"engines": [{"id": "p0", "url": "http://127.0.0.1:9"}],'
        ' "listen": {"port": 0}, "admin": {"port": 0},'
        f' "ctl": {{"socket": "{tmp_path / "ctl.sock"}"}},'
        ' "serving": {"admission": "open"},'
        ' "cluster": {"endpoints": ["http://127.0.0.1:9"], "lease_ttl_s": 2,'
        ' "request_timeout_s": 0.5}}'
    )
    done = subprocess.run(
        [sys.executable, "-m", "narwhal", "serve", "--config", str(path)],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    last = done.stderr.decode().strip().splitlines()[-1]
    assert last.startswith("narwhal: cannot join the cluster within 3 s"), last
    assert "cluster.endpoints=['http://127.0.0.1:9']" in last


async def test_a_replica_with_worker_processes_takes_its_part_and_shares_its_facts(
    nursery: trio.Nursery, launch: Launch, etcd_three: EtcdCluster
) -> None:
    # serving.workers: the decision core holds the gate and the limiters the split sets,
    # and narwhalctl on it speaks for the cluster as on any replica.
    fleet = await start_fleet(nursery, 2, speed=5.0)

    def config(name: str, workers: int) -> dict[str, Any]:
        return document(
            fleet,
            ["prefill", "decode"],
            serving={"admission": "open", "workers": workers, "max_connections": 64},
            cluster={
                "endpoints": etcd_three.endpoints,
                "replica_id": name,
                "lease_ttl_s": TTL_S,
                "request_timeout_s": 0.5,
            },
        )

    a = await launch(config("a", 2))
    b = await launch(config("b", 1))
    for daemon in (a, b):
        await _until(daemon, lambda s: s["members"] == ["a", "b"], within_s=15)
    assert [(await _cluster(d))["max_admitted"] for d in (a, b)] == [32, 32]
    async with httpx.AsyncClient(timeout=30) as client:
        for daemon in (a, b):
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
            response = await client.post(f"{daemon.url}/v1/completions", json=body)
            assert response.status_code == 200, response.text
    done = await a.ctl("drain", "d1")
    assert done.returncode == 0, done.stderr
    with trio.fail_after(10):
        while True:
            if (await b.state())["recovery"]["engines"]["d1"]["drained"]:
                break
            await trio.sleep(0.05)
