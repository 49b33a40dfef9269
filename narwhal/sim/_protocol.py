"""The interface a simulated engine's dialect implements, and what both dialects share.

Owns: `EngineProtocol`, one per engine, picked at start-up from the spec's dialect
(`_vllm.VLLMProtocol`, `_sglang.SGLangProtocol`): how the engine reads and refuses a
request, how a P/D pair's legs meet and move KV, how its errors and answers are shaped,
and which routes, auth rule and metrics it has. Also `ApiError`, `Plan` (a request read
and accepted) and the reading both dialects do alike: the prompt count, the chat
template, the output bound of a request that sets none.
Invariants: every difference between vLLM and SGLang lives in a subclass; the engine,
`_api` and `_run` ask their protocol and never test the dialect
(tests/sim/test_protocol.py reads the package for such tests).
Errors: `ApiError` is a refusal, answered in the dialect's error envelope (or, when
`streamed`, as an error event after a stream's 200).
See: `_vllm`, `_sglang` (each dialect's rules), docs/design.md#engine-wire-facts.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import attrs

from .._values import json_int
from ._faults import FaultSpec
from ._http import HttpRequest, Responder
from ._metrics import Collector, EngineMetrics
from ._output import Shapes
from ._records import Lease, RemoteKV, ReqCtx
from ._tokenizer import BOS, piece_id, render_chat

if TYPE_CHECKING:
    from ._engine import SimEngine
    from ._run import Run

Route = Callable[[HttpRequest, Responder], Awaitable[None]]
Routes = dict[tuple[str, str], Route]
# (path, JSON body, wall-clock limit) of a decoder's request for its KV.
KvRequest = tuple[str, dict[str, Any], float]

_COMPACT = (",", ":")
# The `type` of an error whose status has no name of its own in vLLM's handlers.
_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    501: "NotImplementedError",
}


def compact_json(obj: Any) -> str:
    return json.dumps(obj, separators=_COMPACT)


def token_prompt(prompt: object) -> bool:
    """Whether a completion prompt is one list of token ids."""
    return (
        isinstance(prompt, list) and bool(prompt) and all(json_int(t) is not None for t in prompt)
    )


def stops(body: dict[str, Any]) -> list[str]:
    """The request's stop strings (a string or a list of them; empty ones never match)."""
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        return []
    return [s for s in stop if isinstance(s, str) and s]


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


@attrs.define(kw_only=True)
class Leg:
    """Which leg of a P/D pair a request is, and where its KV comes from or goes."""

    phase: str = "aggregate"
    # A decode leg's producer.
    remote: RemoteKV | None = None
    # SGLang's bootstrap room, on either leg of its pair.
    room: int | None = None
    # Keep the KV after finishing, for a decoder (a prefill leg).
    hold_kv: bool = False


@attrs.define(kw_only=True)
class Plan:
    leg: Leg
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
    # The prompt's token ids, read only by an engine that caches prefixes.
    prompt_ids: list[int] | None = None


