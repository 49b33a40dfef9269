"""One completion request, from ingress to the last byte (docs/design.md#retries,
#streaming-failures, #placement, #deadlines).

Each request is one trio nursery inside one deadline scope (serving.request_timeout_s,
from ingress through tokenisation, queueing, backoff, engine work and client writes).
Inside it run the request itself and a watcher that cancels everything the moment the
client disconnects, which closes the engine connections so the engines abort too.

Engine legs have their own timers:
- prefill: serving.prefill_timeout_s around the prefill HTTP request;
- handoff: serving.handoff_timeout_s from the start of the prefill request until the
  decode request is sent, so a decode never runs against KV blocks the producer may
  have released; an expired handoff is retried with a fresh prefill;
- first token: engine.first_token_timeout_s from before the decode stream opens until
  the first generated token;
- decode gap: engine.decode_read_timeout_s between transport chunks after that.
One CancelScope per stream carries the first-token and gap timers by moving its
deadline, which is cheaper than a scope per chunk.

What the client sees: before the response starts, failures are HTTP errors with an
OpenAI-style envelope. A streaming response commits 200 just before the decode stream
opens; from then on any failure is a terminal `data: {"error": ...}` event with no
`[DONE]`, but for a client error before the stream's first bytes (an engine refusing
the request inside its stream, as vLLM does a streamed request's validation error),
which is still the HTTP error it is (`ClientChannel`). A leg's failure is named by its
kind here and answered as `_failure.FAILURE_POLICY` says; whether it is retried is
`_retry.next_attempt`'s to say: only before that commit (or, for non-streaming
requests, before the body is sent), only for transient failures, within
serving.max_attempts, the retry budget and the request's deadline.

Requests that only one engine can serve well (`ClientRequest.one_engine`: n > 1,
prompt_logprobs) go to an aggregate engine; without one, a vLLM pair's decode engine
alone serves prompt_logprobs (it computes the prompt either way), and n > 1 is refused.
On a vLLM fleet, what the decode engine would refuse though its prefill engine would not
is refused before any leg (`decode_refusal`).
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, nullcontext
from typing import Literal, Protocol

import trio

from .._codes import ErrorCode
from .._errors import (
    ENGINE_AUTH_STATUSES,
    BadRequest,
    EngineFailed,
    Expired,
    NarwhalError,
    NotFound,
    Refused,
    RequestTimeout,
    Unavailable,
)
from .._values import json_int
from ..admission import (
    PathQuote,
    Priced,
    ProfileSource,
    judge,
    placement_policy,
    price_fleet,
    quote_paths,
    shared_overhead_s,
    ttft_budget_s,
)
from ..config import Config
from ..engines import (
    ENDPOINT_PATHS,
    SGLANG_DEFAULT_BOOTSTRAP_PORT,
    ConnectError,
    Json,
    PoolTimeout,
    RemoteProtocolError,
    Response,
    ResponseTooLarge,
    SseEvent,
    SseKind,
    SseScanner,
    parse_error_body,
)
from ..engines._assemble import ResponseAssembler, streamed_leg_body, unassemblable_reason
from ..engines._dialects import (
    TOKEN_ID_BYTES,
    EndpointKind,
    TokenizeScan,
    chat_tokenize_refused,
    encode,
    new_bootstrap_room,
    sglang_pd_body,
    tokenize_body,
    usage_tokens,
    vllm_decode_body,
    vllm_kv_params,
    vllm_prefill_body,
    with_usage_report,
)
from ..engines._sse import SseOverflow
from ..fleet import Claim, EngineState, EngineView, key_refused, model_refused, names_model
from ..placement import DEFAULT_POLICY, NoPlacement, Placement, Policy, choose
from ._client import (
    ClientChannel,
    ClientGone,
    Receive,
    Send,
    content_length,
    discard_body,
    has_body,
    read_body,
    watch_disconnect,
)
from ._context import (
    DEGRADED_PUBLIC,
    DecodeGaps,
    DemandEvent,
    RequestRecord,
    ServingContext,
    log,
)
from ._context_check import check_context, output_bound, widest_context
from ._failure import FailureKind, classify_answer, classify_event, leg_failure
from ._per_client import client_key
from ._request import (
    ClientRequest,
    decode_refusal,
    parse_body,
    request_id_from_header,
    truncated_prompt,
)
from ._retry import GiveUp, Reason, Tried, next_attempt

LegPhase = Literal["prefill", "decode", "aggregate"]
_ERROR_BODY_LIMIT = 65536
# Retry-After of a refusal at saturation (the retained ceiling, a full or timed-out
# admission queue): slots free as requests finish, which no prediction here prices.
_SATURATED_RETRY_AFTER_S = 1.0
# Gaps kept per stream for the decode correction; a window this size is plenty for a
# median, and it bounds the memory of very long generations.
_MAX_GAPS = 256


def _client_address(scope: dict[str, object]) -> str:
    """The address the client's limits count it under (`client_key`)."""
    peer = scope.get("client")
    if isinstance(peer, list | tuple) and peer and isinstance(peer[0], str):
        return client_key(peer[0])
    return ""


def _body_timeout(limit: str, value: float) -> RequestTimeout:
    return RequestTimeout(f"request body not complete within {limit}={value}")


class _HandoffExpired(Exception):
    pass


class _KvGrowth:
    """A streamed decode leg's generated tokens, counted into its engine's resident KV
    (`decode_tokens`, the prompt's share being held by the phase slot) while the leg
    runs: pricing reads it as the KV the engine has committed."""

    __slots__ = ("cap", "ctx", "engine", "estimate", "generated", "reported")

    def __init__(self, ctx: ServingContext, engine: EngineState, cap: int | None) -> None:
        self.ctx = ctx
        self.engine = engine
        self.cap = math.inf if cap is None else cap  # the request's output bound
        self.generated = engine.load.generated()
        self.estimate = 0.0
        self.reported: int | None = None  # usage.completion_tokens, once the engine sent it

    @property
    def tokens(self) -> int:
        return self.generated.tokens

    def add(self, events: int) -> None:
        """`events` more token events: each carries the engine's recent tokens per event
        (`EngineState.tokens_per_event`), not one token."""
        self.estimate = min(self.cap, self.estimate + events * self.engine.tokens_per_event)
        grown = int(self.estimate) - self.generated.tokens
        if grown > 0:
            self.generated.add(grown)

    def __enter__(self) -> _KvGrowth:
        return self

    def __exit__(self, *exc: object) -> None:
        self.generated.release()
        # The engine's report, when it sent one, is the KV turnover.
        freed = self.generated.tokens if self.reported is None else self.reported
        self.ctx.kv_freed(self.engine, freed, trio.current_time())


class _GapLoad:
    """The engine's load over a stream's counted gaps, for `DecodeGaps`, and what else
    went into those gaps.

    A gap is the time between two reads shared by the tokens the second brought, so a
    client write that blocked the relay (or the router's loop, busy elsewhere) is spread
    over the tokens that piled up meanwhile, which is their rate, except where no more
    came: a stall that outlasted the stream inflates the gaps of the tokens the engine
    made during it, at most as many as fit in the stall. A stream whose longest write
    spans a quarter of its gaps' time or more is left out of latency residuals (`alone`);
    below that, the inflated gaps are too few to carry the median. (Dropping streams at
    any write longer than one gap would drop most of a busy router's, whose writes wait
    for the loop.) A prefill leg on the engine meanwhile (a `both` engine, or one the
    controller just moved) puts prefill chunks into the decode steps, which the decode
    profile does not model."""

    __slots__ = ("active", "kv_tokens", "longest_write_s", "max_active", "max_kv", "prefill")

    def __init__(self) -> None:
        self.active = 0
        self.kv_tokens = 0
        self.max_active = 0
        self.max_kv = 0
        self.prefill = False
        self.longest_write_s = 0.0

    def add(self, engine: EngineState, gaps: int) -> None:
        if gaps <= 0:
            return
        load = engine.load
        active, kv = load.decode_active, load.decode_tokens
        self.active += gaps * active
        self.kv_tokens += gaps * kv
        self.max_active = max(self.max_active, active)
        self.max_kv = max(self.max_kv, kv)
        self.prefill = self.prefill or load.prefill_inflight > 0

    def summary(self, gaps: list[float]) -> DecodeGaps | None:
        """The stream's gaps and their load, summarised once for the serving signals and
        the leg observer; None without any gaps."""
        if not gaps:
            return None
        ordered = sorted(gaps)
        count = len(ordered)
        # Gaps are differences of readings of a clock that never goes back, so none is
        # negative: those that are not positive are the zeros, first in order.
        zeros = bisect.bisect_right(ordered, 0.0)
        return DecodeGaps(
            count=count,
            median_s=_sorted_median(ordered, 0),
            positive=count - zeros,
            positive_median_s=_sorted_median(ordered, zeros) if zeros < count else 0.0,
            mean_active=self.active / count,
            mean_kv_tokens=self.kv_tokens / count,
            max_active=self.max_active,
            max_kv_tokens=self.max_kv,
        )

    def alone(self, summary: DecodeGaps) -> bool:
        """Whether the gaps were the engine's decoding alone, for a latency residual."""
        return not self.prefill and self.longest_write_s * 4 < summary.median_s * summary.count


