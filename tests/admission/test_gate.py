from __future__ import annotations

import random

import pytest
import trio
import trio.testing

from narwhal._errors import Refused
from narwhal.admission import AdmissionGate, RetryBudget, backoff_ceiling, full_jitter
from narwhal.fleet import Share


async def test_gate_is_fifo_and_reports_wait(autojump_clock: trio.testing.MockClock) -> None:
    gate = AdmissionGate(max_admitted=1, queue_capacity=3)
    order: list[int] = []
    waits: list[float] = []

    async def request(i: int, hold: float) -> None:
        async with gate.admitted(queue_timeout_s=100) as waited:
            order.append(i)
            waits.append(waited)
            await trio.sleep(hold)

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(request, i, 10.0)
            await trio.testing.wait_all_tasks_blocked()
        assert gate.statistics().waiting == 3
    assert order == [0, 1, 2, 3]
    assert waits == [0, 10, 20, 30]


async def test_zero_capacity_rejects_at_saturation(autojump_clock: trio.testing.MockClock) -> None:
    gate = AdmissionGate(max_admitted=1, queue_capacity=0)
    async with gate.admitted(queue_timeout_s=0):
        with pytest.raises(Refused, match=r"serving.queue_capacity=0") as info:
            async with gate.admitted(queue_timeout_s=0):
                pass
        assert info.value.code == "queue_full"
        assert trio.current_time() == 0


async def test_full_queue_rejects(autojump_clock: trio.testing.MockClock) -> None:
    gate = AdmissionGate(max_admitted=1, queue_capacity=1)
    async with trio.open_nursery() as nursery, gate.admitted(queue_timeout_s=10):
        nursery.start_soon(_enter, gate, 50.0)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(Refused, match=r"^admission queue is full \(serving.queue_capacity=1"):
            async with gate.admitted(queue_timeout_s=10):
                pass


async def _enter(gate: AdmissionGate, queue_timeout_s: float) -> None:
    async with gate.admitted(queue_timeout_s=queue_timeout_s):
        pass


async def test_queue_timeout(autojump_clock: trio.testing.MockClock) -> None:
    gate = AdmissionGate(max_admitted=1, queue_capacity=1)
    async with gate.admitted(queue_timeout_s=1):
        with pytest.raises(Refused, match=r"serving.queue_timeout_s=2.5") as info:
            async with gate.admitted(queue_timeout_s=2.5):
                pass
        assert info.value.code == "queue_timeout"
        assert trio.current_time() == 2.5
    assert gate.statistics().waiting == 0


async def test_reconfigure_admits_waiters_in_place(autojump_clock: trio.testing.MockClock) -> None:
    gate = AdmissionGate(max_admitted=1, queue_capacity=5)
    admitted: list[float] = []

    async def one() -> None:
        async with gate.admitted(queue_timeout_s=100):
            admitted.append(trio.current_time())
            await trio.sleep(50)

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(one)
        await trio.testing.wait_all_tasks_blocked()
        assert len(admitted) == 1
        gate.limit_to(3, "serving.max_connections=3")
        await trio.testing.wait_all_tasks_blocked()
        assert len(admitted) == 3


def test_backoff_ceiling_doubles_up_to_the_cap() -> None:
    assert [backoff_ceiling(n, base_s=0.1, cap_s=0.5) for n in (1, 2, 3, 4)] == [0.1, 0.2, 0.4, 0.5]


def test_full_jitter_stays_within_the_ceiling() -> None:
    rng = random.Random(1)
    samples = [full_jitter(3, base_s=0.1, cap_s=1.0, rng=rng) for _ in range(2000)]
    assert 0 <= min(samples) < 0.02
    assert 0.38 < max(samples) <= 0.4
    assert 0.18 < sum(samples) / len(samples) < 0.22  # uniform on [0, 0.4]


def test_retry_budget_spends_and_replenishes() -> None:
    budget = RetryBudget(maximum=2, replenish=0.5)
    assert budget.try_spend()
    assert budget.try_spend()
    assert not budget.try_spend()
    assert (budget.spent_total, budget.denied_total) == (2, 1)
    budget.on_success()
    assert not budget.try_spend()  # 0.5 credit is not a whole retry
    budget.on_success()
    assert budget.try_spend()
    for _ in range(10):
        budget.on_success()
    assert budget.level == 2  # never above the maximum
    budget.reconfigure(maximum=1, replenish=0.1)
    assert budget.level == 1


async def test_a_refusal_names_the_limit_as_this_replica_holds_it() -> None:
    gate = AdmissionGate(max_admitted=1, queue_capacity=0)
    gate.limit_to(1, Share(index=1, count=2).describe("serving.max_connections", 3))
    async with gate.admitted(queue_timeout_s=1):
        with pytest.raises(Refused) as refused:
            async with gate.admitted(queue_timeout_s=1):
                pass
    assert str(refused.value).startswith(
        "all this replica's 1 of serving.max_connections=3 (2 replicas) admission slots are "
        "in use and queueing is off"
    )
    gate.limit_to(0, "none")  # a part that rounds to nothing still admits one at a time
    assert gate.statistics().max_admitted == 1
