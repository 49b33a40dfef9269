"""The generation endpoints of a simulated engine, and the routes both dialects share.

Owns: `Api`: ``POST /v1/completions`` and ``/v1/chat/completions`` from the request to an
accepted `_run.Run` (body, injected faults, admission against --max-num-queued-reqs), and
``GET /v1/models``.
Invariants: what a request means, how it is refused and what it is answered is the
engine's protocol's (`_protocol.EngineProtocol`); this module only orders the steps every
engine takes and keeps the engine's books (counters, outcomes, aborts).
Errors: a refusal is `ApiError`, answered in the protocol's envelope.
See: docs/design.md#engine-wire-facts (the section is cited where a detail matters).
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING

import trio

from ._core import CoreRequest, ReqState
from ._faults import FaultSpec, FaultSpecError, parse_faults
from ._http import HttpRequest, Responder
from ._metrics import count_streaming
from ._output import plan_choices
from ._protocol import ApiError, Plan
from ._records import ReqCtx
from ._run import Run

if TYPE_CHECKING:
    from ._engine import SimEngine

_DEFAULT_MESSAGES = {
    500: "Internal server error",
    503: "The server is overloaded or not ready yet.",
    429: "Too many requests",
}


class Api:
    def __init__(self, engine: SimEngine) -> None:
        self.e = engine
        self.protocol = engine.protocol

    async def generate(self, req: HttpRequest, resp: Responder, *, chat: bool) -> None:
        e, protocol = self.e, self.protocol
        xrid = req.headers.get("x-request-id") or uuid.uuid4().hex
        echo = protocol.echo_headers(xrid)
        try:
            plan = self._read(req, chat=chat)
        except ApiError as err:
            e.counters.rejected_invalid += 1
            protocol.fail_unstarted(req, err.message)
            if err.streamed:
                await resp.start_stream(200, headers=echo)
                event = protocol.error_event(
                    err.status, err.message, type_=err.type, param=err.param
                )
                await resp.end_stream(event + b"data: [DONE]\n\n")
                return
            await protocol.send_error(resp, err, echo)
            return
        leg = plan.leg.phase
        faults = e.request_faults(leg, plan.header_faults)
        armed = faults is not None and plan.header_faults is None
        if faults is not None and faults.error_status is not None:
            e.counters.errors_injected += 1
            e.record(
                None,
                request_id=xrid,
                phase=leg,
                outcome="error",
                status=faults.error_status,
                armed_fault=armed,
            )
            message = faults.error_message or _DEFAULT_MESSAGES.get(
                faults.error_status, f"Injected error {faults.error_status}"
            )
            protocol.fail_unstarted(req, message)
            await protocol.send_error(resp, ApiError(faults.error_status, message), echo)
            return
        limit = e.spec.max_num_queued
        if limit is not None:
            queued = len(e.core.running) + len(e.core.waiting) + len(e.core.pulling) + e.pending
            if queued + plan.n > limit:
                # n choices take n places.
                e.counters.rejected_queue_full += 1
                protocol.fail_unstarted(req, "queue full")
                e.record(
                    None, request_id=xrid, phase=leg, outcome="error", status=503, armed_fault=armed
                )
                await protocol.send_error(resp, protocol.queue_full(queued, limit), echo)
                return
        if protocol.never_answers(plan):
            await self._hang(xrid, leg)
            return
        ids, internal_id = protocol.request_ids(xrid, chat=chat, plan=plan)
        choices = plan_choices(
            e.spec.seed,
            plan.prompt_key,
            n=plan.n,
            max_tokens=plan.max_tokens,
            min_tokens=plan.min_tokens,
            stops=plan.stops,
            include_stop=plan.include_stop,
        )
        core = CoreRequest(
            rid=internal_id,
            prompt_tokens=plan.prompt_tokens,
            # The n choices decode in step; the sequence runs until the last one ends.
            max_tokens=max(c.limit for c in choices),
            hold_kv=plan.leg.hold_kv,
            remote_kv=plan.leg.remote is not None,
            token_ids=plan.prompt_ids or (),
        )
        ctx = ReqCtx(
            request_id=xrid,
            internal_id=core.rid,
            phase=leg,
            core=core,
            arrival=trio.current_time(),
            faults=faults,
            armed_fault=armed,
            remote=plan.leg.remote,
            stream=plan.stream,
        )
        ctx.lease_s = e.lease_for(faults)
        protocol.open_leg(ctx, plan)
        core.owner = ctx
        e.counters.requests[leg] += 1
        e.metrics.prompt_tokens += plan.prompt_tokens
        count_streaming(e.metrics.streaming_prompt_tokens, plan.stream, plan.prompt_tokens)
        run = Run(e, ctx, resp, plan, ids, echo, choices)
        outcome, status = "aborted", 499
        try:
            outcome, status = await run.serve()
        finally:
            if core.state is not ReqState.FINISHED:
                e.core.abort(core)
                e.wake_scheduler()
                if ctx.remote is not None and ctx in e.awaiting_kv:
                    protocol.abandon_kv(ctx.remote)
            e.awaiting_kv.discard(ctx)
            protocol.close_leg(ctx, outcome)
            if run.crashed:
                outcome = "error"
            if outcome == "aborted" and resp.started:
                status = resp.status
            run.settle(outcome, status)

    async def _hang(self, request_id: str, leg: str) -> None:
        """A request its engine never answers, held until its client leaves."""
        e = self.e
        e.counters.requests[leg] += 1
        e.pending += 1
        try:
            await trio.sleep_forever()
        finally:
            e.pending -= 1
            e.record(None, request_id=request_id, phase=leg, outcome="aborted", status=499)

    def _read(self, req: HttpRequest, *, chat: bool) -> Plan:
        try:
            body = json.loads(req.body)
        except ValueError as exc:
            raise ApiError(
                400, f"JSON decode error: {exc}", type_="Bad Request", param="body"
            ) from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", type_="Bad Request")
        header_faults: FaultSpec | None = None
        raw = req.headers.get("x-sim-fault")
        if raw:
            try:
                header_faults = parse_faults(json.loads(raw), per_request=True)
            except (ValueError, FaultSpecError) as exc:
                raise ApiError(400, f"invalid X-Sim-Fault header: {exc}") from None
        return self.protocol.read(body, chat=chat, header_faults=header_faults)

    async def models(self, req: HttpRequest, resp: Responder) -> None:
        card = self.protocol.model_card(int(self.e.started_at))
        await resp.send_json(200, {"object": "list", "data": [card]})
