"""Narwhal with serving.workers = 2: worker processes serve the clients, the daemon
decides, against narwhal-sim on loopback."""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import h11
import httpx
import pytest
import trio

from narwhal.config import load_config
from narwhal.ctl import CtlRequest
from narwhal.plane._pool import WorkerPool
from narwhal.sim import Fleet, serve_fleet
from narwhal.supervisor import Operations, Supervisor
from narwhal.supervisor._plane import Plane

from ..serving.conftest import MODEL, Stack, StartStack, fleet_config
from ..support import FakeFileLimit, SseReader, open_sse


async def two_workers(
    start_stack: StartStack, speed: float = 20.0
) -> tuple[Stack, Plane, WorkerPool]:
    """Narwhal with serving.workers = 2 in front of a 1P1D sim fleet: the stack, the
    daemon's plane and its workers."""
    stack = await start_stack(serving={"workers": 2, "admission": "open"}, speed=speed)
    plane = stack.supervisor.plane
    assert plane is not None
    assert plane.pool is not None
    return stack, plane, plane.pool


async def test_two_workers_serve_streams_and_answers_and_the_core_counts_them(
    start_stack: StartStack,
) -> None:
    stack, plane, pool = await two_workers(start_stack)
    assert len({stats.pid for stats in pool.statistics()}) == 2
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:

            async def one(i: int) -> None:
                body = {"model": MODEL, "prompt": f"hello {i}", "max_tokens": 8}
                if i % 2:
                    async with client.stream(
                        "POST", "/v1/completions", json={**body, "stream": True}
                    ) as response:
                        assert response.status_code == 200
                        raw = (await response.aread()).decode()
                    assert raw.rstrip().endswith("data: [DONE]")
                else:
                    response = await client.post("/v1/completions", json=body)
                    assert response.status_code == 200, response.text
                    assert json.loads(response.text)["usage"]["completion_tokens"] == 8

            async with trio.open_nursery() as nursery:
                for i in range(20):
                    nursery.start_soon(one, i)
    ctx = stack.supervisor.ctx
    assert ctx is not None
    assert ctx.outcomes["ok"] == 20
    assert ctx.retained == 0
    assert plane.core.sessions == 0


async def test_metrics_and_state_are_the_core_s_with_every_workers_part(
    start_stack: StartStack,
) -> None:
    stack = await start_stack(serving={"workers": 2, "admission": "open"})
    with trio.fail_after(60):
        # One connection a request: each lands on whichever worker accepts it.
        for i in range(12):
            async with stack.client() as client:
                body = {"model": MODEL, "prompt": f"hi {i}", "max_tokens": 4}
                response = await client.post("/v1/completions", json=body)
                assert response.status_code == 200
        metrics = await stack.metrics()
        state = await stack.state()
    assert 'narwhal_requests_total{endpoint="completions",outcome="ok"} 12.0' in metrics
    assert state["requests"]["outcomes"] == {"ok": 12}
    workers = state["workers"]
    assert [w["index"] for w in workers] == [0, 1]
    assert all(w["starts"] == 1 and w["retained"] == 0 for w in workers)
    assert sum(sum(w["token_counts"].values()) for w in workers) == 12
    # The document's own counts are the workers' added up, as one process's would be.
    requests = state["requests"]
    assert sum(requests["token_counts"].values()) == 12
    assert requests["token_counts"] == dict(
        sum((Counter(w["token_counts"]) for w in workers), Counter())
    )
    assert sum(requests["context_checks"].values()) == 12
    # narwhalctl state shows the same document.
    ctl = await Operations(stack.supervisor)(CtlRequest("state"))
    assert isinstance(ctl, dict)
    assert [w["index"] for w in ctl["workers"]] == [0, 1]
    assert ctl["requests"]["token_counts"] == requests["token_counts"]


