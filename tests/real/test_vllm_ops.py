"""Operating Narwhal in front of real vLLM: profile and check the NIXL pair with the real
commands, serve it with predictive admission on the measured profile, and reload the real
daemon (SIGHUP) while it streams.

The commands and the daemon run as their own processes, as an operator runs them; the
daemon reports readiness over NOTIFY_SOCKET (tests/ops/daemon.py).
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from ..ops.daemon import Daemon, Launch, launcher
from ..support import open_sse, post_stream, wait_for
from .client import Throttle, counter, post_json, sse_events, unique_text
from .conftest import MODEL, aggregate_config, narwhal_in_front, pair_config
from .engines import RealFleet

# A small sweep: profiling is about the commands working on real engines, not about a
# precise fit (this shared 2-core box gives poor fits anyway, which warn, not fail).
PROFILE_ARGS = [
    "--fast",
    "--prefill-sizes",
    "16,256,1024",
    "--prefill-repeats",
    "2",
    "--decode-active",
    "1,4",
    "--decode-contexts",
    "128",
    # More gaps than --fast's 12: under load vLLM merges tokens into fewer events.
    "--decode-gaps",
    "24",
    "--handoff-sizes",
    "64,512",
    "--handoff-repeats",
    "1",
    "--quiet",
    # Not --fast's 120 s: the sweep takes 27 s on a quiet box, but one CI run's NIXL pull
    # outlasted the 30 s lease, and a transfer has stalled for 145 s (below).
    "--budget-s",
    "270",
]
# The lease (vLLM's 30 s KV lease on the producer) is not measured: 30 s of the tier's
# budget for a fact of the engine build, not of Narwhal.
CHECK_ARGS = ["--handoff-samples", "1", "--handoff-sizes", "64", "--no-lease", "--quiet"]
# Targets this box always meets: a handoff's first token takes 0.1-1 s here, but a NIXL
# transfer has stalled for 145 s (UCX on a loaded 2-core box), and admission then
# projects the next requests' first tokens from that lag.
SLO = {"ttft_s": 600.0, "tpot_s": 10.0}


async def run_command(module: str, *args: str) -> tuple[int, str, str]:
    result = await trio.run_process(
        [sys.executable, "-m", module, *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


async def test_profile_and_check_the_pair_then_serve_it_with_predictive_admission(
    vllm: RealFleet, tmp_path: Path
) -> None:
    store = tmp_path / "profiles.json"
    # No serving.handoff_timeout_s: narwhal-check warns (a handoff may outlive the 30 s
    # lease), but a cap below the lease expired handoffs that NIXL took 5-30 s to make on
    # this loaded box, and its check waits that long per pair.
    document = pair_config(
        vllm, profiles={"path": str(store)}, serving={"admission": "predictive"}, slo=SLO
    )
    config = tmp_path / "narwhal.json"
    config.write_text(json.dumps(document))

    with trio.fail_after(300):
        code, out, err = await run_command(
            "narwhal.cli.profile", "--config", str(config), *PROFILE_ARGS
        )
    assert code == 0, err
    assert out.startswith(f"wrote {store}: 2 engine profile(s), 2 handoff pair(s) in "), out
    profiles = json.loads(store.read_text())
    assert sorted(profiles["engines"]) == ["decode", "prefill"]

    with trio.fail_after(300):
        code, out, err = await run_command(
            "narwhal.cli.check", "--config", str(config), *CHECK_ARGS
        )
    # A row's notes may go on indented lines under it, and a count ends the table.
    # A pair's target is "prefill -> decode": (check, target, status) is read up to the
    # status word.
    statuses = ("PASS", "FAIL", "WARN", "SKIP")
    rows = []
    for line in out.splitlines()[1:]:
        words = line.split()
        if line[:1].strip() and any(word in statuses for word in words[2:]):
            at = next(i for i, word in enumerate(words) if i >= 2 and word in statuses)
            rows.append((words[0], " ".join(words[1:at]), words[at]))
    failed = [row for row in rows if row[2] == "FAIL"]
    assert (code, failed) == (0, []), out + err
    checked = {(row[0], row[1]) for row in rows}
    assert {
        ("handoff", "prefill -> decode"),
        ("tokenize", "decode"),
        ("metrics", "prefill"),
    } <= checked, out

    async with (
        narwhal_in_front(document) as stack,
        httpx.AsyncClient(timeout=120.0) as client,
    ):
        state = await stack.state()
        assert state["admission"]["mode"] == "predictive"
        assert state["admission"]["profiles_loaded"] is True
        body = {"model": MODEL, "prompt": unique_text(40), "max_tokens": 6, "ignore_eos": True}
        got = await post_json(client, f"{stack.url}/v1/completions", body)
        assert got["usage"]["completion_tokens"] == 6
        streamed = {
            **body,
            "prompt": unique_text(40),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        status, _, raw = await post_stream(client, f"{stack.url}/v1/completions", streamed)
        assert status == 200, raw
        assert sse_events(raw)[-1]["usage"]["completion_tokens"] == 6
        outcomes = (await stack.state())["requests"]["outcomes"]
    assert outcomes == {"ok": 2}, outcomes


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """AF_UNIX paths (the daemon's control and notify sockets) must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="nw-real-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def launch(short_tmp: Path) -> AsyncIterator[Launch]:
    async with launcher(short_tmp) as start:
        yield start


STREAM_TOKENS = 1000


async def stream(
    url: str, started: trio.MemorySendChannel[None], results: list[dict[str, Any]]
) -> None:
    """One streamed completion: says when its first event came, then reads it to the end."""
    body = {
        "model": MODEL,
        "prompt": unique_text(20),
        "max_tokens": STREAM_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with open_sse(url, "/v1/completions", body) as reader:
        assert reader.status == 200
        first = await reader.event()
        assert first is not None
        events = [first]
        await started.send(None)
        while (event := await reader.event()) is not None:
            events.append(event)
    assert events[-1] == "[DONE]", events[-3:]
    results.append(json.loads(events[-2])["usage"])


@contextmanager
def daemon_log_on_failure(daemon: Daemon) -> Iterator[None]:
    """The daemon's log goes with its temporary directory: printed when the block fails."""
    try:
        yield
    except BaseException:
        print(f"--- {daemon.log_path} ---\n{daemon.log_path.read_text()[-30000:]}", file=sys.stderr)
        raise


async def streaming_on(daemon: Daemon, engine: str) -> int:
    """The streams Narwhal is relaying from `engine` now. vLLM 0.32's
    `vllm:num_requests_running` is no witness: it read 0 for over a second while four
    streams ran on the engine (its scheduler statistics do not come with every step)."""
    in_flight = (await daemon.state())["requests"]["in_flight"]
    return sum(r["decode_engine"] == engine and r["stage"] == "streaming" for r in in_flight)


# A stream is staged at most this often: agg1 can finish all four before it is stopped
# (a stall of this process, seen in CI at load 14, or output already made and buffered).
STAGINGS = 3


async def reload_during_streams(
    vllm: RealFleet,
    daemon: Daemon,
    changed: dict[str, Any],
    clients: trio.Nursery,
    results: list[dict[str, Any]],
) -> bool:
    """Four streams start on agg1, and the reload that removes agg1 runs while agg1 (its
    core and its API server) is stopped with them on it. False (nothing reloaded) when
    the streams had all ended by the time agg1 was stopped: the staging missed, not the
    behaviour."""
    agg1 = vllm["agg1"]
    assert agg1.pid is not None
    send, receive = trio.open_memory_channel[None](4)
    with Throttle([agg1.engine_core_pid()]) as throttle:
        async with send:
            for _ in range(4):
                clients.start_soon(stream, daemon.url, send.clone(), results)
        await receive.receive()
        # A stream has begun on agg1, throttled so that it is likely still running (at
        # full speed agg1 makes it in a second or two). With agg1 stopped it stays there
        # through the reload, with whichever of the others reached agg1 before the stop
        # (the rest go to agg0 after it).
        with throttle.stopped(agg1.pid):
            if not await streaming_on(daemon, "agg1"):
                return False
            assert (await daemon.ctl("undrain", "agg0")).returncode == 0
            daemon.write_config(changed)
            daemon.signal(signal.SIGHUP)
            await daemon.message("RELOADING=1")
            await daemon.message("READY=1")
            state = await daemon.state()
            last = state["supervisor"]["reloads"][-1]
            assert (last["applied"], last["trigger"]) == (True, "SIGHUP"), last
            assert 'engines[agg1]: "present" -> "removed"' in last["changes"], last
            assert [e["id"] for e in state["engines"]] == ["agg0"]
            assert state["admission"]["max_admitted"] == 64
    return True


async def test_a_sighup_reload_removes_an_engine_while_streams_run_on_it(
    vllm: RealFleet, launch: Launch
) -> None:
    initial = aggregate_config(vllm)
    daemon = await launch(initial)
    changed = {
        **initial,
        "engines": [e for e in initial["engines"] if e["id"] == "agg0"],
        "serving": {**initial["serving"], "max_connections": 64},
    }
    results: list[dict[str, Any]] = []
    # Placement chooses freely between two idle engines: agg0 is drained while the
    # streams start, so that they run on agg1, the engine the reload removes.
    assert (await daemon.ctl("drain", "agg0")).returncode == 0
    with trio.fail_after(240), daemon_log_on_failure(daemon):
        async with trio.open_nursery() as clients:
            for _ in range(STAGINGS):
                if await reload_during_streams(vllm, daemon, changed, clients, results):
                    break
            else:
                pytest.fail(
                    f"agg1 finished every stream before it could be stopped, {STAGINGS} times"
                )
    # Nothing dropped: every stream ran to its end, on the removed engine too.
    assert [u["completion_tokens"] for u in results] == [STREAM_TOKENS] * len(results)
    assert len(results) >= 4
    # Retirement is checked on a timer after the engine's last stream ends, then logged.
    await wait_for(lambda: bool(daemon.events("engine_retired")), within_s=30)
    assert [e["engine"] for e in daemon.events("engine_retired")] == ["agg1"]

    # New work goes to agg0 only.
    agg1 = vllm["agg1"]
    before = await counter(agg1, "vllm:generation_tokens_total")
    async with httpx.AsyncClient(timeout=120.0) as client:
        for _ in range(2):
            got = await post_json(
                client,
                f"{daemon.url}/v1/completions",
                {"model": MODEL, "prompt": unique_text(8), "max_tokens": 4},
            )
            assert got["usage"]["completion_tokens"] == 4
    assert await counter(agg1, "vllm:generation_tokens_total") == before
    daemon.signal(signal.SIGTERM)
    with trio.fail_after(30):
        assert await daemon.process.wait() == 0
