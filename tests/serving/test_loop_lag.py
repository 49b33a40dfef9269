"""The event-loop lag probe, and the process metrics beside it on /metrics."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry

from narwhal.config import load_config
from narwhal.serving import ServingContext
from narwhal.serving._app import App
from narwhal.serving._context import DEADLINE_ANSWERS_PER_PASS
from narwhal.serving._lag import EXCUSE_FLOOR_S, LAG_PROBE_S, LAG_WINDOW, LoopLag, Paced

from .conftest import StartStack


def lag_count(registry: CollectorRegistry) -> float | None:
    return registry.get_sample_value("narwhal_event_loop_lag_seconds_count")


async def test_the_probe_records_how_long_a_runnable_task_waits_for_the_loop(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = CollectorRegistry()
    lag = LoopLag(registry)
    async with trio.open_nursery() as nursery:
        await nursery.start(lag.run)
        await trio.sleep(4 * LAG_PROBE_S + 0.1)
        state = lag.state()
        assert (state.samples, state.lag_max_s) == (4, 0.0)  # an idle loop

        async def cpu_bound() -> None:
            # Holds the loop for 10 ms each time it runs, as a busy router's batch does.
            while True:
                autojump_clock.jump(0.01)
                await trio.lowlevel.checkpoint()

        nursery.start_soon(cpu_bound)
        await trio.sleep(40 * LAG_PROBE_S)
        state = lag.state()
        # Each probe waits out the neighbour's turns between its yield and its next run:
        # none, one or two of them, by where trio puts each in its batch.
        assert isinstance(state.samples, int)
        assert state.samples >= 40
        samples = list(lag._recent)[4:]
        assert all(s in (0.0, pytest.approx(0.01), pytest.approx(0.02)) for s in samples)
        assert max(samples) >= 0.01
        assert sum(samples) >= 0.01 * len(samples) / 4
        assert lag_count(registry) == state.samples
        nursery.cancel_scope.cancel()


async def test_one_long_stall_shows_in_how_late_the_probe_ran(
    autojump_clock: trio.testing.MockClock,
) -> None:
    lag = LoopLag(CollectorRegistry())
    async with trio.open_nursery() as nursery:
        await nursery.start(lag.run)
        await trio.sleep(1.1)  # between probes: the probe is asleep, not queued behind us
        start = trio.current_time()
        autojump_clock.jump(2.0)  # a synchronous 2 s stall: no yield, so no queue behind
        # The probe is due (its timer expired during the stall) but has not run yet:
        # its wait so far counts before it runs.
        assert lag.worst_since(start) == pytest.approx(1.85)  # due at +1.25
        await trio.sleep(1.0)
        assert lag.worst_since(start) == pytest.approx(1.85)
        assert lag.state().lag_max_s == 0.0  # the histogram measures the yield only
        assert lag.worst_since(trio.current_time()) == 0.0  # nothing since
        nursery.cancel_scope.cancel()


async def test_lag_excuses_a_deadline_at_a_tenth_of_it_and_never_below_the_floor() -> None:
    lag = LoopLag(CollectorRegistry())
    now = trio.current_time()
    lag.observe(0.3, at=now - 1.0)
    assert lag.excuse(2.0) == (
        "the router's own event loop lagged 0.3 s meanwhile (at least 10% of 2 s): router "
        "overload, not held against the engine"
    )
    assert lag.excuse(3.5) is None  # 0.3 s is under a tenth of it
    assert lag.excuse(0.5) is None  # the lag was seen before this deadline began
    assert lag.excuse(0.5, since=now - 2.0) is not None
    lag.observe(EXCUSE_FLOOR_S / 2, at=now)
    assert lag.excuse(0.02, since=now) is None  # a tenth, but under the floor


def test_the_state_keeps_only_the_last_minute_of_probes() -> None:
    registry = CollectorRegistry()
    lag = LoopLag(registry)
    lag.observe(3.0)
    for _ in range(LAG_WINDOW):
        lag.observe(0.001)
    lag.observe(-0.5)  # a clock read before the deadline is on time, not early
    state = lag.state()
    assert state.samples == LAG_WINDOW
    assert (state.lag_max_s, state.lag_p50_s) == (0.001, 0.001)
    assert lag_count(registry) == LAG_WINDOW + 2  # the histogram keeps everything
    assert LoopLag(CollectorRegistry()).state().lag_p99_s is None


async def test_a_running_router_reports_loop_lag_and_process_metrics(
    start_stack: StartStack,
) -> None:
    stack = await start_stack()
    async with httpx.AsyncClient() as client:
        metrics = (await client.get(f"{stack.admin_url}/metrics")).text
        state = (await client.get(f"{stack.admin_url}/narwhal/state")).json()
    assert "narwhal_event_loop_lag_seconds_bucket" in metrics
    assert "process_cpu_seconds_total" in metrics
    loop = state["supervisor"]["loop"]
    assert loop["probe_interval_s"] == LAG_PROBE_S
    assert isinstance(loop["samples"], int)
    assert set(loop) == {"probe_interval_s", "samples", "lag_p50_s", "lag_p99_s", "lag_max_s"}


class _Passes(trio.abc.Instrument):
    """Counts passes of the scheduler: each begins after a poll for I/O."""

    def __init__(self) -> None:
        self.count = 0

    def after_io_wait(self, timeout: float) -> None:
        self.count += 1


async def test_paced_work_takes_a_few_tasks_per_pass_of_the_scheduler() -> None:
    # Hundreds of deadlines that expire together make their tasks runnable in one pass,
    # which then polls no I/O until all of them have answered: paced, they answer a few
    # per pass, none in the pass it became ready in.
    passes = _Passes()
    paced = Paced(3)
    took: list[tuple[int, int]] = []  # (task, pass)
    ready = trio.Event()

    async def answer(index: int) -> None:
        await ready.wait()
        called = passes.count
        await paced.turn()
        assert passes.count > called
        took.append((index, passes.count))

    trio.lowlevel.add_instrument(passes)
    try:
        async with trio.open_nursery() as nursery:
            for index in range(10):
                nursery.start_soon(answer, index)
            await trio.testing.wait_all_tasks_blocked()
            ready.set()
    finally:
        trio.lowlevel.remove_instrument(passes)
    per_pass: dict[int, int] = {}
    for _, at in took:
        per_pass[at] = per_pass.get(at, 0) + 1
    assert sorted(per_pass.values(), reverse=True) == [3, 3, 3, 1]
    assert len(took) == 10


async def test_body_timeouts_that_expire_together_are_answered_a_few_per_pass(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # 48 requests whose bodies never come, all arrived at the same moment: their
    # serving.body_timeout_s expires in one pass, and their 408s used to go out in it too.
    ctx = ServingContext(
        load_config(
            {
                "engines": [
                    {"id": "p0", "url": "http://127.0.0.1:1", "role": "prefill"},
                    {"id": "d0", "url": "http://127.0.0.1:2", "role": "decode"},
                ],
                "serving": {"admission": "open", "body_timeout_s": 5.0},
            }
        )
    )
    app = App(ctx)
    passes = _Passes()
    answered: list[tuple[int, int]] = []  # (status, pass)

    async def never() -> MutableMapping[str, Any]:
        await trio.sleep_forever()
        raise AssertionError

    async def send(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answered.append((message["status"], passes.count))

    async def request(index: int) -> None:
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/completions",
            "headers": [(b"content-length", b"100")],
            "client": (f"192.0.2.{index}", 40000),
        }
        await app(scope, never, send)

    trio.lowlevel.add_instrument(passes)
    try:
        async with trio.open_nursery() as nursery:
            for index in range(48):
                nursery.start_soon(request, index)
    finally:
        trio.lowlevel.remove_instrument(passes)
    assert trio.current_time() == 5.0
    assert [status for status, _ in answered] == [408] * 48
    per_pass: dict[int, int] = {}
    for _, at in answered:
        per_pass[at] = per_pass.get(at, 0) + 1
    assert max(per_pass.values()) == DEADLINE_ANSWERS_PER_PASS
    assert len(per_pass) == 48 // DEADLINE_ANSWERS_PER_PASS
