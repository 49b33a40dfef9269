"""A simulated engine that speaks SGLang 0.5.23: its bootstrap pair, its errors, its routes.

Owns: `SGLangProtocol`. The pair protocol is SGLang's concurrent bootstrap pair
(docs/design.md#sglang-bootstrap): roles are fixed at launch (``disaggregation_mode``); both legs
of a pair carry the same ``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` and run
at once. The prefill leg waits in its bootstrap queue until its decoder registers for the
room, then computes one token and pushes the KV; the decode leg takes it from the
prefill server's bootstrap server (``/_sim/bootstrap/transfer``) within the waiting
timeout. An aggregate ("null") server ignores bootstrap fields.
Invariants: the wording and shapes are SGLang 0.5.23's, as recorded in
tests/conformance/recorded-sglang.json; its checks are `_sglang_checks`, its chunks and
metrics `_sglang_wire`.
Errors: the flat pre-0.10.1 vLLM envelope ``{object: "error", message, type, param,
code}`` (docs/design.md#engine-errors); a pair that fails answers 500 in SGLang's own words
(disaggregation/prefill.py, decode.py, common/conn.py).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import trio

from .._values import json_int
from . import _sglang_checks as checks
from ._faults import FaultSpec
from ._http import HttpRequest, Responder
from ._metrics import EngineMetrics, count_streaming
from ._output import Shapes
from ._protocol import ApiError, EngineProtocol, KvRequest, Leg, Plan, Routes, stops
from ._records import Lease, RemoteKV, ReqCtx
from ._sglang_wire import SglangCollector, SglangShapes, error_event
from ._spec import ENGINE_VERSION
from ._tokenizer import piece_id

if TYPE_CHECKING:
    from ._engine import SimEngine
    from ._run import Run

# SGLang's --decode-log-interval: a decode server reports its load every this many steps.
_DECODE_LOG_INTERVAL = 40


class SGLangProtocol(EngineProtocol):
    headers_before_first_token = False
    owned_by = "sglang"

    def __init__(self, engine: SimEngine) -> None:
        super().__init__(engine)
        # SGLang sets its load gauges when its scheduler first reports: at its first
        # batch, on a decode server at its first log interval or its first idle tick
        # after serving (`note_step`).
        self.load_reported = False
        self._decode_steps = 0

    @property
    def mode(self) -> str:
        return self.e.spec.disaggregation_mode

    # -- identity and routes ----------------------------------------------------------
    @property
    def version(self) -> str:
        return ENGINE_VERSION["sglang"]

    def routes(self) -> Routes:
        # 0.5.23 has no /version (404): /get_server_info says its version.
        return {
            ("POST", "/v1/tokenize"): self.tokenize,
            ("GET", "/health_generate"): self.e.serve_health,
            ("GET", "/get_server_info"): self._server_info,
            ("GET", "/get_model_info"): self._model_info,
            ("GET", "/flush_cache"): self._flush_cache,
            ("POST", "/flush_cache"): self._flush_cache,
        }

    def requires_api_key(self, method: str, path: str) -> bool:
        """SGLang's middleware guards every path but /health* and /metrics*, so its
        /tokenize and /get_server_info need the key, never OPTIONS; the simulator's own
        /_sim/ routes stand in for no engine route and stay open."""
        if method == "OPTIONS" or path.startswith("/_sim/"):
            return False
        return not path.startswith(("/health", "/metrics"))

    async def tokenize(self, req: HttpRequest, resp: Responder) -> None:
        """Its /tokenize takes any model name (serving_tokenize.py@0351c1fa reads only
        the prompt) and reports its tokenizer's model_max_length (docs/design.md#tokenize)."""
        body = await self.read_json_body(req, resp)
        if body is None:
            return
        try:
            answer = self._tokenize(body)
        except ApiError as err:
            await self.send_error(resp, err)
            return
        spec = self.e.spec
        length = spec.tokenizer_max_length or spec.timing.max_model_len
        await resp.send_json(200, {**answer, "max_model_len": length})

    def _tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """SGLang's /tokenize answer, less max_model_len (docs/design.md#tokenize; sglang
        protocol.py TokenizeRequest, serving_tokenize.py). `prompt` is a string or a list of
        strings, each counted with add_special_tokens (default true). A newer build
        (`SimEngineSpec.tokenize_messages`) takes `messages` instead, rendered as its chat
        completion renders them and never with add_special_tokens; an older one requires
        `prompt`, so FastAPI refuses a body without it."""
        prompt, messages = body.get("prompt"), body.get("messages")
        if self.e.spec.tokenize_messages:
            if (prompt is None) == (messages is None):
                raise checks.validation_error(
                    ("body",),
                    "value_error",
                    "Value error, Exactly one of 'prompt' or 'messages' must be provided.",
                    body,
                )
            if messages is not None:
                if not isinstance(messages, list):
                    raise checks.validation_error(
                        ("body", "messages"), "list_type", "Input should be a valid list", messages
                    )
                ids = self.e.tokenizer.encode(self.chat_text(messages, body))
                return {"tokens": ids, "count": len(ids)}
        elif prompt is None:
            raise checks.validation_error(("body", "prompt"), "missing", "Field required", body)
        if isinstance(prompt, list):
            if not all(isinstance(p, str) for p in prompt):
                raise ApiError(400, "prompt must be a list of strings", param="prompt")
            many = [[piece_id(x) for x in self.pieces(p, body)] for p in prompt]
            return {"tokens": many, "count": [len(ids) for ids in many]}
        if not isinstance(prompt, str):
            raise ApiError(
                400,
                f"Invalid prompt type: <class '{type(prompt).__name__}'>. "
                "Expected str or List[str].",
            )
        ids = [piece_id(x) for x in self.pieces(prompt, body)]
        return {"tokens": ids, "count": len(ids)}

    async def _server_info(self, req: HttpRequest, resp: Responder) -> None:
        e = self.e
        t = e.spec.timing
        await resp.send_json(
            200,
            {
                "model_path": e.spec.model,
                "tokenizer_path": e.spec.model,
                "served_model_name": e.spec.model,
                "tp_size": 1,
                "dp_size": 1,
                # The --context-length flag, null unless set (the model config's limit
                # is on the /v1/models card); --allow-auto-truncate, off by default.
                "context_length": None,
                "allow_auto_truncate": False,
                "chunked_prefill_size": t.chunk_tokens,
                "page_size": t.block_size,
                "max_running_requests": t.max_num_seqs,
                "max_total_num_tokens": t.kv_capacity_tokens,
                "disaggregation_mode": self.mode,
                "disaggregation_bootstrap_port": e.port,
                "disaggregation_transfer_backend": "fake",
                "internal_states": [
                    {
                        "last_gen_throughput": 0.0,
                        "num_running_reqs": len(e.core.running),
                        "num_queue_reqs": len(e.core.waiting) + e.pending,
                    }
                ],
                "version": self.version,
                **self.identity(),
            },
        )

    async def _model_info(self, req: HttpRequest, resp: Responder) -> None:
        e = self.e
        await resp.send_json(
            200,
            {
                "model_path": e.spec.model,
                "tokenizer_path": e.spec.model,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
            },
        )

    async def _flush_cache(self, req: HttpRequest, resp: Responder) -> None:
        await resp.send(
            200,
            b"Cache flushed.\nPlease check backend logs for more details. (When there are "
            b"running or waiting requests, the operation will not be performed.)\n",
            content_type="text/plain; charset=utf-8",
        )

    # -- errors -----------------------------------------------------------------------
    def error_body(
        self, status: int, message: str, *, type_: str | None = None, param: str | None = None
    ) -> dict[str, Any]:
        type_ = self.error_type(status, type_)
        return {
            "object": "error",
            "message": message,
            "type": type_,
            "param": param,
            "code": status,
        }

    def error_event(
        self, status: int, message: str, type_: str | None = None, param: str | None = None
    ) -> bytes:
        return error_event(status, message)

    def abort_error(self, status: int, message: str) -> ApiError:
        # An abort's status other than 400 comes as an HTTPException, whose status its
        # handler names as the type.
        return ApiError(status, message, type_=str(status))

    def queue_full(self, queued: int, limit: int) -> ApiError:
        return ApiError(
            503,
            "The engine is currently busy and cannot accept new requests. Please try again "
            "later or on a different instance.",
            type_="Service Unavailable",
        )

    # -- reading a generation request -------------------------------------------------
    def echo_headers(self, request_id: str) -> list[tuple[str, str]]:
        return []  # SGLang sends no x-request-id

    def special_tokens(self, body: dict[str, Any], *, chat: bool) -> int:
        # Its request models have no add_special_tokens: a completion always adds them.
        return 0 if chat else 1

    def add_generation_prompt(self, body: dict[str, Any]) -> bool:
        # Its chat request has no add_generation_prompt: it adds the generation prompt
        # unless the last message is continued.
        return not body.get("continue_final_message", False)

    def empty_conversation(self) -> ApiError | None:
        return ApiError(
            400,
            "Cannot apply chat template to an empty conversation. Provide at least one message.",
        )

    def read(self, body: dict[str, Any], *, chat: bool, header_faults: FaultSpec | None) -> Plan:
        e = self.e
        checks.check_declared(body, chat=chat)
        stream = bool(body.get("stream") or False)
        n = checks.choices(body.get("n", 1), stream=stream)
        if not chat:
            checks.check_prompt(body)
        checks.check_lora(body)
        stream_options = body.get("stream_options")
        include_usage = continuous_usage = False
        if stream and isinstance(stream_options, dict):
            include_usage = bool(stream_options.get("include_usage", False))
            # The running usage on every chunk, with or without include_usage
            # (docs/design.md#usage-chunks).
            continuous_usage = bool(stream_options.get("continuous_usage_stats"))
        leg = self._leg(body)
        prompt_tokens, prompt_key = self.prompt(body, chat=chat)
        limit = e.spec.timing.max_model_len
        min_tokens = body.get("min_tokens") or 0
        max_tokens, _ = self.output_bound(body, chat=chat)
        if prompt_tokens >= limit:
            raise ApiError(
                400,
                f"The input ({prompt_tokens} tokens) is longer than the "
                f"model's context length ({limit} tokens).",
            )
        if max_tokens is None:
            max_tokens = self.unbounded(prompt_tokens, min_tokens)
        max_tokens = self.check_max_tokens(max_tokens, suffix=False)
        checks.check_context(prompt_tokens, max_tokens, limit)
        # SamplingParams.verify in its tokenizer manager, against the request's own
        # bound: a prefill server sets max_new_tokens to 1 only later, in its bootstrap
        # queue, and checks nothing after that.
        refusal = checks.sampling_refusal(
            body, max_tokens, min_tokens if isinstance(min_tokens, int) else 0
        )
        if refusal is not None:
            raise ApiError(400, refusal)
        bound = checks.max_request_input(limit, e.spec.timing.kv_capacity_tokens)
        if prompt_tokens >= bound:
            # Its scheduler's own check, after the tokenizer manager's: it aborts the
            # request, which a stream reports after its 200.
            raise ApiError(
                400,
                f"Input length ({prompt_tokens} tokens) exceeds the maximum allowed "
                f"length ({bound} tokens). Use a shorter input or enable "
                "--allow-auto-truncate.",
                streamed=stream,
            )
        if leg.phase == "prefill":
            # SGLang's prefill server forces max_new_tokens=1 (docs/design.md#sglang-bootstrap).
            max_tokens = 1
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
            top_logprobs=checks.top_logprobs(body, chat=chat),
            stops=stops(body),
            # Its spelling of include_stop_str_in_output.
            include_stop=bool(body.get("no_stop_trim")),
            # Its min_new_tokens only keeps end-of-sequence tokens out: a stop string
            # ends a choice from its first token on.
            min_tokens=0,
            model=self._answered_model(body.get("model")),
        )

    def _answered_model(self, model: object) -> str:
        """The model an answer names: the request's, "default" when it names none (its
        request models' default)."""
        if model is None:
            return "default"
        return model if isinstance(model, str) else self.e.spec.model

    def _leg(self, body: dict[str, Any]) -> Leg:
        """The leg is the server's launch mode (docs/design.md#sglang-bootstrap), whatever the
        body says: an aggregate server ignores bootstrap fields, a disaggregated one needs
        them."""
        if self.mode == "null":
            return Leg()
        host = body.get("bootstrap_host")
        port = body.get("bootstrap_port")
        room = body.get("bootstrap_room")
        if room is None:
            # SGLang's spelling (docs/design.md#sglang-bootstrap).
            raise ApiError(
                400, "Invalid request: Disaggregated request received without boostrap room id"
            )
        if not isinstance(room, int) or isinstance(room, bool):
            raise ApiError(400, "bootstrap_room must be an integer (batches are not simulated)")
        if self.mode == "prefill":
            return Leg(phase="prefill", room=room, hold_kv=True)
        if not isinstance(host, str) or not isinstance(port, int):
            raise ApiError(
                400, "bootstrap_host and bootstrap_port are required with bootstrap_room"
            )
        remote = RemoteKV(host=host, port=port, num_tokens=0, room=room)
        return Leg(phase="decode", remote=remote, room=room)

    def request_ids(self, request_id: str, *, chat: bool, plan: Plan) -> tuple[list[str], str]:
        # Its request id, a uuid's hex; a streamed choice has one of its own.
        ids = [self.e.new_hex(32) for _ in range(plan.n if plan.stream else 1)]
        return ids, ids[0]

    def never_answers(self, plan: Plan) -> bool:
        """A bootstrap pair given n > 1: neither server answers (seen on 0.5.23: nothing
        within 60 s), the request held until its client leaves."""
        return plan.n > 1 and self.mode != "null"

    # -- the P/D pair -----------------------------------------------------------------
    def serves_bootstrap(self) -> bool:
        # Only a prefill server runs a bootstrap server.
        return self.mode == "prefill"

    def fail_unstarted(self, req: HttpRequest, reason: str) -> None:
        """A prefill request that never starts must still fail its decoder's wait."""
        if self.mode != "prefill":
            return
        try:
            body = json.loads(req.body)
        except ValueError:
            return
        if isinstance(body, dict):
            room = json_int(body.get("bootstrap_room"))
            if room is not None:
                self.e.kv.room(room).fail(reason)

    def open_leg(self, ctx: ReqCtx, plan: Plan) -> None:
        room = plan.leg.room
        if room is not None and ctx.phase == "prefill":
            ctx.room = self.e.kv.room(room)
            # Its KV waits for the decoder as long as the bootstrap does.
            ctx.lease_s = self.e.spec.scaled(self.e.spec.bootstrap_timeout_s)

    async def wait_for_peer(self, run: Run) -> tuple[str, int] | None:
        """A prefill request sits in the bootstrap queue until its decoder registers for
        the room (docs/design.md#sglang-bootstrap), at most the bootstrap timeout."""
        e, ctx = self.e, run.ctx
        room = ctx.room
        if room is None:
            return None
        e.pending += 1
        try:
            with trio.move_on_after(e.spec.scaled(e.spec.bootstrap_timeout_s)) as wait:
                await room.d_arrived.wait()
        finally:
            e.pending -= 1
        if not wait.cancelled_caught:
            return None
        room.fail("bootstrap timeout")
        # SGLang 0.5.23's words (disaggregation/prefill.py, common/conn.py).
        msg = (
            f"Prefill bootstrap failed for request rank=0 req.rid={ctx.internal_id!r} "
            f"req.bootstrap_room={room.room} with exception "
            f"KVTransferError(bootstrap_room={room.room}): Request {room.room} timed "
            f"out after {e.spec.bootstrap_timeout_s:.1f}s in KVPoll.Bootstrapping"
        )
        return await run.fail(500, msg)

    def kv_request(self, remote: RemoteKV) -> KvRequest:
        spec = self.e.spec
        body = {"room": remote.room, "num_tokens": remote.num_tokens, "decode": self.e.url}
        return "/_sim/bootstrap/transfer", body, spec.scaled(spec.waiting_timeout_s)

    def transfer_failure(self, ctx: ReqCtx, reason: str) -> str:
        room = ctx.remote.room if ctx.remote is not None else None
        cause = (
            "Aborted by AbortReq."
            if "Aborted" in reason
            else "Failed to get kvcache from prefill instance, it might be dead"
        )
        # SGLang 0.5.23's words (disaggregation/decode.py).
        return (
            f"Decode transfer failed for request rank=0 "
            f"decode_req.req.rid={ctx.internal_id!r} "
            f"decode_req.req.bootstrap_room={room} with exception "
            f"KVTransferError(bootstrap_room={room}): {cause}"
        )

    def abandon_kv(self, remote: RemoteKV) -> None:
        pass  # its bootstrap server sees the decoder go (`_kv.KvStore.receiver_gone`)

    def kv_transfer_params(self, ctx: ReqCtx) -> dict[str, Any] | None:
        return None  # a pair's legs meet through their bootstrap room

    async def run(self) -> None:
        pass  # nothing to heartbeat: the prefill server pushes the KV

    def close_leg(self, ctx: ReqCtx, outcome: str) -> None:
        if ctx.room is not None:
            ctx.room.fail("Aborted by AbortReq." if outcome == "aborted" else "prefill failed")

    def kv_held(self, ctx: ReqCtx, lease: Lease) -> None:
        room = ctx.room
        if room is None:
            return
        room.lease = lease
        room.done.set()
        if room.d_gone:
            self.e.kv.receiver_gone(lease)

    def lease_expired(self, lease: Lease) -> None:
        room = next((r for r in self.e.kv.rooms.values() if r.lease is lease), None)
        if room is not None:
            room.fail("KV cache released by the prefill instance before transfer")

    # -- answers ----------------------------------------------------------------------
    def shapes(self, plan: Plan, ids: list[str], created: int) -> Shapes:
        return SglangShapes(chat=plan.chat, model=plan.model, ids=ids, created=created)

    def stream_failure(self, run: Run, status: int, message: str) -> bytes:
        out = error_event(status, message)
        if run.plan.include_usage:
            # Its generator leaves its loop at the error and goes on to its usage chunk.
            out += b"data: " + run.shapes.usage_chunk(run.usage()).encode() + b"\n\n"
        return out

    # -- metrics and load -------------------------------------------------------------
    def note_step(self, idle: bool, decodes: bool) -> None:
        if idle:
            self.load_reported = self._decode_steps > 0
        elif self.mode != "decode":
            self.load_reported = True
        elif decodes:
            self._decode_steps += 1
            self.load_reported = self._decode_steps >= _DECODE_LOG_INTERVAL

    def count_generated(self, metrics: EngineMetrics, progressed: list[Any]) -> None:
        for r in progressed:
            count_streaming(metrics.streaming_generation_tokens, r.owner.stream)

    def collector(self) -> SglangCollector:
        e = self.e
        return SglangCollector(
            e.metrics,
            e.gauges,
            model=e.spec.model,
            engine=e.label,
            # Its label of its server mode.
            engine_type=self.mode.replace("null", "unified"),
        )
