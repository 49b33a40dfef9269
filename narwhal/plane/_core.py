"""The decision core's answers to its workers (docs/architecture.md#workers).

Owns
  `DecisionCore`: the handlers of every worker's channel, over the one `ServingContext`
  the core keeps. A limit the spec makes global is held here, by the same objects a
  single process uses, on behalf of the worker's request:
  - `retain`: one of the retained requests (serving.max_connections +
    serving.queue_capacity) and one of its client's bodies still arriving
    (serving.max_pending_bodies_per_client), refused as the single process refuses; the
    note `body_read` gives the body's back.
  - `admitted`: an admission slot (serving.max_connections), queued in arrival order
    across every worker, for at most serving.queue_timeout_s; answers the time queued.

Invariants
  What a worker holds is a hold on its channel (`Channel.hold`): released when the worker
  leaves the `async with`, and when the worker dies, by the cancellation of the handlers'
  tasks, whatever the worker was doing. So the counts here are exact at every moment but
  for the requests of a worker that has just died, which are released in the scheduler's
  next pass.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from ..serving._context import ServingContext
from ..serving._decisions import SATURATED_RETRY_AFTER_S, refusal_before_body
from ._channel import CallHandler, NoteHandler

Reply = Callable[[object], None]


class DecisionCore:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        # The body holds of requests still reading theirs, by worker and request key.
        self._bodies: dict[tuple[int, str], Callable[[], None]] = {}

    def handlers(self, worker: int) -> tuple[CallHandler, NoteHandler]:
        """The handlers of worker `worker`'s channel."""

        async def on_call(name: str, payload: object, reply: Reply) -> object:
            if name == "retain":
                assert isinstance(payload, tuple)
                key, address = payload
                await self._retain(worker, key, address, reply)
                return None
            if name == "admitted":
                assert isinstance(payload, float | int)
                await self._admitted(float(payload), reply)
                return None
            raise ValueError(f"the core has no call `{name}`")

        def on_note(name: str, payload: object) -> None:
            if name == "body_read":
                assert isinstance(payload, str)
                release = self._bodies.pop((worker, payload), None)
                if release is not None:
                    release()

        return on_call, on_note

    async def _retain(self, worker: int, key: str, address: str, reply: Reply) -> None:
        ctx = self.ctx
        refused = refusal_before_body(ctx, address)
        if refused is not None:
            raise refused[0]
        ctx.retained += 1
        body = self._bodies[(worker, key)] = ctx.pending_bodies.hold(address)
        try:
            reply(None)
            await trio.sleep_forever()
        finally:
            body()
            self._bodies.pop((worker, key), None)
            ctx.retained -= 1

    async def _admitted(self, queue_timeout_s: float, reply: Reply) -> None:
        async with self.ctx.gate.admitted(
            queue_timeout_s=queue_timeout_s, retry_after_s=SATURATED_RETRY_AFTER_S
        ) as waited:
            reply(waited)
            await trio.sleep_forever()
