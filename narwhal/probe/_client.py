"""Direct, instrumented requests to one engine (not through the router).

Built on the router's own transport (`ConnectionPool`) and dialect helpers, so a probe
sends exactly the legs the router sends. An SGLang server launched as prefill or decode
answers a generation request only as one leg of a bootstrap pair (400 otherwise, notes
5.2), so such an engine's `complete`, `stream` and `hold_stream` send each request as
its leg of a pair with `EngineClient.partner`, a server of the other launched role.

Every call here is unbounded in time by design: deadlines belong to the caller
(narwhal-profile's sweep budget, narwhal-check's per-check limits).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import attrs
import trio

from .._errors import ENGINE_AUTH_STATUSES
from .._values import json_int
from ..config import Engine, EngineSpec
from ..engines import (
    SGLANG_DEFAULT_BOOTSTRAP_PORT,
    ConnectionPool,
    Json,
    PoolTimeout,
    SseKind,
    SseScanner,
    TransportError,
    dialect_for,
    parse_error_body,
)
from ..engines._dialects import (
    encode,
    new_bootstrap_room,
    sglang_pd_body,
    tokenize_count,
    usage_tokens,
    vllm_decode_body,
    vllm_kv_params,
    vllm_prefill_body,
)
from ..fleet import explain_refusal
from ..profiles import build_identity, pd_server
from ._prom import Sample, first_labels, first_value, parse_metrics

R = TypeVar("R", "Completion", "StreamResult")
NULL_PARAMS = "it answered the router's prefill leg with kv_transfer_params: null"

_BODY_LIMIT = 64 * 1024 * 1024
_JSON = (b"content-type", b"application/json")


class ProbeError(Exception):
    """A probe request failed; the message names the engine and what happened."""


@attrs.frozen
class Completion:
    status: int
    seconds: float
    prompt_tokens: int | None
    document: object
    error: str | None = None
    # usage.prompt_tokens_details.cached_tokens, when the engine reports it (vLLM with
    # --enable-prompt-tokens-details): the prompt tokens its prefix cache served.
    cached_tokens: int | None = None


@attrs.frozen
class StreamResult:
    """A streamed completion timed from the moment its request was sent."""

    status: int
    ok: bool
    # Seconds from sending the request to the first generated token (None: no token).
    first_token_s: float | None
    # Absolute trio times of the first token and of each later token (see `token_times`).
    first_token_at: float | None
    # Per-token intervals after the first token: a read that brings k token events
    # contributes k gaps of (elapsed since the previous read)/k.
    gaps: tuple[float, ...]
    tokens: int
    error: str | None = None
    # usage.prompt_tokens of the final usage chunk, when the engine sent one.
    prompt_tokens: int | None = None


@attrs.frozen
class Identity:
    dialect: str
    version: str
    build: str
    model: str
    max_model_len: int
    kv_capacity_tokens: int | None
    kv_capacity_source: str
    # Requests the engine runs at once, when it says (SGLang's max_running_requests).
    max_num_seqs: int | None = None
    max_num_seqs_source: str = ""
    # SGLang's launch mode from /get_server_info ("prefill", "decode" or "null" for an
    # aggregate server); None when the engine does not say (vLLM).
    disaggregation_mode: str | None = None
    # The KV block size vllm:cache_config_info reports (prefix caching hits whole blocks);
    # None when the engine does not say.
    block_size: int | None = None

    @property
    def build_identity(self) -> str:
        """What makes a profile valid for this engine: engine build, model, context."""
        return build_identity(
            dialect=self.dialect,
            version=self.version,
            build=self.build,
            model=self.model,
            max_model_len=self.max_model_len,
        )


@attrs.frozen
class Gauges:
    running: float | None
    waiting: float | None
    kv_usage: float | None
    kv_expired: float | None


class EngineClient:
    """One configured engine, probed directly."""

    def __init__(self, spec: EngineSpec, engine: Engine, *, max_connections: int = 128) -> None:
        self.spec = spec
        self.id = spec.id
        self.dialect = dialect_for(spec.dialect)
        host, port = spec.origin()
        self.host = host
        self.port = port
        self.pool = ConnectionPool(
            host,
            port,
            max_connections=max_connections,
            connect_timeout_s=engine.connect_timeout_s,
            pool_timeout_s=engine.pool_timeout_s,
            api_key=spec.api_key_text(),
        )
        self.serial = 0
        # "prefill"/"decode" for an SGLang server launched in that mode (its configured
        # role), None when plain requests are fine.
        self.pd_role = pd_server(spec)
        # The server of the other launched role every generation request pairs with;
        # chosen by the sweep or the check.
        self.partner: EngineClient | None = None

    def __repr__(self) -> str:
        return f"<EngineClient {self.id} {self.spec.url}>"

    async def aclose(self) -> None:
        await self.pool.aclose()

    def _request_id(self, kind: str) -> bytes:
        self.serial += 1
        return f"narwhal-probe-{self.id}-{kind}-{self.serial}".encode()

    # -- plain requests --------------------------------------------------------------------
    async def get(self, path: str, *, limit: int = _BODY_LIMIT) -> tuple[int, bytes]:
        try:
            async with self.pool.request(b"GET", path.encode()) as response:
                return response.status, await response.aread(limit)
        except (TransportError, PoolTimeout) as exc:
            raise ProbeError(f"engine {self.id!r} GET {path}: {exc}") from None

    async def post_json(self, path: str, body: Json, *, kind: str = "probe") -> tuple[int, object]:
        headers = [_JSON, (b"x-request-id", self._request_id(kind))]
        try:
            async with self.pool.request(b"POST", path.encode(), headers, encode(body)) as response:
                raw = await response.aread(_BODY_LIMIT)
                status = response.status
        except (TransportError, PoolTimeout) as exc:
            raise ProbeError(f"engine {self.id!r} POST {path}: {exc}") from None
        if status != 200:
            info = parse_error_body(status, raw)
            return status, info.message
        try:
            return status, json.loads(raw)
        except ValueError:
            raise ProbeError(f"engine {self.id!r} POST {path}: answer is not JSON") from None

    async def health(self) -> int:
        status, _ = await self.get(self.dialect.health_path.decode(), limit=65536)
        return status

    async def tokenize(self, text: str) -> tuple[int | None, object]:
        """(exact count or None, the whole answer) for a completion-style prompt."""
        body: Json = {"model": self.spec.model, "prompt": text}
        status, doc = await self.post_json(self.dialect.tokenize_path.decode(), body)
        if status != 200:
            raise ProbeError(f"engine {self.id!r} /tokenize answered {status}: {doc}")
        return tokenize_count(doc), doc

    async def metrics(self) -> list[Sample]:
        status, raw = await self.get("/metrics")
        if status != 200:
            raise ProbeError(f"engine {self.id!r} /metrics answered {status}")
        return parse_metrics(raw.decode("utf-8", "replace"))

    async def gauges(self) -> Gauges:
        samples = await self.metrics()
        return Gauges(
            running=first_value(samples, "vllm:num_requests_running", "sglang:num_running_reqs"),
            waiting=first_value(samples, "vllm:num_requests_waiting", "sglang:num_queue_reqs"),
            kv_usage=first_value(samples, "vllm:kv_cache_usage_perc", "sglang:token_usage"),
            kv_expired=first_value(
                samples, "vllm:nixl_num_kv_expired_reqs_total", "vllm:nixl_num_kv_expired_reqs"
            ),
        )

    async def identity(self) -> Identity:
        """Engine version/build, served model, context limit and KV capacity."""
        version, build = "unknown", ""
        status, raw = await self.get("/version", limit=65536)
        if status == 200:
            doc = _loads(raw)
            if isinstance(doc, dict):
                version = str(doc.get("version", "unknown"))
                build = str(doc.get("build") or "")
        server_info: dict[str, object] = {}
        if self.spec.dialect == "sglang":
            status, raw = await self.get("/get_server_info")
            doc = _loads(raw) if status == 200 else None
            if isinstance(doc, dict):
                server_info = doc
                if version == "unknown":
                    version = str(doc.get("version", "unknown"))
                build = build or str(doc.get("build") or "")
        status, raw = await self.get("/v1/models")
        if status in ENGINE_AUTH_STATUSES:
            # Guarded by both engines under --api-key; "serves no model" would mislead.
            message = parse_error_body(status, raw).message
            why = explain_refusal(status, sends_key=self.pool.sends_api_key, message=message)
            raise ProbeError(f"engine {self.id!r} GET /v1/models: the engine {why}")
        doc = _loads(raw) if status == 200 else None
        cards = doc.get("data") if isinstance(doc, dict) else None
        models = [c for c in cards if isinstance(c, dict)] if isinstance(cards, list) else []
        card = next((c for c in models if c.get("id") == self.spec.model), None)
        if card is None:
            served = ", ".join(str(c.get("id")) for c in models) or "none"
            raise ProbeError(
                f"engine {self.id!r} does not serve model {self.spec.model!r} "
                f"(the config's engines[].model); /v1/models lists: {served}"
            )
        max_len = json_int(card.get("max_model_len"))
        if max_len is None or max_len <= 0:
            _, tok = await self.tokenize("x")
            max_len = json_int(tok.get("max_model_len")) if isinstance(tok, dict) else None
        if max_len is None or max_len <= 0:
            raise ProbeError(
                f"engine {self.id!r}: neither /v1/models nor /tokenize reports max_model_len"
            )
        capacity, source = None, ""
        block_size: int | None = None
        info = first_labels(await self.metrics(), "vllm:cache_config_info")
        if info is not None:
            with contextlib.suppress(KeyError, ValueError):
                block_size = int(info["block_size"])
            try:
                capacity = int(info["num_gpu_blocks"]) * int(info["block_size"])
                source = "vllm:cache_config_info num_gpu_blocks x block_size"
            except (KeyError, ValueError):
                capacity = None
        total = json_int(server_info.get("max_total_num_tokens"))
        if capacity is None and total is not None:
            capacity, source = total, "sglang /get_server_info max_total_num_tokens"
        # vLLM publishes no max_num_seqs; SGLang's server args carry max_running_requests
        # when it was set (None when SGLang derives it from memory at start-up).
        seqs = json_int(server_info.get("max_running_requests"))
        if seqs is not None and seqs <= 0:
            seqs = None
        return Identity(
            dialect=self.spec.dialect,
            version=version,
            build=build,
            model=self.spec.model,
            max_model_len=max_len,
            kv_capacity_tokens=capacity,
            kv_capacity_source=source,
            max_num_seqs=seqs,
            max_num_seqs_source="sglang /get_server_info max_running_requests" if seqs else "",
            disaggregation_mode=_mode(server_info.get("disaggregation_mode")),
            block_size=block_size if block_size and block_size > 0 else None,
        )

    async def launch_mode(self) -> str | None:
        """The disaggregation mode SGLang's /get_server_info reports (None: not said)."""
        status, raw = await self.get("/get_server_info")
        if status != 200:
            raise ProbeError(f"engine {self.id!r} GET /get_server_info answered {status}")
        doc = _loads(raw)
        return _mode(doc.get("disaggregation_mode")) if isinstance(doc, dict) else None

    # -- generation --------------------------------------------------------------------------
    def completion_body(self, prompt: str, max_tokens: int, *, stream: bool) -> Json:
        body: Json = {
            "model": self.spec.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    # -- bootstrap pairs (SGLang prefill/decode servers) ---------------------------------------
    def _paired(self, body: Json) -> bool:
        return self.pd_role is not None and "bootstrap_room" not in body

    def _partner_legs(self, body: Json) -> tuple[EngineClient, Json, Json]:
        """(partner, this engine's leg, the partner's leg) of one bootstrap pair that
        carries `body`'s prompt. The prefill leg is non-streaming and the decode leg
        streamed, as the router sends them."""
        partner = self.partner
        if partner is None:
            other = "decode" if self.pd_role == "prefill" else "prefill"
            raise ProbeError(
                f"engine {self.id!r} is an SGLang {self.pd_role} server, which answers only "
                f"requests paired with a server of the other role, and no SGLang {other} "
                "engine is available to pair it with"
            )
        p = self if self.pd_role == "prefill" else partner
        port = p.spec.bootstrap_port or SGLANG_DEFAULT_BOOTSTRAP_PORT
        room = new_bootstrap_room()
        prompt = body.get("prompt")
        max_tokens = body.get("max_tokens")
        partner_body = partner.completion_body(
            prompt if isinstance(prompt, str) else "",
            max_tokens if isinstance(max_tokens, int) else 1,
            stream=partner.pd_role == "decode",
        )
        return (
            partner,
            sglang_pd_body(body, host=p.host, port=port, room=room),
            sglang_pd_body(partner_body, host=p.host, port=port, room=room),
        )

    async def _with_partner(
        self, partner: EngineClient, other: Json, own: Callable[[], Awaitable[R]]
    ) -> tuple[R | None, str | None]:
        """This engine's leg and the partner's at once: (this leg's result, None if it was
        cancelled; why the partner's leg failed). The first leg to fail cancels the other,
        which would otherwise wait for its peer until SGLang's bootstrap timeout."""
        results: list[R] = []
        failures: list[str] = []
        legs = trio.CancelScope()

        async def partner_leg() -> None:
            failure = await partner._partner_leg(other)
            if failure is not None:
                failures.append(f"partner {partner.id!r} {partner.pd_role} leg: {failure}")
                legs.cancel()

        async def own_leg() -> None:
            results.append(await own())
            if _failure(results[0]) is not None:
                legs.cancel()

        with legs:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partner_leg)
                nursery.start_soon(own_leg)
        return (results[0] if results else None), (failures[0] if failures else None)

    async def _partner_leg(self, body: Json) -> str | None:
        """This engine's leg of a pair another engine is measured through; why it failed."""
        if self.pd_role == "decode":
            return _failure(await self._stream(body, kind="partner"))
        return _failure(await self._complete(body, kind="partner"))

    async def complete(self, body: Json, *, kind: str = "probe") -> Completion:
        """A non-streaming completion, timed from sending to the last body byte (of this
        engine's answer: a partner's leg is not part of the time)."""
        if not self._paired(body):
            return await self._complete(body, kind=kind)
        partner, own, other = self._partner_legs(body)
        result, failure = await self._with_partner(
            partner, other, lambda: self._complete(own, kind=kind)
        )
        if result is None:
            return Completion(0, 0.0, None, None, failure)
        if failure is not None and result.error is None:
            return attrs.evolve(result, error=failure)
        return result

    async def _complete(self, body: Json, *, kind: str = "probe") -> Completion:
        start = trio.current_time()
        status, doc = await self.post_json("/v1/completions", body, kind=kind)
        seconds = trio.current_time() - start
        if status != 200:
            return Completion(status, seconds, None, None, f"HTTP {status}: {doc}")
        return Completion(
            status, seconds, usage_tokens(doc, "prompt_tokens"), doc, cached_tokens=_cached(doc)
        )

    async def stream(
        self,
        body: Json,
        *,
        kind: str = "probe",
        on_head: Callable[[], None] | None = None,
        request_id: bytes | None = None,
    ) -> StreamResult:
        """A streamed completion: time to first token and the inter-token gaps."""
        if not self._paired(body):
            return await self._stream(body, kind=kind, on_head=on_head, request_id=request_id)
        partner, own, other = self._partner_legs(body)
        result, failure = await self._with_partner(
            partner,
            other,
            lambda: self._stream(own, kind=kind, on_head=on_head, request_id=request_id),
        )
        if result is None:
            return StreamResult(0, False, None, None, (), 0, failure)
        if failure is not None and result.ok:
            return attrs.evolve(result, ok=False, error=failure)
        return result

    async def _stream(
        self,
        body: Json,
        *,
        kind: str = "probe",
        on_head: Callable[[], None] | None = None,
        request_id: bytes | None = None,
    ) -> StreamResult:
        headers = [_JSON, (b"x-request-id", request_id or self._request_id(kind))]
        start = trio.current_time()
        scanner = SseScanner()
        first_at: float | None = None
        last_at = start
        gaps: list[float] = []
        tokens = 0
        done = False
        error: str | None = None
        status = 0
        prompt_tokens: int | None = None
        try:
            async with self.pool.request(
                b"POST", b"/v1/completions", headers, encode(body)
            ) as response:
                status = response.status
                if on_head is not None:
                    on_head()
                if response.status != 200:
                    raw = await response.aread(65536)
                    info = parse_error_body(response.status, raw)
                    return StreamResult(
                        response.status,
                        False,
                        None,
                        None,
                        (),
                        0,
                        f"HTTP {info.status}: {info.message}",
                    )
                async for chunk in response:
                    now = trio.current_time()
                    count = 0
                    for event in scanner.feed(chunk):
                        if event.kind is SseKind.DONE:
                            done = True
                        elif event.kind is SseKind.ERROR:
                            error = str((event.error or {}).get("message", "error event"))
                        elif event.kind is SseKind.DATA:
                            if _has_text(event.payload):
                                count += 1
                            else:
                                prompt_tokens = _usage_prompt_tokens(event.payload)
                    if count == 0:
                        continue
                    if first_at is None:
                        first_at = now
                        count -= 1
                        tokens += 1
                    elif count:
                        gaps.extend([(now - last_at) / count] * count)
                    tokens += count
                    last_at = now
        except (TransportError, PoolTimeout) as exc:
            error = f"transport: {exc}"
        ok = done and error is None and first_at is not None
        if not done and error is None:
            error = "stream ended without [DONE]"
        return StreamResult(
            status,
            ok,
            None if first_at is None else first_at - start,
            first_at,
            tuple(gaps),
            tokens,
            error,
            prompt_tokens,
        )

    async def hold_stream(
        self,
        body: Json,
        *,
        accepted: Callable[[], None],
        failed: Callable[[str], None],
    ) -> None:
        """Open a streamed request and keep it open, unread, until cancelled: load for a
        decode measurement. `accepted` runs once the response head arrived (the engine
        has the request), or after `failed` reported why it never will."""
        if not self._paired(body):
            await self._hold(body, accepted=accepted, failed=failed)
            return
        partner, own, other = self._partner_legs(body)
        told = False

        def tell() -> None:
            nonlocal told
            if not told:
                told = True
                accepted()

        async def partner_leg() -> None:
            failure = await partner._partner_leg(other)
            if failure is not None:
                failed(f"engine {self.id!r}: a load request's partner {partner.id!r}: {failure}")
                tell()
                legs.cancel_scope.cancel()

        async with trio.open_nursery() as legs:
            legs.start_soon(partner_leg)
            await self._hold(own, accepted=tell, failed=failed)
            # A held leg returns only when it failed; its partner would wait for its peer.
            legs.cancel_scope.cancel()

    async def _hold(
        self,
        body: Json,
        *,
        accepted: Callable[[], None],
        failed: Callable[[str], None],
    ) -> None:
        headers = [_JSON, (b"x-request-id", self._request_id("load"))]
        try:
            async with self.pool.request(
                b"POST", b"/v1/completions", headers, encode(body)
            ) as response:
                if response.status != 200:
                    raw = await response.aread(65536)
                    info = parse_error_body(response.status, raw)
                    failed(
                        f"engine {self.id!r}: load request answered {info.status}: {info.message}"
                    )
                    accepted()
                    return
                accepted()
                await trio.sleep_forever()
        except (TransportError, PoolTimeout) as exc:
            failed(f"engine {self.id!r}: load request failed: {exc}")
            accepted()


