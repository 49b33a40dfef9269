"""Real etcd clusters for the cluster tests: Debian's etcd-server (etcd 3.4), no fakes.

Each test gets its own cluster on free ports of 127.0.0.1 with its data under tmp_path;
teardown leaves no etcd process behind. Missing etcd fails the test (tools/test.sh
installs it), it never skips.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0
# Without the proxy handler urllib would send 127.0.0.1 through an http_proxy if one is set.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_ports(count: int) -> list[int]:
    """`count` distinct ports nothing listens on (now: a race with other programs is
    possible but harmless, etcd then fails to start and says so)."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


class EtcdCluster:
    """`size` etcd members on 127.0.0.1; `endpoints[i]` is member i's client url."""

    def __init__(self, root: Path, size: int) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            pytest.fail(
                "etcd is not on PATH: install Debian's etcd-server "
                "(apt-get install etcd-server), as tools/test.sh does"
            )
        self._binary = binary
        self._root = root
        ports = free_ports(2 * size)
        self.endpoints = [f"http://127.0.0.1:{ports[2 * i]}" for i in range(size)]
        self._peers = [f"http://127.0.0.1:{ports[2 * i + 1]}" for i in range(size)]
        self._procs: list[subprocess.Popen[bytes] | None] = [None] * size
        self._paused: set[int] = set()
        self._token = f"narwhal-test-{os.getpid()}-{ports[0]}"

    def _log(self, i: int) -> Path:
        return self._root / f"etcd-{i}.log"

    def start(self, i: int) -> None:
        """Start member i (again: after kill() it rejoins from its data dir)."""
        running = self._procs[i]
        assert running is None or running.poll() is not None, f"member {i} is running"
        initial = ",".join(f"m{j}={peer}" for j, peer in enumerate(self._peers))
        args = [
            self._binary,
            f"--name=m{i}",
            f"--data-dir={self._root / f'etcd-{i}'}",
            f"--listen-client-urls={self.endpoints[i]}",
            f"--advertise-client-urls={self.endpoints[i]}",
            f"--listen-peer-urls={self._peers[i]}",
            f"--initial-advertise-peer-urls={self._peers[i]}",
            f"--initial-cluster={initial}",
            "--initial-cluster-state=new",
            f"--initial-cluster-token={self._token}",
            # Forms (and re-elects) within a second; the minimum lease TTL follows the
            # election timeout (1.5x, rounded up): 1 s here.
            "--heartbeat-interval=50",
            "--election-timeout=500",
            # The replicas write their loads many times a second: keep the history short
            # (docs/operations.md#several-replicas).
            "--auto-compaction-mode=periodic",
            "--auto-compaction-retention=10m",
            "--logger=zap",
            "--log-outputs=stderr",
        ]
        with self._log(i).open("ab") as log:
            self._procs[i] = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )

    def start_all(self) -> None:
        for i in range(len(self.endpoints)):
            self.start(i)
        self.wait_ready()

    def wait_ready(self, indices: list[int] | None = None) -> None:
        """Until every member (of `indices`) answers its status and knows a leader."""
        indices = list(range(len(self.endpoints))) if indices is None else indices
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = set(indices)
        problems: dict[int, str] = {}
        while waiting:
            for i in sorted(waiting):
                proc = self._procs[i]
                if proc is None or proc.poll() is not None:
                    pytest.fail(f"etcd member {i} exited while starting:\n{self._tail(i)}")
                problem = self._status_problem(i)
                if problem is None:
                    waiting.discard(i)
                else:
                    problems[i] = problem
            if not waiting:
                return
            if time.monotonic() > deadline:
                tails = "\n".join(f"member {i}: {problems[i]}\n{self._tail(i)}" for i in waiting)
                pytest.fail(f"etcd not ready within {START_TIMEOUT_S}s:\n{tails}")
            time.sleep(0.05)

    def _status_problem(self, i: int) -> str | None:
        request = urllib.request.Request(
            f"{self.endpoints[i]}/v3/maintenance/status", data=b"{}", method="POST"
        )
        try:
            with _OPENER.open(request, timeout=2) as response:
                status = json.load(response)
        except (OSError, urllib.error.URLError, ValueError) as exc:
            return str(exc)
        return None if status.get("leader") else f"no leader yet: {status}"

    def _tail(self, i: int) -> str:
        try:
            return self._log(i).read_text(errors="replace")[-3000:]
        except OSError:
            return "(no log)"

    def kill(self, i: int) -> None:
        """SIGKILL member i (and reap it)."""
        proc = self._procs[i]
        assert proc is not None
        self._paused.discard(i)
        proc.kill()
        proc.wait()

    def pause(self, i: int) -> None:
        """SIGSTOP member i: its sockets stay open and nothing answers (a hung host)."""
        proc = self._procs[i]
        assert proc is not None
        proc.send_signal(signal.SIGSTOP)
        self._paused.add(i)

    def resume(self, i: int) -> None:
        proc = self._procs[i]
        assert proc is not None
        proc.send_signal(signal.SIGCONT)
        self._paused.discard(i)

    def pause_all(self) -> None:
        for i in range(len(self.endpoints)):
            self.pause(i)

    def resume_all(self) -> None:
        for i in sorted(self._paused):
            self.resume(i)

    def stop_all(self) -> None:
        """SIGTERM each member in turn (a stopped one is continued first, or it would
        never see the signal), SIGKILL one still there after STOP_TIMEOUT_S, and reap
        them all. In turn: a leader stopping hands its leadership to a live member first,
        and waits several seconds for one that is stopping too."""
        self.resume_all()
        for proc in self._procs:
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs = [None] * len(self._procs)


def _cluster(tmp_path: Path, size: int) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path, size)
    try:
        cluster.start_all()
        yield cluster
    finally:
        cluster.stop_all()


@pytest.fixture
def etcd_one(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A one-member etcd: fast to start, for what needs no failover."""
    yield from _cluster(tmp_path, 1)


@pytest.fixture
def etcd_three(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A three-member etcd cluster, for failover and outages."""
    yield from _cluster(tmp_path, 3)
