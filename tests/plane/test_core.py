"""The core holds the spec's global limits for every worker's requests at once, and a
worker that goes releases what it held."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
import trio

from narwhal._codes import ErrorCode
from narwhal.config import Config, load_config
from narwhal.fleet import EngineState
from narwhal.placement import Placement
from narwhal.plane import Channel, PeerGone
from narwhal.plane._core import DecisionCore
from narwhal.plane._remote import RemoteDecisions
from narwhal.serving._context import ServingContext
from narwhal.serving._decisions import Admitted, BeforeBody
from narwhal.serving._request import ClientRequest, parse_body
from narwhal.serving._retry import Tried

Reply = Callable[[object], None]


def configured(**serving: Any) -> Config:
    if serving.get("queue_capacity"):
        serving = {
            "queue_timeout_s": 30,
            "prefill_concurrency": 1,
            "decode_concurrency": 1,
            "handoff_timeout_s": 30,
            **serving,
        }
    document: dict[str, Any] = {
        "engines": [
            {"id": "p0", "url": "http://127.0.0.1:9000", "role": "prefill"},
            {"id": "d0", "url": "http://127.0.0.1:9001", "role": "decode"},
        ],
        "serving": {"admission": "open", **serving},
    }
    return load_config(document)


async def _nothing(name: str, payload: object, reply: Reply) -> object:
    raise AssertionError(name)


class Worker:
    """A worker's side: its own context (as a worker process has) and its channel."""

    def __init__(self, config: Config, channel: Channel) -> None:
        self.ctx = ServingContext(config)
        self.config = config
        self.channel = channel

    def decisions(self) -> RemoteDecisions:
        return RemoteDecisions(self.ctx, self.config, self.channel, "completions")

    @asynccontextmanager
    async def request(self, address: str = "10.0.0.1") -> AsyncIterator[RemoteDecisions]:
        decisions = self.decisions()
        async with decisions.retained(address):
            yield decisions

    def admission(
        self, decisions: RemoteDecisions, tokens: int = 100
    ) -> AbstractAsyncContextManager[Admitted]:
        return decisions.admission(decisions_request(self), tokens, None)


@asynccontextmanager
async def workers(core: DecisionCore, count: int) -> AsyncIterator[list[Worker]]:
    """`count` workers' channels to `core`, each over a socketpair."""
    async with trio.open_nursery() as nursery:
        made = []
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
            made.append(Worker(core.ctx.config, worker_end))
        yield made
        nursery.cancel_scope.cancel()


async def test_one_admission_queue_in_arrival_order_across_workers() -> None:
    core = DecisionCore(ServingContext(configured(max_connections=1, queue_capacity=2)))
    gate = core.ctx.gate
    order: list[str] = []
    with trio.fail_after(10):
        async with (
            workers(core, 3) as (one, two, three),
            trio.open_nursery() as nursery,
            AsyncExitStack() as held,
        ):
            first = await held.enter_async_context(one.request())
            await held.enter_async_context(one.admission(first))
            assert gate.statistics().admitted == 1

            async def queued(name: str, worker: Worker) -> None:
                async with worker.request() as decisions, worker.admission(decisions):
                    order.append(name)

            nursery.start_soon(queued, "two", two)
            await wait_for(lambda: gate.statistics().waiting == 1)
            nursery.start_soon(queued, "three", three)
            await wait_for(lambda: gate.statistics().waiting == 2)
            # Leaving worker one's hold (first out) frees the slot: the queue goes in order.
        assert order == ["two", "three"]
        await wait_for(lambda: core.sessions == 0)
        assert gate.statistics().admitted == 0
        assert core.ctx.retained == 0


async def test_a_worker_that_dies_gives_back_its_slots_and_queue_places() -> None:
    core = DecisionCore(ServingContext(configured(max_connections=1, queue_capacity=1)))
    gate = core.ctx.gate
    with trio.fail_after(10):
        async with workers(core, 2) as (one, two), trio.open_nursery() as nursery:
            admitted = trio.Event()

            async def holder() -> None:
                async with one.request() as decisions, one.admission(decisions):
                    await trio.sleep_forever()  # past its worker's death, as a stuck worker

            async def waiter() -> None:
                async with two.request() as decisions, two.admission(decisions) as granted:
                    assert granted.waited_s > 0
                    admitted.set()

            nursery.start_soon(holder)
            await wait_for(lambda: gate.statistics().admitted == 1)
            nursery.start_soon(waiter)
            await wait_for(lambda: gate.statistics().waiting == 1)
            one.channel.close("killed")  # the worker's process is gone
            await admitted.wait()
            with pytest.raises(PeerGone):
                await one.decisions().standing()
            await wait_for(lambda: core.ctx.retained == 0)
            nursery.cancel_scope.cancel()