def _sorted_median(ordered: list[float], start: int) -> float:
    """`statistics.median(ordered[start:])` of a sorted list, without copying it."""
    size = len(ordered) - start
    middle = start + size // 2
    if size % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


class Flow:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    # ------------------------------------------------------------------ ingress

    async def handle(
        self,
        endpoint: Literal["completions", "chat"],
        scope: dict[str, object],
        receive: Receive,
        send: Send,
        *,
        refusal: NarwhalError | None = None,
    ) -> None:
        """Serve one completion request; `refusal`: the app refused it already (its API
        key), answered and counted here like the other refusals before the body."""
        ctx = self.ctx
        config = ctx.config  # one snapshot per request: a reload applies to new requests
        arrival = trio.current_time()
        headers = scope.get("headers", [])
        assert isinstance(headers, list)
        request_id = request_id_from_header(_header(headers, b"x-request-id"))
        client = ClientChannel(
            send,
            request_id,
            close_connection=has_body(headers),
            engine_details=config.serving.expose_engine_details,
        )
        if refusal is not None:
            # Before anything else: a client without the key learns nothing of the state,
            # and gets nothing more of the router (its body unread, its connection closed).
            await self._refuse(client, endpoint, refusal, receive, headers, keep_connection=False)
            return
        if not ctx.accepting:
            await self._refuse(
                client,
                endpoint,
                Unavailable("narwhal is shutting down", code=ErrorCode.SHUTTING_DOWN),
                receive,
                headers,
                # No connection to a daemon that is going away is worth keeping.
                keep_connection=False,
            )
            return
        if ctx.retained >= ctx.retained_ceiling:
            # docs/design.md#retained-ceiling: past the ceiling, refuse before parsing the body.
            ctx.unsized_offers += 1
            await self._refuse(
                client,
                endpoint,
                Refused(
                    f"narwhal retains at most serving.max_connections + serving.queue_capacity"
                    f" = {ctx.retained_ceiling} requests",
                    code=ErrorCode.RETAINED_CEILING,
                    retry_after_s=_SATURATED_RETRY_AFTER_S,
                ),
                receive,
                headers,
            )
            return
        address = _client_address(scope)
        if ctx.pending_bodies.full(address):
            # Below the ceiling, so that one client's slow bodies cannot reach it. Its
            # body is not waited for: the client has enough of them arriving already.
            refusal = ctx.pending_bodies.refusal(address)
            ctx.pending_bodies.refused(address)
            await self._refuse(client, endpoint, refusal, receive, headers, keep_connection=False)
            return
        record = RequestRecord(id=request_id, endpoint=endpoint, arrival=arrival)
        ctx.retained += 1
        ctx.records[id(record)] = record
        body_read = ctx.pending_bodies.hold(address)
        outcome = "client_disconnected"
        try:
            outcome = await self._handle_retained(
                endpoint, config, headers, receive, client, record, body_read
            )
        except Exception:
            # A bug must still produce a well-formed error, never a dropped connection.
            log.exception("internal error serving request %s", request_id)
            outcome = ErrorCode.INTERNAL_ERROR
            with trio.move_on_after(1.0):
                await client.send_error(
                    NarwhalError(f"internal error serving request {request_id}")
                )
        finally:
            body_read()
            ctx.retained -= 1
            del ctx.records[id(record)]
            ctx.finished(outcome, record)
            ctx.metrics.requests_by(endpoint, outcome).inc()
            ctx.metrics.request_duration_by(endpoint).observe(trio.current_time() - arrival)
            ctx.projection_observed(record, trio.current_time())
            projected = record.projected_ttft_s
            observed = record.observed_ttft_s
            log.info(
                "request finished",
                extra={
                    "event": "request",
                    "request_id": request_id,
                    "endpoint": endpoint,
                    "outcome": outcome,
                    "status": client.status,
                    "prefill_engine": record.prefill_engine,
                    "decode_engine": record.decode_engine,
                    "attempts": record.attempts,
                    "prompt_tokens": record.prompt_tokens,
                    "duration_s": round(trio.current_time() - arrival, 6),
                    "projected_ttft_s": _round(projected),
                    "projected_wait_s": _round(record.projected_wait_s),
                    "observed_ttft_s": _round(observed),
                    "prefill_s": _round(record.prefill_s),
                    "projected_in_domain": record.projected_in_domain,
                },
            )

    async def _refuse(
        self,
        client: ClientChannel,
        endpoint: str,
        error: NarwhalError,
        receive: Receive,
        headers: list[tuple[bytes, bytes]],
        *,
        keep_connection: bool = True,
    ) -> None:
        """Refuse a request whose body is not parsed (docs/design.md#retained-ceiling: before body
        parsing).

        The body is still read and dropped when that is cheap, so that a client's pooled
        connection survives the refusal: a flood of 429s does not become a flood of new
        connections. A body that is large or slow to come is left unread, and the answer
        closes the connection instead, as it does unless `keep_connection`."""
        serving = self.ctx.config.serving
        if not keep_connection:
            client.close_connection = True
        elif client.close_connection and await discard_body(
            receive, content_length(headers), serving.max_request_bytes, serving.client_stall_s
        ):
            client.close_connection = False
        self.ctx.finished(error.code)
        self.ctx.metrics.requests.labels(endpoint, error.code).inc()
        self.ctx.metrics.refusals.labels(error.code).inc()
        await client.send_error(error)

    async def _handle_retained(
        self,
        endpoint: Literal["completions", "chat"],
        config: Config,
        headers: list[tuple[bytes, bytes]],
        receive: Receive,
        client: ClientChannel,
        record: RequestRecord,
        body_read: Callable[[], None],
    ) -> str:
        """`body_read` counts the request out of its client's bodies still arriving."""
        serving = config.serving
        deadline = record.arrival + serving.request_timeout_s
        gone = False
        reading_body = True
        failure: NarwhalError | None = None
        with trio.CancelScope(deadline=deadline) as deadline_scope:
            record.scope = deadline_scope  # the supervisor cancels it past the shutdown grace
            try:
                # One deadline for the whole body, not a gap between chunks: a byte a
                # second would reset a gap timer forever while holding a retained slot.
                try:
                    with trio.move_on_at(record.arrival + serving.body_timeout_s) as body_scope:
                        raw = await read_body(
                            receive, content_length(headers), serving.max_request_bytes
                        )
                finally:
                    body_read()
                if body_scope.cancelled_caught:
                    # Bodies that arrived together time out together: see Paced.
                    await self.ctx.deadline_answers.turn()
                    raise _body_timeout("serving.body_timeout_s", serving.body_timeout_s)
                reading_body = False
                client.close_connection = False
                request = parse_body(
                    raw,
                    kind=endpoint,
                    request_id=record.id,
                    models=self.ctx.models,
                    arrival=record.arrival,
                    deadline=deadline,
                    vocab_size=config.engine.vocab_size,
                )
            except ClientGone:
                return "client_disconnected"
            except NarwhalError as exc:
                failure = exc
            else:
                record.stream = request.stream

                async with trio.open_nursery() as nursery:

                    def on_gone() -> None:
                        nonlocal gone
                        if client.finished:
                            return  # hypercorn reports the end of a completed exchange too
                        gone = True
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(watch_disconnect, receive, on_gone)
                    try:
                        await self._serve(request, config, client, record)
                    except NarwhalError as exc:
                        failure = exc
                    nursery.cancel_scope.cancel()
            if failure is not None and not gone:
                if isinstance(failure, Refused):
                    self.ctx.metrics.refusals.labels(failure.code).inc()
                await client.send_error(failure)
        if gone:
            return "client_disconnected"
        if deadline_scope.cancelled_caught:
            # Outside the expired scope; the write itself is bounded by the client
            # stall limit, so this cannot hang. A body still arriving when the request's
            # deadline passes (at or before serving.body_timeout_s) is the same client
            # fault as one past the body's own deadline. Deadlines that expire together
            # are answered a few at a time: see Paced.
            await self.ctx.deadline_answers.turn()
            error = record.abort
            if error is None and reading_body:
                error = _body_timeout("serving.request_timeout_s", serving.request_timeout_s)
            elif error is None:
                error = Expired(
                    f"request exceeded serving.request_timeout_s={serving.request_timeout_s}",
                    code=ErrorCode.EXPIRED,
                )
            await client.send_error(error)
            return error.code
        if failure is not None:
            return failure.code
        return "ok"

    # ------------------------------------------------------------------ the request

    async def _serve(
        self, request: ClientRequest, config: Config, client: ClientChannel, record: RequestRecord
    ) -> None:
        ctx = self.ctx
        if request.model not in ctx.models:
            raise NotFound(f"the model `{request.model}` does not exist", param="model")
        if ctx.degraded_reason is not None:
            raise Unavailable(
                f"narwhal is degraded: {ctx.degraded_reason}",
                code=ErrorCode.DEGRADED,
                public=f"narwhal is degraded: {DEGRADED_PUBLIC}",
            )
        if all(engine.dialect.name == "vllm" for engine in ctx.fleet):
            refusal = decode_refusal(request)
            if refusal is not None:
                raise refusal
        if request.one_engine == "n" and not self._has_aggregate():
            raise BadRequest(
                f"n={request.n} is served only by an aggregate engine (role `both`), and the "
                "fleet has none: a prefill/decode pair hands over the KV of one sequence, "
                "not n",
                param="n",
            )
        record.stage = "tokenizing"
        tokens, method = await self._count_tokens(request, config, record)
        record.prompt_tokens = tokens
        record.token_count_method = method
        serving = config.serving
        quotes: list[PathQuote] = []
        if serving.admission == "predictive":
            quotes = self._admit_predictively(request, tokens, config)
        record.stage = "queued"
        try:
            async with ctx.gate.admitted(
                queue_timeout_s=serving.queue_timeout_s, retry_after_s=_SATURATED_RETRY_AFTER_S
            ) as waited:
                self._offered(request, tokens, admitted=True)
                ctx.metrics.queue_wait.observe(waited)
                await self._attempts(request, tokens, config, client, record, quotes)
        except Refused as refusal:
            if refusal.code in (ErrorCode.QUEUE_FULL, ErrorCode.QUEUE_TIMEOUT):
                self._offered(request, tokens, admitted=False, reason=refusal.code)
            raise

    def _has_aggregate(self) -> bool:
        """Whether the fleet has an engine in the `both` role now (in placement or not)."""
        return any(engine.role == "both" for engine in self.ctx.fleet)

    def _aggregate_only(self, request: ClientRequest) -> bool:
        """Whether the request goes to an aggregate engine alone (`one_engine`)."""
        return request.one_engine is not None and self._has_aggregate()

    def _offered(
        self, request: ClientRequest, tokens: int, *, admitted: bool, reason: str | None = None
    ) -> None:
        bound = _output_bound(request, tokens, widest_context(self._available()))
        self.ctx.demand_events.append(
            DemandEvent(trio.current_time(), tokens, bound, admitted, reason)
        )

    def _admit_predictively(
        self, request: ClientRequest, tokens: int, config: Config
    ) -> list[PathQuote]:
        """docs/design.md#admission: refuse with 429 when the cheapest prefill path misses the
        budget.

        Returns every path's quote, so the projection of the path placement picks can be
        recorded and compared with the TTFT the client saw.
        """
        ctx = self.ctx
        if ctx.profiles is None:
            raise Unavailable(
                "serving.admission is predictive but no usable engine profile is loaded "
                f"(profiles.path={config.profiles.path}); run narwhal-profile, or set "
                "serving.admission to open",
                code=ErrorCode.NO_PROFILE,
                public="serving.admission is predictive but no usable engine profile is "
                "loaded; run narwhal-profile, or set serving.admission to open",
            )
        quotes = quote_paths(
            self._priced(ctx.profiles).values(),
            prompt_tokens=tokens,
            handoff_s=ctx.profiles.handoff_s(tokens),
        )
        if self._aggregate_only(request):
            quotes = [quote for quote in quotes if quote.mode == "aggregate"]
        verdict = judge(
            quotes,
            prompt_tokens=tokens,
            ttft_target_s=config.slo.ttft_s,
            margin=config.serving.admission_margin,
            allowance=ctx.projection_errors.allowance(tokens, trio.current_time()),
        )
        if verdict.admitted:
            return quotes
        assert verdict.code is not None
        self._offered(request, tokens, admitted=False, reason=verdict.code)
        if verdict.code == ErrorCode.TTFT_BUDGET:
            # docs/design.md#reactive-parameters: a projected TTFT breach allows one guarded D-to-P
            # evaluation.
            ctx.signals.ttft_breach()
        if verdict.code == ErrorCode.NO_PRICED_PATH:
            raise Unavailable(verdict.message, code=verdict.code)
        raise Refused(
            verdict.message,
            code=verdict.code,
            retry_after_s=verdict.retry_after_s,
            final=verdict.final,
        )

    def _priced(self, profiles: ProfileSource) -> dict[str, Priced]:
        """Every engine as pricing sees it now: profile, backlog and decode-side load."""
        ctx = self.ctx
        now = trio.current_time()
        signals = ctx.load_signals(now)
        return price_fleet(
            ctx.fleet.views(now),
            profiles,
            backlog_s=signals.backlog_s,
            first_token_lag_s=signals.first_token_lag_s,
            kv_release_per_s=signals.kv_release_per_s,
        )

    def _policy(self, tokens: int, config: Config) -> Policy:
        ctx = self.ctx
        if config.serving.admission != "predictive" or ctx.profiles is None:
            return DEFAULT_POLICY
        return placement_policy(
            self._priced(ctx.profiles),
            prompt_tokens=tokens,
            handoff_s=ctx.profiles.handoff_s(tokens),
            ttft_budget_s=ttft_budget_s(config.slo.ttft_s, config.serving.admission_margin),
            tpot_target_s=config.slo.tpot_s,
        )

    async def _count_tokens(
        self, request: ClientRequest, config: Config, record: RequestRecord
    ) -> tuple[int, str]:
        """Exact prompt length from the engine's /tokenize, else the chars fallback, with
        the reason for it counted and kept on the record: an estimate moves admission,
        placement and KV accounting, so an operator needs to see why there is one."""
        ctx = self.ctx
        if request.prompt_token_ids is not None:
            # The engines count token ids as sent: the count is exact without /tokenize.
            available = self._available()
            count = self._truncated(request, request.prompt_token_ids, available)
            self._check_context(request, count, record, available)
            return count, "token_ids"
        ratio, _ = ctx.chars_per_token(config)
        estimate = max(1, math.ceil(request.prompt_chars / ratio))
        if not config.engine.tokenize:
            reason = "disabled"
        elif isinstance(engine := self._tokenizer_engine(request.kind), str):
            reason = engine
        else:
            body = tokenize_body(engine.dialect, request.kind, request.body)
            answer = await self._tokenize(engine, request, body, config)
            if not isinstance(answer, str):
                count, context = answer
                ctx.token_methods["exact"] += 1
                ctx.metrics.token_counts_by("exact").inc()
                if context is not None and context != engine.context_length:
                    # vLLM's answer carries the context its completions are held to: the
                    # freshest word on it, between recovery's reads.
                    engine.set_context(context, "its /tokenize answer's max_model_len")
                available = self._available()
                count = self._truncated(request, count, available)
                self._check_context(request, count, record, available)
                return count, "exact"
            reason = answer
        ctx.token_methods["fallback"] += 1
        ctx.metrics.token_counts_by("fallback").inc()
        ctx.token_fallbacks[reason] += 1
        ctx.metrics.token_fallbacks_by(reason).inc()
        record.token_count_fallback = reason
        return self._truncated(request, estimate, self._available()), "fallback"

    def _available(self) -> list[EngineState]:
        """The engines in placement now (availability changes only across an await)."""
        now = trio.current_time()
        return [e for e in self.ctx.fleet if e.unavailable_reason(now) is None]

    def _truncated(self, request: ClientRequest, count: int, available: list[EngineState]) -> int:
        """The prompt length the engines will run (`truncated_prompt`), when every
        available engine honours `truncate_prompt_tokens` (vLLM); one that ignores it
        (SGLang) runs the prompt whole. -1 keeps up to the largest context an engine
        reports, the longer prompt placement may meet (none while one is unknown)."""
        if request.truncate_prompt_tokens is None:
            return count
        if not available or not all(e.dialect.request_truncation for e in available):
            return count
        contexts = [e.context_length for e in available]
        known = [c for c in contexts if c is not None]
        return truncated_prompt(request, count, max(known) if len(known) == len(contexts) else None)

    def _check_context(
        self,
        request: ClientRequest,
        count: int,
        record: RequestRecord,
        available: list[EngineState],
    ) -> None:
        """Refuse, before any leg, a request whose exact prompt length `count` every
        available engine would refuse for its context, by its build's rule
        (`check_context`): placement may pick any of them, and one no engine would take
        is certain to be refused, by the prefill engine or the decode engine. A request
        only some would refuse is left to those. Where none reports its context
        (`EngineState.context_note` says why), nothing is checked and the engine refuses
        it itself: counted as `unknown` and kept on the record."""
        ctx = self.ctx
        result, refusal = check_context(request, count, available)
        ctx.context_checks[result] += 1
        ctx.metrics.context_checks_by(result).inc()
        if result == "unknown":
            record.context_unchecked = "no available engine reports its context length"
        if refusal is not None:
            raise refusal

    def _tokenizer_engine(self, kind: EndpointKind) -> EngineState | str:
        """The engine to ask, or why there is none: `no_engine`, or `unsupported` when
        every available engine is an SGLang build whose /tokenize refused the chat form
        (asking again would cost a round trip for a certain refusal)."""
        now = trio.current_time()
        refusals = self.ctx.chat_tokenize_refusals
        candidates = []
        for engine in self.ctx.fleet:
            if engine.unavailable_reason(now) is None:
                candidates.append(engine)
            else:
                # Out of placement (a restart hold, an ejection, a drain): it may come
                # back as another build, so it is asked again then.
                refusals.forget(engine)
        if kind == "chat":
            config = self.ctx.config
            able = [e for e in candidates if not refusals.known(e, config, now)]
            if candidates and not able:
                return "unsupported"
            candidates = able
        if not candidates:
            return "no_engine"
        # The least busy engine by router-side accounting; ties by config order.
        return min(candidates, key=lambda e: e.serving_pool.in_use)

    async def _tokenize(
        self, engine: EngineState, request: ClientRequest, body: Json, config: Config
    ) -> tuple[int, int | None] | str:
        """The engine's count and, where its answer gives it, its context length; or why
        there is no count."""
        payload = encode(body)
        with trio.move_on_after(config.engine.tokenize_timeout_s):
            try:
                async with engine.serving_pool.request(
                    b"POST", engine.dialect.tokenize_path, _json_headers(request.id), payload
                ) as response:
                    status = response.status
                    if status == 200:
                        return await self._read_tokenize(response, len(payload), engine, request)
                    raw = await response.aread(_ERROR_BODY_LIMIT)
                    info = parse_error_body(status, raw)
                    if status in ENGINE_AUTH_STATUSES:
                        # SGLang guards /tokenize with --api-key (vLLM leaves it open):
                        # the engine would refuse the request's legs too.
                        key_refused(engine, status, info.message, config)
                        return "engine_auth"
                    if names_model(status, info):
                        # vLLM's /tokenize checks the model as its completions do.
                        model_refused(engine, info.message, config)
                        return "engine_model"
                    if request.kind == "chat" and chat_tokenize_refused(
                        engine.dialect, status, info.message
                    ):
                        self._chat_refused(engine, status)
                        return "unsupported"
                    return "engine_error"
            except (ConnectError, RemoteProtocolError, PoolTimeout):
                return "unreachable"
            except (
                ResponseTooLarge,
                ValueError,
                RecursionError,  # json.loads of deeply nested input
            ):
                return "bad_answer"
        return "timeout"

    async def _read_tokenize(
        self, response: Response, sent: int, engine: EngineState, request: ClientRequest
    ) -> tuple[int, int | None] | str:
        """A 200 answer's count and the engine's context length, scanned as it arrives
        (`TokenizeScan`) and bounded by what the text sent can count to."""
        scan = TokenizeScan()
        limit = _ERROR_BODY_LIMIT + TOKEN_ID_BYTES * sent
        size = 0
        while chunk := await response.receive_available():
            size += len(chunk)
            if size > limit:
                return "bad_answer"
            scan.feed(chunk)
        count = scan.count()
        if count is None:
            return "bad_answer"
        if request.kind == "chat" and self.ctx.chat_tokenize_refusals.forget(engine):
            log.info(
                "engine %s counts chat messages again: its /tokenize takes them now (an "
                "upgraded build)",
                engine.id,
                extra={"event": "tokenize_chat_accepted", "engine": engine.id},
            )
        return count, scan.context(engine.dialect)

    def _chat_refused(self, engine: EngineState, status: int) -> None:
        """`engine`'s build has no chat form of /tokenize: its chat requests are estimated
        without asking until it may have changed (`ChatTokenizeRefusals`)."""
        refusals = self.ctx.chat_tokenize_refusals
        if refusals.refused(engine, trio.current_time()):
            log.warning(
                "engine %s counts no chat messages: its /tokenize refused them (HTTP %d), as "
                "an SGLang build without their form does; its chat requests are estimated "
                "at the chars ratio, and it is asked again after a reload, after it has been "
                "out of placement (as a restart takes it) or in %ss",
                engine.id,
                status,
                f"{refusals.recheck_s:g}",
                extra={"event": "tokenize_chat_refused", "engine": engine.id, "status": status},
            )

    async def _attempts(
        self,
        request: ClientRequest,
        tokens: int,
        config: Config,
        client: ClientChannel,
        record: RequestRecord,
        quotes: list[PathQuote],
    ) -> None:
        ctx = self.ctx
        tried = Tried()
        aggregate_only = self._aggregate_only(request)
        while True:
            record.attempts = tried.attempts
            views = ctx.fleet.views(trio.current_time())
            if aggregate_only:
                views = tuple(view for view in views if view.role == "both")
            placement = _place(views, tried, self._policy(tokens, config))
            if isinstance(placement, NoPlacement):
                raise Unavailable(
                    placement.reason, code=ErrorCode.NO_ENGINE_AVAILABLE, public=placement.public
                )
            if placement.unserved:
                # docs/design.md#placement: every candidate misses its projected SLO; run on the
                # cheapest.
                ctx.unserved_placements += 1
                ctx.metrics.unserved_placements.inc()
            record.prefill_engine = placement.prefill
            record.decode_engine = placement.decode
            if tried.attempts == 1:
                _record_projection(record, placement, quotes)
            # The instances the legs run on: a reload may replace an engine (same id,
            # another server) before a leg on it fails, and the failure is the old
            # instance's, not its replacement's.
            decode = ctx.fleet.get(placement.decode)
            assert decode is not None
            prefill = None if placement.prefill is None else ctx.fleet.get(placement.prefill)
            if prefill is not None and _decode_alone(request, decode):
                # The decode engine computes the prompt itself: no prefill leg.
                prefill = None
                record.prefill_engine = None
            try:
                await self._attempt(request, tokens, prefill, decode, config, client, record)
            except EngineFailed as failure:
                failed = prefill if prefill and failure.engine_id == prefill.id else decode
                self._count_failure(failure, failed, placement)
                decision = next_attempt(
                    failure,
                    tried,
                    prefill=placement.prefill,
                    visible=client.started,
                    serving=config.serving,
                    budget_credits=ctx.retry_budget.level,
                    deadline=request.deadline,
                    now=trio.current_time(),
                    jitter=ctx.rng.random(),
                )
                if isinstance(decision, GiveUp):
                    await self._give_up(decision, failure, record, request.deadline)
                    raise
                spent = ctx.retry_budget.try_spend()
                assert spent  # next_attempt saw the credit, and nothing ran since
                ctx.metrics.retries.labels(failure.code).inc()
                record.stage = "backoff"
                await trio.sleep(decision.backoff_s)
                tried = decision.tried
                continue
            ctx.retry_budget.on_success()
            return

    async def _give_up(
        self, decision: GiveUp, failure: EngineFailed, record: RequestRecord, deadline: float
    ) -> None:
        """Before `failure` ends the request: say why in its message, count a retry the
        budget refused, and let a deadline too close for the retry answer the client
        (`expired`), as it would have during the backoff."""
        if decision.reason is Reason.BUDGET_EXHAUSTED:
            self.ctx.retry_budget.refused()
        if decision.note:
            failure.note(decision.note)
        if decision.reason is Reason.DEADLINE:
            record.stage = "backoff"
            await trio.sleep_until(deadline)  # the request's deadline scope cancels it

    def _count_failure(
        self, failure: EngineFailed, engine: EngineState, placement: Placement
    ) -> None:
        """Report a failed leg on `engine`, the instance it ran on, to the metrics and to
        recovery, which charges it as the failure's row says."""
        if failure.code == ErrorCode.KV_TRANSFER_FAILED and placement.prefill is not None:
            # Recovery tells which engine of the pair fails its transfers.
            failure.partner_id = (
                placement.decode if failure.engine_id == placement.prefill else placement.prefill
            )
        self.ctx.metrics.engine_failures.labels(
            failure.engine_id, failure.phase, failure.code
        ).inc()
        self.ctx.engine_leg_failed(failure, engine)

    async def _attempt(
        self,
        request: ClientRequest,
        tokens: int,
        prefill: EngineState | None,
        decode: EngineState,
        config: Config,
        client: ClientChannel,
        record: RequestRecord,
    ) -> None:
        # The decode engine is chosen a whole prefill before its leg starts: placement
        # sees the request there from now on.
        with decode.load.decode_placed(tokens) as pending:
            if prefill is None:
                await self._aggregate(request, tokens, decode, config, client, record, pending)
                return
            if prefill.dialect.concurrent_legs:
                await self._sglang_pair(
                    request, tokens, prefill, decode, config, client, record, pending
                )
            else:
                await self._vllm_pair(
                    request, tokens, prefill, decode, config, client, record, pending
                )

    # ------------------------------------------------------------------ dialects

    async def _vllm_pair(
        self,
        request: ClientRequest,
        tokens: int,
        prefill: EngineState,
        decode: EngineState,
        config: Config,
        client: ClientChannel,
        record: RequestRecord,
        pending: Claim,
    ) -> None:
        serving = config.serving
        record.stage = "prefill"
        handoff_cap = serving.handoff_timeout_s or math.inf  # 0: the deadline is the cap
        async with self._phase_slot(prefill, "prefill", tokens):
            # docs/design.md#retries: the handoff's age counts from the prefill HTTP request, not
            # from the wait for a prefill slot before it (no KV exists yet during that wait).
            prefill_started = trio.current_time()
            raw = await self._json_leg(
                prefill,
                "prefill",
                encode(vllm_prefill_body(request.body)),
                request,
                config,
                timeout_s=serving.prefill_timeout_s,
                on_timeout=FailureKind.PREFILL_TIMEOUT,
                timeout_setting="serving.prefill_timeout_s",
                prompt_tokens=tokens,
            )
        kv_params = vllm_kv_params(_loads(raw, prefill, "prefill"))
        record.prefilled_at = trio.current_time()
        record.stage = "handoff"
        # Until the decode request is sent, the producer holds KV blocks for us.
        handoff = prefill.load.handoff()
        try:
            async with self._phase_slot(
                decode, "decode", tokens, not_after=prefill_started + handoff_cap, pending=pending
            ):
                handoff.release()
                body, own_usage, unstreamed = _leg_body(request, decode)
                await self._decode_leg(
                    decode,
                    "decode",
                    encode(vllm_decode_body(body, kv_params)),
                    request,
                    config,
                    client,
                    record,
                    first_token_budget=config.engine.first_token_timeout_s,
                    own_usage=own_usage,
                    unstreamed=unstreamed,
                )
        except _HandoffExpired:
            age = trio.current_time() - prefill_started
            raise _failed(
                decode,
                "decode",
                FailureKind.HANDOFF_EXPIRED,
                f"kv handoff from {prefill.id} expired after {age:.3f}s "
                f"(serving.handoff_timeout_s={serving.handoff_timeout_s}); "
                "the prefill must be redone",
                public=f"kv handoff expired after {age:.3f}s "
                f"(serving.handoff_timeout_s={serving.handoff_timeout_s}); "
                "the prefill must be redone",
            ) from None
        finally:
            handoff.release()

    async def _sglang_pair(
        self,
        request: ClientRequest,
        tokens: int,
        prefill: EngineState,
        decode: EngineState,
        config: Config,
        client: ClientChannel,
        record: RequestRecord,
        pending: Claim,
    ) -> None:
        """Both legs at once with the same body; the engines pair by bootstrap room.

        Both phase slots are held before either leg is sent: a prefill sent while its
        decode waits for a slot would wait in the prefill engine's bootstrap queue, run
        into serving.prefill_timeout_s and be charged to a healthy prefill engine. The
        prefill slot is taken first, as on every path, so no two pairs can each hold the
        slot the other waits for.

        Either leg failing cancels the other at once (peers hang here until a bootstrap
        timeout). The decode stream's output is held until the prefill leg succeeds, so
        a prefill failure, an error event in its stream included, is still an HTTP error
        the client can retry.
        """
        serving = config.serving
        port = prefill.spec.bootstrap_port or SGLANG_DEFAULT_BOOTSTRAP_PORT
        # Both legs take the same body, so the prefill leg is asked for usage too; its
        # answer is not relayed.
        shared, own_usage, unstreamed = _leg_body(request, decode)
        body = encode(
            sglang_pd_body(shared, host=prefill.host, port=port, room=new_bootstrap_room())
        )
        prefill_done = trio.Event()
        prefill_slot = trio.Event()
        both_slots = trio.Event()
        first_failure: list[BaseException] = []
        record.stage = "prefill"
        timer = trio.CancelScope()  # its deadline starts once both legs are sent

        async def run_prefill() -> None:
            async with self._phase_slot(prefill, "prefill", tokens):
                prefill_slot.set()
                await both_slots.wait()
                await self._json_leg(
                    prefill,
                    "prefill",
                    body,
                    request,
                    config,
                    timeout_s=serving.prefill_timeout_s,
                    on_timeout=FailureKind.PREFILL_TIMEOUT,
                    timeout_setting="serving.prefill_timeout_s",
                    prompt_tokens=tokens,
                    sse=unstreamed is None,
                )
            record.prefilled_at = trio.current_time()
            record.stage = "decode"
            timer.deadline = min(
                timer.deadline, trio.current_time() + config.engine.first_token_timeout_s
            )
            if request.stream:
                await client.start_stream()
            prefill_done.set()

        async def run_decode() -> None:
            await prefill_slot.wait()
            async with self._phase_slot(decode, "decode", tokens, pending=pending):
                timer.deadline = (
                    trio.current_time()
                    + serving.prefill_timeout_s
                    + config.engine.first_token_timeout_s
                )
                both_slots.set()
                await self._decode_leg(
                    decode,
                    "decode",
                    body,
                    request,
                    config,
                    client,
                    record,
                    first_token_budget=math.inf,
                    timer=timer,
                    hold_until=prefill_done,
                    own_usage=own_usage,
                    unstreamed=unstreamed,
                )

        async with trio.open_nursery() as legs:
            for leg in (run_prefill, run_decode):
                legs.start_soon(_first_failure_cancels, leg, first_failure, legs.cancel_scope)
        if first_failure:
            raise first_failure[0]

    async def _aggregate(
        self,
        request: ClientRequest,
        tokens: int,
        engine: EngineState,
        config: Config,
        client: ClientChannel,
        record: RequestRecord,
        pending: Claim,
    ) -> None:
        """One engine does both phases: its first token includes the prefill."""
        record.stage = "decode"
        body, own_usage, unstreamed = _leg_body(request, engine)
        async with self._phase_slot(engine, "decode", tokens, pending=pending):
            await self._decode_leg(
                engine,
                "aggregate",
                encode(body),
                request,
                config,
                client,
                record,
                first_token_budget=config.serving.prefill_timeout_s
                + config.engine.first_token_timeout_s,
                own_usage=own_usage,
                unstreamed=unstreamed,
            )

    # ------------------------------------------------------------------ legs

    @asynccontextmanager
    async def _phase_slot(
        self,
        engine: EngineState,
        phase: Literal["prefill", "decode"],
        tokens: int,
        *,
        not_after: float = math.inf,
        pending: Claim | None = None,
    ) -> AsyncIterator[None]:
        """Hold one of the engine's phase slots (serving.*_concurrency) and account load.

        A prefill waiting for its slot counts as queued prefill work on the engine from
        the moment it is placed; a decode's load moves from pending to active here.
        """
        limiter = engine.prefill_limiter if phase == "prefill" else engine.decode_limiter
        borrower = object()
        backlog = self.ctx.backlog
        curve = None if self.ctx.profiles is None else self.ctx.profiles.prefill_curve(engine.id)
        if phase == "prefill" and curve is not None:
            # Committed when the leg is placed, so later arrivals see it while it waits.
            shared = shared_overhead_s(
                curve.prefill_s(0), tokens, self.ctx.config.engine.prefill_chunk_tokens
            )
            backlog.commit(engine, curve.prefill_s(tokens), trio.current_time(), shared)
        queued = engine.load.prefill_queue(tokens) if phase == "prefill" else nullcontext()
        try:
            with queued:
                await trio.lowlevel.checkpoint_if_cancelled()
                # A free slot is the common case; the handoff scope is only needed to wait.
                if trio.current_time() < not_after and _acquire_nowait(limiter, borrower):
                    expired = False
                else:
                    with trio.CancelScope(deadline=not_after) as wait:
                        await limiter.acquire_on_behalf_of(borrower)
                    expired = wait.cancelled_caught
        except BaseException:
            if phase == "prefill" and curve is not None:
                backlog.release(engine)
            raise
        if expired or trio.current_time() > not_after:
            if not expired:
                limiter.release_on_behalf_of(borrower)
            raise _HandoffExpired
        if pending is not None:
            pending.release()
        leg = engine.load.prefill(tokens) if phase == "prefill" else engine.load.decode(tokens)
        try:
            with leg:
                yield
        finally:
            if phase == "decode":
                # The KV the prompt held is freed with the slot.
                self.ctx.kv_freed(engine, tokens, trio.current_time())
            elif curve is not None:
                backlog.release(engine)
            limiter.release_on_behalf_of(borrower)

    @asynccontextmanager
    async def _engine_request(
        self, engine: EngineState, phase: LegPhase, path: bytes, body: bytes, request: ClientRequest
    ) -> AsyncIterator[Response]:
        """One engine HTTP request; transport failures become EngineFailed here, once."""
        try:
            async with engine.serving_pool.request(
                b"POST", path, _json_headers(request.id), body
            ) as response:
                yield response
        except ConnectError as exc:
            # A connect deadline is excused like the leg deadlines when the router's own
            # loop lag explains it (recovery's leg_failed): under a client flood the
            # handshake's answer waits unread, and the engine would be taken out.
            raise _failed(
                engine,
                phase,
                FailureKind.UNREACHABLE,
                str(exc),  # names the engine's host and port
                public="could not connect to the engine",
                deadline_s=exc.timeout_s,
            ) from None
        except RemoteProtocolError as exc:
            raise _failed(engine, phase, FailureKind.CONNECTION_LOST, str(exc)) from None
        except PoolTimeout as exc:
            # Local starvation is not the engine's fault and is not retried
            # (docs/design.md#retries).
            raise Unavailable(
                str(exc),
                code=ErrorCode.POOL_EXHAUSTED,
                public=f"no connection to a {phase} engine within engine.pool_timeout_s="
                f"{self.ctx.config.engine.pool_timeout_s}",
            ) from None

    async def _status_failure(
        self, engine: EngineState, phase: LegPhase, response: Response
    ) -> EngineFailed:
        try:
            raw = await response.aread(_ERROR_BODY_LIMIT)
        except ResponseTooLarge:
            raw = b""
        info = parse_error_body(response.status, raw)
        status = response.status
        kind = classify_answer(info, bootstrap_pair=_bootstrap_pair(engine, phase))
        if kind is FailureKind.KEY_REFUSED:
            why = key_refused(engine, status, info.message, self.ctx.config)
            public = f"refused narwhal's API key (HTTP {status}): the router's configuration"
            return _answered(engine, phase, kind, why, f"{public} is at fault, not the request")
        if kind is FailureKind.MODEL_MISSING:
            why = model_refused(engine, info.message, self.ctx.config)
            public = f"does not serve model {engine.spec.model!r}: the router's configuration"
            return _answered(engine, phase, kind, why, f"{public} is at fault, not the request")
        if kind is FailureKind.TRANSFER_FAILED:
            return _transfer_failed(engine, phase, info.message)
        answer = f"returned HTTP {status}: {info.message}"
        return _answered(engine, phase, kind, answer, status=status, param=info.param)

    async def _json_leg(
        self,
        engine: EngineState,
        phase: LegPhase,
        body: bytes,
        request: ClientRequest,
        config: Config,
        *,
        timeout_s: float,
        on_timeout: FailureKind,
        timeout_setting: str,
        prompt_tokens: int = 0,
        sse: bool = False,
    ) -> bytes:
        """A leg read whole; the body is retained up to serving.max_response_bytes.

        `sse`: the body is an event stream (SGLang's prefill leg shares the client's
        streamed body), and an error event inside its 200 fails the leg."""
        limit = config.serving.max_response_bytes
        path = ENDPOINT_PATHS[request.kind]
        started = trio.current_time()
        alone = _alone(engine)
        with trio.move_on_after(timeout_s) as timer:
            async with self._engine_request(engine, phase, path, body, request) as response:
                if response.status != 200:
                    raise await self._status_failure(engine, phase, response)
                try:
                    raw = await response.aread(limit)
                except ResponseTooLarge:
                    raise _failed(
                        engine,
                        phase,
                        FailureKind.TOO_LARGE,
                        f"response exceeds serving.max_response_bytes={limit}",
                    ) from None
                if sse:
                    _raise_stream_error(engine, phase, raw)
        if not timer.cancelled_caught:
            self.ctx.leg_observer.leg_ok(
                engine,
                phase,
                trio.current_time() - started,
                prompt_tokens=prompt_tokens,
                contended=alone is None or engine.load.legs_started != alone,
            )
            return raw
        detail = f"exceeded {timeout_setting}={timeout_s}"
        raise _failed(engine, phase, on_timeout, detail, deadline_s=timeout_s)

    async def _decode_leg(
        self,
        engine: EngineState,
        phase: LegPhase,
        body: bytes,
        request: ClientRequest,
        config: Config,
        client: ClientChannel,
        record: RequestRecord,
        *,
        first_token_budget: float,
        timer: trio.CancelScope | None = None,
        hold_until: trio.Event | None = None,
        own_usage: bool = False,
        unstreamed: str | None = None,
    ) -> None:
        """Run the leg that produces the client's output.

        A non-streaming client request's leg is a stream too (`_leg_body`), read through
        the same relay, so the first-token and gap timers, the first-token signal and
        the TTFT/TPOT observations all apply to it; its events are collected instead of
        sent, and the client gets the assembled document once the stream has ended with
        [DONE]. Until then nothing is visible, so a failure is an HTTP error and may be
        retried. `unstreamed` names why a leg was sent non-streaming instead (see
        `unassemblable_reason`): it is read whole, with only the request deadline.
        """
        record.stage = "decode"
        if unstreamed is not None:
            self.ctx.unstreamed_legs[unstreamed] += 1
            self.ctx.metrics.unstreamed_legs_by(unstreamed).inc()
            bound = _output_bound(request, record.prompt_tokens, engine.context_length)
            with engine.load.unstreamed_decode(bound, trio.current_time()):
                raw = await self._json_leg(
                    engine,
                    phase,
                    body,
                    request,
                    config,
                    timeout_s=math.inf,
                    on_timeout=FailureKind.DECODE_TIMEOUT,
                    timeout_setting="",
                    prompt_tokens=record.prompt_tokens or 0,
                )
            document = _loads(raw, engine, phase)  # relayed as application/json: JSON
            # The KV its output held is freed now too (the slot frees the prompt's); vLLM
            # and SGLang both report it.
            generated = usage_tokens(document, "completion_tokens") or 0
            if generated > 0:
                self.ctx.kv_freed(engine, generated, trio.current_time())
            if hold_until is not None:
                await hold_until.wait()
            record.stage = "writing"
            await client.send_json(200, raw)
            return
        sink: _Sink = client
        collector = None
        if not request.stream:
            sink = collector = _Collector(engine, phase, request, config.serving.max_response_bytes)
        elif hold_until is None:
            # docs/design.md#streaming-failures: commit 200 before decode starts.
            await client.start_stream()
        if timer is None:
            timer = trio.CancelScope(deadline=trio.current_time() + first_token_budget)
        if phase == "decode" and not engine.dialect.concurrent_legs:
            with engine.load.awaiting_first_token(trio.current_time()) as waiting:
                await _relay(
                    self, engine, phase, body, request, config, sink, record, timer, hold_until,
                    own_usage, first_token_seen=waiting.release,
                )  # fmt: skip
        else:
            await _relay(
                self, engine, phase, body, request, config, sink, record, timer, hold_until,
                own_usage,
            )  # fmt: skip
        if collector is not None:
            document = encode(collector.result())
            if hold_until is not None:
                await hold_until.wait()
            record.stage = "writing"
            await client.send_json(200, document)


