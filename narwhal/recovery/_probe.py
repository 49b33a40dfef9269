"""Talking to engines on their control pools: health probes, identity, load, verification.

Everything here runs on `EngineState.control_pool`, the connections reserved for health
and recovery (engine.control_connections), so probes never queue behind client traffic
and client traffic never waits for a probe. When that pool has no free connection the
probe does not wait for one: it reports `inconclusive`, which leaves the verdict as it
was (manual 4.1: probe exhaustion leaves the engine verdict unchanged).

Deadlines: a health probe (GET /health, then GET /version for the engine's identity,
which SGLang guards with its --api-key: a refusal there is reported with the probe)
gets engine.health_timeout_s in total, as do a /metrics scrape and a key check (GET
/v1/models, which the engine guards with its --api-key). A verification pair
runs a complete prefill leg and a complete decode leg, each bounded on its own by
engine.first_token_timeout_s (manual 6), in the engine's dialect:

- vLLM: the prefill leg asks the producer to keep its KV for a remote decode; the
  decode leg hands the returned `kv_transfer_params` to the consumer, which pulls the
  KV, so a verification exercises exactly the handoff real traffic uses and leaves no
  KV behind.
- SGLang: both legs at once with one bootstrap room, as the request path does.
- An engine with role `both`, or one with no available partner of the other role, is
  verified with a local pair on itself: a one-token non-streaming completion (prefill)
  and a one-token streamed completion (decode). Not an SGLang prefill or decode
  server: its role is fixed at launch and it answers a request without bootstrap_room
  with 400 (engine-protocols notes §5.2), so a local pair would fail a healthy engine.
  Recovery never builds one (it pairs such an engine with a server of the other role,
  or skips); a local pair handed here for one is reported inconclusive, unsent.

The decode leg must deliver at least one generated event and the `[DONE]` terminator.

A failed pair names the engine it is certainly due to (`VerifyResult.culprit`), if any.
How an engine answered is its own doing: a refused or dropped connection, an oversized
or cut-off answer. What it answered (an error status or event, no token, no answer in
time) is its own only when its leg depends on no other engine: a vLLM prefill leg and
both legs of a local pair. Otherwise the partner may have caused
it: an SGLang leg waits for the other one in the bootstrap room (a prefill that never
joins leaves the decode waiting, then failing its KV transfer with 500; a decode that
never joins leaves the prefill waiting), and a vLLM decode leg pulls the prefill's KV.

A leg answered with 401/403 makes the pair `refused`, naming the engine that refused
Narwhal's API key: the caller judges that as the request path does (`fleet.key_refused`),
not as a failed verification, since the engine refuses the key, not the work. A leg
answered with 429 makes it `inconclusive`: the engine is busy, not broken, and the
request path never counts a 429 against an engine either.
"""

from __future__ import annotations

import json
import math
from typing import Literal, Protocol

import attrs
import trio

from .._errors import ENGINE_AUTH_STATUSES
from ..config import Config
from ..engines import (
    SGLANG_DEFAULT_BOOTSTRAP_PORT,
    ConnectError,
    ConnectionPool,
    PoolTimeout,
    RemoteProtocolError,
    ResponseTooLarge,
    SseKind,
    SseScanner,
    parse_error_body,
)
from ..engines._dialects import (
    card_context,
    encode,
    lists_model,
    new_bootstrap_room,
    sglang_pd_body,
    truncates_requests,
    vllm_decode_body,
    vllm_kv_params,
    vllm_prefill_body,
)
from ..engines._sse import SseOverflow
from ..fleet import EngineState, explain_refusal, names_model
from ._health import Identity

Outcome = Literal["ok", "failed", "inconclusive"]
VerifyOutcome = Literal["ok", "failed", "inconclusive", "refused"]
KeyOutcome = Literal["accepted", "refused", "failed", "inconclusive"]

_SMALL_BODY = 64 * 1024
# SGLang's /get_server_info lists every server arg (some 20-40 KB); a /v1/models answer
# grows with the LoRA adapters loaded. The bound is for a broken engine.
_INFO_BODY = 1024 * 1024
# A vLLM /metrics page is ~100 KB; the bound is for a broken or hostile engine.
METRICS_BODY_LIMIT = 8 * 1024 * 1024
_VERIFY_PROMPT = "Narwhal verification."
_IDENTITY_KEYS = ("version", "build", "instance_id")


