"""Fault campaigns against the simulator: every fault the simulator can inject, under
concurrent load, each followed by the full invariant check (invariants.py).

Each campaign is a bounded loop (a request count and a time bound). The `ci` variant
is the short one in the default run; the `long` variant repeats it at scale
(`pytest -m slow tests/reliability`).
"""

from __future__ import annotations

from typing import Any

import pytest

from .campaign import Campaign, StartCampaign

PREFILLS = (0, 1)
DECODES = (2, 3)


def scale(ci: int, long: int) -> list[Any]:
    return [pytest.param(ci, id="ci"), pytest.param(long, id="long", marks=pytest.mark.slow)]


def stream_share(c: Campaign, share: float = 0.7) -> bool:
    return c.rng.random() < share


def expect_some(c: Campaign, *labels: str) -> None:
    """The campaign really exercised what it is about (not just the happy path)."""
    seen = c.exchanges_by_label()
    for label in labels:
        assert any(key.startswith(label) for key in seen), (label, seen)


@pytest.mark.parametrize("count", scale(60, 1500))
async def test_engine_crash_mid_stream(start: StartCampaign, count: int) -> None:
    c = await start("crash", seed=1)

    async def plan(i: int) -> None:
        r = c.rng.random()
        if r < 0.3:
            c.fleet[c.rng.choice(DECODES)].set_faults(
                crash_after_tokens=c.rng.randint(0, 5), leg="decode", count=1
            )
        elif r < 0.45:
            c.fleet[c.rng.choice(PREFILLS)].set_faults(crash_after_tokens=0, leg="prefill", count=1)
        await c.send(i, c.body(stream=stream_share(c), max_tokens=10))

    await c.run(count, plan, concurrency=8, within_s=60)
    report = await c.check()
    report.assert_ok()
    assert c.total("crashes_injected") > 0
    expect_some(c, "ok", "stream_error:engine_connection_lost")


@pytest.mark.parametrize("count", scale(40, 600))
async def test_stalls_before_and_after_the_first_token(start: StartCampaign, count: int) -> None:
    c = await start("stall", seed=2, serving={"request_timeout_s": 2.5})

    async def plan(i: int) -> None:
        r = c.rng.random()
        if r < 0.2:
            c.fleet[c.rng.choice(DECODES)].set_faults(
                stall_before_first_token_s=30, leg="decode", count=1
            )
        elif r < 0.4:
            c.fleet[c.rng.choice(DECODES)].set_faults(
                stall_after_tokens=c.rng.randint(1, 4), leg="decode", count=1
            )
        elif r < 0.55:
            c.fleet[c.rng.choice(PREFILLS)].set_faults(
                stall_before_first_token_s=30, leg="prefill", count=1
            )
        await c.send(i, c.body(stream=stream_share(c), max_tokens=12))

    await c.run(count, plan, concurrency=8, within_s=60)
    # The plan's decode stalls reach a stream only when the next decode leg on that engine
    # is a streamed request's (3-4 of 40 runs' requests, and once none under load), so a
    # stream is sent into them until one is cut by the first-token timer.
    for index in range(count, count + 5):
        for decode in DECODES:
            c.fleet[decode].set_faults(stall_before_first_token_s=30, leg="decode", count=1)
        exchange = await c.send(index, c.body(stream=True, max_tokens=12))
        if c.label_of(exchange) == "stream_error:first_token_timeout":
            break
    for decode in DECODES:
        c.fleet[decode].clear_faults()
    report = await c.check()
    report.assert_ok()
    # Every stall is endless from the router's point of view: each one must have been
    # cut by a router timer, and the engine must have seen that as an abort.
    stalls = c.total("stalls_injected")
    assert stalls > 0
    assert c.total("aborted") == stalls, (c.total("aborted"), stalls)
    assert report.checks["aborts_seen"].notes["expected"] != 0
    expect_some(c, "ok", "stream_error:first_token_timeout", "stream_error:decode_stalled")


