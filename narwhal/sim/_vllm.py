"""A simulated engine that speaks vLLM: its P/D legs, its errors, its routes.

Owns: `VLLMProtocol`. The pair protocol is vLLM's sequential legs over NixlConnector
(docs/design.md#vllm-nixl-handoff, #kv-lease): a request whose ``kv_transfer_params`` say
``do_remote_decode`` is a prefill leg, which keeps its KV under a lease and answers the
params a decoder needs; a request with ``do_remote_prefill`` and those params is a
decode leg, which heartbeats the producer's lease until it pulls the KV
(``/_sim/nixl/*``), and tells the producer when it gives up. An engine without a KV
connector serves both as plain requests.
Invariants: what differs between the builds it plays is `_vllm_builds`' table; its
checks are `_vllm_checks`, its chunks and metrics `_vllm_wire`.
Errors: ``{"error": {message, type, param, code}}`` (vLLM >= 0.10.1); an accepted
request the engine fails answers 500 "Internal server error" (kv_load_failure_policy
fail: docs/design.md#kv-lease).
"""

from __future__ import annotations

import json
import zlib
from typing import TYPE_CHECKING, Any

import h11
import trio

from .._values import json_int
from . import _http, _vllm_checks as checks
from ._faults import FaultSpec
from ._http import HttpRequest, Responder
from ._metrics import EngineMetrics
from ._output import Shapes
from ._protocol import (
    ApiError,
    EngineProtocol,
    KvRequest,
    Leg,
    Plan,
    Routes,
    stops,
    token_prompt,
)
from ._records import Lease, RemoteKV, ReqCtx
from ._tokenizer import BOS, piece_id
from ._vllm_wire import VllmCollector, VllmShapes

if TYPE_CHECKING:
    from ._engine import SimEngine
    from ._run import Run

_KV_PARAM_KEYS = (
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
)
# Wall-clock bound on an engine-to-engine control call (heartbeat, release notice).
_CONTROL_TIMEOUT_S = 5.0
# Wall-clock bound on a NIXL-style pull beyond its transfer time.
_PULL_SLACK_S = 10.0
_MIN_HEARTBEAT_S = 0.001