class EngineProtocol(abc.ABC):
    """One engine's dialect. The sections below are what differs between the two."""

    # Whether a stream's 200 and headers go out before its first token (vLLM's
    # StreamingResponse), or with its first chunk (SGLang's handler).
    headers_before_first_token: bool
    # The owner a /v1/models card names.
    owned_by: str

    def __init__(self, engine: SimEngine) -> None:
        self.e = engine

    # -- identity and routes ----------------------------------------------------------
    @property
    @abc.abstractmethod
    def version(self) -> str:
        """The version the engine reports."""

    @abc.abstractmethod
    def routes(self) -> Routes:
        """The routes only this dialect has, added to every engine's own."""

    @abc.abstractmethod
    def requires_api_key(self, method: str, path: str) -> bool:
        """Whether an engine started with --api-key demands the key for this request."""

    def model_card(self, created: int) -> dict[str, Any]:
        spec = self.e.spec
        return {
            "id": spec.model,
            "object": "model",
            "created": created,
            "owned_by": self.owned_by,
            "root": spec.model,
            "parent": None,
            "max_model_len": spec.timing.max_model_len,
        }

    def identity(self) -> dict[str, str]:
        """The build and instance id a version document carries, unless the engine
        reports its version as the stock engine does."""
        spec = self.e.spec
        return (
            {} if spec.stock_version else {"build": spec.build, "instance_id": self.e.instance_id}
        )

    @abc.abstractmethod
    async def tokenize(self, req: HttpRequest, resp: Responder) -> None: ...

    # -- errors -----------------------------------------------------------------------
    @abc.abstractmethod
    def error_body(
        self, status: int, message: str, *, type_: str | None = None, param: str | None = None
    ) -> dict[str, Any]:
        """A refusal's JSON body."""

    @abc.abstractmethod
    def error_event(
        self, status: int, message: str, type_: str | None = None, param: str | None = None
    ) -> bytes:
        """An error after a stream's 200, as its ``data:`` event."""

    @abc.abstractmethod
    def abort_error(self, status: int, message: str) -> ApiError:
        """An accepted request the engine fails (KV load, injected error), unstreamed."""

    @abc.abstractmethod
    def queue_full(self, queued: int, limit: int) -> ApiError:
        """The refusal of a request past --max-num-queued-reqs."""

    async def send_error(
        self, resp: Responder, err: ApiError, headers: list[tuple[str, str]] | None = None
    ) -> None:
        body = self.error_body(err.status, err.message, type_=err.type, param=err.param)
        await resp.send_json(err.status, body, headers=headers)

    @staticmethod
    def error_type(status: int, type_: str | None) -> str:
        """An error's `type`: the one given, vLLM's exception name for the status, or the
        status's HTTP phrase."""
        if type_ is None:
            type_ = _ERROR_TYPES.get(status)
        if type_ is None:
            try:
                type_ = HTTPStatus(status).phrase
            except ValueError:
                type_ = "InternalServerError" if status >= 500 else "BadRequestError"
        return type_

    # -- reading a generation request -------------------------------------------------
    @abc.abstractmethod
    def echo_headers(self, request_id: str) -> list[tuple[str, str]]:
        """Headers every answer to a generation request carries."""

    @abc.abstractmethod
    def read(self, body: dict[str, Any], *, chat: bool, header_faults: FaultSpec | None) -> Plan:
        """The request, checked as the engine checks it, in its order; raises ApiError."""

    @abc.abstractmethod
    def request_ids(self, request_id: str, *, chat: bool, plan: Plan) -> tuple[list[str], str]:
        """(The ids its answer carries, one per choice or one for all; its internal id.)"""

    @abc.abstractmethod
    def never_answers(self, plan: Plan) -> bool:
        """Whether the engine holds the request without ever answering it."""

    # -- the P/D pair -----------------------------------------------------------------
    @abc.abstractmethod
    def fail_unstarted(self, req: HttpRequest, reason: str) -> None:
        """A request refused before it started, seen by the pair's other leg."""

    @abc.abstractmethod
    def open_leg(self, ctx: ReqCtx, plan: Plan) -> None:
        """An accepted request's leg, set up before it runs."""

    @abc.abstractmethod
    async def wait_for_peer(self, run: Run) -> tuple[str, int] | None:
        """Wait, before scheduling, for the pair's other leg; the request's outcome when
        that fails, else None."""

    @abc.abstractmethod
    def kv_request(self, remote: RemoteKV) -> KvRequest:
        """How a decode leg asks its producer for the KV over the side channel."""

    @abc.abstractmethod
    def transfer_failure(self, ctx: ReqCtx, reason: str) -> str:
        """The error a decode leg answers when its KV never came (`reason`: why)."""

    @abc.abstractmethod
    def abandon_kv(self, remote: RemoteKV) -> None:
        """A decode leg gave up before it had its KV."""

    @abc.abstractmethod
    def close_leg(self, ctx: ReqCtx, outcome: str) -> None:
        """The request ended (`outcome`), whatever became of it."""

    @abc.abstractmethod
    def kv_held(self, ctx: ReqCtx, lease: Lease) -> None:
        """A prefill leg finished; its KV is held under `lease` for its decoder."""

    @abc.abstractmethod
    def lease_expired(self, lease: Lease) -> None:
        """KV held for a decoder ran out of time before the decoder took it."""

    @abc.abstractmethod
    def serves_bootstrap(self) -> bool:
        """Whether the engine runs a bootstrap server (/_sim/bootstrap/transfer answers)."""

    @abc.abstractmethod
    def kv_transfer_params(self, ctx: ReqCtx) -> dict[str, Any] | None:
        """What a finished request's answer tells a decoder (null: nothing)."""

    def prompt_details(self, ctx: ReqCtx, *, chat: bool, stream: bool) -> dict[str, Any] | None:
        """The usage's prompt_tokens_details, when the engine reports them."""
        return None

    @abc.abstractmethod
    async def run(self) -> None:
        """The dialect's own background work, for the engine's life."""

    # -- answers ----------------------------------------------------------------------
    @abc.abstractmethod
    def shapes(self, plan: Plan, ids: list[str], created: int) -> Shapes: ...

    @abc.abstractmethod
    def stream_failure(self, run: Run, status: int, message: str) -> bytes:
        """The events a stream sends, before [DONE], when the engine fails it."""

    # -- metrics and load -------------------------------------------------------------
    # Whether the load gauges are published yet (`note_step` decides when they start).
    load_reported: bool

    @abc.abstractmethod
    def note_step(self, idle: bool, decodes: bool) -> None:
        """A scheduler step happened while the load is not reported yet."""

    @abc.abstractmethod
    def count_generated(self, metrics: EngineMetrics, progressed: list[Any]) -> None:
        """Count the tokens a step generated, beyond `generation_tokens`."""

    @abc.abstractmethod
    def collector(self) -> Collector:
        """The engine's /metrics, under the dialect's names."""

    # -- shared reading ---------------------------------------------------------------
    @abc.abstractmethod
    def special_tokens(self, body: dict[str, Any], *, chat: bool) -> int:
        """The special tokens added in front of a prompt (the chat template has its own)."""

    @abc.abstractmethod
    def add_generation_prompt(self, body: dict[str, Any]) -> bool:
        """Whether the chat template ends with the assistant's turn opened."""

    @abc.abstractmethod
    def empty_conversation(self) -> ApiError | None:
        """The refusal of ``messages: []``, where it is not the generic one."""

    def prompt(self, body: dict[str, Any], *, chat: bool) -> tuple[int, str]:
        """The prompt's token count and a key its deterministic output is drawn from."""
        tok = self.e.tokenizer
        if chat:
            messages = body.get("messages")
            if isinstance(messages, list) and not messages:
                refusal = self.empty_conversation()
                if refusal is not None:
                    raise refusal
            if not isinstance(messages, list) or not messages:
                raise ApiError(400, "messages must be a non-empty list", param="messages")
            text = self.chat_text(messages, body)
            return tok.count(text) + self.special_tokens(body, chat=True), text
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return tok.count(prompt) + self.special_tokens(body, chat=False), prompt
        if isinstance(prompt, list) and prompt and all(json_int(t) is not None for t in prompt):
            return len(prompt), compact_json(prompt[:64])
        if isinstance(prompt, list) and len(prompt) > 1:
            raise ApiError(
                400,
                "batched prompts are not simulated; send one prompt per request",
                param="prompt",
            )
        raise ApiError(400, "prompt must be a string or a list of token ids", param="prompt")

    def prompt_ids(self, body: dict[str, Any], *, chat: bool) -> list[int]:
        """The prompt's token ids, as `prompt` counts them (call it after `prompt`, which
        refuses what has none)."""
        tok = self.e.tokenizer
        if chat:
            text = self.chat_text(body["messages"], body)
            special = self.special_tokens(body, chat=True)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                return [int(t) for t in prompt or ()]
            text, special = prompt, self.special_tokens(body, chat=False)
        ids = tok.encode(text)
        return [piece_id(BOS), *ids] if special else ids

    def chat_text(self, messages: list[Any], body: dict[str, Any]) -> str:
        """The prompt the engine renders for a chat body, the same for /tokenize and the
        completion so that the count the router asks for is the one it is charged."""
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ApiError(400, "tools must be a list", param="tools")
        try:
            return render_chat(
                messages,
                add_generation_prompt=self.add_generation_prompt(body),
                continue_final_message=bool(body.get("continue_final_message", False)),
                tools=tools,
            )
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from None

    def pieces(self, prompt: str, body: dict[str, Any]) -> list[str]:
        """A text prompt's tokens as /tokenize counts them (add_special_tokens: true)."""
        pieces = self.e.tokenizer.pieces(prompt)
        if body.get("add_special_tokens", True):
            pieces.insert(0, BOS)
        return pieces

    @staticmethod
    def output_bound(body: dict[str, Any], *, chat: bool) -> tuple[Any, str]:
        """(The request's output bound as sent, the parameter that set it.) A completion's
        defaults to 16 (both engines' CompletionRequest)."""
        if not chat:
            return body.get("max_tokens", 16), "max_tokens"
        max_tokens = body.get("max_completion_tokens")
        if max_tokens is not None:
            return max_tokens, "max_completion_tokens"
        return body.get("max_tokens"), "max_tokens"

    def unbounded(self, prompt_tokens: int, min_tokens: object) -> int:
        """The output bound of a request that sets none (vLLM's get_max_tokens: the
        context); see SimEngineSpec.unbounded_max_tokens."""
        max_tokens = self.e.spec.timing.max_model_len - prompt_tokens
        bound = self.e.spec.unbounded_max_tokens
        if bound is not None:
            floor = min_tokens if isinstance(min_tokens, int) else 0
            max_tokens = min(max_tokens, max(bound, floor))
        return max_tokens

    @staticmethod
    def check_max_tokens(max_tokens: object, *, suffix: bool) -> int:
        """The output bound, refused unless a positive integer; `suffix`: with vLLM
        0.32's ``(parameter=..., value=...)``."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            message = f"max_tokens must be at least 1, got {max_tokens}."
            if suffix:
                message += f" (parameter=max_tokens, value={max_tokens})"
            raise ApiError(400, message, param="max_tokens")
        return max_tokens

    async def read_json_body(self, req: HttpRequest, resp: Responder) -> dict[str, Any] | None:
        """A /tokenize body, or None once its refusal is sent."""
        try:
            body = json.loads(req.body) if req.body else {}
        except ValueError as exc:
            await self.send_error(resp, ApiError(400, f"JSON decode error: {exc}"))
            return None
        if not isinstance(body, dict):
            await self.send_error(resp, ApiError(400, "request body must be a JSON object"))
            return None
        return body