@pytest.mark.parametrize("count", scale(40, 600))
async def test_request_deadline_over_endless_streams(start: StartCampaign, count: int) -> None:
    """With no gap limit, only serving.request_timeout_s ends a stalled stream: it must
    end it on time, with an `expired` event, and the engine must see the abort."""
    c = await start(
        "deadline", seed=3, engine={"decode_read_timeout_s": 0}, serving={"request_timeout_s": 1.2}
    )

    async def plan(i: int) -> None:
        if c.rng.random() < 0.4:
            c.fleet[c.rng.choice(DECODES)].set_faults(
                stall_after_tokens=c.rng.randint(1, 3), leg="decode", count=1
            )
        await c.send(i, c.body(stream=stream_share(c, 0.8), max_tokens=12))

    await c.run(count, plan, concurrency=10, within_s=60)
    report = await c.check()
    report.assert_ok()
    assert c.total("aborted") == c.total("stalls_injected") > 0
    expired = [ex for ex in c.exchanges if c.label_of(ex).endswith(":expired")]
    assert expired
    assert all(1.2 <= ex.duration <= 1.2 + 1.0 for ex in expired), [e.duration for e in expired]


@pytest.mark.parametrize("count", scale(80, 1500))
async def test_5xx_storm(start: StartCampaign, count: int) -> None:
    """Bursts of engine errors on both phases: retried within max_attempts and the
    budget before output, mapped (never passed through) when they end the request."""
    c = await start("storm", seed=4, serving={"retry_budget": 20, "retry_replenish": 0.2})

    async def plan(i: int) -> None:
        if c.rng.random() < 0.4:
            index = c.rng.randrange(4)
            c.fleet[index].set_faults(
                error_status=c.rng.choice((500, 502, 503, 504, 429)),
                leg="prefill" if index in PREFILLS else "decode",
                count=c.rng.randint(1, 4),
            )
        await c.send(i, c.body(stream=stream_share(c), max_tokens=6))

    await c.run(count, plan, concurrency=8, within_s=60)
    report = await c.check()
    report.assert_ok()
    assert c.total("errors_injected") > 0
    state = await c.stack.state()
    assert state["retry_budget"]["spent_total"] > 0
    for ex in c.exchanges:
        label = c.label_of(ex)
        assert not label.startswith("error:internal"), label
        if ex.status is not None and ex.status >= 500:
            assert ex.status in (502, 503, 504), (ex.status, label)


@pytest.mark.parametrize("count", scale(40, 600))
async def test_slow_first_tokens(start: StartCampaign, count: int) -> None:
    c = await start("slowft", seed=5, serving={"request_timeout_s": 3.0})

    async def plan(i: int) -> None:
        if c.rng.random() < 0.5:
            index = c.rng.randrange(4)
            c.fleet[index].set_faults(
                slow_first_token_s=c.rng.uniform(0.1, 1.6),
                leg="prefill" if index in PREFILLS else "decode",
                count=1,
            )
        await c.send(i, c.body(stream=stream_share(c), max_tokens=6))

    await c.run(count, plan, concurrency=8, within_s=60)
    report = await c.check()
    report.assert_ok()
    assert c.total("slow_first_tokens_injected") > 0
    expect_some(c, "ok")


@pytest.mark.parametrize("count", scale(40, 600))
async def test_kv_lease_expiry_and_failed_pulls(start: StartCampaign, count: int) -> None:
    c = await start("lease", seed=6)

    async def plan(i: int) -> None:
        r = c.rng.random()
        if r < 0.3:
            c.fleet[c.rng.choice(PREFILLS)].set_faults(lease_s=0.0001, leg="prefill", count=1)
        elif r < 0.45:
            c.fleet[c.rng.choice(DECODES)].set_faults(kv_pull_fail=True, leg="decode", count=1)
        await c.send(i, c.body(stream=stream_share(c, 0.5), max_tokens=6))

    await c.run(count, plan, concurrency=6, within_s=60)
    report = await c.check()  # includes: every KV lease released or expired
    report.assert_ok()
    assert c.total("kv_pull_failed") > 0
    expect_some(c, "ok", "stream_error:engine_stream_error")