@attrs.frozen
class HandoffResult:
    """One crossed P/D handoff, timed."""

    ok: bool
    prompt_tokens: int | None
    prefill_s: float | None
    # Prefill response -> first decode token.
    handoff_s: float | None
    # Decode request sent -> first decode token.
    first_token_s: float | None
    error: str | None = None
    kv_params: Json | None = None


async def prefill_leg(p: EngineClient, prompt: str) -> tuple[Completion, Json | None]:
    """The router's P leg (vLLM): one token, KV kept for a remote decoder."""
    body = vllm_prefill_body(p.completion_body(prompt, 1, stream=False))
    result = await p.complete(body, kind="prefill")
    return result, vllm_kv_params(result.document)


async def decode_leg(
    d: EngineClient, prompt: str, kv_params: Json | None, *, max_tokens: int = 2
) -> StreamResult:
    body = vllm_decode_body(d.completion_body(prompt, max_tokens, stream=True), kv_params)
    return await d.stream(body, kind="decode")


@attrs.frozen
class KvConnector:
    """What a vLLM engine's answer to the router's prefill leg says of its KV connector:
    `present` True (it answered with `kv_transfer_params`), False (`kv_transfer_params:
    null`: it has no connector, or one that hands nothing over) or None (the leg failed,
    `detail` says how)."""

    present: bool | None
    detail: str

    @property
    def stored(self) -> str:
        """The profile store's `kv_connector` value ("" when not known)."""
        return {True: "present", False: "none", None: ""}[self.present]