async def test_serving_max_connections_is_one_limit_across_workers(
    start_stack: StartStack,
) -> None:
    stack = await start_stack(
        serving={"workers": 2, "admission": "open", "max_connections": 1}, speed=1.0
    )
    with trio.fail_after(60):
        async with stack.client() as second:
            long = {"model": MODEL, "prompt": "a", "max_tokens": 400, "stream": True}
            async with open_sse(stack.url, "/v1/completions", long) as streaming:
                assert streaming.status == 200
                assert await streaming.event() is not None
                # Whichever worker takes the other connections, the one slot is held: the
                # retained ceiling is max_connections + queue_capacity = 1.
                for _ in range(4):
                    async with stack.client() as other:
                        short = {"model": MODEL, "prompt": "b", "max_tokens": 2}
                        refused = await other.post("/v1/completions", json=short)
                    assert refused.status_code == 429
                    assert refused.json()["error"]["code"] == "retained_ceiling"
            # The client left: its worker sees it go, and the core frees the slot.
            while stack.ctx.retained:  # noqa: ASYNC110  (another process's)
                await trio.sleep(0.01)
            done = await second.post(
                "/v1/completions", json={"model": MODEL, "prompt": "c", "max_tokens": 2}
            )
            assert done.status_code == 200
    state = await stack.state()
    assert state["requests"]["outcomes"]["retained_ceiling"] == 4


async def test_a_killed_worker_fails_only_its_requests_and_is_started_again(
    start_stack: StartStack,
) -> None:
    stack, plane, pool = await two_workers(start_stack, speed=1.0)
    body = {"model": MODEL, "prompt": "long", "max_tokens": 300, "stream": True}
    endings: dict[int, str] = {}
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            started = 0
            all_started = trio.Event()

            async def stream(i: int) -> None:
                nonlocal started
                async with open_sse(stack.url, "/v1/completions", body) as streaming:
                    assert streaming.status == 200
                    assert await streaming.event() is not None
                    started += 1
                    if started == 8:
                        all_started.set()
                    last = ""
                    try:
                        while (event := await streaming.event()) is not None:
                            last = event
                    except (h11.RemoteProtocolError, trio.BrokenResourceError):
                        last = "cut"
                    endings[i] = last

            for i in range(8):
                nursery.start_soon(stream, i)
            await all_started.wait()
            state = await stack.state()
            assert all("in_flight" in w for w in state["workers"]), state["workers"]
            serving = {w["index"]: len(w["in_flight"]) for w in state["workers"]}
            assert len(state["requests"]["in_flight"]) == 8  # every worker's, listed once
            victim = max(serving, key=lambda index: serving[index])
            pid = pool.statistics()[victim].pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
    cut = sorted(i for i, end in endings.items() if end == "cut")
    done = sorted(i for i, end in endings.items() if end == "[DONE]")
    assert len(cut) == serving[victim]  # the killed worker's streams, no other
    assert len(done) == 8 - serving[victim]
    ctx = stack.ctx
    with trio.fail_after(10):
        # The core releases a request's holds in its next scheduler passes, each in its
        # own task: the gate's slot may outlast the retained count by a pass.
        while ctx.retained or plane.core.sessions or ctx.gate.statistics().admitted:  # noqa: ASYNC110
            await trio.sleep(0.01)
        while pool.statistics()[victim].starts < 2:  # noqa: ASYNC110
            await trio.sleep(0.05)
    assert ctx.gate.statistics().admitted == 0
    assert all(engine.load.decode_active == 0 for engine in ctx.fleet)
    # Each request the worker took with it ends once, counted as such.
    assert ctx.outcomes["worker_lost"] == serving[victim]
    assert ctx.outcomes["ok"] == 8 - serving[victim]
    assert pool.statistics()[victim].last_exit == "it was killed by SIGKILL"
    async with stack.client() as client:
        again = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}
        )
    assert again.status_code == 200


async def test_a_shutdown_drains_the_workers_requests_and_stops_them(
    start_stack: StartStack,
) -> None:
    stack, _, pool = await two_workers(start_stack, speed=2.0)
    pids = [stats.pid for stats in pool.statistics()]
    body = {"model": MODEL, "prompt": "drain me", "max_tokens": 60, "stream": True}
    with trio.fail_after(60):
        async with open_sse(stack.url, "/v1/completions", body) as streaming:
            assert await streaming.event() is not None
            stack.supervisor.request_shutdown()
            events = [event async for event in _events(streaming)]
        # The stream in flight finished within the grace; new clients are refused.
        assert events[-1] == "[DONE]"
        await pool.wait_stopped()
    assert all(stats.pid is None for stats in pool.statistics())
    for pid in pids:
        assert pid is not None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def _events(reader: SseReader) -> AsyncIterator[str]:
    while (event := await reader.event()) is not None:
        yield event