@attrs.frozen
class KeyRefusal:
    """An engine answered one of recovery's requests with HTTP 401/403: it refused
    Narwhal's API key, as it would the request path's (`fleet.key_refused`)."""

    engine: EngineState
    status: int
    message: str  # the engine's, from its error body


@attrs.frozen
class ModelRefusal:
    """An engine answered one of recovery's legs with a 404 naming the model: it does
    not serve its engines[].model, as the request path would find (`fleet.model_refused`)."""

    engine: EngineState
    message: str  # the engine's, from its error body


@attrs.frozen
class ProbeResult:
    outcome: Outcome
    detail: str
    # False: the connection was refused or failed; None: cannot tell (a timeout).
    reachable: bool | None
    identity: Identity | None = None
    # The identity check (GET /version) was refused: SGLang guards /version with its
    # --api-key, unlike its health route.
    refusal: KeyRefusal | None = None
    # "failed" for want of an answer within this deadline (engine.health_timeout_s).
    deadline_s: float | None = None


@attrs.frozen
class LoadSample:
    """The engine's own view of its load (its /metrics)."""

    running: float
    waiting: float
    kv_usage: float | None
    # prometheus_client's process collector (vLLM with one API server); None when absent.
    started_at: float | None = None
    # The prompt-token counter per series (its label text, one per rank): it restarts
    # from zero with the engine. None when absent.
    prompt_tokens: tuple[tuple[str, float], ...] | None = None
    # The engine has not published its running and waiting gauges yet, which a fresh
    # SGLang server does only once its scheduler first reports (a decode server after
    # 40 decode steps or an idle tick, `_GAUGES_LATER`): read as no load, not a fault.
    gauges_pending: bool = False


@attrs.frozen
class ContextReading:
    """What an engine says of its context length: `length` and where it was read, or
    None and why not. `final`: the answer settles it until the engine restarts; a failed
    request is asked again at the next good probe."""

    length: int | None
    detail: str
    final: bool = True
    # Whether the /v1/models answer lists the configured model; None when there was no
    # model list to read (`model_refused` takes an engine out by a 404, this readmits it).
    listed: bool | None = None


class ScrapeError(Exception):
    """This engine's load could not be observed in this pass."""


@attrs.frozen
class KeyCheck:
    """Whether an engine takes Narwhal's API key: accepted (HTTP 200), refused (401/403),
    failed (any other answer, or none) or inconclusive (no free control connection)."""

    outcome: KeyOutcome
    detail: str


@attrs.frozen
class VerifyResult:
    # refused: an engine of the pair refused Narwhal's API key or the model (`refusal`
    # names it), which says nothing of either engine's health.
    outcome: VerifyOutcome
    detail: str
    # "failed" only: the engine the failure is certainly due to; None when the other
    # engine of the pair may have caused it (see the module docstring).
    culprit: str | None = None
    refusal: KeyRefusal | ModelRefusal | None = None
    # "failed" for want of an answer within this deadline (engine.first_token_timeout_s).
    deadline_s: float | None = None


@attrs.frozen(eq=False)
class VerifyPair:
    """Which engine runs which verification leg; `subject` is the one being judged.

    `standby`: the partner is out of service itself (it answers its health probe but has
    not passed a verification), so it is no known-good reference for the subject."""

    subject: EngineState
    phase: str
    prefill: EngineState
    decode: EngineState
    request_id: str
    standby: bool = False

    @property
    def local(self) -> bool:
        return self.prefill is self.decode

    @property
    def partner(self) -> EngineState | None:
        if self.local:
            return None
        return self.decode if self.prefill is self.subject else self.prefill

    def describe(self) -> str:
        if self.local:
            return f"local pair on {self.subject.id}"
        text = f"prefill on {self.prefill.id}, decode on {self.decode.id}"
        if self.standby:
            text += " (standby partner: itself out of service)"
        return text


class Prober(Protocol):
    """Engine I/O used by recovery and the monitor; tests inject fakes."""

    async def health(self, engine: EngineState, config: Config) -> ProbeResult: ...

    async def scrape(self, engine: EngineState, config: Config) -> LoadSample: ...

    async def verify(self, pair: VerifyPair, config: Config) -> VerifyResult: ...

    async def check_key(self, engine: EngineState, config: Config) -> KeyCheck: ...

    async def context(self, engine: EngineState, config: Config) -> ContextReading: ...