async def _relay(
    flow: Flow,
    engine: EngineState,
    phase: LegPhase,
    body: bytes,
    request: ClientRequest,
    config: Config,
    client: _Sink,
    record: RequestRecord,
    timer: trio.CancelScope,
    hold_until: trio.Event | None,
    own_usage: bool,
    first_token_seen: Callable[[], None] | None = None,
) -> None:
    """Relay an engine SSE stream to the client (or to a `_Collector`), event by event.

    Only complete events are forwarded, so a terminal error event we add can never be
    glued onto half an engine line. Events before the first generated token (chat's
    role chunk, say) are held in a buffer bounded by serving.max_response_bytes and
    sent with the first token.

    Token accounting: an event may carry several tokens (see `with_usage_report`), and
    one read may bring several events when the router fell behind. A read's events share
    the time since the previous read as their intervals, and the engine's final
    `usage.completion_tokens` rescales the leg's intervals and its TPOT to tokens. That
    usage chunk is not relayed when only the router asked for it (`own_usage`).
    """
    ctx = flow.ctx
    started = trio.current_time()
    alone = _alone(engine)
    limit = config.serving.max_response_bytes
    gap = config.engine.decode_read_timeout_s or math.inf
    scanner = SseScanner()
    gaps: list[float] = []  # decode token intervals, for the live decode correction
    load = _GapLoad()  # and for a latency residual
    held: list[bytes] = []
    held_bytes = 0
    first_at: float | None = None
    last_at = 0.0
    tokens = 0  # token events from the first token on
    reported: int | None = None
    done = False
    path = ENDPOINT_PATHS[request.kind]
    growth = None
    if phase != "prefill":
        bound = _output_bound(request, record.prompt_tokens, engine.context_length)
        growth = _KvGrowth(ctx, engine, bound)
    with timer, growth or nullcontext():
        async with flow._engine_request(engine, phase, path, body, request) as response:
            if response.status != 200:
                raise await flow._status_failure(engine, phase, response)
            kind = response.header(b"content-type") or b""
            if kind.split(b";")[0].strip().lower() == b"application/json":
                # Read as a stream, it would only end "without [DONE]": say what it is.
                raise _failed(
                    engine,
                    phase,
                    FailureKind.BAD_RESPONSE,
                    "answered a streaming request with application/json, not an event stream",
                )
            while not done:
                chunk = await response.receive_available()
                now = trio.current_time()
                if not chunk:
                    raise _failed(
                        engine,
                        phase,
                        FailureKind.TRUNCATED,
                        "stream ended without the [DONE] terminator",
                    )
                if first_at is not None:
                    timer.deadline = now + gap  # partial lines and metadata reset it too
                try:
                    events = scanner.feed(chunk)
                except SseOverflow as exc:
                    raise _failed(engine, phase, FailureKind.BAD_STREAM, str(exc)) from None
                out: list[bytes] = []
                read_tokens = 0
                for event in events:
                    if event.kind is SseKind.ERROR:
                        raise _stream_error(engine, phase, event)
                    raw = event.raw
                    if event.kind is SseKind.DONE:
                        done = True
                    elif event.kind is SseKind.DATA:
                        usage_only = False
                        if b'"usage"' in event.payload:
                            usage = _usage_report(event.payload)
                            if usage is not None:
                                reported, usage_only = usage
                                if growth is not None:
                                    growth.reported = reported
                                if usage_only and own_usage:
                                    continue  # the router asked for it, not the client
                        if first_at is None and not usage_only and _has_token(event.payload):
                            first_at = now
                            timer.deadline = now + gap
                            if hold_until is None or hold_until.is_set():
                                record.first_output_at = now
                            ctx.metrics.ttft_by(phase).observe(now - request.arrival)
                            if first_token_seen is not None:
                                first_token_seen()
                                # The decode request went out after its prefill answered,
                                # so this is the decode side's whole share of the TTFT.
                                ctx.first_token_lag(engine, now - started, now)
                        if first_at is not None and not usage_only:
                            read_tokens += 1
                    if first_at is None:
                        held.append(raw)
                        held_bytes += len(raw)
                    else:
                        out.append(raw)
                    if done:
                        break
                if read_tokens:
                    if tokens:
                        share = (now - last_at) / read_tokens
                        counted = min(read_tokens, _MAX_GAPS - len(gaps))
                        gaps.extend([share] * counted)
                        load.add(engine, counted)
                    tokens += read_tokens
                    last_at = now
                    if growth is not None:
                        growth.add(read_tokens)
                if first_at is None and held_bytes + scanner.pending > limit:
                    raise _failed(
                        engine,
                        phase,
                        FailureKind.HELD_TOO_LARGE,
                        f"pre-output buffer exceeds serving.max_response_bytes={limit}",
                    )
                if out and (hold_until is None or hold_until.is_set()):
                    if held:
                        out = [*held, *out]
                        held = []
                        held_bytes = 0
                        if first_at is not None and record.first_output_at is None:
                            record.first_output_at = now  # SGLang: held until the prefill
                    record.stage = "streaming"
                    await client.send_chunk(b"".join(out))
                    load.longest_write_s = max(load.longest_write_s, trio.current_time() - now)
                elif out:
                    held.extend(out)  # SGLang: the prefill leg has not answered yet
    generated = tokens
    if reported is not None:
        engine.observe_packing(tokens, reported)
        if reported > tokens > 1:  # events carried several tokens each
            scale = (tokens - 1) / (reported - 1)
            gaps = [gap * scale for gap in gaps]
            generated = reported
    if request.n > 1:
        # n sequences' events interleave, several per decode step: their gaps are not
        # one sequence's token interval, and a sequence made a share of the tokens.
        gaps = []
        generated //= request.n
    summary = load.summary(gaps)  # one per stream: the controller, correction and residual
    if summary is not None:
        ctx.signals.decode_gaps(engine, summary)
    if timer.cancelled_caught:
        if first_at is None:
            waited = trio.current_time() - started
            if ctx.loop_lag.starved(waited) is None:
                # Otherwise the router's own lag explains it: it says nothing about decode
                # capacity, so it does not reset the controller's evidence window.
                ctx.signals.first_token_timeout(engine)
            raise _failed(
                engine,
                phase,
                FailureKind.FIRST_TOKEN_TIMEOUT,
                f"no first token within engine.first_token_timeout_s="
                f"{config.engine.first_token_timeout_s}",
                deadline_s=waited,
            )
        # A stream's client has seen its first token by now, so only a non-streaming
        # request, with nothing shown, retries.
        raise _failed(
            engine,
            phase,
            FailureKind.DECODE_STALLED,
            f"engine was silent for engine.decode_read_timeout_s="
            f"{config.engine.decode_read_timeout_s}",
            deadline_s=gap,
        )
    if held:
        if hold_until is not None:
            await hold_until.wait()
        if first_at is not None and record.first_output_at is None:
            record.first_output_at = trio.current_time()
        await client.send_chunk(b"".join(held))
    if generated > 1 and first_at is not None:
        record.observed_tpot_s = (last_at - first_at) / (generated - 1)
        ctx.metrics.tpot.observe(record.observed_tpot_s)
    ctx.leg_observer.leg_ok(
        engine,
        phase,
        trio.current_time() - started,
        prompt_tokens=record.prompt_tokens or 0,
        contended=alone is None or engine.load.legs_started != alone,
        gaps=summary if summary is not None and load.alone(summary) else None,
    )
    await client.end_stream()