async def kv_connectors(clients: Sequence[EngineClient], prompt: str) -> dict[str, KvConnector]:
    """Which vLLM engines have a KV connector: each gets the router's prefill leg (one
    token of `prompt`, KV kept for a remote decode) in turn, and its answer says
    (`KvConnector`). SGLang engines pair by bootstrap rooms instead and are left out.

    An engine configured `both` may or may not have one (a NixlConnector engine plays
    either role), so the answer, not the configuration, is what tells. An engine that
    has one then holds the prompt's KV for a decode that would pull it; left alone, the
    lease would run out and count as an expired handoff, which a lease measurement
    started soon after (narwhal-check right after narwhal-profile) would take for its
    own. So the engines found to have one pull each other's in a ring, in config order
    (each the next one's; a one-engine fleet its own, its self pair): the same handoffs,
    both ways, that the crossed pairs measured next make. A lone engine with one in a
    larger fleet has nobody to pull its KV and keeps it until its lease ends. The caller
    bounds the time."""
    out: dict[str, KvConnector] = {}
    held: list[tuple[EngineClient, Json]] = []
    vllm = [c for c in clients if c.spec.dialect == "vllm"]
    for client in vllm:
        prefill, params = await prefill_leg(client, prompt)
        if prefill.error is not None:
            out[client.id] = KvConnector(None, f"the prefill leg failed: {prefill.error}")
        elif params is None:
            out[client.id] = KvConnector(False, NULL_PARAMS)
        else:
            out[client.id] = KvConnector(
                True, "it answered the router's prefill leg with kv_transfer_params"
            )
            held.append((client, params))
    if len(held) > 1 or len(vllm) == 1:
        for i, (_, params) in enumerate(held):
            consumer = held[(i + 1) % len(held)][0]
            await decode_leg(consumer, prompt, params, max_tokens=1)
    return out


