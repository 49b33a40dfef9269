"""The OpenAI-compatible endpoints of a simulated engine, in vLLM's or SGLang's dialect.

Wire shapes follow engine-protocols.md; the section is cited where a detail matters.
"""

from __future__ import annotations

import json
import time
import uuid
import zlib
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .._values import json_int
from ._core import CoreRequest, ReqState
from ._faults import FaultSpec, FaultSpecError, parse_faults
from ._http import DropConnection, HttpRequest, Responder
from ._metrics import count_streaming
from ._output import Choice, Shapes, plan_choices, usage
from ._records import RemoteKV, ReqCtx
from ._sglang_checks import max_request_input, sampling_refusal
from ._sglang_wire import SglangShapes, error_event
from ._spec import ENGINE_VERSION
from ._tokenizer import BOS, VOCAB_SIZE, piece_id, render_chat
from ._vllm_wire import VllmShapes

if TYPE_CHECKING:
    from ._engine import SimEngine

_COMPACT = (",", ":")
_VLLM_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    501: "NotImplementedError",
}
_DEFAULT_MESSAGES = {
    500: "Internal server error",
    503: "The server is overloaded or not ready yet.",
    429: "Too many requests",
}
# vLLM's --max-logprobs default.
_MAX_LOGPROBS = 20
_KV_PARAM_KEYS = (
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
)


def _j(obj: Any) -> str:
    return json.dumps(obj, separators=_COMPACT)


def _token_prompt(prompt: object) -> bool:
    """Whether a completion prompt is one list of token ids."""
    return (
        isinstance(prompt, list) and bool(prompt) and all(json_int(t) is not None for t in prompt)
    )


def _stops(body: dict[str, Any]) -> list[str]:
    """The request's stop strings (a string or a list of them; empty ones never match)."""
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        return []
    return [s for s in stop if isinstance(s, str) and s]


def _validation_error(
    loc: tuple[str, ...], kind: str, msg: str, value: object, cause: Exception | None = None
) -> ApiError:
    """FastAPI's refusal of a body its pydantic model rejects, as SGLang's validation
    handler answers it: 400, "Bad Request", the error's text then its list's. `value` is
    what pydantic reports as the input (the field's value; the body for a missing field),
    `cause` a field validator's exception."""
    error: dict[str, object] = {"type": kind, "loc": loc, "msg": msg, "input": value}
    if cause is not None:
        error["ctx"] = {"error": cause}
    return ApiError(400, f"1 validation error:\n  {error!r} {[error]!r}", type_="Bad Request")


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str | None = None,
        param: str | None = None,
        streamed: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        # Found after a stream's 200 (vLLM's input processor, inside its generator;
        # SGLang's scheduler, which aborts the request): an error event, then [DONE].
        self.streamed = streamed


