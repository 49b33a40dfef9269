"""One client request, from ingress to the last byte (docs/design.md#retries,
#streaming-failures, #placement, #deadlines).

Owns
  `Exchange`: the request, its deadline, its client channel and its record, and the
  short loop that serves it: refuse early (the retained ceiling, a client's bodies
  still arriving, shutdown), read and parse the body, count the prompt's tokens
  (`_tokens`), admit (`_admit`), queue at the gate, then attempts: place, run the
  pair's protocol (`_pairs`), and on a leg's failure ask `_retry.next_attempt` whether
  to try again.

Invariants
  Each request is one trio nursery inside one deadline scope (serving.request_timeout_s,
  from ingress through tokenisation, queueing, backoff, engine work and client writes);
  beside it a watcher cancels everything the moment the client disconnects, which
  closes the engine connections so the engines abort too. The configuration is read
  once per request: a reload applies to new requests. Every request leaves the
  retained count, the records, the metrics and the log exactly once, whatever ends it.
  Engine legs have their own timers (`_legs`): prefill (serving.prefill_timeout_s),
  handoff (serving.handoff_timeout_s), first token (engine.first_token_timeout_s) and
  decode gap (engine.decode_read_timeout_s).

Errors
  Before a response starts, failures are HTTP errors with an OpenAI-style envelope
  (`ClientChannel`). A streaming response commits 200 just before the decode stream
  opens; from then on a failure is a terminal `data: {"error": ...}` event with no
  `[DONE]`, but for a client error before the stream's first bytes, which is still
  the HTTP error it is. A leg's failure is answered as `_failure.FAILURE_POLICY` says;
  it is retried only as `_retry.next_attempt` says. A bug answers 500
  `internal_error`, never a dropped connection.

See
  docs/architecture.md (the request's scopes), docs/client-contract.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import trio

from .._codes import ErrorCode
from .._errors import (
    BadRequest,
    EngineFailed,
    Expired,
    NarwhalError,
    NotFound,
    Refused,
    RequestTimeout,
    Unavailable,
)
from ..admission import PathQuote
from ..fleet import EngineState
from ..placement import NoPlacement, Placement
from ..prefix import PromptKey
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
from ._context import DEGRADED_PUBLIC, RequestRecord, ServingContext, log
from ._decisions import BeforeBody, Decisions
from ._pairs import aggregate, pair_protocol
from ._per_client import client_key
from ._prefix import prompt_of
from ._request import ClientRequest, decode_refusal, parse_body, request_id_from_header
from ._retry import GiveUp, Reason, Tried
from ._tokens import count_tokens

Endpoint = Literal["completions", "chat"]


class Exchange:
    """One client request; `request` and `tokens` exist once its body is parsed and
    its prompt counted, `record` once it is retained."""

    __slots__ = (
        "address",
        "arrival",
        "cached",
        "client",
        "config",
        "ctx",
        "decisions",
        "endpoint",
        "headers",
        "prompt",
        "prompt_ids",
        "record",
        "request",
        "request_id",
        "tokens",
    )

    def __init__(
        self, ctx: ServingContext, endpoint: Endpoint, scope: dict[str, object], send: Send
    ) -> None:
        self.ctx = ctx
        self.config = ctx.config  # one snapshot per request: a reload applies to new ones
        self.decisions: Decisions = ctx.decisions_for(self.config, endpoint)
        self.endpoint = endpoint
        self.arrival = trio.current_time()
        headers = scope.get("headers", [])
        assert isinstance(headers, list)
        self.headers: list[tuple[bytes, bytes]] = headers
        self.address = _client_address(scope)
        self.request_id = request_id_from_header(_header(headers, b"x-request-id"))
        self.client = ClientChannel(
            send,
            self.request_id,
            close_connection=has_body(headers),
            engine_details=self.config.serving.expose_engine_details,
        )
        self.record: RequestRecord
        self.request: ClientRequest
        self.tokens = 0
        # The prompt's token ids when the router counted them itself; its key for the
        # prefix caches; the tokens of it each engine holds, as of the last placement.
        self.prompt_ids: list[int] | None = None
        self.prompt: PromptKey | None = None
        self.cached: dict[str, int] = {}

    # ------------------------------------------------------------------ ingress

    async def run(self, receive: Receive, *, refusal: NarwhalError | None = None) -> None:
        """Serve the request; `refusal`: the app refused it already (its API key),
        answered and counted here like the other refusals before the body."""
        if refusal is not None:
            # Before anything else: a client without the key learns nothing of the state,
            # and gets nothing more of the router (its body unread, its connection closed).
            await self._refuse(receive, refusal, keep_connection=False)
            return
        try:
            async with self.decisions.retained(self.address):
                await self._retained_request(receive)
        except BeforeBody as refused:
            await self._refuse(receive, refused.error, keep_connection=refused.keep_connection)

    async def _retained_request(self, receive: Receive) -> None:
        ctx = self.ctx
        self.record = record = RequestRecord(
            id=self.request_id, endpoint=self.endpoint, arrival=self.arrival
        )
        ctx.records[id(record)] = record
        outcome = "client_disconnected"
        try:
            outcome = await self._retained(receive, self.decisions.body_read)
        except Exception:
            # A bug must still produce a well-formed error, never a dropped connection.
            log.exception("internal error serving request %s", record.id)
            outcome = ErrorCode.INTERNAL_ERROR
            with trio.move_on_after(1.0):
                await self.client.send_error(
                    NarwhalError(f"internal error serving request {record.id}")
                )
        finally:
            self.decisions.body_read()
            del ctx.records[id(record)]
            self._finished(outcome)

    def _finished(self, outcome: str) -> None:
        ctx, record, endpoint = self.ctx, self.record, self.endpoint
        now = trio.current_time()
        self.decisions.finished(outcome, record)
        ctx.metrics.requests_by(endpoint, outcome).inc()
        ctx.metrics.request_duration_by(endpoint).observe(now - self.arrival)
        log.info(
            "request finished",
            extra={
                "event": "request",
                "request_id": record.id,
                "endpoint": endpoint,
                "outcome": outcome,
                "status": self.client.status,
                "prefill_engine": record.prefill_engine,
                "decode_engine": record.decode_engine,
                "attempts": record.attempts,
                "prompt_tokens": record.prompt_tokens,
                "cached_tokens": record.cached_tokens,
                "engine_cached_tokens": record.engine_cached_tokens,
                "duration_s": round(now - self.arrival, 6),
                "projected_ttft_s": _round(record.projected_ttft_s),
                "projected_wait_s": _round(record.projected_wait_s),
                "observed_ttft_s": _round(record.observed_ttft_s),
                "prefill_s": _round(record.prefill_s),
                "projected_in_domain": record.projected_in_domain,
            },
        )

    async def _refuse(
        self, receive: Receive, error: NarwhalError, *, keep_connection: bool = True
    ) -> None:
        """Refuse a request whose body is not parsed (docs/design.md#retained-ceiling:
        before body parsing).

        The body is still read and dropped when that is cheap, so that a client's pooled
        connection survives the refusal: a flood of 429s does not become a flood of new
        connections. A body that is large or slow to come is left unread, and the answer
        closes the connection instead, as it does unless `keep_connection`."""
        serving, client = self.config.serving, self.client
        if not keep_connection:
            client.close_connection = True
        elif client.close_connection and await discard_body(
            receive, content_length(self.headers), serving.max_request_bytes, serving.client_stall_s
        ):
            client.close_connection = False
        self.decisions.finished(error.code)
        self.ctx.metrics.requests.labels(self.endpoint, error.code).inc()
        self.ctx.metrics.refusals.labels(error.code).inc()
        await client.send_error(error)

    async def _retained(self, receive: Receive, body_read: Callable[[], None]) -> str:
        """Read, parse and serve the retained request; its outcome. `body_read` counts
        the request out of its client's bodies still arriving."""
        serving, client, record = self.config.serving, self.client, self.record
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
                            receive, content_length(self.headers), serving.max_request_bytes
                        )
                finally:
                    body_read()
                if body_scope.cancelled_caught:
                    # Bodies that arrived together time out together: see Paced.
                    await self.ctx.deadline_answers.turn()
                    raise _body_timeout("serving.body_timeout_s", serving.body_timeout_s)
                reading_body = False
                client.close_connection = False
                self.request = parse_body(
                    raw,
                    kind=self.endpoint,
                    request_id=record.id,
                    models=self.ctx.models,
                    arrival=record.arrival,
                    deadline=deadline,
                    vocab_size=self.config.engine.vocab_size,
                )
            except ClientGone:
                return "client_disconnected"
            except NarwhalError as exc:
                failure = exc
            else:
                record.stream = self.request.stream

                async with trio.open_nursery() as nursery:

                    def on_gone() -> None:
                        nonlocal gone
                        if client.finished:
                            return  # hypercorn reports the end of a completed exchange too
                        gone = True
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(watch_disconnect, receive, on_gone)
                    try:
                        await self._serve()
                    except NarwhalError as exc:
                        failure = exc
                    nursery.cancel_scope.cancel()
            if failure is not None and not gone:
                if isinstance(failure, Refused):
                    self.ctx.metrics.refusals.labels(failure.code).inc()
                    if failure.quote is not None:
                        _record_quote(record, failure.quote)
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

    async def _serve(self) -> None:
        ctx, request, record, decisions = self.ctx, self.request, self.record, self.decisions
        if request.model not in ctx.models:
            raise NotFound(f"the model `{request.model}` does not exist", param="model")
        standing = await decisions.standing()
        if standing.degraded_reason is not None:
            raise Unavailable(
                f"narwhal is degraded: {standing.degraded_reason}",
                code=ErrorCode.DEGRADED,
                public=f"narwhal is degraded: {DEGRADED_PUBLIC}",
            )
        if all(engine.dialect.name == "vllm" for engine in ctx.fleet):
            refusal = decode_refusal(request)
            if refusal is not None:
                raise refusal
        if request.one_engine == "n" and not standing.has_aggregate:
            raise BadRequest(
                f"n={request.n} is served only by an aggregate engine (role `both`), and the "
                "fleet has none: a prefill/decode pair hands over the KV of one sequence, "
                "not n",
                param="n",
            )
        record.stage = "tokenizing"
        tokens, method = await count_tokens(self)
        self.tokens = record.prompt_tokens = tokens
        record.token_count_method = method
        self.prompt = prompt_of(self)
        record.stage = "queued"
        async with decisions.admission(request, tokens, self.prompt) as admitted:
            self.cached = admitted.cached
            ctx.metrics.queue_wait.observe(admitted.waited_s)
            await self._attempts(admitted.quotes)

    async def _attempts(self, quotes: list[PathQuote]) -> None:
        """Place and run attempts until one succeeds or `next_attempt` gives up."""
        ctx, request, record, decisions = self.ctx, self.request, self.record, self.decisions
        tried = Tried()
        while True:
            record.attempts = tried.attempts
            if tried.attempts > 1:
                self.cached = await decisions.cached(self.prompt)
            placed = await decisions.place(request, self.tokens, self.cached, tried, self.prompt)
            placement = placed.placement
            if isinstance(placement, NoPlacement):
                raise Unavailable(
                    placement.reason, code=ErrorCode.NO_ENGINE_AVAILABLE, public=placement.public
                )
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
            if placed.local_prefill:
                # The decode engine computes the prompt itself: no prefill leg.
                prefill = None
                record.prefill_engine = None
                prices = placed.local_prices
                if prices is not None and prices.local_s is not None and tried.attempts <= 1:
                    # The projection is the path taken (the admission quote priced the
                    # pair's): the prefill's own step makes the first token, no decode
                    # step follows.
                    record.projected_ttft_s = prices.local_s
                    record.projected_wait_s = prices.local_wait_s
            record.cached_tokens = placed.cached_tokens
            record.engine_cached_tokens = None
            try:
                await self._attempt(prefill, decode, local_prefill=placed.local_prefill)
            except EngineFailed as failure:
                failed = prefill if prefill and failure.engine_id == prefill.id else decode
                decision = await decisions.retry(
                    failure,
                    failed,
                    tried,
                    placement,
                    visible=self.client.started,
                    deadline=request.deadline,
                )
                if isinstance(decision, GiveUp):
                    await self._give_up(decision, failure)
                    raise
                record.stage = "backoff"
                await trio.sleep(decision.backoff_s)
                tried = decision.tried
                continue
            decisions.succeeded()
            return

    async def _attempt(
        self, prefill: EngineState | None, decode: EngineState, *, local_prefill: bool
    ) -> None:
        async with self.decisions.decode_placed(decode, self.tokens):
            if prefill is None:
                await aggregate(self, decode, local_prefill=local_prefill)
            else:
                await pair_protocol(prefill.dialect).run(self, prefill, decode)

    async def _give_up(self, decision: GiveUp, failure: EngineFailed) -> None:
        """Before `failure` ends the request: say why in its message, and let a deadline
        too close for the retry answer the client (`expired`), as it would have during
        the backoff."""
        if decision.note:
            failure.note(decision.note)
        if decision.reason is Reason.DEADLINE:
            self.record.stage = "backoff"
            await trio.sleep_until(self.request.deadline)  # the deadline scope cancels it


def _record_projection(
    record: RequestRecord, placement: Placement, quotes: list[PathQuote]
) -> None:
    """The admission quote of the prefill path placement chose (aggregate: the engine)."""
    engine = placement.prefill if placement.prefill is not None else placement.decode
    mode = "disaggregated" if placement.prefill is not None else "aggregate"
    for quote in quotes:
        if quote.engine == engine and quote.mode == mode:
            _record_quote(record, quote)
            return


def _record_quote(record: RequestRecord, quote: PathQuote) -> None:
    record.projected_ttft_s = quote.ttft_s
    record.projected_wait_s = quote.wait_s
    record.projected_in_domain = quote.in_domain


def _client_address(scope: dict[str, object]) -> str:
    """The address the client's limits count it under (`client_key`)."""
    peer = scope.get("client")
    if isinstance(peer, list | tuple) and peer and isinstance(peer[0], str):
        return client_key(peer[0])
    return ""


def _body_timeout(limit: str, value: float) -> RequestTimeout:
    return RequestTimeout(f"request body not complete within {limit}={value}")


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None