async def test_workers_read_the_fleets_standing_from_the_cores_mirror(
    start_stack: StartStack,
) -> None:
    stack, _plane, _pool = await two_workers(start_stack)
    operations = Operations(stack.supervisor)
    # n > 1 needs an aggregate engine (role `both`): whether the fleet has one is the
    # core's, mirrored to the workers.
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 2}

    async def statuses(wanted: int) -> None:
        """Until four answers in a row, each on a new connection (either worker), are
        `wanted`."""
        in_a_row = 0
        while in_a_row < 4:
            async with stack.client() as client:
                answer = await client.post("/v1/completions", json=body)
            in_a_row = in_a_row + 1 if answer.status_code == wanted else 0
            await trio.sleep(0.005)

    with trio.fail_after(30):
        await statuses(400)
        assert await operations(CtlRequest("pin", "d1", "both"))
        await statuses(200)
        assert await operations(CtlRequest("pin", "d1", "decode"))
        await statuses(400)


async def test_workers_log_each_request_as_the_daemon_does_with_their_index(
    start_stack: StartStack, capfd: pytest.CaptureFixture[str]
) -> None:
    stack, _plane, pool = await two_workers(start_stack)
    with trio.fail_after(30):
        async with stack.client() as client:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
        lines: list[dict[str, object]] = []
        while not lines:
            # The workers share the daemon's stderr: one JSON object a line.
            _, err = capfd.readouterr()
            lines = [json.loads(text) for text in err.splitlines() if '"event": "request"' in text]
            await trio.sleep(0.01)
    (line,) = lines
    assert line["outcome"] == "ok"
    assert line["logger"] == "narwhal.request"
    assert line["worker"] in {stats.index for stats in pool.statistics()}
    assert (line["prefill_engine"], line["decode_engine"]) == ("p0", "d1")


async def test_a_reload_removing_an_engine_lets_its_streams_end_without_new_workers(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    fleet: Fleet = await nursery.start(partial(serve_fleet, engines=3, speed=1.0, model=MODEL))
    document = fleet_config(
        fleet, ["prefill", "decode", "decode"], serving={"workers": 2, "admission": "open"}
    )
    path = tmp_path / "narwhal.json"
    path.write_text(json.dumps(document))
    supervisor: Supervisor = await nursery.start(
        Supervisor(
            load_config(document), config_path=str(path), open_files=FakeFileLimit().limit()
        ).run
    )
    stack = Stack(fleet, supervisor, load_config(document))
    plane = supervisor.plane
    assert plane is not None
    assert plane.pool is not None
    body = {"model": MODEL, "prompt": "long", "max_tokens": 120, "stream": True}
    with trio.fail_after(60):
        async with open_sse(stack.url, "/v1/completions", body) as streaming:
            assert await streaming.event() is not None
            (running,) = (await stack.state())["requests"]["in_flight"]
            removed = running["decode_engine"]
            document["engines"] = [e for e in document["engines"] if e["id"] != removed]
            path.write_text(json.dumps(document))
            result = await supervisor.reload()
            assert result.applied, result.errors
            # The stream goes on to its end on the engine that left the configuration.
            last = ""
            while (event := await streaming.event()) is not None:
                last = event
            assert last == "[DONE]"
        # The same workers serve on, with the engines now configured.
        assert [stats.starts for stats in plane.pool.statistics()] == [1, 1]
        async with stack.client() as client:
            for _ in range(4):
                short = {"model": MODEL, "prompt": "b", "max_tokens": 2}
                answer = await client.post("/v1/completions", json=short)
                assert answer.status_code == 200, answer.text
        state = await stack.state()
    assert removed not in [engine["id"] for engine in state["engines"]]
    assert state["requests"]["outcomes"] == {"ok": 5}
