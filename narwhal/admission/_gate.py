"""The global admission gate: at most serving.max_connections admitted requests, and a
bounded FIFO of requests waiting for a slot (docs/design.md#waiting-and-phase-concurrency).

trio's CapacityLimiter wakes waiters in arrival order, so the queue is FIFO without any
bookkeeping of our own; the capacity bound is checked before a request starts to wait.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio

from .._codes import ErrorCode
from .._errors import Refused


@attrs.frozen
class GateStatistics:
    admitted: int
    max_admitted: int
    waiting: int
    queue_capacity: int


class AdmissionGate:
    def __init__(self, *, max_admitted: int, queue_capacity: int) -> None:
        self._limiter = trio.CapacityLimiter(max_admitted)
        self.queue_capacity = queue_capacity
        # How a refusal names the limit: the setting, or this replica's part of it.
        self.limit = f"serving.max_connections={max_admitted}"

    def reconfigure(self, *, queue_capacity: int) -> None:
        self.queue_capacity = queue_capacity

    def limit_to(self, max_admitted: int, limit: str) -> None:
        """Admit at most `max_admitted` (at least 1) at once; `limit` names it for refusals.
        Requests holding slots above a lowered limit keep them; new ones wait."""
        self._limiter.total_tokens = max(1, max_admitted)
        self.limit = limit

    def statistics(self) -> GateStatistics:
        stats = self._limiter.statistics()
        return GateStatistics(
            admitted=stats.borrowed_tokens,
            max_admitted=int(stats.total_tokens),
            waiting=stats.tasks_waiting,
            queue_capacity=self.queue_capacity,
        )

    @asynccontextmanager
    async def admitted(
        self, *, queue_timeout_s: float, retry_after_s: float | None = None
    ) -> AsyncIterator[float]:
        """Hold an admission slot for the body; yields the time spent queued.

        Raises Refused when the gate is saturated and the queue is full (or disabled),
        or when the wait exceeds queue_timeout_s. The caller's deadline scope caps the
        wait too (docs/design.md#waiting-and-phase-concurrency: the queue timeout is capped by the
        request deadline).
        """
        borrower = object()
        started = trio.current_time()
        try:
            self._limiter.acquire_on_behalf_of_nowait(borrower)
        except trio.WouldBlock:
            stats = self._limiter.statistics()
            if stats.tasks_waiting >= self.queue_capacity:
                if self.queue_capacity == 0:
                    message = (
                        f"all {self.limit} admission slots are in use and queueing is off "
                        "(serving.queue_capacity=0)"
                    )
                else:
                    message = (
                        f"admission queue is full (serving.queue_capacity="
                        f"{self.queue_capacity} requests waiting)"
                    )
                raise Refused(
                    message, code=ErrorCode.QUEUE_FULL, retry_after_s=retry_after_s
                ) from None
            with trio.move_on_after(queue_timeout_s) as wait:
                await self._limiter.acquire_on_behalf_of(borrower)
            if wait.cancelled_caught:
                raise Refused(
                    f"waited serving.queue_timeout_s={queue_timeout_s} for admission",
                    code=ErrorCode.QUEUE_TIMEOUT,
                    retry_after_s=retry_after_s,
                ) from None
        try:
            yield trio.current_time() - started
        finally:
            self._limiter.release_on_behalf_of(borrower)