class _Exhausted(Exception):
    pass


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


def _free(pool: ConnectionPool) -> bool:
    stats = pool.statistics()
    return stats.in_use < stats.max_connections


def _check_free(engine: EngineState) -> None:
    # Checked synchronously right before the request: the pool then hands out a slot
    # without waiting, so a probe never waits on an exhausted control pool.
    if not _free(engine.control_pool):
        stats = engine.control_pool.statistics()
        raise _Exhausted(
            f"control pool of {engine.id} exhausted ({stats.in_use}/{stats.max_connections} "
            "in use; engine.control_connections)"
        )


async def _get(
    engine: EngineState, path: bytes, limit: int = _SMALL_BODY
) -> tuple[int, bytes] | ProbeResult:
    """GET `path` on the control pool: the status and body, or the failed or
    inconclusive probe result when there is no answer."""
    where = f"GET {path.decode()}"
    try:
        _check_free(engine)
        async with engine.control_pool.request(b"GET", path, _headers()) as response:
            return response.status, await response.aread(limit)
    except (_Exhausted, PoolTimeout) as exc:
        return ProbeResult("inconclusive", str(exc), None)
    except ConnectError as exc:
        return ProbeResult("failed", f"{where}: {exc}", False)
    except (RemoteProtocolError, ResponseTooLarge) as exc:
        return ProbeResult("failed", f"{where}: {exc}", True)


async def _get_json(engine: EngineState, path: bytes) -> object:
    """GET `path` on the control pool: its JSON answer, or (a str) why there is none."""
    where = f"GET {path.decode()}"
    answer = await _get(engine, path, _INFO_BODY)
    if isinstance(answer, ProbeResult):
        return answer.detail
    status, raw = answer
    if status != 200:
        return f"{where} returned HTTP {status}"
    try:
        document: object = json.loads(raw)
    except (ValueError, RecursionError):
        return f"{where} returned a body that is not JSON"
    return document


def _headers(request_id: str | None = None) -> list[tuple[bytes, bytes]]:
    headers = [(b"accept", b"*/*")]
    if request_id is not None:
        headers += [(b"content-type", b"application/json"), (b"x-request-id", request_id.encode())]
    return headers


def _refused_detail(where: str, refusal: KeyRefusal) -> str:
    # The control pool carries the engine's one configured key, as the serving pool does.
    sends_key = refusal.engine.control_pool.sends_api_key
    why = explain_refusal(refusal.status, sends_key=sends_key, message=refusal.message)
    return f"{where}: the engine {why}"