def _output_bound(
    request: ClientRequest, prompt_tokens: int | None, context: int | None
) -> int | None:
    """The most tokens the request's n sequences can generate, each capped by the room its
    prompt leaves in the context; None: no bound but the context."""
    bound = output_bound(request.max_tokens, prompt_tokens, context)
    return None if bound is None else bound * request.n


def _leg_body(request: ClientRequest, engine: EngineState) -> tuple[Json, bool, str | None]:
    """The body a decode (or aggregate) leg sends, whether its usage chunk is the
    router's alone (not relayed), and, for a leg sent without streaming, why."""
    if request.stream:
        body, own_usage = with_usage_report(request.body, engine.dialect, engine.version)
        return body, own_usage, None
    reason = unassemblable_reason(request.kind, request.body)
    if reason is not None:
        return request.body, False, reason
    # The collector needs the usage chunk: a non-streaming answer always has usage.
    return streamed_leg_body(request.body), False, None


class _Sink(Protocol):
    async def send_chunk(self, data: bytes) -> None: ...
    async def end_stream(self) -> None: ...


class _Collector:
    """Where `_relay` writes a non-streaming request's stream: complete events, kept
    until [DONE] and assembled into the engine's non-streaming answer.

    The answer is retained whole, as a non-streaming engine answer was, so it is bounded
    by serving.max_response_bytes."""

    __slots__ = ("_assembler", "_engine", "_limit", "_phase", "_scanner", "_size")

    def __init__(
        self, engine: EngineState, phase: LegPhase, request: ClientRequest, limit: int
    ) -> None:
        self._engine = engine
        self._phase = phase
        self._limit = limit
        self._size = 0
        self._scanner = SseScanner()
        self._assembler = ResponseAssembler(request.kind, engine.dialect.name)

    async def send_chunk(self, data: bytes) -> None:
        self._size += len(data)
        if self._size > self._limit:
            raise _failed(
                self._engine,
                self._phase,
                FailureKind.TOO_LARGE,
                f"response exceeds serving.max_response_bytes={self._limit}",
            )
        # _relay hands over whole events only, and has already failed the leg on an
        # error event.
        for event in self._scanner.feed(data):
            if event.kind is not SseKind.DATA:
                continue
            try:
                chunk = json.loads(event.payload)
            except (ValueError, RecursionError):
                chunk = None
            if not isinstance(chunk, dict):
                raise _failed(
                    self._engine,
                    self._phase,
                    FailureKind.BAD_STREAM,
                    "sent an event that is not a JSON object",
                )
            self._assembler.add(chunk)

    async def end_stream(self) -> None:
        await trio.lowlevel.checkpoint()

    def result(self) -> Json:
        return self._assembler.result()