class VLLMProtocol(EngineProtocol):
    headers_before_first_token = True
    owned_by = "vllm"
    # Its load gauges are there from the start.
    load_reported = True

    def __init__(self, engine: SimEngine) -> None:
        super().__init__(engine)
        self.build = engine.spec.vllm

    # -- identity and routes ----------------------------------------------------------
    @property
    def version(self) -> str:
        return self.e.spec.vllm_version

    def routes(self) -> Routes:
        return {("GET", "/version"): self._version}

    async def _version(self, req: HttpRequest, resp: Responder) -> None:
        await resp.send_json(200, {"version": self.version, **self.identity()})

    def requires_api_key(self, method: str, path: str) -> bool:
        """vLLM's AuthenticationMiddleware guards only paths under /v1 (/tokenize,
        /health, /metrics and /version stay open), never OPTIONS; the simulator's own
        /_sim/ routes stand in for no engine route and stay open."""
        return method != "OPTIONS" and path.startswith("/v1")

    def model_card(self, created: int) -> dict[str, Any]:
        card = super().model_card(created)
        card["permission"] = [
            {
                "id": f"modelperm-{self.e.instance_id.replace('-', '')}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ]
        return card

    async def tokenize(self, req: HttpRequest, resp: Responder) -> None:
        e = self.e
        body = await self.read_json_body(req, resp)
        if body is None:
            return
        model = body.get("model")
        if model is not None and model != e.spec.model:
            await self.send_error(resp, checks.unknown_model(self.build, model, e.spec.model))
            return
        if "messages" in body:
            messages = body["messages"]
            try:
                if not isinstance(messages, list):
                    raise ApiError(400, "messages must be a list", param="messages")
                text = self.chat_text(messages, body)
            except ApiError as err:
                await self.send_error(resp, err)
                return
            # The template carries its own BOS; vLLM defaults add_special_tokens to False here.
            pieces = e.tokenizer.pieces(text)
            if body.get("add_special_tokens", False):
                pieces.insert(0, BOS)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                await self.send_error(
                    resp, ApiError(400, "prompt must be a string", param="prompt")
                )
                return
            pieces = self.pieces(prompt, body)
        ids = [piece_id(p) for p in pieces]
        strs = pieces if body.get("return_token_strs") else None
        limit = e.spec.timing.max_model_len
        await resp.send_json(
            200, {"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": strs}
        )

    # -- errors -----------------------------------------------------------------------
    def error_body(
        self, status: int, message: str, *, type_: str | None = None, param: str | None = None
    ) -> dict[str, Any]:
        type_ = self.error_type(status, type_)
        return {"error": {"message": message, "type": type_, "param": param, "code": status}}

    def error_event(
        self, status: int, message: str, type_: str | None = None, param: str | None = None
    ) -> bytes:
        body = self.error_body(status, message, type_=type_, param=param)
        if self.build.wire_032:
            # create_streaming_error_response: json.dumps with its default separators.
            return b"data: " + json.dumps(body).encode() + b"\n\n"
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    def abort_error(self, status: int, message: str) -> ApiError:
        return ApiError(status, message, type_="InternalServerError")

    def queue_full(self, queued: int, limit: int) -> ApiError:
        # vLLM >= 0.29 admission control: QueueOverflowError is a GracefulHTTPError, so
        # `type` is the HTTP phrase (docs/design.md#engine-errors).
        msg = (
            "The engine is currently busy and cannot accept new requests. Please "
            "try again later or on a different instance."
            if self.build.wire_032
            else f"The engine's request queue is full ({queued} queued, "
            f"max_num_queued_reqs={limit}); retry on another instance."
        )
        return ApiError(503, msg, type_="Service Unavailable")

    # -- reading a generation request -------------------------------------------------
    def echo_headers(self, request_id: str) -> list[tuple[str, str]]:
        return [("x-request-id", request_id)]

    def add_generation_prompt(self, body: dict[str, Any]) -> bool:
        return bool(body.get("add_generation_prompt", True))

    def special_tokens(self, body: dict[str, Any], *, chat: bool) -> int:
        # A chat's add_special_tokens defaults to false (its template has a BOS), a
        # completion's to true.
        return 1 if body.get("add_special_tokens", not chat) else 0

    def empty_conversation(self) -> ApiError | None:
        if not self.build.wire_032:
            return None
        return ApiError(
            400,
            "Cannot apply chat template to an empty conversation. Provide at least one message.",
        )

    def read(self, body: dict[str, Any], *, chat: bool, header_faults: FaultSpec | None) -> Plan:
        e, build = self.e, self.build
        stream = bool(body.get("stream") or False)
        checks.check_body(build, body, stream=stream, chat=chat)
        model = body.get("model")
        if model is not None and model != e.spec.model:
            raise checks.unknown_model(build, model, e.spec.model)
        stream_options = body.get("stream_options")
        include_usage = continuous_usage = False
        if stream and isinstance(stream_options, dict):
            include_usage = bool(stream_options.get("include_usage", build.include_usage_default))
            # The running usage on every chunk, only with include_usage
            # (docs/design.md#usage-chunks).
            continuous_usage = include_usage and bool(stream_options.get("continuous_usage_stats"))
        leg = self._leg(body)
        prompt_tokens, prompt_key = self.prompt(body, chat=chat)
        limit = e.spec.timing.max_model_len
        keep = json_int(body.get("truncate_prompt_tokens"))
        prompt_tokens = checks.truncate(build, keep, prompt_tokens, limit)
        prompt_ids = None
        if e.spec.prefix_caching:
            # truncate_prompt_tokens keeps the prompt's last tokens.
            prompt_ids = self.prompt_ids(body, chat=chat)[-prompt_tokens:]
        min_tokens = body.get("min_tokens") or 0
        max_tokens, bound_param = self.output_bound(body, chat=chat)
        if max_tokens is None and not chat and build.null_max_tokens_is_default:
            max_tokens = 16
        if build.context_rule == "prompt_alone":
            max_tokens = checks.fit_output(
                max_tokens,
                bound_param,
                prompt_tokens,
                limit,
                token_prompt=not chat and token_prompt(body.get("prompt")),
            )
        elif prompt_tokens >= limit:
            raise checks.over_context(prompt_tokens, limit)
        if max_tokens is None:
            max_tokens = self.unbounded(prompt_tokens, min_tokens)
        max_tokens = self.check_max_tokens(max_tokens, suffix=build.wire_032)
        if build.context_rule == "prompt_and_output":
            checks.check_total(max_tokens, prompt_tokens, limit)
        n = checks.check_sampling(build, body, max_tokens, min_tokens)
        # The engine's input checks, inside its generator: after a stream's 200.
        top = checks.check_inputs(body, chat=chat, stream=stream)
        return Plan(
            leg=leg,
            stream=stream,
            include_usage=include_usage,
            continuous_usage=continuous_usage,
            chat=chat,
            prompt_tokens=prompt_tokens,
            prompt_key=prompt_key,
            max_tokens=max_tokens,
            header_faults=header_faults,
            n=n,
            top_logprobs=top,
            stops=stops(body),
            include_stop=bool(body.get("include_stop_str_in_output")),
            min_tokens=min_tokens if isinstance(min_tokens, int) else 0,
            # vLLM answers with its own name (it refuses others).
            model=e.spec.model,
            prompt_ids=prompt_ids,
        )

    def _leg(self, body: dict[str, Any]) -> Leg:
        """The leg the request's kv_transfer_params name (docs/design.md#vllm-nixl-handoff)."""
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict) or not self.e.spec.kv_connector:
            # Without a connector vLLM serves the request as any other: no KV is kept
            # for a decoder, none is pulled from a producer.
            return Leg()
        if params.get("do_remote_decode"):
            return Leg(phase="prefill", hold_kv=True)
        if not params.get("do_remote_prefill"):
            return Leg()
        port = params.get("remote_port")
        if any(params.get(k) is None for k in _KV_PARAM_KEYS) or not isinstance(port, int):
            # vLLM logs "Got invalid KVTransferParams" and computes the prompt itself.
            return Leg(phase="decode")
        remote = RemoteKV(
            host=str(params["remote_host"]),
            port=port,
            num_tokens=int(params.get("remote_num_tokens") or 0),
            engine_id=str(params["remote_engine_id"]),
            request_id=str(params["remote_request_id"]),
            block_ids=params["remote_block_ids"],
            prefill_cached_tokens=json_int(params.get("remote_prefill_cached_tokens")),
        )
        return Leg(phase="decode", remote=remote)

    def request_ids(self, request_id: str, *, chat: bool, plan: Plan) -> tuple[list[str], str]:
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        return [response_id], f"{response_id}-{self.e.new_hex()}"

    def never_answers(self, plan: Plan) -> bool:
        return False

    # -- the P/D pair -----------------------------------------------------------------
    # The legs are sequential: neither waits for the other, and a prefill leg's KV is
    # held for whichever decoder pulls it first (no bootstrap server, no rooms).
    def fail_unstarted(self, req: HttpRequest, reason: str) -> None:
        pass

    def open_leg(self, ctx: ReqCtx, plan: Plan) -> None:
        pass

    async def wait_for_peer(self, run: Run) -> tuple[str, int] | None:
        return None

    def close_leg(self, ctx: ReqCtx, outcome: str) -> None:
        pass

    def kv_held(self, ctx: ReqCtx, lease: Lease) -> None:
        pass

    def lease_expired(self, lease: Lease) -> None:
        pass

    def serves_bootstrap(self) -> bool:
        return False

    def kv_request(self, remote: RemoteKV) -> KvRequest:
        spec = self.e.spec
        body: dict[str, Any] = {
            "engine_id": remote.engine_id,
            "request_id": remote.request_id,
            "block_ids": remote.block_ids,
            "num_tokens": remote.num_tokens,
        }
        limit = spec.scaled(spec.timing.kv_transfer_s(remote.num_tokens)) * 3 + _PULL_SLACK_S
        return "/_sim/nixl/pull", body, limit

    def transfer_failure(self, ctx: ReqCtx, reason: str) -> str:
        # kv_load_failure_policy=fail: FINISHED_ERROR -> GenerationError -> 500
        # (docs/design.md#kv-lease).
        return "Internal server error"

    def abandon_kv(self, remote: RemoteKV) -> None:
        """Tell the producer we will never pull (vLLM notifies P with an empty block list)."""
        self.e.spawn(self._send_release, remote)

    async def _send_release(self, remote: RemoteKV) -> None:
        body = {"engine_id": remote.engine_id, "request_ids": [remote.request_id]}
        try:
            with trio.fail_after(_CONTROL_TIMEOUT_S):
                await _http.request(
                    remote.host,
                    remote.port,
                    "POST",
                    "/_sim/nixl/release",
                    body,
                    connect=self.e.connect,
                )
        except (OSError, trio.TooSlowError, h11.ProtocolError):
            pass

    def kv_transfer_params(self, ctx: ReqCtx) -> dict[str, Any] | None:
        lease = ctx.lease
        if lease is None:
            return None
        e = self.e
        # Newer vLLM pull mode (docs/design.md#vllm-nixl-handoff): one block list per KV-cache
        # group.
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(lease.blocks)],
            "remote_engine_id": e.instance_id,
            "remote_request_id": lease.id,
            "remote_host": e.advertised_host,
            "remote_port": e.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": lease.tokens,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
        }
        if self.build.wire_032:
            # The producer's own prefix-cache hit, for the decoder to report.
            params["remote_prefill_cached_tokens"] = ctx.core.cached_tokens or 0
        return params

    def prompt_details(self, ctx: ReqCtx, *, chat: bool, stream: bool) -> dict[str, Any] | None:
        """usage.prompt_tokens_details, only with --enable-prompt-tokens-details: the
        prompt tokens the engine did not compute (a decode leg: the producer's hit when
        its params say it, else the whole prompt, which came over the wire)."""
        if not self.e.spec.prompt_tokens_details:
            return None
        core = ctx.core
        cached = core.cached_tokens or 0
        if ctx.remote is not None:
            hit = ctx.remote.prefill_cached_tokens
            cached = hit if hit is not None else core.prompt_tokens
        if not chat:
            # A completion sets cached_tokens alone; its stream dumps only what is set.
            if stream:
                return {"cached_tokens": cached}
            return {
                "cached_tokens": cached,
                "created_cache_tokens": None,
                "multimodal_tokens": None,
            }
        return {
            "cached_tokens": cached,
            "created_cache_tokens": core.created_tokens,
            "multimodal_tokens": None,
        }

    async def run(self) -> None:
        """Heartbeat every producer whose KV a decode leg still waits for, every
        lease/6 as vLLM does; the floor keeps absurd speed factors from spinning."""
        e = self.e
        interval = max(e.spec.scaled(e.spec.lease_s) / 6.0, _MIN_HEARTBEAT_S)
        while True:
            await trio.sleep(interval)
            groups: dict[tuple[str, int, str], list[str]] = {}
            for ctx in e.awaiting_kv:
                rk = ctx.remote
                if rk is not None:
                    groups.setdefault((rk.host, rk.port, rk.engine_id), []).append(rk.request_id)
            for (host, port, engine_id), ids in groups.items():
                e.spawn(self.send_heartbeat, host, port, engine_id, ids)

    async def send_heartbeat(self, host: str, port: int, engine_id: str, ids: list[str]) -> None:
        counters = self.e.counters
        counters.heartbeats_sent += 1
        body = {"engine_id": engine_id, "request_ids": ids}
        try:
            with trio.fail_after(_CONTROL_TIMEOUT_S):
                await _http.request(
                    host, port, "POST", "/_sim/nixl/heartbeat", body, connect=self.e.connect
                )
        except (OSError, trio.TooSlowError, h11.ProtocolError):
            counters.heartbeats_failed += 1

    # -- answers ----------------------------------------------------------------------
    def shapes(self, plan: Plan, ids: list[str], created: int) -> Shapes:
        spec, build = self.e.spec, self.build
        fingerprint = None
        if build.wire_032:
            # vllm-<version>-<hash of the engine's configuration>.
            config = f"{spec.model}\x00{spec.kv_connector}\x00{spec.timing.max_model_len}"
            fingerprint = f"vllm-{build.version}-{zlib.crc32(config.encode()):08x}"
        return VllmShapes(
            build=build,
            chat=plan.chat,
            model=plan.model,
            response_id=ids[0],
            created=created,
            fingerprint=fingerprint,
            include_usage=plan.include_usage,
        )

    def stream_failure(self, run: Run, status: int, message: str) -> bytes:
        # A chat stream that failed before its first token still opens its choices.
        out = run.role_chunks() if run.plan.chat and run.sent == 0 else b""
        return out + self.error_event(status, message, "InternalServerError")

    # -- metrics and load -------------------------------------------------------------
    def note_step(self, idle: bool, decodes: bool) -> None:
        pass

    def count_generated(self, metrics: EngineMetrics, progressed: list[Any]) -> None:
        pass  # its counters have no is_streaming series

    def collector(self) -> VllmCollector:
        e = self.e
        timing = e.spec.timing
        return VllmCollector(
            e.metrics,
            e.gauges,
            model=e.spec.model,
            engine=e.label,
            cache_info={
                "block_size": str(timing.block_size),
                "cache_dtype": "auto",
                "enable_prefix_caching": str(e.spec.prefix_caching),
                "gpu_memory_utilization": "0.9",
                "num_cpu_blocks": "None",
                "num_gpu_blocks": str(timing.total_blocks),
            },
            started_at=e.started_at,
            kv_connector=e.spec.kv_connector,
        )