class HttpProber:
    """The production `Prober`: HTTP on each engine's control pool."""

    async def health(self, engine: EngineState, config: Config) -> ProbeResult:
        timeout = config.engine.health_timeout_s
        path = engine.dialect.health_path.decode()
        with trio.move_on_after(timeout):
            answer = await _get(engine, engine.dialect.health_path)
            if isinstance(answer, ProbeResult):
                return answer
            status, _ = answer
            if status != 200:
                return ProbeResult("failed", f"GET {path} returned HTTP {status}", True)
            identity = await self._identity(engine)
            detail = f"GET {path} returned HTTP 200"
            if isinstance(identity, KeyRefusal):
                refused = _refused_detail("GET /version", identity)
                return ProbeResult("ok", f"{detail}; {refused}", True, None, identity)
            return ProbeResult("ok", detail, True, identity)
        return ProbeResult(
            "failed",
            f"GET {path}: no answer within engine.health_timeout_s={timeout}",
            None,
            deadline_s=timeout,
        )

    async def check_key(self, engine: EngineState, config: Config) -> KeyCheck:
        """GET the dialect's key_check_path, which the engine guards with its --api-key,
        within engine.health_timeout_s."""
        timeout = config.engine.health_timeout_s
        path = engine.dialect.key_check_path
        where = f"GET {path.decode()}"
        with trio.move_on_after(timeout):
            answer = await _get(engine, path)
            if isinstance(answer, ProbeResult):
                unknown = answer.outcome == "inconclusive"
                return KeyCheck("inconclusive" if unknown else "failed", answer.detail)
            status, raw = answer
            if status == 200:
                return KeyCheck("accepted", f"{where} returned HTTP 200")
            if status in ENGINE_AUTH_STATUSES:
                refusal = KeyRefusal(engine, status, parse_error_body(status, raw).message)
                return KeyCheck("refused", _refused_detail(where, refusal))
            return KeyCheck("failed", f"{where} returned HTTP {status}")
        return KeyCheck("failed", f"{where}: no answer within engine.health_timeout_s={timeout}")

    async def context(self, engine: EngineState, config: Config) -> ContextReading:
        """The engine's context length from its /v1/models card (`card_context`), within
        engine.health_timeout_s; None for an SGLang server that truncates over-long
        requests instead of refusing them (`truncates_requests`), or when it will not
        say."""
        timeout = config.engine.health_timeout_s
        with trio.move_on_after(timeout):
            answer = await _get_json(engine, b"/v1/models")
            if isinstance(answer, str):
                return ContextReading(None, answer, final=False)
            listed = lists_model(answer, engine.spec.model)
            length = card_context(answer, engine.spec.model)
            if isinstance(length, str):
                return ContextReading(None, length, listed=listed)
            path = engine.dialect.truncation_path
            if path is None:
                return ContextReading(length, "GET /v1/models max_model_len", listed=listed)
            answer = await _get_json(engine, path)
            if isinstance(answer, str):
                return ContextReading(None, answer, final=False, listed=listed)
            truncates = truncates_requests(answer)
            if isinstance(truncates, str):
                return ContextReading(None, truncates, listed=listed)
            if truncates:
                return ContextReading(
                    None,
                    f"it cuts over-long requests down instead of refusing them "
                    f"(allow_auto_truncate in GET {path.decode()}), its max_model_len "
                    f"{length} notwithstanding",
                    listed=listed,
                )
            return ContextReading(length, "GET /v1/models max_model_len", listed=listed)
        return ContextReading(
            None, f"no answer within engine.health_timeout_s={timeout}", final=False
        )

    async def _identity(self, engine: EngineState) -> Identity | KeyRefusal | None:
        """(key, value) pairs of /version that name the running instance, if any; the
        refusal when the engine refused Narwhal's API key there."""
        answer = await _get(engine, b"/version")
        if isinstance(answer, ProbeResult):
            return None
        status, raw = answer
        if status in ENGINE_AUTH_STATUSES:
            return KeyRefusal(engine, status, parse_error_body(status, raw).message)
        if status != 200:
            return None
        try:
            document = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(document, dict):
            return None
        pairs = tuple(
            (key, str(document[key]))
            for key in _IDENTITY_KEYS
            if key in document and document[key] is not None
        )
        return pairs or None

    async def scrape(self, engine: EngineState, config: Config) -> LoadSample:
        timeout = config.engine.health_timeout_s
        try:
            _check_free(engine)
        except _Exhausted as exc:
            raise ScrapeError(str(exc)) from None
        with trio.move_on_after(timeout):
            try:
                async with engine.control_pool.request(b"GET", b"/metrics", _headers()) as response:
                    raw = await response.aread(METRICS_BODY_LIMIT)
                    if response.status != 200:
                        raise ScrapeError(f"GET /metrics returned HTTP {response.status}")
            except (ConnectError, RemoteProtocolError, ResponseTooLarge, PoolTimeout) as exc:
                raise ScrapeError(f"GET /metrics: {exc}") from None
            return parse_load(raw, engine.dialect.name)
        raise ScrapeError(f"GET /metrics: no answer within engine.health_timeout_s={timeout}")

    async def verify(self, pair: VerifyPair, config: Config) -> VerifyResult:
        limit = config.engine.first_token_timeout_s
        subject = pair.subject
        if pair.local and subject.role != "both" and subject.fixed_role is not None:
            return VerifyResult(
                "inconclusive",
                f"{pair.describe()} not sent: {subject.id} is a {subject.role} server of "
                f"dialect {subject.dialect.name}; {subject.fixed_role}",
            )
        try:
            _check_free(pair.prefill)
            _check_free(pair.decode)
            if pair.local:
                await _local_pair(pair, limit)
            elif pair.prefill.dialect.concurrent_legs:
                await _sglang_pair(pair, limit)
            else:
                await _vllm_pair(pair, limit)
        except _Exhausted as exc:
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
            return _LegRefused(_refused_detail(self.where, refusal), refusal)
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
                b"POST", b"/v1/completions", _headers(pair.request_id), body
            ) as response:
                raw = await response.aread(_SMALL_BODY)
                if response.status != 200:
                    raise fail.status(response.status, raw)
                return raw
        except PoolTimeout as exc:
            raise _Exhausted(str(exc)) from None
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
                b"POST", b"/v1/completions", _headers(pair.request_id), body
            ) as response:
                if response.status != 200:
                    raw = await response.aread(_SMALL_BODY)
                    raise fail.status(response.status, raw)
                data_events = 0
                while chunk := await response.receive_some():
                    received += len(chunk)
                    if received > _SMALL_BODY:
                        raise fail.broken(f"{where} sent more than {_SMALL_BODY} bytes")
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
            raise _Exhausted(str(exc)) from None
        except (ConnectError, RemoteProtocolError, ResponseTooLarge, SseOverflow) as exc:
            raise fail.broken(f"{where}: {exc}") from None
    raise fail.late(limit)