def _alone(engine: EngineState) -> int | None:
    """Called inside a leg's reservation: the engine's leg count if this leg is the only
    one on it right now, else None. The leg was uncontended throughout when the count is
    unchanged at its end."""
    load = engine.load
    if load.prefill_inflight + load.decode_active > 1:
        return None
    return load.legs_started


def _place(views: tuple[EngineView, ...], tried: Tried, policy: Policy) -> Placement | NoPlacement:
    """Where an attempt goes: not to an engine `tried` leaves out while another can take it.
    When none can (the role's others are out), a retry goes back to the engine that
    failed, as any HTTP retry would: a transient failure is worth the attempt, and
    refusing the request as `no_engine_available` would blame a fleet that still has an
    engine. An engine taken out of placement meanwhile (unreachable, breaker, quarantine,
    ejection) is not placeable either way."""
    placement = choose(views, excluded=tried.excluded | tried.avoided, policy=policy)
    if isinstance(placement, NoPlacement) and tried.avoided:
        placement = choose(views, excluded=tried.excluded, policy=policy)
    if isinstance(placement, NoPlacement) and tried.excluded:
        placement = choose(views, excluded=frozenset(), policy=policy)
    return placement


def _record_projection(
    record: RequestRecord, placement: Placement, quotes: list[PathQuote]
) -> None:
    """The admission quote of the prefill path placement chose (aggregate: the engine)."""
    engine = placement.prefill if placement.prefill is not None else placement.decode
    mode = "disaggregated" if placement.prefill is not None else "aggregate"
    for quote in quotes:
        if quote.engine == engine and quote.mode == mode:
            record.projected_ttft_s = quote.ttft_s
            record.projected_wait_s = quote.wait_s
            record.projected_in_domain = quote.in_domain
            return


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def _failed(
    engine: EngineState,
    phase: LegPhase,
    kind: FailureKind,
    detail: str,
    *,
    public: str | None = None,
    deadline_s: float | None = None,
) -> EngineFailed:
    """An engine leg's failure of `kind`, as FAILURE_POLICY has it. `public`: `detail` for
    a client, when `detail` names the engine or its address."""
    return leg_failure(
        kind,
        f"{phase} engine {engine.id}: {detail}",
        public=f"{phase} engine: {detail if public is None else public}",
        engine_id=engine.id,
        phase=phase,
        deadline_s=deadline_s,
    )


