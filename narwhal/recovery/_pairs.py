"""Verification pairs on the wire: a complete prefill leg and decode leg, as clients'.

Owns
  `verify_pair`: the legs of a `VerifyPair` in the engines' dialect, each bounded on its
  own by engine.first_token_timeout_s (docs/design.md#deadlines), and whom a failure is due to.
  - vLLM: the prefill leg asks the producer to keep its KV for a remote decode; the
    decode leg hands the returned `kv_transfer_params` to the consumer, which pulls
    the KV, so a verification exercises exactly the handoff real traffic uses and
    leaves no KV behind.
  - SGLang: both legs at once with one bootstrap room, as the request path does.
  - A local pair (role `both`, or no available partner of the other role): a one-token
    non-streaming completion (prefill) and a one-token streamed one (decode) on the
    subject. Never on an SGLang prefill or decode server: its role is fixed at launch
    and it answers a request without bootstrap_room with 400
    (docs/design.md#sglang-bootstrap); recovery never builds one, and one handed here is reported
    inconclusive, unsent.

Invariants
  The decode leg must deliver at least one generated event and the `[DONE]` terminator.
  A failed pair names the engine it is certainly due to (`VerifyResult.culprit`), if
  any. How an engine answered is its own doing: a refused or dropped connection, an
  oversized or cut-off answer. What it answered (an error status or event, no token,
  no answer in time) is its own only when its leg depends on no other engine: a vLLM
  prefill leg and both legs of a local pair. Otherwise the partner may have caused it:
  an SGLang leg waits for the other one in the bootstrap room (a prefill that never
  joins leaves the decode waiting, then failing its KV transfer with 500; a decode
  that never joins leaves the prefill waiting), and a vLLM decode leg pulls the
  prefill's KV.

Errors (as the result's outcome)
  refused: a leg answered 401/403 (Narwhal's API key) or a 404 naming the model; the
  caller judges it as the request path does (`fleet.key_refused`,
  `fleet.model_refused`), not as a failed verification. inconclusive: a leg answered
  429 (busy, not broken; the request path never counts a 429 either), or no free
  control connection.
"""

from __future__ import annotations

import json

import trio

from .._errors import ENGINE_AUTH_STATUSES
from ..config import Config
from ..engines import (
    SGLANG_DEFAULT_BOOTSTRAP_PORT,
    ConnectError,
    PoolTimeout,
    RemoteProtocolError,
    ResponseTooLarge,
    SseKind,
    SseScanner,
    parse_error_body,
)
from ..engines._dialects import (
    encode,
    new_bootstrap_room,
    sglang_pd_body,
    vllm_decode_body,
    vllm_kv_params,
    vllm_prefill_body,
)
from ..engines._sse import SseOverflow
from ..fleet import EngineState, names_model
from ._control import SMALL_BODY, Exhausted, check_free, headers, refused_detail
from ._evidence import KeyRefusal, ModelRefusal, VerifyPair, VerifyResult

_VERIFY_PROMPT = "Narwhal verification."