async def crossed_handoff(
    p: EngineClient, d: EngineClient, prompt: str, *, max_tokens: int = 2
) -> HandoffResult:
    """Prefill on `p`, decode on `d`, as the router does; timed."""
    if p.spec.dialect == "sglang":
        return await _sglang_handoff(p, d, prompt, max_tokens=max_tokens)
    prefill, params = await prefill_leg(p, prompt)
    if prefill.error is not None:
        return HandoffResult(
            False, None, prefill.seconds, None, None, f"prefill on {p.id!r}: {prefill.error}"
        )
    if params is None:
        return HandoffResult(
            False,
            prefill.prompt_tokens,
            prefill.seconds,
            None,
            None,
            f"prefill on {p.id!r} returned no kv_transfer_params",
        )
    ready = trio.current_time()
    decode = await decode_leg(d, prompt, params, max_tokens=max_tokens)
    if decode.first_token_at is None or not decode.ok:
        return HandoffResult(
            False,
            prefill.prompt_tokens,
            prefill.seconds,
            None,
            decode.first_token_s,
            f"decode on {d.id!r}: {decode.error or 'no token'}",
            params,
        )
    return HandoffResult(
        True,
        prefill.prompt_tokens,
        prefill.seconds,
        decode.first_token_at - ready,
        decode.first_token_s,
        None,
        params,
    )


