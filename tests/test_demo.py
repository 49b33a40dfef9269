"""The README's demo command works end to end (a short run of it)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest.mock import patch

import httpx
import trio

from narwhal.demo import Job, Result, _read_stream

from .support import free_port

REPO = Path(__file__).resolve().parent.parent


def test_demo_runs_the_fleet_router_and_workload() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "narwhal.demo", "--requests", "12", "--speed", "4"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "outcomes          {'ok': 12}" in proc.stdout
    assert '"retained": 0' in proc.stdout  # the final /narwhal/state is printed
    assert proc.stderr == ""
    # The summary comes last, after the state document, where a person looks first.
    lines = proc.stdout.rstrip("\n").splitlines()
    assert lines[-6] == "== Narwhal demo: summary ==", lines[-8:]
    assert lines[-1].startswith("non-stream total  ")


def _demo_config(tmp_path: Path, **changes: object) -> tuple[dict[str, Any], Path]:
    document = json.loads((REPO / "conf" / "demo.json").read_text())
    # Free ports of its own, so that the test neither needs nor disturbs the default ones.
    engines = document["engines"]
    base = _free_run(len(engines))
    for offset, engine in enumerate(engines):
        engine["url"] = f"http://127.0.0.1:{base + offset}"
    # The demo's profile store names the default ports: admission prices nothing here.
    document["serving"]["admission"] = "open"
    document["listen"]["port"] = free_port()
    document.setdefault("admin", {})["port"] = free_port()
    # The copy's relative paths would be taken from its own folder: point them back.
    document["profiles"]["path"] = str(REPO / "runs" / "profiles.json")
    document["ctl"]["socket"] = str(tmp_path / "demo.sock")
    document.update(changes)
    config = tmp_path / "demo.json"
    config.write_text(json.dumps(document))
    return document, config


def _free_run(count: int) -> int:
    """The first of `count` consecutive free ports (the demo's fleet needs them)."""
    for _ in range(50):
        base = free_port()
        if base + count > 65535:
            continue
        probes = [socket.socket() for _ in range(count)]
        try:
            for offset, probe in enumerate(probes):
                probe.bind(("127.0.0.1", base + offset))
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
        return base
    raise AssertionError("no run of free ports")


def _run_demo(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "narwhal.demo", "--requests", "4", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )


def test_a_failed_demo_says_why(tmp_path: Path) -> None:
    document = json.loads((REPO / "conf" / "demo.json").read_text())
    # Too short for any request: every one fails, and the demo exits 1.
    _, config = _demo_config(
        tmp_path, serving={**document["serving"], "admission": "open", "request_timeout_s": 0.05}
    )
    proc = _run_demo(config)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.startswith("narwhal-demo: failed: 4 of 4 requests did not succeed: {"), (
        proc.stderr
    )
    assert proc.stderr.endswith("; see runs/demo/\n")
    assert proc.stdout.rstrip("\n").splitlines()[-6] == "== Narwhal demo: summary =="


def test_the_demo_starts_nothing_on_ports_another_process_holds(tmp_path: Path) -> None:
    document, config = _demo_config(tmp_path)
    port = document["admin"]["port"]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        proc = _run_demo(config)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.startswith(f"narwhal-demo: ports in use: 127.0.0.1:{port} (admin.port): ")
    assert proc.stdout == ""  # nothing started


def test_a_serve_that_ends_before_it_is_ready_is_reported_with_its_last_words(
    tmp_path: Path,
) -> None:
    # Predictive admission with the demo's profile store, which names other engine ports:
    # serve refuses to start.
    document = json.loads((REPO / "conf" / "demo.json").read_text())
    _, config = _demo_config(tmp_path, serving=document["serving"])
    proc = _run_demo(config)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.startswith(
        "narwhal-demo: failed: narwhal serve ended before it was ready; "
        "narwhal serve exited with 1 ("
    ), proc.stderr
    assert "run narwhal-profile" in proc.stderr  # serve's own last words


async def test_demo_tpot_counts_tokens_not_events() -> None:
    # Two events a second apart carrying 1 and 4 tokens, then the usage chunk: 4 token
    # intervals in the second, not one.
    stream = (
        b'data: {"choices":[{"text":" a"}]}\n\n'
        b'data: {"choices":[{"text":" b c d e"}]}\n\n'
        b'data: {"choices":[],"usage":{"completion_tokens":5}}\n\n'
        b"data: [DONE]\n\n"
    )
    clock = iter([10.0, 11.0])
    result = Result(Job("completions", prompt_words=1, max_tokens=5, stream=True, at_s=0.0))
    with patch.object(trio, "current_time", lambda: next(clock)):
        outcome = await _read_stream(httpx.Response(200, content=stream), 9.5, result)
    assert outcome == "ok"
    assert result.ttft_s == 0.5
    assert result.tpot_s == 0.25
