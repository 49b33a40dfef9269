"""The README's demo command works end to end (a short run of it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from unittest.mock import patch

import httpx
import trio

from narwhal.demo import Job, Result, _read_stream

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