async def test_the_retained_ceiling_counts_every_workers_requests() -> None:
    core = DecisionCore(ServingContext(configured(max_connections=1, queue_capacity=1)))
    with trio.fail_after(10):
        async with workers(core, 2) as (one, two):
            async with one.request("10.0.0.1"), two.request("10.0.0.2"):
                assert core.ctx.retained == 2
                assert (one.ctx.retained, two.ctx.retained) == (1, 1)  # each its own too
                with pytest.raises(BeforeBody) as refused:
                    async with one.request("10.0.0.3"):
                        pass
                assert refused.value.error.code == ErrorCode.RETAINED_CEILING
                assert str(refused.value.error).endswith("= 2 requests")
                assert refused.value.keep_connection
            await wait_for(lambda: core.ctx.retained == 0)
            assert core.ctx.unsized_offers == 1


async def test_a_clients_bodies_still_arriving_are_counted_across_workers() -> None:
    core = DecisionCore(
        ServingContext(configured(max_connections=8, max_pending_bodies_per_client=2))
    )
    with trio.fail_after(10):
        async with workers(core, 2) as (one, two), one.request() as first, two.request():
            with pytest.raises(BeforeBody, match="already has 2 "):
                async with two.request():
                    pass
            first.body_read()  # its body is read: the client may send another
            async with two.request():
                assert core.ctx.retained == 3
                assert core.ctx.pending_bodies.statistics().counted == 2


async def test_phase_slots_are_the_engines_whichever_worker_asks() -> None:
    core = DecisionCore(ServingContext(configured(max_connections=4, prefill_concurrency=1)))
    prefill = core.ctx.fleet.get("p0")
    assert prefill is not None
    with trio.fail_after(10):
        async with workers(core, 2) as (one, two), trio.open_nursery() as nursery:
            got = trio.Event()
            async with one.request() as first:
                engine = one.ctx.fleet.get("p0")
                assert engine is not None
                async with first.phase_slot(engine, "prefill", 1000):
                    assert first.alone(engine) == 1  # the core's count of legs started
                    assert prefill.load.prefill_inflight == 1

                    async def second() -> None:
                        async with two.request() as other:
                            engine = two.ctx.fleet.get("p0")
                            assert engine is not None
                            async with other.phase_slot(engine, "prefill", 500):
                                got.set()

                    nursery.start_soon(second)
                    await wait_for(lambda: prefill.load.prefill_queued_tokens == 500)
                    assert not got.is_set()  # serving.prefill_concurrency=1, across workers
            await got.wait()
            await wait_for(lambda: core.sessions == 0)
            assert prefill.load.prefill_inflight == prefill.load.prefill_queued == 0


async def test_claims_a_dead_workers_legs_held_are_given_back() -> None:
    core = DecisionCore(ServingContext(configured()))
    decode = core.ctx.fleet.get("d0")
    assert decode is not None
    with trio.fail_after(10):
        async with workers(core, 1) as (one,):
            engine = one.ctx.fleet.get("d0")
            assert engine is not None
            async with one.request() as decisions:
                growth = decisions.generated(engine)
                growth.add(40)
                waiting = decisions.awaiting_first_token(engine, trio.current_time())
                await decisions.standing()  # a round trip: every note before it is in
                assert decode.load.decode_tokens == 0  # reported in steps of 64 tokens
                growth.add(30)
                await wait_for(lambda: decode.load.decode_tokens == 70)
                assert decode.load.statistics().awaiting_first_token == 1
                waiting.release()
                await wait_for(lambda: decode.load.statistics().awaiting_first_token == 0)
                growth.add(2)
                one.channel.close("killed")
            await wait_for(lambda: core.sessions == 0)
            assert decode.load.decode_tokens == 0


async def test_a_legs_growth_not_yet_reported_is_reported_before_its_release() -> None:
    core = DecisionCore(ServingContext(configured()))
    decode = core.ctx.fleet.get("d0")
    assert decode is not None
    with trio.fail_after(10):
        async with workers(core, 1) as (one,), one.request() as decisions:
            engine = one.ctx.fleet.get("d0")
            assert engine is not None
            growth = decisions.generated(engine)
            growth.add(10)
            kept = decisions.generated(engine)
            kept.add(64)
            growth.release()
            await decisions.standing()
            # Released whole: nothing of the first stays; the second is on the ledger.
            assert decode.load.decode_tokens == 64


class PerToken:
    """A prefill profile of 1 ms per token, the same on every engine."""

    def prefill_curve(self, engine_id: str) -> PerToken:
        return self

    def prefill_s(self, n: int) -> float:
        return 0.001 * n


async def test_a_workers_prompts_are_booked_in_the_cores_backlog() -> None:
    # A 1,000-token prompt: 1 s in a prefill slot; 0.4 s when a decode engine that holds
    # 600 of its tokens prefills it itself (cache.local_prefill_share).
    ctx = ServingContext(configured())
    ctx.profiles = PerToken()  # type: ignore[assignment]
    core = DecisionCore(ctx)
    prefill, decode = ctx.fleet.get("p0"), ctx.fleet.get("d0")
    assert prefill is not None
    assert decode is not None
    with trio.fail_after(10):
        async with workers(core, 1) as (one,), one.request() as decisions:
            engine = one.ctx.fleet.get("d0")
            assert engine is not None
            booked = decisions.local_prefill(engine, 1000, 600)
            await decisions.standing()  # a round trip: every note before it is in
            assert ctx.backlog.wait_s(decode, trio.current_time()) == pytest.approx(0.4, abs=0.05)
            booked.release()
            await wait_for(lambda: decode not in ctx.backlog.finish)
            engine = one.ctx.fleet.get("p0")
            assert engine is not None
            async with decisions.phase_slot(engine, "prefill", 1000):
                wait = ctx.backlog.wait_s(prefill, trio.current_time())
                assert wait == pytest.approx(1.0, abs=0.05)
            await wait_for(lambda: prefill not in ctx.backlog.finish)