class Api:
    def __init__(self, engine: SimEngine) -> None:
        self.e = engine
        self.sglang = engine.spec.dialect == "sglang"

    # -- errors ---------------------------------------------------------------------------
    def error_body(
        self, status: int, message: str, *, type_: str | None = None, param: str | None = None
    ) -> dict[str, Any]:
        if type_ is None:
            type_ = _VLLM_TYPES.get(status)
        if type_ is None:
            try:
                type_ = HTTPStatus(status).phrase
            except ValueError:
                type_ = "InternalServerError" if status >= 500 else "BadRequestError"
        if self.sglang:
            # SGLang keeps the flat pre-0.10.1 vLLM shape (§5.5).
            return {
                "object": "error",
                "message": message,
                "type": type_,
                "param": param,
                "code": status,
            }
        return {"error": {"message": message, "type": type_, "param": param, "code": status}}

    async def send_error(
        self, resp: Responder, err: ApiError, headers: list[tuple[str, str]] | None = None
    ) -> None:
        body = self.error_body(err.status, err.message, type_=err.type, param=err.param)
        await resp.send_json(err.status, body, headers=headers)

    def sse_error(
        self, status: int, message: str, type_: str | None = None, param: str | None = None
    ) -> bytes:
        if self.sglang:
            return error_event(status, message)
        body = self.error_body(status, message, type_=type_, param=param)
        if self.e.spec.vllm.wire_032:
            # create_streaming_error_response: json.dumps with its default separators.
            return b"data: " + json.dumps(body).encode() + b"\n\n"
        return b"data: " + _j(body).encode() + b"\n\n"

    # -- /v1/completions and /v1/chat/completions -----------------------------------------
    async def generate(self, req: HttpRequest, resp: Responder, *, chat: bool) -> None:
        e = self.e
        xrid = req.headers.get("x-request-id") or uuid.uuid4().hex
        # vLLM answers with the request's id; SGLang sends no such header.
        echo = [] if self.sglang else [("x-request-id", xrid)]
        try:
            plan = self._parse(req, chat=chat)
        except ApiError as err:
            e.counters.rejected_invalid += 1
            self._fail_room(req, err.message)
            if err.streamed:
                await resp.start_stream(200, headers=echo)
                event = self.sse_error(err.status, err.message, type_=err.type, param=err.param)
                await resp.end_stream(event + b"data: [DONE]\n\n")
                return
            await self.send_error(resp, err, echo)
            return
        leg = plan.leg
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
            self._fail_room(req, message)
            await self.send_error(resp, ApiError(faults.error_status, message), echo)
            return
        limit = e.spec.max_num_queued
        if limit is not None:
            queued = len(e.core.running) + len(e.core.waiting) + len(e.core.pulling) + e.pending
            if queued + plan.n > limit:
                # vLLM >= 0.29 admission control: QueueOverflowError is a GracefulHTTPError,
                # so `type` is the HTTP phrase (§3.4); n choices take n places.
                e.counters.rejected_queue_full += 1
                self._fail_room(req, "queue full")
                e.record(
                    None, request_id=xrid, phase=leg, outcome="error", status=503, armed_fault=armed
                )
                msg = (
                    "The engine is currently busy and cannot accept new requests. Please "
                    "try again later or on a different instance."
                    if e.spec.vllm.wire_032
                    else f"The engine's request queue is full ({queued} queued, "
                    f"max_num_queued_reqs={limit}); retry on another instance."
                )
                await self.send_error(resp, ApiError(503, msg, type_="Service Unavailable"), echo)
                return
        if self.sglang and plan.n > 1 and e.spec.disaggregation_mode != "null":
            await self._hang(xrid, leg)
            return
        if self.sglang:
            # Its request id, a uuid's hex; a streamed choice has one of its own.
            ids = [e.new_hex(32) for _ in range(plan.n if plan.stream else 1)]
            response_id = ids[0]
            internal_id = response_id
        else:
            prefix = "chatcmpl" if chat else "cmpl"
            response_id = f"{prefix}-{xrid}"
            ids = [response_id]
            internal_id = f"{response_id}-{e.new_hex()}"
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
            hold_kv=plan.hold_kv,
            remote_kv=plan.remote is not None,
        )
        ctx = ReqCtx(
            request_id=xrid,
            internal_id=core.rid,
            phase=leg,
            core=core,
            arrival=trio.current_time(),
            faults=faults,
            armed_fault=armed,
            remote=plan.remote,
            stream=plan.stream,
        )
        ctx.lease_s = e.lease_for(faults)
        if plan.room is not None and leg == "prefill":
            ctx.room = e.room(plan.room)
            ctx.lease_s = e.spec.scaled(e.spec.bootstrap_timeout_s)
        core.owner = ctx
        e.counters.requests[leg] += 1
        e.metrics.prompt_tokens += plan.prompt_tokens
        count_streaming(e.metrics.streaming_prompt_tokens, plan.stream, plan.prompt_tokens)
        run = _Run(self, ctx, resp, plan, ids, echo, choices)
        outcome, status = "aborted", 499
        try:
            outcome, status = await run.serve()
        finally:
            if core.state is not ReqState.FINISHED:
                e.core.abort(core)
                e.wake_scheduler()
                if ctx.remote is not None and ctx in e.awaiting_kv:
                    e.notify_release(ctx.remote)
            e.awaiting_kv.discard(ctx)
            if ctx.room is not None:
                ctx.room.fail("Aborted by AbortReq." if outcome == "aborted" else "prefill failed")
            if run.crashed:
                outcome = "error"
            if outcome == "aborted" and resp.started:
                status = resp.status
            run.settle(outcome, status)

    async def _hang(self, request_id: str, leg: str) -> None:
        """SGLang's bootstrap pair given n > 1: neither server answers (seen on 0.5.23:
        nothing within 60 s), the request held until its client leaves."""
        e = self.e
        e.counters.requests[leg] += 1
        e.pending += 1
        try:
            await trio.sleep_forever()
        finally:
            e.pending -= 1
            e.record(None, request_id=request_id, phase=leg, outcome="aborted", status=499)

    def _fail_room(self, req: HttpRequest, reason: str) -> None:
        """An SGLang prefill request that never starts must still fail its decoder's wait."""
        if self.e.spec.disaggregation_mode != "prefill":
            return
        try:
            body = json.loads(req.body)
        except ValueError:
            return
        if isinstance(body, dict):
            room = json_int(body.get("bootstrap_room"))
            if room is not None:
                self.e.room(room).fail(reason)

    def _parse(self, req: HttpRequest, *, chat: bool) -> _Plan:
        e = self.e
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
        if self.sglang:
            # Its request models declare `stream: bool = False` and `n: int = 1`, so
            # FastAPI refuses a null for either (protocol.py@9b116dff).
            for key, kind, msg in (
                ("stream", "bool_type", "Input should be a valid boolean"),
                ("n", "int_type", "Input should be a valid integer"),
            ):
                if key in body and body[key] is None:
                    raise _validation_error(("body", key), kind, msg, None)
            if not chat and "max_tokens" in body:
                self._sglang_check_completion_max_tokens(body["max_tokens"])
        stream = bool(body.get("stream") or False)
        model = body.get("model")
        build = e.spec.vllm
        n = 1
        if self.sglang:
            n = self._sglang_choices(body.get("n", 1), stream=stream)
            if not chat:
                self._sglang_check_prompt(body)
            self._sglang_check_lora(body)
        else:
            self._vllm_check_body(body, stream=stream, chat=chat)
            if model is not None and model != e.spec.model:
                message = f"The model `{model}` does not exist."
                if build.wire_032:
                    message += f" Valid aliases: {e.spec.model}."
                raise ApiError(404, message, type_="NotFoundError", param="model")
        stream_options = body.get("stream_options")
        include_usage = continuous_usage = False
        if stream and isinstance(stream_options, dict):
            # Its default: vLLM 0.29 true (notes §4.4), 0.32 false; SGLang false (§5.5).
            default = build.include_usage_default and not self.sglang
            include_usage = bool(stream_options.get("include_usage", default))
            # The running usage on every chunk: vLLM only with include_usage (§4.4),
            # SGLang either way.
            continuous_usage = (include_usage or self.sglang) and bool(
                stream_options.get("continuous_usage_stats")
            )

        leg, remote, room, hold_kv = self._leg(body)
        prompt_tokens, prompt_key = self._prompt(body, chat=chat)
        limit = e.spec.timing.max_model_len
        keep = json_int(body.get("truncate_prompt_tokens"))
        if not self.sglang and keep is not None:
            # vLLM keeps the prompt's last `keep` tokens before any other check (-1: as
            # many as fit, 0.32 holding one back for the output); SGLang's request models
            # have no such field.
            if build.wire_032 and keep > limit:
                raise ApiError(
                    400,
                    f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = "
                    f"{limit}. Please request a smaller truncation size. "
                    f"(parameter=truncate_prompt_tokens, value={keep})",
                    param="truncate_prompt_tokens",
                )
            if keep == -1:
                keep = limit - 1 if build.wire_032 else limit
            if keep > limit:
                raise ApiError(
                    400,
                    f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
                    f"({limit}). Please, select a smaller truncation size.",
                )
            if keep >= 1:
                prompt_tokens = min(prompt_tokens, keep)
        min_tokens = body.get("min_tokens") or 0
        if chat:
            max_tokens = body.get("max_completion_tokens")
            bound_param = "max_tokens" if max_tokens is None else "max_completion_tokens"
            if max_tokens is None:
                max_tokens = body.get("max_tokens")
        else:
            bound_param = "max_tokens"
            # vLLM's and SGLang's CompletionRequest default; vLLM 0.32 reads null as it.
            max_tokens = body.get("max_tokens", 16)
            if max_tokens is None and not self.sglang and build.null_max_tokens_is_default:
                max_tokens = 16
        if not self.sglang and build.context_rule == "prompt_alone":
            max_tokens = self._fit_output(
                max_tokens,
                bound_param,
                prompt_tokens,
                limit,
                token_prompt=not chat and _token_prompt(body.get("prompt")),
            )
        elif prompt_tokens >= limit:
            if self.sglang:
                raise ApiError(
                    400,
                    f"The input ({prompt_tokens} tokens) is longer than the "
                    f"model's context length ({limit} tokens).",
                )
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {prompt_tokens} input tokens. Please reduce the length of the input "
                "messages.",
                param="input_tokens",
            )
        if max_tokens is None:
            # No bound (vLLM's get_max_tokens: the context, or a generation config's
            # max_new_tokens); see SimEngineSpec.unbounded_max_tokens.
            max_tokens = limit - prompt_tokens
            bound = e.spec.unbounded_max_tokens
            if bound is not None:
                floor = min_tokens if isinstance(min_tokens, int) else 0
                max_tokens = min(max_tokens, max(bound, floor))
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            message = f"max_tokens must be at least 1, got {max_tokens}."
            if build.wire_032 and not self.sglang:
                message += f" (parameter=max_tokens, value={max_tokens})"
            raise ApiError(400, message, param="max_tokens")
        if self.sglang and prompt_tokens + max_tokens > limit:
            # Its tokenizer manager's check (newer builds: a total equal to the context
            # passes), on a prefill server too: that sets max_new_tokens to 1 later, in
            # its bootstrap queue.
            raise ApiError(
                400,
                "Requested token count exceeds the model's maximum context length of "
                f"{limit} tokens. You requested a total of {prompt_tokens + max_tokens} "
                f"tokens: {prompt_tokens} tokens from the input messages and {max_tokens} "
                "tokens for the completion. Please reduce the number of tokens in the input "
                "messages or the completion to fit within the limit.",
            )
        if self.sglang:
            # SamplingParams.verify in its tokenizer manager, against the request's own
            # bound: a prefill server sets max_new_tokens to 1 only later, in its
            # bootstrap queue, and checks nothing after that.
            floor = min_tokens if isinstance(min_tokens, int) else 0
            refusal = sampling_refusal(body, max_tokens, floor)
            if refusal is not None:
                raise ApiError(400, refusal)
            bound = max_request_input(limit, e.spec.timing.kv_capacity_tokens)
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
            if room is not None and leg == "prefill":
                max_tokens = 1  # SGLang's prefill server forces max_new_tokens=1 (§5.2)
        if (
            not self.sglang
            and build.context_rule == "prompt_and_output"
            and prompt_tokens + max_tokens > limit
        ):
            raise ApiError(
                400,
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                f"model's maximum context length is {limit} tokens and your request has "
                f"{prompt_tokens} input tokens ({max_tokens} > {limit} - {prompt_tokens}).",
                param="max_tokens",
            )
        top: int | None = None
        if self.sglang:
            top = self._sglang_top_logprobs(body, chat=chat)
        else:
            n = self._vllm_check_sampling(body, max_tokens, min_tokens)
            # The engine's input checks, inside its generator: after a stream's 200.
            top = self._vllm_check_inputs(body, chat=chat, stream=stream)
        stops = _stops(body)
        return _Plan(
            leg=leg,
            remote=remote,
            room=room,
            hold_kv=hold_kv,
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
            stops=stops,
            # SGLang's spelling of it.
            include_stop=bool(
                body.get("no_stop_trim" if self.sglang else "include_stop_str_in_output")
            ),
            # SGLang's min_new_tokens only keeps end-of-sequence tokens out: a stop string
            # ends a choice from its first token on.
            min_tokens=0 if self.sglang or not isinstance(min_tokens, int) else min_tokens,
            model=self._answered_model(model),
        )

    def _vllm_check_body(self, body: dict[str, Any], *, stream: bool, chat: bool) -> None:
        """vLLM's request-model validators, before anything else runs."""
        build = self.e.spec.vllm
        stream_options = body.get("stream_options")
        if build.wire_032:
            # A VLLMValidationError in a model validator; `{}` passes (it checks truth).
            if stream_options and not stream:
                raise ApiError(
                    400,
                    "Stream options can only be defined when `stream=True`. "
                    "(parameter=stream_options)",
                    param="stream_options",
                )
        elif stream_options is not None and not stream:
            # A pydantic model validator in vLLM, so FastAPI's validation handler answers.
            raise ApiError(
                400,
                "1 validation error:\n  {'type': 'value_error', 'loc': ('body',), 'msg': "
                "'Value error, Stream options can only be defined when `stream=True`.'}",
                type_="Bad Request",
                param="body",
            )
        name = "top_logprobs" if chat else "logprobs"
        value = body.get(name)
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ApiError(
                400,
                f"`{name}` must be an integer. (parameter={name}, value={value})",
                param=name,
            )
        if value < 0 and value != -1:
            raise ApiError(
                400,
                f"`{name}` must be a positive value or -1. (parameter={name}, value={value})",
                param=name,
            )
        if chat and value != 0 and not body.get("logprobs"):
            raise ApiError(
                400,
                "when using `top_logprobs`, `logprobs` must be set to true. "
                f"(parameter=top_logprobs, value={value})",
                param="top_logprobs",
            )

    def _fit_output(
        self,
        max_tokens: Any,
        param: str,
        prompt_tokens: int,
        limit: int,
        *,
        token_prompt: bool,
    ) -> Any:
        """vLLM 0.32's context rule: a bound above max_model_len and a prompt alone over
        the context are refused; otherwise the output is capped at what the context leaves
        (a prompt of exactly the context leaves 0, refused by the sampling check)."""
        count = json_int(max_tokens)
        if count is not None and count > limit:
            raise ApiError(
                400,
                f"{param}={count} cannot be greater than max_model_len={limit}. Please "
                f"request fewer output tokens. (parameter={param}, value={count})",
                param=param,
            )
        if prompt_tokens > limit:
            # A text prompt is tokenized with truncation at the context + 1, so its count
            # stops there; a prompt of token ids is counted in full.
            shown = prompt_tokens if token_prompt else limit + 1
            qualifier = "" if token_prompt else "at least "
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your "
                f"prompt contains {qualifier}{shown} input tokens, which exceeds this limit "
                "even without any output tokens. Please reduce the length of the input "
                f"prompt. (parameter=input_tokens, value={shown})",
                param="input_tokens",
            )
        if count is not None:
            return min(count, limit - prompt_tokens)
        return max_tokens

    def _vllm_check_sampling(self, body: dict[str, Any], max_tokens: int, min_tokens: Any) -> int:
        """SamplingParams' own checks, after the context check, before the stream: the
        number of choices (n)."""
        n = body.get("n")
        n = 1 if n is None else n
        if isinstance(n, bool) or not isinstance(n, int):
            raise ApiError(400, f"n must be an int, but is of type {type(n)}")
        if n < 1:
            raise ApiError(400, f"n must be at least 1, got {n}.")
        temperature = body.get("temperature")
        if isinstance(temperature, int | float) and not isinstance(temperature, bool):
            if temperature < 0:
                raise ApiError(
                    400,
                    f"temperature must be non-negative, got {float(temperature)}. "
                    f"(parameter=temperature, value={float(temperature)})",
                    param="temperature",
                )
            if temperature > 2:
                raise ApiError(
                    400,
                    f"temperature must be in [0, 2], got {float(temperature)}. "
                    f"(parameter=temperature, value={float(temperature)})",
                    param="temperature",
                )
        if isinstance(min_tokens, int) and not 0 <= min_tokens <= max_tokens:
            message = (
                f"min_tokens must be greater than or equal to 0, got {min_tokens}."
                if min_tokens < 0
                else f"min_tokens must be less than or equal to max_tokens={max_tokens}, got "
                f"{min_tokens}."
            )
            if self.e.spec.vllm.wire_032:
                # Raised without a parameter: no suffix, param null.
                raise ApiError(400, message)
            message += f" (parameter=min_tokens, value={min_tokens})"
            raise ApiError(400, message, param="min_tokens")
        return n

    def _vllm_check_inputs(self, body: dict[str, Any], *, chat: bool, stream: bool) -> int | None:
        """The engine's input processor, inside its generator (an error event after a
        stream's 200): the logprobs asked for, then the prompt's token ids. Returns how
        many top logprobs each token carries (None: no logprobs)."""
        if chat:
            top = (json_int(body.get("top_logprobs")) or 0) if body.get("logprobs") else None
        else:
            top = json_int(body.get("logprobs"))
        if top is not None:
            asked = VOCAB_SIZE if top == -1 else top
            if asked > _MAX_LOGPROBS:
                raise ApiError(
                    400,
                    f"Requested sample logprobs of {asked}, which is greater than max "
                    f"allowed: {_MAX_LOGPROBS} (parameter=logprobs, value={asked})",
                    param="logprobs",
                    streamed=stream,
                )
        prompt = None if chat else body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        if _token_prompt(prompt):
            assert isinstance(prompt, list)
            ids = [json_int(t) or 0 for t in prompt]
            wrong = min(ids) if min(ids) < 0 else max(ids)
            if not 0 <= wrong < VOCAB_SIZE:
                raise ApiError(400, f"Token id {wrong} is out of vocabulary", streamed=stream)
        return top

    def _answered_model(self, model: object) -> str:
        """The model an answer names: vLLM its own (it refuses others), SGLang the
        request's, "default" when it names none (its request models' default)."""
        if not self.sglang:
            return self.e.spec.model
        if model is None:
            return "default"
        return model if isinstance(model, str) else self.e.spec.model

    @staticmethod
    def _sglang_choices(value: object, *, stream: bool) -> int:
        """The choices SGLang serves for `n` (`n: int = 1` in its request models): n
        above 1 as asked, else one. Its non-streaming answer of n=0 divides by n
        (`range(0, len, n)` in its usage processor) once the request has run; the
        simulator answers it without running it."""
        n = json_int(value)
        if n is None:
            raise _validation_error(
                ("body", "n"), "int_type", "Input should be a valid integer", value
            )
        if n == 0 and not stream:
            raise ApiError(400, "range() arg 3 must not be zero", type_="BadRequest")
        return max(n, 1)

    @staticmethod
    def _sglang_top_logprobs(body: dict[str, Any], *, chat: bool) -> int | None:
        """How many top logprobs SGLang sends per token (None: no logprobs): a
        completion's `logprobs`, a chat's `top_logprobs` (0 unless set) once `logprobs`
        is true. It has no upper bound."""
        if chat:
            return (json_int(body.get("top_logprobs")) or 0) if body.get("logprobs") else None
        return json_int(body.get("logprobs"))

    def _sglang_check_prompt(self, body: dict[str, Any]) -> None:
        """SGLang's CompletionRequest requires `prompt` (FastAPI refuses a body without
        it), and its `_validate_request` an unempty one, before anything else runs (so
        never after a stream's 200)."""
        if "prompt" not in body:
            raise _validation_error(("body", "prompt"), "missing", "Field required", body)
        prompt = body["prompt"]
        if not prompt or (isinstance(prompt, list) and all(not p for p in prompt)):
            raise ApiError(400, "Prompt cannot be empty")

    def _sglang_check_lora(self, body: dict[str, Any]) -> None:
        """SGLang does not check `model` against the name it serves: its OpenAI routes
        take any name. Newer builds read `base:adapter` as a LoRA adapter selection,
        ahead of the request's own `lora_path` (sgl-project/sglang
        python/sglang/srt/entrypoints/openai/serving_completions.py@004c82e0, the same in
        serving_chat: `_validate_request` checks the prompt only, and
        `_resolve_lora_path(request.model, request.lora_path)` in serving_base splits the
        name at its first colon, an empty adapter meaning none). Its tokenizer manager
        (`_validate_and_resolve_lora`) then refuses any adapter on a server launched
        without --enable-lora, which every simulated one is, with a ValueError: 400, streamed
        or not, like the context check after it."""
        model = body.get("model")
        adapter: object = None
        if isinstance(model, str) and ":" in model:
            adapter = model.split(":", 1)[1].strip() or None
        if adapter is None:
            adapter = body.get("lora_path")
            if isinstance(adapter, list):
                adapter = next((a for a in adapter if a), None)
        if adapter:
            raise ApiError(
                400,
                f"LoRA adapter '{adapter}' was requested, but LoRA is not enabled. Please "
                "launch the server with --enable-lora flag and preload adapters using "
                "--lora-paths or /load_lora_adapter endpoint.",
            )

    @staticmethod
    def _sglang_check_completion_max_tokens(value: object) -> None:
        """SGLang's CompletionRequest declares `max_tokens: int = 16` with a validator
        that it be positive (protocol.py): FastAPI refuses null or 0 before SGLang's code
        runs, where vLLM reads null as no bound."""
        if value is None:
            raise _validation_error(
                ("body", "max_tokens"), "int_type", "Input should be a valid integer", None
            )
        count = json_int(value)
        if count is not None and count <= 0:
            cause = ValueError("max_tokens must be positive")
            raise _validation_error(
                ("body", "max_tokens"), "value_error", f"Value error, {cause}", count, cause
            )

    def _leg(self, body: dict[str, Any]) -> tuple[str, Any, int | None, bool]:
        """(leg, remote KV, bootstrap room, hold KV after finishing)."""
        e = self.e
        if self.sglang:
            # The leg is the server's launch mode (§5.1), whatever the body says: an
            # aggregate server ignores bootstrap fields, a disaggregated one needs them.
            mode = e.spec.disaggregation_mode
            if mode == "null":
                return "aggregate", None, None, False
            host = body.get("bootstrap_host")
            port = body.get("bootstrap_port")
            room = body.get("bootstrap_room")
            if room is None:
                # SGLang's spelling (§5.2).
                raise ApiError(
                    400, "Invalid request: Disaggregated request received without boostrap room id"
                )
            if not isinstance(room, int) or isinstance(room, bool):
                raise ApiError(400, "bootstrap_room must be an integer (batches are not simulated)")
            if mode == "prefill":
                return "prefill", None, room, True
            if not isinstance(host, str) or not isinstance(port, int):
                raise ApiError(
                    400, "bootstrap_host and bootstrap_port are required with bootstrap_room"
                )
            return "decode", RemoteKV(host=host, port=port, num_tokens=0, room=room), room, False
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict) or not e.spec.kv_connector:
            # Without a connector vLLM serves the request as any other: no KV is kept
            # for a decoder, none is pulled from a producer.
            return "aggregate", None, None, False
        if params.get("do_remote_decode"):
            return "prefill", None, None, True
        if params.get("do_remote_prefill"):
            if any(params.get(k) is None for k in _KV_PARAM_KEYS):
                # vLLM logs "Got invalid KVTransferParams" and computes the prompt itself.
                return "decode", None, None, False
            port = params.get("remote_port")
            if not isinstance(port, int):
                return "decode", None, None, False
            remote = RemoteKV(
                host=str(params["remote_host"]),
                port=port,
                num_tokens=int(params.get("remote_num_tokens") or 0),
                engine_id=str(params["remote_engine_id"]),
                request_id=str(params["remote_request_id"]),
                block_ids=params["remote_block_ids"],
            )
            return "decode", remote, None, False
        return "aggregate", None, None, False

    def _prompt(self, body: dict[str, Any], *, chat: bool) -> tuple[int, str]:
        tok = self.e.tokenizer
        if chat:
            messages = body.get("messages")
            if isinstance(messages, list) and not messages and self.e.spec.vllm.wire_032:
                raise ApiError(
                    400,
                    "Cannot apply chat template to an empty conversation. Provide at least "
                    "one message.",
                )
            if not isinstance(messages, list) or not messages:
                raise ApiError(400, "messages must be a non-empty list", param="messages")
            text = self._chat_text(messages, body)
            # The template carries its own BOS. vLLM adds special tokens on top when asked
            # (default false); SGLang's chat request has no such field.
            special = 1 if body.get("add_special_tokens", False) and not self.sglang else 0
            return tok.count(text) + special, text
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            # vLLM's CompletionRequest takes add_special_tokens (default true); SGLang's has
            # no such field, so its completions always add them.
            special = 1 if body.get("add_special_tokens", True) or self.sglang else 0
            return tok.count(prompt) + special, prompt
        if isinstance(prompt, list) and prompt and all(json_int(t) is not None for t in prompt):
            return len(prompt), _j(prompt[:64])
        if isinstance(prompt, list) and len(prompt) > 1:
            raise ApiError(
                400,
                "batched prompts are not simulated; send one prompt per request",
                param="prompt",
            )
        raise ApiError(400, "prompt must be a string or a list of token ids", param="prompt")

    # -- other endpoints ------------------------------------------------------------------
    async def tokenize(self, req: HttpRequest, resp: Responder) -> None:
        e = self.e
        try:
            body = json.loads(req.body) if req.body else {}
        except ValueError as exc:
            await self.send_error(resp, ApiError(400, f"JSON decode error: {exc}"))
            return
        if not isinstance(body, dict):
            await self.send_error(resp, ApiError(400, "request body must be a JSON object"))
            return
        model = body.get("model")
        if model is not None and model != e.spec.model and not self.sglang:
            # SGLang's /tokenize, like its completions, takes any name (serving_tokenize.py
            # @0351c1fa reads only the prompt).
            message = f"The model `{model}` does not exist."
            if e.spec.vllm.wire_032:
                message += f" Valid aliases: {e.spec.model}."
            await self.send_error(resp, ApiError(404, message, param="model"))
            return
        limit = e.spec.timing.max_model_len
        if self.sglang:
            try:
                answer = self._sglang_tokenize(body)
            except ApiError as err:
                await self.send_error(resp, err)
                return
            # Its tokenizer's model_max_length (notes §5.4), not the server's context.
            length = e.spec.tokenizer_max_length or limit
            await resp.send_json(200, {**answer, "max_model_len": length})
            return
        if "messages" in body:
            messages = body["messages"]
            try:
                if not isinstance(messages, list):
                    raise ApiError(400, "messages must be a list", param="messages")
                text = self._chat_text(messages, body)
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
            pieces = self._pieces(prompt, body)
        ids = [piece_id(p) for p in pieces]
        strs = pieces if body.get("return_token_strs") else None
        await resp.send_json(
            200, {"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": strs}
        )

    def _sglang_tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """SGLang's /tokenize answer, less max_model_len (notes §5.4; sglang protocol.py
        TokenizeRequest, serving_tokenize.py). `prompt` is a string or a list of strings,
        each counted with add_special_tokens (default true). A newer build
        (`SimEngineSpec.tokenize_messages`) takes `messages` instead, rendered as its chat
        completion renders them and never with add_special_tokens; an older one requires
        `prompt`, so FastAPI refuses a body without it."""
        prompt, messages = body.get("prompt"), body.get("messages")
        if self.e.spec.tokenize_messages:
            if (prompt is None) == (messages is None):
                raise _validation_error(
                    ("body",),
                    "value_error",
                    "Value error, Exactly one of 'prompt' or 'messages' must be provided.",
                    body,
                )
            if messages is not None:
                if not isinstance(messages, list):
                    raise _validation_error(
                        ("body", "messages"), "list_type", "Input should be a valid list", messages
                    )
                ids = self.e.tokenizer.encode(self._chat_text(messages, body))
                return {"tokens": ids, "count": len(ids)}
        elif prompt is None:
            raise _validation_error(("body", "prompt"), "missing", "Field required", body)
        if isinstance(prompt, list):
            if not all(isinstance(p, str) for p in prompt):
                raise ApiError(400, "prompt must be a list of strings", param="prompt")
            many = [[piece_id(x) for x in self._pieces(p, body)] for p in prompt]
            return {"tokens": many, "count": [len(ids) for ids in many]}
        if not isinstance(prompt, str):
            raise ApiError(
                400,
                f"Invalid prompt type: <class '{type(prompt).__name__}'>. "
                "Expected str or List[str].",
            )
        ids = [piece_id(x) for x in self._pieces(prompt, body)]
        return {"tokens": ids, "count": len(ids)}

    def _chat_text(self, messages: list[Any], body: dict[str, Any]) -> str:
        """The prompt the engine renders for a chat body, the same for /tokenize and the
        completion so that the count the router asks for is the one it is charged.
        SGLang's chat request has no add_generation_prompt: it adds the generation prompt
        unless the last message is continued."""
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ApiError(400, "tools must be a list", param="tools")
        continue_final = bool(body.get("continue_final_message", False))
        if self.sglang:
            add_generation_prompt = not continue_final
        else:
            add_generation_prompt = bool(body.get("add_generation_prompt", True))
        try:
            return render_chat(
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final,
                tools=tools,
            )
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from None

    def _pieces(self, prompt: str, body: dict[str, Any]) -> list[str]:
        pieces = self.e.tokenizer.pieces(prompt)
        if body.get("add_special_tokens", True):
            pieces.insert(0, BOS)
        return pieces

    async def models(self, req: HttpRequest, resp: Responder) -> None:
        e = self.e
        created = int(e.started_at)
        card: dict[str, Any] = {
            "id": e.spec.model,
            "object": "model",
            "created": created,
            "owned_by": "sglang" if self.sglang else "vllm",
            "root": e.spec.model,
            "parent": None,
            "max_model_len": e.spec.timing.max_model_len,
        }
        if not self.sglang:
            card["permission"] = [
                {
                    "id": f"modelperm-{e.instance_id.replace('-', '')}",
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
        await resp.send_json(200, {"object": "list", "data": [card]})

    async def server_info(self, req: HttpRequest, resp: Responder) -> None:
        e = self.e
        t = e.spec.timing
        identity = (
            {} if e.spec.stock_version else {"build": e.spec.build, "instance_id": e.instance_id}
        )
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
                "disaggregation_mode": e.spec.disaggregation_mode,
                "disaggregation_bootstrap_port": e.port,
                "disaggregation_transfer_backend": "fake",
                "internal_states": [
                    {
                        "last_gen_throughput": 0.0,
                        "num_running_reqs": len(e.core.running),
                        "num_queue_reqs": len(e.core.waiting) + e.pending,
                    }
                ],
                "version": ENGINE_VERSION["sglang"],
                **identity,
            },
        )

    async def model_info(self, req: HttpRequest, resp: Responder) -> None:
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

    async def flush_cache(self, req: HttpRequest, resp: Responder) -> None:
        await resp.send(
            200,
            b"Cache flushed.\nPlease check backend logs for more details. (When there are "
            b"running or waiting requests, the operation will not be performed.)\n",
            content_type="text/plain; charset=utf-8",
        )