# vLLM and SGLang name the same three gauges differently.
_LOAD_NAMES: dict[str, tuple[str, str, str]] = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"),
}
_PROMPT_COUNTER = {"vllm": "vllm:prompt_tokens_total", "sglang": "sglang:prompt_tokens_total"}
# Older vLLM builds only have the deprecated name.
_KV_FALLBACK = {"vllm": "vllm:gpu_cache_usage_perc"}
# SGLang (0.5.23) sets its load gauges only when its scheduler reports: a prefill or
# aggregate server at its first batch, a decode server after 40 decode steps or at an
# idle tick after serving. Until then its /metrics has the rest of its metrics (it was
# started with --enable-metrics), among them this one, set at start-up: a page with it
# and without the gauges is a fresh server's.
_GAUGES_LATER = {"sglang": "sglang:max_total_num_tokens"}
_START_TIME = "process_start_time_seconds"


def parse_load(raw: bytes, dialect: str) -> LoadSample:
    """Running and waiting requests (summed over data-parallel ranks), KV usage (the
    fullest rank) and, when reported, the process start time and the prompt-token counter
    of each rank, from Prometheus text. Only the wanted lines are parsed: a vLLM /metrics
    page is ~100 KB and is read every monitor pass. The last two only feed restart
    detection, so a malformed value there is skipped rather than failing the scrape. A
    fresh SGLang server's page without the gauges reads as no load, `gauges_pending`."""
    running_name, waiting_name, kv_name = _LOAD_NAMES.get(dialect, _LOAD_NAMES["vllm"])
    kv_fallback = _KV_FALLBACK.get(dialect)
    prompt_name = _PROMPT_COUNTER.get(dialect, _PROMPT_COUNTER["vllm"])
    later = _GAUGES_LATER.get(dialect)
    optional = {_START_TIME, prompt_name}
    if later:
        optional.add(later)
    wanted = {running_name, waiting_name, kv_name, *optional}
    if kv_fallback:
        wanted.add(kv_fallback)
    found: dict[str, list[float]] = {}
    prompt: list[tuple[str, float]] = []
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ScrapeError("GET /metrics: body is not utf-8") from None
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        end = len(line)
        for sep in ("{", " "):
            index = line.find(sep)
            if index != -1:
                end = min(end, index)
        name = line[:end]
        if name not in wanted:
            continue
        labels_end = line.rindex("}") + 1 if "{" in line[end : end + 1] else end
        fields = line[labels_end:].split()
        value = math.nan
        problem = None if fields else f"no value for {name}"
        if fields:
            try:
                value = float(fields[0])
            except ValueError:
                problem = f"bad value for {name}: {fields[0]!r}"
        if problem is not None:
            if name in optional:
                continue
            raise ScrapeError(f"GET /metrics: {problem}")
        if not math.isfinite(value):
            continue
        if name == prompt_name:
            prompt.append((line[end:labels_end], value))
        else:
            found.setdefault(name, []).append(value)
    pending = False
    if running_name not in found or waiting_name not in found:
        missing = [n for n in (running_name, waiting_name) if n not in found]
        if len(missing) < 2 or later not in found:
            raise ScrapeError(f"GET /metrics lacks {', '.join(missing)}")
        pending = True
    kv_values = found.get(kv_name) or (found.get(kv_fallback) if kv_fallback else None)
    started = found.get(_START_TIME)
    return LoadSample(
        running=sum(found.get(running_name, [])),
        waiting=sum(found.get(waiting_name, [])),
        kv_usage=max(kv_values) if kv_values else None,
        started_at=max(started) if started else None,
        prompt_tokens=tuple(prompt) if prompt else None,
        gauges_pending=pending,
    )