async def wait_for(condition: Callable[[], bool]) -> None:
    """Until `condition` holds: the core answers over a socket, in this scheduler."""
    with trio.fail_after(5):
        while not condition():  # noqa: ASYNC110  (another task's sockets)
            await trio.sleep(0.001)


async def test_admission_grants_the_first_attempts_placement_claim_and_slot_at_once() -> None:
    core = DecisionCore(ServingContext(configured(max_connections=2)))
    prefill, decode = pair_of(core.ctx)
    with trio.fail_after(10):
        async with workers(core, 1) as (one,), one.request() as decisions:
            p0, d0 = pair_of(one.ctx)
            async with one.admission(decisions) as admitted:
                assert admitted.quotes == []  # serving.admission is open here
                # Held by the core before the worker's legs ask: the decode claim and
                # the prefill slot.
                assert decode.load.decode_pending == 1
                assert prefill.load.prefill_inflight == 1
                sent = one.channel.statistics().frames_sent
                placed = await decisions.place(decisions_request(one), 100, {}, Tried(), None)
                assert isinstance(placed.placement, Placement)
                assert (placed.placement.prefill, placed.placement.decode) == ("p0", "d0")
                async with decisions.decode_placed(d0, 100):
                    async with decisions.phase_slot(p0, "prefill", 100):
                        assert decisions.alone(p0) == 1
                    # Neither was asked for again: no frame went to the core.
                    assert one.channel.statistics().frames_sent == sent
                    await wait_for(lambda: prefill.load.prefill_inflight == 0)
                    assert decode.load.decode_pending == 1
                    async with decisions.phase_slot(d0, "decode", 100):  # asked: 1 frame
                        assert decode.load.decode_active == 1
                        assert decode.load.decode_pending == 0  # the slot took the claim
                await wait_for(lambda: decode.load.decode_active == 0)
                # A retry's placement is the core's to make again.
                again = await decisions.place(
                    decisions_request(one),
                    100,
                    {},
                    Tried(attempts=2, excluded=frozenset({"p0"})),
                    None,
                )
                assert isinstance(again.placement, Placement)
            await wait_for(lambda: core.ctx.gate.statistics().admitted == 0)
            assert decode.load.decode_pending == prefill.load.prefill_queued == 0


async def test_a_first_attempt_that_ends_before_its_legs_gives_back_its_slot() -> None:
    core = DecisionCore(ServingContext(configured(max_connections=2, prefill_concurrency=1)))
    prefill, decode = pair_of(core.ctx)
    with trio.fail_after(10):
        async with workers(core, 1) as (one,):
            d0 = one.ctx.fleet.get("d0")
            assert d0 is not None
            async with one.request() as decisions, one.admission(decisions):
                await decisions.place(decisions_request(one), 100, {}, Tried(), None)
                async with decisions.decode_placed(d0, 100):
                    pass  # as when the worker's engine is gone before the leg
                await wait_for(lambda: prefill.load.prefill_inflight == 0)
                assert decode.load.decode_pending == 0
                # The slot is free for the next request's admission.
                async with one.request() as other, one.admission(other):
                    assert prefill.load.prefill_inflight == 1


async def test_a_worker_that_dies_during_its_first_attempt_gives_back_what_the_core_held() -> None:
    core = DecisionCore(ServingContext(configured(max_connections=2)))
    prefill, decode = pair_of(core.ctx)
    with trio.fail_after(10):
        async with workers(core, 1) as (one,):
            async with one.request() as decisions, one.admission(decisions):
                assert prefill.load.prefill_inflight == decode.load.decode_pending == 1
                one.channel.close("killed")
            await wait_for(lambda: core.sessions == 0)
            assert prefill.load.prefill_inflight == decode.load.decode_pending == 0
            assert core.ctx.gate.statistics().admitted == 0
            assert core.ctx.retained == 0


def decisions_request(worker: Worker) -> ClientRequest:
    return parse_body(
        b'{"model": "m", "prompt": "hello", "max_tokens": 4}',
        kind="completions",
        request_id="r",
        models=worker.ctx.models,
        arrival=trio.current_time(),
        deadline=trio.current_time() + 60,
    )


def pair_of(ctx: ServingContext) -> tuple[EngineState, EngineState]:
    """The context's own instances of the prefill and the decode engine."""
    prefill, decode = ctx.fleet.get("p0"), ctx.fleet.get("d0")
    assert prefill is not None
    assert decode is not None
    return prefill, decode