@attrs.define(kw_only=True)
class _Plan:
    leg: str
    remote: Any
    room: int | None
    hold_kv: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    chat: bool
    prompt_tokens: int
    prompt_key: str
    max_tokens: int
    header_faults: FaultSpec | None
    # The number of choices, top logprobs per token (None: none), stop strings.
    n: int = 1
    top_logprobs: int | None = None
    stops: list[str] = attrs.Factory(list)
    include_stop: bool = False
    min_tokens: int = 0
    # The model the answer names.
    model: str = ""


class _Run:
    """One accepted generation request, from admission to its last byte."""

    def __init__(
        self,
        api: Api,
        ctx: ReqCtx,
        resp: Responder,
        plan: _Plan,
        ids: list[str],
        echo: list[tuple[str, str]],
        choices: list[Choice],
    ) -> None:
        self.api = api
        self.e = api.e
        self.ctx = ctx
        self.resp = resp
        self.plan = plan
        self.echo = echo
        self.choices = choices
        self.sent = 0
        self.crashed = False
        self.settled = False
        self.created = int(time.time())
        if plan.remote is not None:
            plan.remote.num_tokens = plan.remote.num_tokens or plan.prompt_tokens
        self.shapes: Shapes
        if api.sglang:
            self.shapes = SglangShapes(
                chat=plan.chat, model=plan.model, ids=ids, created=self.created
            )
            return
        spec = self.e.spec
        build = spec.vllm
        fingerprint = None
        if build.wire_032:
            # vllm-<version>-<hash of the engine's configuration>.
            config = f"{spec.model}\x00{spec.kv_connector}\x00{spec.timing.max_model_len}"
            fingerprint = f"vllm-{build.version}-{zlib.crc32(config.encode()):08x}"
        self.shapes = VllmShapes(
            build=build,
            chat=plan.chat,
            model=plan.model,
            response_id=ids[0],
            created=self.created,
            fingerprint=fingerprint,
            include_usage=plan.include_usage,
        )

    # -- the request's life ---------------------------------------------------------------
    async def serve(self) -> tuple[str, int]:
        e, ctx, plan = self.e, self.ctx, self.plan
        core = ctx.core
        f = ctx.faults
        if ctx.remote is not None:
            # Heartbeats start as soon as the decoder has the request (§2.2).
            e.awaiting_kv.add(ctx)
        if f is not None and f.slow_first_token_s:
            e.counters.slow_first_tokens_injected += 1
            e.pending += 1
            try:
                await trio.sleep(f.slow_first_token_s)
            finally:
                e.pending -= 1
        if plan.stream and not self.api.sglang:
            # vLLM's StreamingResponse sends the 200 and headers before the first token;
            # SGLang's handler waits for the first chunk (`_send`).
            await self.resp.start_stream(200, headers=self.echo)
        room = ctx.room
        if room is not None:
            # SGLang prefill: the request sits in the bootstrap queue until its decoder
            # registers for the room (§5.3).
            e.pending += 1
            try:
                with trio.move_on_after(e.spec.scaled(e.spec.bootstrap_timeout_s)) as wait:
                    await room.d_arrived.wait()
            finally:
                e.pending -= 1
            if wait.cancelled_caught:
                room.fail("bootstrap timeout")
                # SGLang 0.5.23's words (disaggregation/prefill.py, common/conn.py).
                msg = (
                    f"Prefill bootstrap failed for request rank=0 req.rid={ctx.internal_id!r} "
                    f"req.bootstrap_room={room.room} with exception "
                    f"KVTransferError(bootstrap_room={room.room}): Request {room.room} timed "
                    f"out after {e.spec.bootstrap_timeout_s:.1f}s in KVPoll.Bootstrapping"
                )
                return await self._fail(500, msg)
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
        reason = await e.pull(ctx)
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
        rk = ctx.remote
        if rk is not None and rk.room is not None:
            cause = (
                "Aborted by AbortReq."
                if "Aborted" in reason
                else "Failed to get kvcache from prefill instance, it might be dead"
            )
            # SGLang 0.5.23's words (disaggregation/decode.py).
            msg = (
                f"Decode transfer failed for request rank=0 "
                f"decode_req.req.rid={ctx.internal_id!r} "
                f"decode_req.req.bootstrap_room={rk.room} with exception "
                f"KVTransferError(bootstrap_room={rk.room}): {cause}"
            )
        else:
            # kv_load_failure_policy=fail: FINISHED_ERROR -> GenerationError -> 500 (§2.3).
            msg = "Internal server error"
        return await self._fail(500, msg, outcome)

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

    async def _fail(self, status: int, message: str, outcome: str = "error") -> tuple[str, int]:
        sglang = self.api.sglang
        if self.plan.stream:
            out = b""
            if self.plan.chat and not sglang and self.sent == 0:
                out += self._role_chunks()
            out += self.api.sse_error(status, message, "InternalServerError")
            if sglang and self.plan.include_usage:
                # SGLang's generator leaves its loop at the error and goes on to its
                # usage chunk.
                out += b"data: " + self.shapes.usage_chunk(self._usage()).encode() + b"\n\n"
            self.settle(outcome, 200)
            await self._send(out + b"data: [DONE]\n\n", last=True)
            return outcome, 200
        # SGLang: an abort's status other than 400 comes as an HTTPException, whose
        # status its handler names as the type.
        err = ApiError(status, message, type_=str(status) if sglang else "InternalServerError")
        self.settle(outcome, status)
        await self.api.send_error(self.resp, err, self.echo)
        return outcome, status

    def _role_chunks(self) -> bytes:
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
                return await self._fail(500, "Internal server error")
            sent = self.sent
            if crash_at is not None and sent >= crash_at:
                e.counters.crashes_injected += 1
                self.crashed = True
                self.settle("error", self.resp.status if self.resp.started else 0)
                raise DropConnection()
            if error_at is not None and sent >= error_at:
                e.counters.sse_errors_injected += 1
                return await self._fail(500, "Internal server error")
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
            out += self._role_chunks()
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

    def _usage(self) -> dict[str, Any]:
        completion = sum(min(self.sent, c.limit) for c in self.choices)
        return usage(self.plan.prompt_tokens, completion)

    async def _finish(self) -> tuple[str, int]:
        plan = self.plan
        if plan.stream:
            out = self.shapes.finish_chunks(self.choices).encode()
            if plan.include_usage:
                out += b"data: " + self.shapes.usage_chunk(self._usage()).encode() + b"\n\n"
            self.settle("ok", 200)
            await self._send(out + b"data: [DONE]\n\n", last=True)
            return "ok", 200
        body = self._body()
        self.settle("ok", 200)
        await self.resp.send(200, body, headers=self.echo)
        return "ok", 200

    def _kv_params(self) -> dict[str, Any] | None:
        lease = self.ctx.lease
        if lease is None or self.api.sglang:
            return None
        e = self.e
        # Newer vLLM pull mode (§1.4): one block list per KV-cache group.
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
        if e.spec.vllm.wire_032:
            # No prefix-cache hits are simulated.
            params["remote_prefill_cached_tokens"] = 0
        return params

    def _body(self) -> bytes:
        parts = []
        for choice in self.choices:
            end = min(self.sent, choice.limit)
            logprobs = self._logprobs(choice, 0, end)
            parts.append((choice, choice.piece(0, end), logprobs))
        return self.shapes.body(parts, self._usage(), self._kv_params())
