"""Engine legs: one engine request of an exchange, with its slot, timers and accounting
(docs/design.md#deadlines, #streaming-failures).

Owns
  `phase_slot`, an engine's phase slot (serving.*_concurrency) with the load and prefill
  backlog it accounts; `Leg`, one HTTP request to an engine: read whole
  (`Leg.read_whole`) or relayed as a stream (`Leg.produce`, `Leg.relay`) through a
  `StreamMeter`; `KvGrowth`, a streamed leg's generated tokens in its engine's KV.

Invariants
  Transport failures become an `EngineFailed` once, in `Leg.request`; every failure is
  made by `_leg_failures`. The first-token timer (engine.first_token_timeout_s) and the
  gap timer (engine.decode_read_timeout_s) are one CancelScope per stream whose
  deadline moves, which is cheaper than a scope per chunk. A non-streaming client
  request's leg is a stream too (`leg_body`), read through the same relay into a
  `Collector`, so the timers and the TTFT/TPOT observations apply to it; nothing is
  visible to its client until the document is assembled, so its failures may be
  retried. A leg's success is reported to the leg observer with whether it ran alone
  on its engine (`_alone`).

Errors
  `EngineFailed` for the engine's failures; `Unavailable` (`pool_exhausted`) when no
  connection to the engine frees up in engine.pool_timeout_s, which is not the
  engine's fault; `HandoffExpired` when a phase slot is not had by its `not_after`.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, nullcontext
from typing import TYPE_CHECKING, Literal

import trio

from .._codes import ErrorCode
from .._errors import EngineFailed, Unavailable
from ..admission import credited_prefill_s, shared_overhead_s
from ..engines import (
    ENDPOINT_PATHS,
    ConnectError,
    Json,
    PoolTimeout,
    RemoteProtocolError,
    Response,
    ResponseTooLarge,
    parse_error_body,
)
from ..engines._assemble import streamed_leg_body, unassemblable_reason
from ..engines._dialects import (
    encode,
    usage_cached_tokens,
    usage_tokens,
    with_usage_report,
)
from ..fleet import Claim, EngineState, key_refused, model_refused
from ._collector import Collector, Sink
from ._context import DecodeGaps, ServingContext
from ._context_check import output_bound
from ._failure import FailureKind, classify_answer
from ._leg_failures import (
    LegPhase,
    answered,
    bootstrap_pair,
    failed,
    fault_failure,
    loads,
    raise_stream_error,
    transfer_failed,
)
from ._meter import GapLoad, StreamMeter
from ._request import ClientRequest

if TYPE_CHECKING:
    from ._decisions import Decisions
    from ._exchange import Exchange

ERROR_BODY_LIMIT = 65536


class HandoffExpired(Exception):
    """A phase slot was not had by its `not_after` (the KV handoff's deadline)."""


def book_prefill(ctx: ServingContext, engine: EngineState, tokens: int, cached: int = 0) -> Claim:
    """Commit a prompt's priced prefill to the engine's backlog (`BacklogBook`), until
    the claim is released; nothing without a prefill profile for the engine.

    Less what the `cached` prefix saves, with cache.affinity's credit (at most 1), as
    admission prices it: a blind fleet books the whole prompt."""
    curve = None if ctx.profiles is None else ctx.profiles.prefill_curve(engine.id)
    if curve is None:
        return Claim(lambda: None)
    credit = min(1.0, ctx.config.cache.affinity)
    work = credited_prefill_s(curve, tokens, cached, credit)
    chunk = ctx.config.engine.prefill_chunk_tokens
    shared = shared_overhead_s(curve.prefill_s(0), tokens, chunk)
    backlog = ctx.backlog
    backlog.commit(engine, work, trio.current_time(), shared)
    return Claim(lambda: backlog.release(engine))


@asynccontextmanager
async def phase_slot(
    ctx: ServingContext,
    engine: EngineState,
    phase: Literal["prefill", "decode"],
    tokens: int,
    *,
    not_after: float = math.inf,
    pending: Claim | None = None,
) -> AsyncIterator[None]:
    """Hold one of the engine's phase slots (serving.*_concurrency) and account load.

    A prefill waiting for its slot counts as queued prefill work on the engine from
    the moment it is placed (`book_prefill`); a decode's load moves from pending to
    active here.
    """
    limiter = engine.prefill_limiter if phase == "prefill" else engine.decode_limiter
    borrower = object()
    # Committed when the leg is placed, so later arrivals see it while it waits. The
    # whole prompt, whatever the engine holds cached: booked at the cached price, the
    # pair path ran 0.3-0.4 s past its projection at the median on the prefix benchmark
    # (0.2 s booking it whole), and admission refused half as many
    # (docs/benchmarks.md#cache-aware-serving).
    booked = book_prefill(ctx, engine, tokens) if phase == "prefill" else None
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
        if booked is not None:
            booked.release()
        raise
    if expired or trio.current_time() > not_after:
        if not expired:
            limiter.release_on_behalf_of(borrower)
        raise HandoffExpired
    if pending is not None:
        pending.release()
    leg = engine.load.prefill(tokens) if phase == "prefill" else engine.load.decode(tokens)
    try:
        with leg:
            yield
    finally:
        if phase == "decode":
            # The KV the prompt held is freed with the slot.
            ctx.kv_freed(engine, tokens, trio.current_time())
        elif booked is not None:
            booked.release()
        limiter.release_on_behalf_of(borrower)


class KvGrowth:
    """A streamed decode leg's generated tokens, counted into its engine's resident KV
    (`decode_tokens`, the prompt's share being held by the phase slot) while the leg
    runs: pricing reads it as the KV the engine has committed."""

    __slots__ = ("cap", "decisions", "engine", "estimate", "generated", "reported")

    def __init__(self, decisions: Decisions, engine: EngineState, cap: int | None) -> None:
        self.decisions = decisions
        self.engine = engine
        self.cap = math.inf if cap is None else cap  # the request's output bound
        self.generated = decisions.generated(engine)
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

    def __enter__(self) -> KvGrowth:
        return self

    def __exit__(self, *exc: object) -> None:
        self.generated.release()
        # The engine's report, when it sent one, is the KV turnover.
        freed = self.generated.tokens if self.reported is None else self.reported
        self.decisions.kv_freed(self.engine, freed)


class Leg:
    """One engine request of exchange `x`: its `phase` on `engine`, the instance placed
    (a reload may replace an engine of the same id while the leg runs). `prefilling`:
    the prefill booked on the engine by a leg that computes the prompt there, released
    at its first token."""

    __slots__ = ("engine", "phase", "prefilling", "x")

    def __init__(
        self, x: Exchange, engine: EngineState, phase: LegPhase, prefilling: Claim | None = None
    ) -> None:
        self.x = x
        self.engine = engine
        self.phase = phase
        self.prefilling = prefilling

    @asynccontextmanager
    async def request(self, body: bytes) -> AsyncIterator[Response]:
        """The engine HTTP request; transport failures become EngineFailed here, once.

        A connect whose deadline the router's own loop lag explains is made once more
        before it fails the leg: nothing reached the engine, so it is safe for either
        leg of a pair, and a stalled router would otherwise fail a request (and its
        handed-off KV) that an idle engine could serve."""
        engine, phase = self.engine, self.phase
        path = ENDPOINT_PATHS[self.x.request.kind]
        for again in (True, False):
            answered_head = False
            try:
                async with engine.serving_pool.request(
                    b"POST", path, json_headers(self.x.request.id), body
                ) as response:
                    answered_head = True
                    yield response
                return
            except ConnectError as exc:
                failure = failed(
                    engine,
                    phase,
                    FailureKind.UNREACHABLE,
                    str(exc),  # names the engine's host and port
                    public="could not connect to the engine",
                    deadline_s=exc.timeout_s,
                )
                if answered_head or not again or not self._lag_explains(exc):
                    # A connect deadline is still excused by recovery's leg_failed
                    # when the lag explains it: under a client flood the handshake's
                    # answer waits unread, and the engine would be taken out.
                    raise failure from None
                self.x.decisions.leg_failed(failure, engine)
            except RemoteProtocolError as exc:
                raise failed(engine, phase, FailureKind.CONNECTION_LOST, str(exc)) from None
            except PoolTimeout as exc:
                # Local starvation is not the engine's fault and is not retried
                # (docs/design.md#retries).
                raise Unavailable(
                    str(exc),
                    code=ErrorCode.POOL_EXHAUSTED,
                    public=f"no connection to a {phase} engine within engine.pool_timeout_s="
                    f"{self.x.config.engine.pool_timeout_s}",
                ) from None

    def _lag_explains(self, exc: ConnectError) -> bool:
        return exc.timeout_s is not None and self.x.ctx.loop_lag.starved(exc.timeout_s) is not None

    async def status_failure(self, response: Response) -> EngineFailed:
        """The failure of an answer with another status than 200."""
        engine, phase = self.engine, self.phase
        try:
            raw = await response.aread(ERROR_BODY_LIMIT)
        except ResponseTooLarge:
            raw = b""
        info = parse_error_body(response.status, raw)
        status = response.status
        kind = classify_answer(info, bootstrap_pair=bootstrap_pair(engine, phase))
        config = self.x.config
        if kind is FailureKind.KEY_REFUSED:
            why = key_refused(engine, status, info.message, config)
            public = f"refused narwhal's API key (HTTP {status}): the router's configuration"
            return answered(engine, phase, kind, why, f"{public} is at fault, not the request")
        if kind is FailureKind.MODEL_MISSING:
            why = model_refused(engine, info.message, config)
            public = f"does not serve model {engine.spec.model!r}: the router's configuration"
            return answered(engine, phase, kind, why, f"{public} is at fault, not the request")
        if kind is FailureKind.TRANSFER_FAILED:
            return transfer_failed(engine, phase, info.message)
        answer = f"returned HTTP {status}: {info.message}"
        return answered(engine, phase, kind, answer, status=status, param=info.param)

    async def read_whole(
        self,
        body: bytes,
        *,
        timeout_s: float,
        on_timeout: FailureKind,
        timeout_setting: str,
        prompt_tokens: int = 0,
        sse: bool = False,
    ) -> bytes:
        """The answer read whole, retained up to serving.max_response_bytes.

        `sse`: the body is an event stream (SGLang's prefill leg shares the client's
        streamed body), and an error event inside its 200 fails the leg."""
        engine, phase = self.engine, self.phase
        limit = self.x.config.serving.max_response_bytes
        started = trio.current_time()
        alone = self.x.decisions.alone(engine)
        with trio.move_on_after(timeout_s) as timer:
            async with self.request(body) as response:
                if response.status != 200:
                    raise await self.status_failure(response)
                try:
                    raw = await response.aread(limit)
                except ResponseTooLarge:
                    raise failed(
                        engine,
                        phase,
                        FailureKind.TOO_LARGE,
                        f"response exceeds serving.max_response_bytes={limit}",
                    ) from None
                if sse:
                    raise_stream_error(engine, phase, raw)
        if not timer.cancelled_caught:
            self.x.decisions.leg_ok(
                engine,
                phase,
                trio.current_time() - started,
                prompt_tokens=prompt_tokens,
                alone=alone,
            )
            return raw
        detail = f"exceeded {timeout_setting}={timeout_s}"
        raise failed(engine, phase, on_timeout, detail, deadline_s=timeout_s)

    async def produce(
        self,
        body: bytes,
        *,
        first_token_budget: float,
        timer: trio.CancelScope | None = None,
        hold_until: trio.Event | None = None,
        own_usage: bool = False,
        unstreamed: str | None = None,
    ) -> None:
        """Run the leg that produces the client's output.

        Its events go to the client, or to a `Collector` for a non-streaming request
        (the client gets the assembled document once the stream has ended with
        [DONE]). `unstreamed` names why a leg was sent non-streaming instead (see
        `unassemblable_reason`): it is read whole, with only the request deadline.
        `hold_until`: nothing is written before it is set (an SGLang pair's prefill)."""
        x, engine = self.x, self.engine
        x.record.stage = "decode"
        if unstreamed is not None:
            await self._produce_unstreamed(body, unstreamed, hold_until)
            return
        sink: Sink = x.client
        collector = None
        if not x.request.stream:
            sink = collector = Collector(
                engine, self.phase, x.request, x.config.serving.max_response_bytes
            )
        elif hold_until is None:
            # docs/design.md#streaming-failures: commit 200 before decode starts.
            await x.client.start_stream()
        if timer is None:
            timer = trio.CancelScope(deadline=trio.current_time() + first_token_budget)
        if self.phase == "decode" and not engine.dialect.concurrent_legs:
            with x.decisions.awaiting_first_token(engine, trio.current_time()) as waiting:
                await self.relay(
                    body,
                    sink,
                    timer,
                    hold_until=hold_until,
                    own_usage=own_usage,
                    first_token_seen=waiting.release,
                )
        else:
            await self.relay(body, sink, timer, hold_until=hold_until, own_usage=own_usage)
        if collector is not None:
            document = encode(collector.result())
            if hold_until is not None:
                await hold_until.wait()
            x.record.stage = "writing"
            await x.client.send_json(200, document)

    async def _produce_unstreamed(
        self, body: bytes, reason: str, hold_until: trio.Event | None
    ) -> None:
        x, engine = self.x, self.engine
        x.ctx.unstreamed_legs[reason] += 1
        x.ctx.metrics.unstreamed_legs_by(reason).inc()
        bound = leg_output_bound(x.request, x.record.prompt_tokens, engine.context_length)
        with x.decisions.unstreamed_decode(engine, bound, trio.current_time()):
            raw = await self.read_whole(
                body,
                timeout_s=math.inf,
                on_timeout=FailureKind.DECODE_TIMEOUT,
                timeout_setting="",
                prompt_tokens=x.record.prompt_tokens or 0,
            )
        document = loads(raw, engine, self.phase)  # relayed as application/json: JSON
        if self.phase == "aggregate":
            engine_cached(x, engine, usage_cached_tokens(document))
        # The KV its output held is freed now too (the slot frees the prompt's); vLLM
        # and SGLang both report it.
        generated = usage_tokens(document, "completion_tokens") or 0
        if generated > 0:
            x.decisions.kv_freed(engine, generated)
        if hold_until is not None:
            await hold_until.wait()
        x.record.stage = "writing"
        await x.client.send_json(200, raw)

    async def relay(
        self,
        body: bytes,
        sink: Sink,
        timer: trio.CancelScope,
        *,
        hold_until: trio.Event | None,
        own_usage: bool,
        first_token_seen: Callable[[], None] | None = None,
    ) -> None:
        """Relay the engine's event stream to `sink` as the `StreamMeter` decides."""
        x, engine, phase, record = self.x, self.engine, self.phase, self.x.record
        started = trio.current_time()
        alone = self.x.decisions.alone(engine)
        gap = x.config.engine.decode_read_timeout_s or math.inf
        meter = StreamMeter(limit=x.config.serving.max_response_bytes, own_usage=own_usage)
        load = GapLoad()
        growth = None
        if phase != "prefill":
            bound = leg_output_bound(x.request, record.prompt_tokens, engine.context_length)
            growth = KvGrowth(x.decisions, engine, bound)
        with timer, growth or nullcontext():
            async with self.request(body) as response:
                await self._expect_stream(response)
                while not meter.done:
                    chunk = await response.receive_available()
                    now = trio.current_time()
                    if not chunk:
                        detail = "stream ended without the [DONE] terminator"
                        raise failed(engine, phase, FailureKind.TRUNCATED, detail)
                    if meter.first_at is not None:
                        timer.deadline = now + gap  # partial lines and metadata reset it too
                    release = hold_until is None or hold_until.is_set()
                    step = meter.feed(chunk, now, release=release)
                    if step.first:
                        timer.deadline = now + gap
                        self._first_token(now, started, release, first_token_seen)
                    if step.tokens:
                        load.add(engine, step.gaps, now)
                        if growth is not None:
                            growth.add(step.tokens)
                    if growth is not None:
                        growth.reported = meter.reported
                    if step.fault is not None:
                        raise fault_failure(engine, phase, step.fault)
                    if step.send is not None:
                        if record.first_output_at is None:
                            record.first_output_at = now  # SGLang: held until the prefill
                        record.stage = "streaming"
                        await sink.send_chunk(step.send)
                        load.longest_write_s = max(load.longest_write_s, trio.current_time() - now)
        generated, summary = self._stream_account(meter, load)
        if phase == "aggregate":
            engine_cached(x, engine, meter.reported_cached)
        if timer.cancelled_caught:
            raise self._silence(meter, started, gap)
        if meter.held:
            if hold_until is not None:
                await hold_until.wait()
            if meter.first_at is not None and record.first_output_at is None:
                record.first_output_at = trio.current_time()
            await sink.send_chunk(meter.take_held())
        tpot_s = meter.tpot_s(generated)
        if tpot_s is not None:
            record.observed_tpot_s = tpot_s
            x.ctx.metrics.tpot.observe(tpot_s)
        x.decisions.leg_ok(
            engine,
            phase,
            trio.current_time() - started,
            prompt_tokens=record.prompt_tokens or 0,
            alone=alone,
            gaps=summary if summary is not None and load.alone(summary) else None,
        )
        await sink.end_stream()

    async def _expect_stream(self, response: Response) -> None:
        if response.status != 200:
            raise await self.status_failure(response)
        kind = response.header(b"content-type") or b""
        if kind.split(b";")[0].strip().lower() == b"application/json":
            # Read as a stream, it would only end "without [DONE]": say what it is.
            raise failed(
                self.engine,
                self.phase,
                FailureKind.BAD_RESPONSE,
                "answered a streaming request with application/json, not an event stream",
            )

    def _first_token(
        self,
        now: float,
        started: float,
        release: bool,
        first_token_seen: Callable[[], None] | None,
    ) -> None:
        x = self.x
        if self.prefilling is not None:
            self.prefilling.release()
        if release:
            x.record.first_output_at = now
        x.ctx.metrics.ttft_by(self.phase).observe(now - x.request.arrival)
        if first_token_seen is not None:
            first_token_seen()
            # The decode request went out after its prefill answered, so this is the
            # decode side's whole share of the TTFT.
            x.decisions.first_token_lag(self.engine, now - started)

    def _stream_account(self, meter: StreamMeter, load: GapLoad) -> tuple[int, DecodeGaps | None]:
        """The tokens the stream generated and its gaps' summary, reported to the
        engine's packing estimate and to the serving signals."""
        engine = self.engine
        if meter.reported is not None:
            engine.observe_packing(meter.tokens, meter.reported)
        generated, gaps = meter.outcome(self.x.request.n)
        summary = load.summary(gaps)  # one per stream: the controller, correction, residual
        if summary is not None:
            self.x.decisions.decode_gaps(engine, summary)
        return generated, summary

    def _silence(self, meter: StreamMeter, started: float, gap: float) -> EngineFailed:
        """The failure of a stream whose timer ran out."""
        x, engine, phase = self.x, self.engine, self.phase
        if meter.first_at is None:
            waited = trio.current_time() - started
            if x.ctx.loop_lag.starved(waited) is None:
                # Otherwise the router's own lag explains it: it says nothing about decode
                # capacity, so it does not reset the controller's evidence window.
                x.decisions.first_token_timeout(engine)
            return failed(
                engine,
                phase,
                FailureKind.FIRST_TOKEN_TIMEOUT,
                f"no first token within engine.first_token_timeout_s="
                f"{x.config.engine.first_token_timeout_s}",
                deadline_s=waited,
            )
        # A stream's client has seen its first token by now, so only a non-streaming
        # request, with nothing shown, retries.
        return failed(
            engine,
            phase,
            FailureKind.DECODE_STALLED,
            f"engine was silent for engine.decode_read_timeout_s="
            f"{x.config.engine.decode_read_timeout_s}",
            deadline_s=gap,
        )


def engine_cached(x: Exchange, engine: EngineState, count: int | None) -> None:
    """Record the prompt tokens `engine`, which computed the prompt, said it found cached
    (`usage_cached_tokens`; None: it did not say), and count them."""
    x.record.engine_cached_tokens = count
    if count:
        x.ctx.metrics.engine_cached_prompt_tokens.labels(engine.id).inc(count)


def leg_output_bound(
    request: ClientRequest, prompt_tokens: int | None, context: int | None
) -> int | None:
    """The most tokens the request's n sequences can generate, each capped by the room its
    prompt leaves in the context; None: no bound but the context."""
    bound = output_bound(request.max_tokens, prompt_tokens, context)
    return None if bound is None else bound * request.n


def leg_body(request: ClientRequest, engine: EngineState) -> tuple[Json, bool, str | None]:
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


def json_headers(request_id: str) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json"), (b"x-request-id", request_id.encode())]


def _acquire_nowait(limiter: trio.CapacityLimiter, borrower: object) -> bool:
    try:
        limiter.acquire_on_behalf_of_nowait(borrower)
    except trio.WouldBlock:
        return False
    return True