def _answered(
    engine: EngineState,
    phase: LegPhase,
    kind: FailureKind,
    answer: str,
    public: str | None = None,
    *,
    status: int | None = None,
    param: str | None = None,
) -> EngineFailed:
    """A failure the engine answered with (`answer`: what it did, in its words, which go
    to the client too: they are about the request the client sent). `status`: the
    engine's, for the kinds that pass it on."""
    return leg_failure(
        kind,
        f"{phase} engine {engine.id} {answer}",
        public=f"{phase} engine {answer if public is None else public}",
        engine_id=engine.id,
        phase=phase,
        engine_status=status,
        param=param,
    )


def _stream_error(engine: EngineState, phase: LegPhase, event: SseEvent) -> EngineFailed:
    """An error event inside a 200 stream (docs/design.md#streaming-failures: engines
    report late errors so); `classify_event` says what it is."""
    error = event.error or {}
    message = error.get("message", "engine error")
    status = json_int(error.get("code"))
    kind = classify_event(status, message, bootstrap_pair=_bootstrap_pair(engine, phase))
    if kind is FailureKind.TRANSFER_FAILED:
        return _transfer_failed(engine, phase, str(message))
    if status is None or kind is FailureKind.STREAM_ERROR:
        return _failed(engine, phase, kind, f"engine reported an error mid-stream: {message}")
    param = error.get("param")
    answer = f"returned {status} in its stream: {message}"
    return _answered(
        engine, phase, kind, answer, status=status, param=param if isinstance(param, str) else None
    )