async def _sglang_handoff(
    p: EngineClient, d: EngineClient, prompt: str, *, max_tokens: int
) -> HandoffResult:
    room = new_bootstrap_room()
    port = p.spec.bootstrap_port or SGLANG_DEFAULT_BOOTSTRAP_PORT
    base = p.completion_body(prompt, max_tokens, stream=False)
    p_body = sglang_pd_body(base, host=p.host, port=port, room=room)
    d_body = sglang_pd_body(
        d.completion_body(prompt, max_tokens, stream=True), host=p.host, port=port, room=room
    )
    results: dict[str, object] = {}

    async def run_p() -> None:
        results["p"] = await p.complete(p_body, kind="prefill")
        results["p_done"] = trio.current_time()

    async def run_d() -> None:
        results["d"] = await d.stream(d_body, kind="decode")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_p)
        nursery.start_soon(run_d)
    pre = results["p"]
    dec = results["d"]
    p_done = results["p_done"]
    assert isinstance(pre, Completion)
    assert isinstance(dec, StreamResult)
    assert isinstance(p_done, float)
    if pre.error is not None:
        return HandoffResult(
            False, None, pre.seconds, None, None, f"prefill on {p.id!r}: {pre.error}"
        )
    if dec.first_token_at is None or not dec.ok:
        return HandoffResult(
            False,
            pre.prompt_tokens,
            pre.seconds,
            None,
            dec.first_token_s,
            f"decode on {d.id!r}: {dec.error or 'no token'}",
        )
    return HandoffResult(
        True,
        pre.prompt_tokens,
        pre.seconds,
        max(0.0, dec.first_token_at - p_done),
        dec.first_token_s,
    )