@pytest.mark.parametrize("count", scale(60, 1200))
async def test_connection_refused_while_engines_go_down_and_up(
    start: StartCampaign, count: int
) -> None:
    c = await start("down", seed=7)
    down: set[int] = set()

    async def plan(i: int) -> None:
        phase = i % 20
        if phase == 3:
            index = c.rng.randrange(4)
            down.add(index)
            await c.fleet[index].go_down()
        elif phase == 12:
            for index in sorted(down):
                await c.fleet[index].come_up()
            down.clear()
        await c.send(i, c.body(stream=stream_share(c), max_tokens=8))

    await c.run(count, plan, concurrency=8, within_s=60)
    for index in sorted(down):
        await c.fleet[index].come_up()
    report = await c.check()
    report.assert_ok()
    expect_some(c, "ok")


@pytest.mark.parametrize("count", scale(60, 1200))
async def test_engine_restarts_under_load(start: StartCampaign, count: int) -> None:
    c = await start("restart", seed=8)

    async def plan(i: int) -> None:
        if i % 15 == 7:
            await c.restart(c.rng.randrange(4))
        await c.send(i, c.body(stream=stream_share(c), max_tokens=16))

    await c.run(count, plan, concurrency=8, within_s=60)
    report = await c.check()
    report.assert_ok()
    assert c.retired
    expect_some(c, "ok")


@pytest.mark.parametrize("count", scale(60, 1200))
async def test_health_flapping(start: StartCampaign, count: int) -> None:
    c = await start("flap", seed=9)
    for index, period in enumerate((0.15, 0.2, 0.15, 0.25)):
        c.fleet[index].set_faults(health_flap_period_s=period)

    async def plan(i: int) -> None:
        await c.send(i, c.body(stream=stream_share(c), max_tokens=8))

    await c.run(count, plan, concurrency=6, within_s=60)
    for handle in c.fleet:
        handle.clear_faults()
    report = await c.check()
    report.assert_ok()
    assert c.total("health_failures_served") > 0
    expect_some(c, "ok")


@pytest.mark.parametrize("count", scale(12, 120))
async def test_slow_clients_are_cut_and_their_legs_aborted(
    start: StartCampaign, count: int
) -> None:
    """Clients that stop reading (a tiny receive window, no reads) beside clients that
    read: the router must drop each slow one within serving.client_stall_s of its
    writes blocking, cancel its decode leg, and keep serving the others."""
    c = await start(
        "slowclient",
        ["prefill", "decode"],
        seed=10,
        speed=1000.0,
        # KV leases last long enough for a decode that waits behind slow clients.
        sim={"timing": None, "lease_s": 30_000.0},
        serving={"client_stall_s": 0.2, "request_timeout_s": 15.0},
    )

    async def plan(i: int) -> None:
        if i % 3 == 0:
            body = {**c.body(stream=True, max_tokens=8000), "prompt": "a"}
            await c.send(
                i,
                body,
                label="slow abort:decode",
                read=False,
                receive_buffer=4096,
                hang_up=c.router_released("router let go"),
            )
        else:
            await c.send(i, c.body(stream=stream_share(c), max_tokens=8))

    await c.run(count, plan, concurrency=4, within_s=60)
    report = await c.check()
    report.assert_ok()
    slow = [ex for ex in c.exchanges if ex.label.startswith("slow")]
    assert slow
    assert all(ex.duration < 10.0 for ex in slow), [ex.duration for ex in slow]
    assert report.checks["aborts_seen"].notes["seen"] == len(slow)
    outcomes = report.checks["accounted"].notes["router_outcomes"]
    assert isinstance(outcomes, dict)
    assert outcomes["client_disconnected"] == len(slow)
    assert outcomes["ok"] == count - len(slow)
