"""The core holds the spec's global limits for every worker's requests at once, and a
worker that goes releases what it held."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
import trio

from narwhal._codes import ErrorCode
from narwhal._errors import Refused
from narwhal.config import load_config
from narwhal.plane import Channel, PeerGone
from narwhal.plane._core import DecisionCore
from narwhal.serving._context import ServingContext

Reply = Callable[[object], None]


def context(**serving: Any) -> ServingContext:
    if serving.get("queue_capacity"):
        serving = {
            "queue_timeout_s": 30,
            "prefill_concurrency": 1,
            "decode_concurrency": 1,
            "handoff_timeout_s": 30,
            **serving,
        }
    config = load_config(
        {
            "engines": [{"id": "e0", "url": "http://127.0.0.1:9000", "role": "both"}],
            "serving": serving,
        }
    )
    return ServingContext(config)


async def _nothing(name: str, payload: object, reply: Reply) -> object:
    raise AssertionError(name)


@asynccontextmanager
async def workers(core: DecisionCore, count: int) -> AsyncIterator[list[Channel]]:
    """`count` workers' channels to `core`, each over a socketpair."""
    async with trio.open_nursery() as nursery:
        channels = []
        for index in range(count):
            a, b = trio.socket.socketpair()
            on_call, on_note = core.handlers(index)
            core_end = Channel(
                trio.SocketStream(a), peer=f"worker {index}", on_call=on_call, on_note=on_note
            )
            worker_end = Channel(
                trio.SocketStream(b), peer="the core", on_call=_nothing, on_note=lambda n, p: None
            )
            await nursery.start(core_end.run)
            await nursery.start(worker_end.run)
            channels.append(worker_end)
        yield channels
        nursery.cancel_scope.cancel()


async def test_one_admission_queue_in_arrival_order_across_workers() -> None:
    ctx = context(max_connections=1, queue_capacity=2, queue_timeout_s=30)
    core = DecisionCore(ctx)
    order: list[str] = []
    with trio.fail_after(10):
        async with (
            workers(core, 3) as (one, two, three),
            trio.open_nursery() as nursery,
            AsyncExitStack() as held,
        ):
            await held.enter_async_context(one.hold("admitted", 30.0))
            assert ctx.gate.statistics().admitted == 1

            async def queued(name: str, channel: Channel) -> None:
                async with channel.hold("admitted", 30.0):
                    order.append(name)

            nursery.start_soon(queued, "two", two)
            await wait_waiting(ctx, 1)
            nursery.start_soon(queued, "three", three)
            await wait_waiting(ctx, 2)
            # The queue holds serving.queue_capacity=2 of any worker: the next is refused.
            with pytest.raises(Refused, match=r"^admission queue is full") as refused:
                await one.call("admitted", 30.0)
            assert refused.value.code == ErrorCode.QUEUE_FULL
            assert refused.value.retry_after_s == 1.0
            # Leaving the hold on worker one frees the slot: the queue goes in order.
        assert order == ["two", "three"]
        assert ctx.gate.statistics().admitted == 0


async def test_a_worker_that_dies_gives_back_its_slots_and_queue_places() -> None:
    ctx = context(max_connections=1, queue_capacity=1, queue_timeout_s=30)
    core = DecisionCore(ctx)
    with trio.fail_after(10):
        async with workers(core, 2) as (one, two), trio.open_nursery() as nursery:
            admitted = trio.Event()

            async def holder() -> None:
                async with one.hold("admitted", 30.0):
                    await trio.sleep_forever()  # past its worker's death, as a stuck worker

            async def waiter() -> None:
                async with two.hold("admitted", 30.0) as waited:
                    assert isinstance(waited, float)
                    admitted.set()

            nursery.start_soon(holder)
            await wait_admitted(ctx, 1)
            nursery.start_soon(waiter)
            await wait_waiting(ctx, 1)
            one.close("killed")  # the worker's process is gone
            await admitted.wait()
            assert ctx.gate.statistics().waiting == 0
            with pytest.raises(PeerGone):
                await one.call("admitted", 30.0)
            nursery.cancel_scope.cancel()


async def test_the_retained_ceiling_counts_every_workers_requests() -> None:
    ctx = context(max_connections=1, queue_capacity=1)
    core = DecisionCore(ctx)
    with trio.fail_after(10):
        async with workers(core, 2) as (one, two):
            async with (
                one.hold("retain", ("r1", "10.0.0.1")),
                two.hold("retain", ("r2", "10.0.0.2")),
            ):
                assert ctx.retained == 2
                with pytest.raises(Refused, match=r"= 2 requests$") as refused:
                    await one.call("retain", ("r3", "10.0.0.3"))
                assert refused.value.code == ErrorCode.RETAINED_CEILING
            await wait_for(lambda: ctx.retained == 0)
            assert ctx.unsized_offers == 1


async def test_a_clients_bodies_still_arriving_are_counted_across_workers() -> None:
    ctx = context(max_connections=8, max_pending_bodies_per_client=2)
    core = DecisionCore(ctx)
    with trio.fail_after(10):
        async with (
            workers(core, 2) as (one, two),
            one.hold("retain", ("a", "10.0.0.1")),
            two.hold("retain", ("b", "10.0.0.1")),
        ):
            with pytest.raises(Refused, match=r"^client 10.0.0.1 already has 2 "):
                await two.call("retain", ("c", "10.0.0.1"))
            # The first's body is read: the client may send another.
            one.note("body_read", "a")
            async with two.hold("retain", ("c", "10.0.0.1")):
                assert ctx.retained == 3
                assert ctx.pending_bodies.statistics().counted == 2


async def wait_waiting(ctx: ServingContext, count: int) -> None:
    await wait_for(lambda: ctx.gate.statistics().waiting == count)


async def wait_admitted(ctx: ServingContext, count: int) -> None:
    await wait_for(lambda: ctx.gate.statistics().admitted == count)


async def wait_for(condition: Callable[[], bool]) -> None:
    # The core answers over a socket: its tasks run in the same scheduler, so once every
    # task is blocked, what the core will do for the frames sent so far is done.
    while not condition():
        await trio.testing.wait_all_tasks_blocked()
        if not condition():
            await trio.sleep(0.001)
