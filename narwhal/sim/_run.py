"""One accepted generation request, from admission to its last byte.

Owns: `Run`: the wait for the pair's other leg and for remote KV, the relay of generated
tokens to the client as chunks or one body, the faults injected into it, and its outcome.
Invariants: the outcome is recorded once (`settle`), before the last bytes go out, so that
a client that has read the end of its response finds it in /_sim/state; what differs
between the dialects (the pair, the shapes, the failure events) is the engine's protocol's.
Errors: a failure after acceptance is answered by `fail` (an error event then [DONE] on a
stream, the protocol's `abort_error` otherwise); an injected crash drops the connection.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import trio

from ._core import ReqState
from ._faults import FaultSpec
from ._http import DropConnection, Responder
from ._output import Choice, usage
from ._protocol import Plan
from ._records import ReqCtx

if TYPE_CHECKING:
    from ._engine import SimEngine


class Run:
    def __init__(
        self,
        engine: SimEngine,
        ctx: ReqCtx,
        resp: Responder,
        plan: Plan,
        ids: list[str],
        echo: list[tuple[str, str]],
        choices: list[Choice],
    ) -> None:
        self.e = engine
        self.protocol = engine.protocol
        self.ctx = ctx
        self.resp = resp
        self.plan = plan
        self.echo = echo
        self.choices = choices
        self.sent = 0
        self.crashed = False
        self.settled = False
        self.created = int(time.time())
        remote = plan.leg.remote
        if remote is not None:
            remote.num_tokens = remote.num_tokens or plan.prompt_tokens
        self.shapes = self.protocol.shapes(plan, ids, self.created)

    # -- the request's life ---------------------------------------------------------------
    async def serve(self) -> tuple[str, int]:
        e, ctx, plan = self.e, self.ctx, self.plan
        core = ctx.core
        f = ctx.faults
        if ctx.remote is not None:
            # Heartbeats start as soon as the decoder has the request (docs/design.md#kv-lease).
            e.awaiting_kv.add(ctx)
        if f is not None and f.slow_first_token_s:
            e.counters.slow_first_tokens_injected += 1
            e.pending += 1
            try:
                await trio.sleep(f.slow_first_token_s)
            finally:
                e.pending -= 1
        if plan.stream and self.protocol.headers_before_first_token:
            await self.resp.start_stream(200, headers=self.echo)
        result = await self.protocol.wait_for_peer(self)
        if result is not None:
            return result
        e.core.add(core)
        e.wake_scheduler()
        if ctx.remote is not None:
            result = await self._await_kv()
            if result is not None:
                return result
        return await self._emit()

    async def _await_kv(self) -> tuple[str, int] | None:
        e, ctx = self.e, self.ctx
        core = ctx.core
        while core.state is ReqState.WAITING:
            await ctx.wait_change()
        if core.state is not ReqState.PULLING:
            return None
        reason = await e.kv.pull(ctx)
        e.awaiting_kv.discard(ctx)
        if reason is None:
            e.counters.kv_pulled += 1
            e.core.pull_done(core)
            e.wake_scheduler()
            return None
        e.counters.kv_pull_failed += 1
        e.metrics.failed_transfers += 1
        e.core.abort(core)
        e.wake_scheduler()
        outcome = "expired_kv" if ("expired" in reason or "unknown" in reason) else "error"
        return await self.fail(500, self.protocol.transfer_failure(ctx, reason), outcome)

    def settle(self, outcome: str, status: int) -> None:
        """Record the outcome once, before the last bytes go out, so that a client that
        has read the end of its response always finds its outcome in /_sim/state."""
        if self.settled:
            return
        self.settled = True
        ctx = self.ctx
        self.e.record(
            ctx,
            request_id=ctx.request_id,
            phase=ctx.phase,
            outcome=outcome,
            status=status,
            tokens=self.sent,
        )

    async def _send(self, data: bytes, *, last: bool = False) -> None:
        """Stream bytes, sending the 200 and headers first if no chunk went out yet."""
        if not self.resp.started:
            await self.resp.start_stream(200, headers=self.echo)
        if last:
            await self.resp.end_stream(data)
        else:
            await self.resp.send_chunk(data)

    async def fail(self, status: int, message: str, outcome: str = "error") -> tuple[str, int]:
        """The engine fails the request it accepted."""
        if self.plan.stream:
            out = self.protocol.stream_failure(self, status, message)
            self.settle(outcome, 200)
            await self._send(out + b"data: [DONE]\n\n", last=True)
            return outcome, 200
        err = self.protocol.abort_error(status, message)
        self.settle(outcome, status)
        await self.protocol.send_error(self.resp, err, self.echo)
        return outcome, status

    def role_chunks(self) -> bytes:
        """A chat stream's first events: one role chunk per choice."""
        so_far = usage(self.plan.prompt_tokens, 0) if self.plan.continuous_usage else None
        return b"".join(
            b"data: " + self.shapes.role_chunk(c.index, so_far).encode() + b"\n\n"
            for c in self.choices
        )

    async def _emit(self) -> tuple[str, int]:
        e, ctx, plan = self.e, self.ctx, self.plan
        core = ctx.core
        f = ctx.faults or FaultSpec()
        stall_first = f.stall_before_first_token_s
        stall_at = f.stall_after_tokens
        crash_at = f.crash_after_tokens
        error_at = f.sse_error_after_tokens
        stream = plan.stream
        max_tokens = core.max_tokens
        while True:
            state = core.state
            if state is ReqState.ABORTED:
                return await self.fail(500, "Internal server error")
            sent = self.sent
            if crash_at is not None and sent >= crash_at:
                e.counters.crashes_injected += 1
                self.crashed = True
                self.settle("error", self.resp.status if self.resp.started else 0)
                raise DropConnection()
            if error_at is not None and sent >= error_at:
                e.counters.sse_errors_injected += 1
                return await self.fail(500, "Internal server error")
            if stall_at is not None and sent >= stall_at:
                e.counters.stalls_injected += 1
                stall_at = None
                if f.stall_s is None:
                    await trio.sleep_forever()
                await trio.sleep(f.stall_s)
                continue
            generated = min(core.generated, max_tokens)
            if generated > sent and (
                generated - sent >= e.spec.stream_interval
                or sent == 0  # the first token goes out at once
                or generated == max_tokens
                or state is ReqState.FINISHED
                or not stream
            ):
                if sent == 0 and stall_first:
                    e.counters.stalls_injected += 1
                    await trio.sleep(stall_first)
                    stall_first = None
                    continue
                upto = generated
                for limit in (crash_at, error_at, stall_at):
                    if limit is not None and limit > sent:
                        upto = min(upto, limit)
                if stream:
                    await self._send_tokens(sent, upto)
                self.sent = upto
                continue
            if state is ReqState.FINISHED:
                return await self._finish()
            await ctx.wait_change()

    def _logprobs(self, choice: Choice, start: int, end: int) -> dict[str, Any] | None:
        """A choice's logprobs for tokens [start, end), in its engine's shape."""
        top = self.plan.top_logprobs
        if top is None:
            return None
        return self.shapes.logprobs(choice, start, end, top)

    async def _send_tokens(self, start: int, end: int) -> None:
        """Tokens [start, end) of the sequence: one chunk per choice still generating."""
        out = b""
        if start == 0 and self.plan.chat:
            out += self.role_chunks()
        continuous = self.plan.continuous_usage
        for choice in self.choices:
            first, last = min(start, choice.limit), min(end, choice.limit)
            if last <= first:
                continue
            logprobs = self._logprobs(choice, first, last)
            text = choice.piece(first, last)
            chunk = self.shapes.token_chunk(
                choice,
                text,
                logprobs,
                final=last >= choice.limit,
                usage_so_far=usage(self.plan.prompt_tokens, last) if continuous else None,
            )
            out += b"data: " + chunk.encode() + b"\n\n"
        await self._send(out)

    def usage(self) -> dict[str, Any]:
        """The request's usage so far: every choice's tokens sent, and the prompt's
        details where the engine reports them."""
        completion = sum(min(self.sent, c.limit) for c in self.choices)
        totals: dict[str, Any] = usage(self.plan.prompt_tokens, completion)
        plan = self.plan
        details = self.protocol.prompt_details(self.ctx, chat=plan.chat, stream=plan.stream)
        if details is not None:
            totals["prompt_tokens_details"] = details
        return totals

    async def _finish(self) -> tuple[str, int]:
        plan = self.plan
        if plan.stream:
            out = self.shapes.finish_chunks(self.choices).encode()
            if plan.include_usage:
                out += b"data: " + self.shapes.usage_chunk(self.usage()).encode() + b"\n\n"
            self.settle("ok", 200)
            await self._send(out + b"data: [DONE]\n\n", last=True)
            return "ok", 200
        body = self._body()
        self.settle("ok", 200)
        await self.resp.send(200, body, headers=self.echo)
        return "ok", 200

    def _body(self) -> bytes:
        parts = []
        for choice in self.choices:
            end = min(self.sent, choice.limit)
            logprobs = self._logprobs(choice, 0, end)
            parts.append((choice, choice.piece(0, end), logprobs))
        kv_params = self.protocol.kv_transfer_params(self.ctx)
        return self.shapes.body(parts, self.usage(), kv_params)