class _LegFailed(Exception):
    """A leg on `engine` failed; `own`: certainly through that engine's own fault."""

    def __init__(
        self, message: str, engine: EngineState, *, own: bool, deadline_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.engine = engine
        self.own = own
        self.deadline_s = deadline_s  # the leg's deadline expired


class _LegRefused(_LegFailed):
    def __init__(self, detail: str, refusal: KeyRefusal | ModelRefusal) -> None:
        super().__init__(detail, refusal.engine, own=True)
        self.refusal = refusal


class _LegBusy(_LegFailed):
    """The engine answered 429: it is busy, not broken, as the request path and the
    breakers judge it (such a failure never counts against an engine)."""

    def __init__(self, detail: str, engine: EngineState) -> None:
        super().__init__(detail, engine, own=True)


async def verify_pair(pair: VerifyPair, config: Config) -> VerifyResult:
    """Run `pair`'s two legs, each bounded by engine.first_token_timeout_s."""
    limit = config.engine.first_token_timeout_s
    subject = pair.subject
    if pair.local and subject.role != "both" and subject.fixed_role is not None:
        return VerifyResult(
            "inconclusive",
            f"{pair.describe()} not sent: {subject.id} is a {subject.role} server of "
            f"dialect {subject.dialect.name}; {subject.fixed_role}",
        )
    try:
        check_free(pair.prefill)
        check_free(pair.decode)
        if pair.local:
            await _local_pair(pair, limit)
        elif pair.prefill.dialect.concurrent_legs:
            await _sglang_pair(pair, limit)
        else:
            await _vllm_pair(pair, limit)
    except Exhausted as exc:
        return VerifyResult("inconclusive", str(exc))
    except _LegRefused as exc:
        return VerifyResult("refused", f"{pair.describe()}: {exc}", refusal=exc.refusal)
    except _LegBusy as exc:
        busy = f"{pair.describe()}: {exc}; a busy engine is not a failed one"
        return VerifyResult("inconclusive", busy)
    except _LegFailed as exc:
        culprit = exc.engine.id if exc.own else None
        detail = f"{pair.describe()}: {exc}"
        return VerifyResult("failed", detail, culprit, deadline_s=exc.deadline_s)
    return VerifyResult("ok", f"{pair.describe()} completed")


def _body(engine: EngineState, *, stream: bool) -> dict[str, object]:
    return {
        "model": engine.spec.model,
        "prompt": _VERIFY_PROMPT,
        "max_tokens": 1,
        "temperature": 0,
        "stream": stream,
    }


async def _local_pair(pair: VerifyPair, limit: float) -> None:
    engine = pair.subject
    prefill, decode = encode(_body(engine, stream=False)), encode(_body(engine, stream=True))
    await _json_leg(engine, "prefill", prefill, pair, limit, paired=False)
    await _stream_leg(engine, "decode", decode, pair, limit, paired=False)


async def _vllm_pair(pair: VerifyPair, limit: float) -> None:
    raw = await _json_leg(
        pair.prefill,
        "prefill",
        encode(vllm_prefill_body(_body(pair.prefill, stream=False))),
        pair,
        limit,
        paired=False,
    )
    try:
        kv_params = vllm_kv_params(json.loads(raw))
    except ValueError:
        raise _LegFailed(
            f"prefill leg on {pair.prefill.id} returned a body that is not JSON",
            pair.prefill,
            own=True,
        ) from None
    body = vllm_decode_body(_body(pair.decode, stream=True), kv_params)
    await _stream_leg(pair.decode, "decode", encode(body), pair, limit, paired=True)


async def _sglang_pair(pair: VerifyPair, limit: float) -> None:
    prefill = pair.prefill
    port = prefill.spec.bootstrap_port or SGLANG_DEFAULT_BOOTSTRAP_PORT
    room = new_bootstrap_room()
    prefill_body = encode(
        sglang_pd_body(_body(prefill, stream=False), host=prefill.host, port=port, room=room)
    )
    decode_body = encode(
        sglang_pd_body(_body(pair.decode, stream=True), host=prefill.host, port=port, room=room)
    )
    failures: list[_LegFailed] = []

    async def leg(kind: str) -> None:
        try:
            if kind == "prefill":
                await _json_leg(prefill, "prefill", prefill_body, pair, limit, paired=True)
            else:
                await _stream_leg(pair.decode, "decode", decode_body, pair, limit, paired=True)
        except _LegFailed as exc:
            failures.append(exc)
            legs.cancel_scope.cancel()

    async with trio.open_nursery() as legs:
        legs.start_soon(leg, "prefill")
        legs.start_soon(leg, "decode")
    if failures:
        raise failures[0]


class _Leg:
    """Raises one leg's failures, each charged to the leg's engine or not (`paired`: what
    the engine answers depends on its partner; see the module docstring)."""

    def __init__(self, engine: EngineState, leg: str, *, paired: bool) -> None:
        self.engine = engine
        self.where = f"{leg} leg on {engine.id}"
        self.paired = paired

    def broken(self, detail: str) -> _LegFailed:
        """How the engine answered: its own fault whatever the partner did."""
        return _LegFailed(detail, self.engine, own=True)

    def answered(self, detail: str, deadline_s: float | None = None) -> _LegFailed:
        """What the engine answered (or that it did not within `deadline_s`): its own
        fault unless the partner had a part in it."""
        return _LegFailed(detail, self.engine, own=not self.paired, deadline_s=deadline_s)

    def status(self, status: int, raw: bytes) -> _LegFailed:
        info = parse_error_body(status, raw)
        if status in ENGINE_AUTH_STATUSES:
            # The engine's own refusal, whatever the partner did; not a failure either.
            refusal = KeyRefusal(self.engine, status, info.message)
            return _LegRefused(refused_detail(self.where, refusal), refusal)
        if names_model(status, info):
            # Launched under another name: refused whatever the partner did, and no
            # failure of its health either.
            model = ModelRefusal(self.engine, info.message)
            detail = f"{self.where} returned HTTP 404: {info.message}"
            return _LegRefused(detail, model)
        if status == 429:
            return _LegBusy(f"{self.where} returned HTTP 429", self.engine)
        return self.answered(f"{self.where} returned HTTP {status}")

    def late(self, limit: float) -> _LegFailed:
        detail = f"{self.where} did not complete within engine.first_token_timeout_s={limit}"
        return self.answered(detail, deadline_s=limit)


async def _json_leg(
    engine: EngineState, leg: str, body: bytes, pair: VerifyPair, limit: float, *, paired: bool
) -> bytes:
    fail = _Leg(engine, leg, paired=paired)
    with trio.move_on_after(limit):
        try:
            async with engine.control_pool.request(
                b"POST", b"/v1/completions", headers(pair.request_id), body
            ) as response:
                raw = await response.aread(SMALL_BODY)
                if response.status != 200:
                    raise fail.status(response.status, raw)
                return raw
        except PoolTimeout as exc:
            raise Exhausted(str(exc)) from None
        except (ConnectError, RemoteProtocolError, ResponseTooLarge) as exc:
            raise fail.broken(f"{fail.where}: {exc}") from None
    raise fail.late(limit)


async def _stream_leg(
    engine: EngineState, leg: str, body: bytes, pair: VerifyPair, limit: float, *, paired: bool
) -> None:
    fail = _Leg(engine, leg, paired=paired)
    where = fail.where
    scanner = SseScanner()
    received = 0
    with trio.move_on_after(limit):
        try:
            async with engine.control_pool.request(
                b"POST", b"/v1/completions", headers(pair.request_id), body
            ) as response:
                if response.status != 200:
                    raw = await response.aread(SMALL_BODY)
                    raise fail.status(response.status, raw)
                data_events = 0
                while chunk := await response.receive_some():
                    received += len(chunk)
                    if received > SMALL_BODY:
                        raise fail.broken(f"{where} sent more than {SMALL_BODY} bytes")
                    for event in scanner.feed(chunk):
                        if event.kind is SseKind.ERROR:
                            message = (event.error or {}).get("message", "error event")
                            raise fail.answered(f"{where} reported an error: {message}")
                        if event.kind is SseKind.DATA:
                            data_events += 1
                        if event.kind is SseKind.DONE:
                            if data_events == 0:
                                raise fail.answered(f"{where} ended without generating a token")
                            return
                # Engines end even a failed stream with [DONE]: a stream cut short is
                # the engine's (or its connection's) own breakage.
                raise fail.broken(f"{where} ended without the [DONE] terminator")
        except PoolTimeout as exc:
            raise Exhausted(str(exc)) from None
        except (ConnectError, RemoteProtocolError, ResponseTooLarge, SseOverflow) as exc:
            raise fail.broken(f"{where}: {exc}") from None
    raise fail.late(limit)