def _decode_alone(request: ClientRequest, decode: EngineState) -> bool:
    """Whether a vLLM pair's decode engine serves the request without a prefill leg: it
    recomputes a prompt whose logprobs are asked for anyway (`one_engine`), and takes a
    request without handoff params as an aggregate one (vLLM's own proxies send it so).
    An SGLang decode server refuses a request without a bootstrap room."""
    return request.one_engine == "prompt_logprobs" and not decode.dialect.concurrent_legs


def _bootstrap_pair(engine: EngineState, phase: LegPhase) -> bool:
    """Whether the leg is one of an SGLang bootstrap pair's (`classify_answer`)."""
    return engine.dialect.concurrent_legs and phase != "aggregate"


def _transfer_failed(engine: EngineState, phase: LegPhase, message: str) -> EngineFailed:
    """An SGLang bootstrap pair's KV transfer failed, as one of its servers reports it."""
    return _failed(
        engine,
        phase,
        FailureKind.TRANSFER_FAILED,
        f"the bootstrap pair's KV transfer failed: {message}",
        # SGLang's words name the pair's transfer endpoints (host:port).
        public="the bootstrap pair's KV transfer failed",
    )


def _raise_stream_error(engine: EngineState, phase: LegPhase, raw: bytes) -> None:
    """Fail a leg whose whole event stream, read at once, holds an error event."""
    try:
        events = SseScanner().feed(raw)
    except SseOverflow as exc:
        raise _failed(engine, phase, FailureKind.BAD_STREAM, str(exc)) from None
    for event in events:
        if event.kind is SseKind.ERROR:
            raise _stream_error(engine, phase, event)