def mode_mismatch(spec: EngineSpec, reported: str | None) -> str | None:
    """Why an SGLang engine's launch mode (/get_server_info ``disaggregation_mode``)
    contradicts its configured role, or None when they agree or it is not reported."""
    if spec.dialect != "sglang" or reported is None:
        return None
    expected = "null" if spec.role == "both" else spec.role
    if reported == expected:
        return None
    return (
        f"engine {spec.id!r} has role {spec.role!r} in the config but reports "
        f"disaggregation_mode={reported!r}; launch it with {_launch_flag(expected)} or "
        "change its role"
    )


def _launch_flag(mode: str) -> str:
    return "no --disaggregation-mode" if mode == "null" else f"--disaggregation-mode {mode}"


def _failure(result: Completion | StreamResult) -> str | None:
    if isinstance(result, Completion):
        return result.error
    return None if result.ok else (result.error or "no token")


def _mode(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _loads(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _cached(document: object) -> int | None:
    usage = document.get("usage") if isinstance(document, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    return json_int(details.get("cached_tokens")) if isinstance(details, dict) else None


def _usage_prompt_tokens(payload: bytes) -> int | None:
    return usage_tokens(_loads(payload), "prompt_tokens")


def _has_text(payload: bytes) -> bool:
    """A token event (not the usage-only chunk that ends a vLLM stream)."""
    return b'"choices":[]' not in payload and b'"choices": []' not in payload