async def _first_failure_cancels(
    leg: object, failures: list[BaseException], scope: trio.CancelScope
) -> None:
    assert callable(leg)
    try:
        await leg()
    except NarwhalError as exc:
        failures.append(exc)
        scope.cancel()


def _acquire_nowait(limiter: trio.CapacityLimiter, borrower: object) -> bool:
    try:
        limiter.acquire_on_behalf_of_nowait(borrower)
    except trio.WouldBlock:
        return False
    return True


def _has_token(payload: bytes) -> bool:
    """Whether a chunk carries generated output (not just chat's role announcement)."""
    try:
        document = json.loads(payload)
    except (ValueError, RecursionError):
        return True  # not ours to judge: the engine sent something, count it
    if not isinstance(document, dict):
        return True
    choices = document.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("text") or choice.get("finish_reason") or choice.get("token_ids"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(
            delta.get(key)
            for key in ("content", "reasoning_content", "reasoning", "tool_calls", "function_call")
        ):
            return True
    return False


def _usage_report(payload: bytes) -> tuple[int, bool] | None:
    """The `usage.completion_tokens` of an event that carries a usage object, and whether
    the event is the usage-only chunk (`choices: []`); None otherwise. Completions chunks
    carry `"usage": null`, so the value is looked at before anything is parsed."""
    at = payload.rfind(b'"usage"')
    rest = payload[at + 7 :].lstrip()
    if not rest.startswith(b":") or not rest[1:].lstrip().startswith(b"{"):
        return None
    try:
        document = json.loads(payload)
    except (ValueError, RecursionError):
        return None
    count = usage_tokens(document, "completion_tokens")
    if count is None or count < 0:
        return None
    assert isinstance(document, dict)  # usage_tokens found a count in it
    return count, document.get("choices") == []


def _loads(raw: bytes, engine: EngineState, phase: LegPhase) -> object:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise _failed(
            engine, phase, FailureKind.BAD_RESPONSE, "returned a body that is not JSON"
        ) from None


def _json_headers(request_id: str) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json"), (b"x-request-id", request_id.encode())]


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None
