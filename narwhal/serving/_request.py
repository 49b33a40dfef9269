"""Parsing and checking a client's completion request body (no I/O)."""

from __future__ import annotations

import json
import re
import uuid

import attrs

from .._codes import ErrorCode
from .._errors import BadRequest
from .._values import json_int
from ..engines import EndpointKind, Json

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
# The fields an engine pair uses to find each other (vLLM's KV handoff, SGLang's
# bootstrap pairing). The router sets them per leg; from a client they would steer an
# engine: make it hold KV for a handoff nobody takes, or connect to a host of the
# client's choosing (vLLM's remote_host/remote_port).
_ROUTER_FIELDS = ("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room")
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_NULL_MEANS_DEFAULT = ("stream", "n")
# What a /v1/completions request without `max_tokens` may generate: both engines'
# CompletionRequest default the field to 16 (vLLM `max_tokens: int | None = 16`, every
# release from 0.4 on; SGLang `max_tokens: int = 16`), and vLLM checks prompt plus those
# 16 against the context as it checks a bound the client sent. Chat requests have no such
# default (the engines let them run to the context), nor has a vLLM completion that sends
# `max_tokens: null`.
COMPLETION_DEFAULT_MAX_TOKENS = 16


@attrs.frozen
class ClientRequest:
    id: str
    kind: EndpointKind
    body: Json
    stream: bool
    model: str
    prompt_chars: int
    # Token ids supplied directly (completions only): an exact length without /tokenize.
    prompt_token_ids: int | None
    # The most tokens the engine may generate (a completion's default when the body has
    # none, `COMPLETION_DEFAULT_MAX_TOKENS`); None: no bound but the context.
    max_tokens: int | None
    # The body field `max_tokens` came from (chat's `max_completion_tokens` comes first).
    max_tokens_field: str
    # vLLM's `truncate_prompt_tokens` when it is an integer (`truncated_prompt`); another
    # value is the engine's to judge.
    truncate_prompt_tokens: int | None
    arrival: float
    deadline: float
    # Sequences asked for (`n`): each generates up to `max_tokens`.
    n: int = 1

    @property
    def one_engine(self) -> str | None:
        """The field that keeps this request from a prefill/decode pair, or None.

        - `n` above 1: a pair hands over one sequence's KV. Given to vLLM's prefill
          engine, n > 1 makes n sequences whose KV the producer holds, and the decode
          engine takes one; the other n - 1 stay pinned until their lease runs out
          (NixlConnector, 30 s). Given only to the decode engine, its n sequences all
          read the one producer request, whose blocks are freed at the first reader's
          notice: the others may read freed blocks. An aggregate engine serves it.
        - `prompt_logprobs`: vLLM's decode engine recomputes the whole prompt for them
          instead of loading the KV it was handed, so a prefill leg is work done twice
          (the decode engine still frees the producer's blocks)."""
        if self.n > 1:
            return "n"
        if self.body.get("prompt_logprobs") is not None:
            return "prompt_logprobs"
        return None


def request_id_from_header(value: bytes | None) -> str:
    """Keep a well-formed client X-Request-Id (both legs and the logs carry it)."""
    if value is not None:
        text = value.decode("latin-1")
        if _REQUEST_ID.fullmatch(text):
            return text
    return uuid.uuid4().hex


def parse_body(
    raw: bytes,
    *,
    kind: EndpointKind,
    request_id: str,
    models: tuple[str, ...],
    arrival: float,
    deadline: float,
    vocab_size: int | None = None,
) -> ClientRequest:
    try:
        # Decode explicitly: json.loads on bytes would guess UTF-16/32 from a BOM.
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise BadRequest("request body is not valid UTF-8", code=ErrorCode.INVALID_JSON) from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply", code=ErrorCode.INVALID_JSON) from None
    except ValueError as exc:
        raise BadRequest(
            f"request body is not valid JSON: {exc}", code=ErrorCode.INVALID_JSON
        ) from None
    if _ESCAPED_SURROGATE.search(raw) is not None:
        # JSON may escape half of a UTF-16 surrogate pair; such a string cannot be
        # encoded again for the engines, so it is refused here, not failed later.
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise BadRequest(
                "request body contains an unpaired surrogate escape (\\ud800-\\udfff)",
                code=ErrorCode.INVALID_JSON,
            ) from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code=ErrorCode.INVALID_JSON)
    for key in _NULL_MEANS_DEFAULT:
        # OpenAI's API takes null for these as "the default", and clients that serialise
        # every optional field send it; SGLang's request models (and vLLM's completions,
        # for `n`) refuse a null, so it is dropped here rather than passed on.
        if key in body and body[key] is None:
            del body[key]
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    model = body.get("model")
    if model is None:
        if len(models) != 1:
            raise BadRequest("'model' is required", param="model")
        model = models[0]
    elif not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")
    for key in _ROUTER_FIELDS:
        if key in body:
            raise BadRequest(
                f"'{key}' is set by the router for each engine leg; clients may not send it",
                param=key,
            )
    n = _samples(body)
    max_tokens_field, max_tokens = _max_tokens(body, kind)
    if kind == "chat":
        chars = _chat_chars(body)
        token_ids = None
    else:
        chars, token_ids = _prompt_size(body, vocab_size)
    return ClientRequest(
        id=request_id,
        kind=kind,
        body=body,
        stream=stream,
        model=model,
        prompt_chars=chars,
        prompt_token_ids=token_ids,
        max_tokens=max_tokens,
        max_tokens_field=max_tokens_field,
        truncate_prompt_tokens=json_int(body.get("truncate_prompt_tokens")),
        arrival=arrival,
        deadline=deadline,
        n=n,
    )


def _samples(body: Json) -> int:
    """The request's `n`, checked with `best_of` beside it.

    `best_of` asks the engine to generate that many sequences and return the n best.
    vLLM's V1 engine has no such thing: it takes the field and ignores it, answering n
    sequences chosen among nothing, at the cost a client asking for best_of=1000 did not
    expect to be spared either. So a `best_of` above n is refused rather than passed on;
    one of at most n asks for nothing more than n and goes on as sent."""
    n = body.get("n", 1)
    count = json_int(n)
    if count is None or count < 1:
        raise BadRequest(f"'n' must be a positive integer, not {n!r}", param="n")
    best_of = body.get("best_of")
    if best_of is None:
        return count
    choices = json_int(best_of)
    if choices is None or choices < 1:
        raise BadRequest(f"'best_of' must be a positive integer, not {best_of!r}", param="best_of")
    if choices > count:
        raise BadRequest(
            f"'best_of' is not supported: best_of={choices} asks for the best {count} of "
            f"{choices} sequences, and vLLM's V1 engine ignores best_of (it would return "
            f"{count} sequence(s) and choose among none); ask for n={choices} and choose "
            "among them",
            param="best_of",
        )
    return count


def decode_refusal(request: ClientRequest) -> BadRequest | None:
    """What vLLM's decode engine would refuse (400) that its prefill engine would not,
    in vLLM's words; None when there is none of it.

    The prefill leg is the body with `stream: false`, no `stream_options`, `max_tokens`
    1 and `min_tokens` at most 1 (`vllm_prefill_body`), so the checks vLLM makes of
    those fields pass there and fail only at the decode leg: after a prefill, whose KV
    the producer then holds for a decode that never comes until its lease runs out, and
    for a stream after the 200. The rules are vLLM 0.32's request validators (completion
    and chat `validate_stream_options`, `check_logprobs`) and SamplingParams' check of
    min_tokens against max_tokens; each rule is older than 0.32. Every other check vLLM
    makes sees the same fields on both legs, and the prefill engine refuses first.
    A min_tokens against a completion's `max_tokens: null`, or a chat without a bound,
    is left to the engine (its bound then depends on the prompt)."""
    body = request.body
    if body.get("stream_options") and not request.stream:
        return BadRequest(
            "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
            param="stream_options",
        )
    prompt_logprobs = body.get("prompt_logprobs")
    if (
        request.stream
        and isinstance(prompt_logprobs, int | float)
        and not isinstance(prompt_logprobs, bool)
        and (prompt_logprobs > 0 or prompt_logprobs == -1)
    ):
        return BadRequest(
            "`prompt_logprobs` are not available when `stream=True`. (parameter=prompt_logprobs)",
            param="prompt_logprobs",
        )
    min_tokens = json_int(body.get("min_tokens"))
    if (
        min_tokens is not None
        and request.max_tokens is not None
        and min_tokens > request.max_tokens
    ):
        return BadRequest(
            f"min_tokens must be less than or equal to max_tokens={request.max_tokens}, "
            f"got {min_tokens}.",
            param="min_tokens",
        )
    return None


def truncated_prompt(request: ClientRequest, prompt_tokens: int, context: int | None) -> int:
    """The prompt length a vLLM engine runs when the request asks it to keep only the
    last `truncate_prompt_tokens` tokens (-1: the context, `max_model_len`): counted, or
    estimated, whole, the prompt would be priced, placed and checked against the context
    at a length the engine never runs, and one past the context refused though the
    engine would cut it down. Other values (0, below -1, -1 with no known context) are
    left as counted: the engine refuses the impossible ones itself."""
    keep = request.truncate_prompt_tokens
    if keep == -1:
        keep = context
    if keep is None or keep < 1:
        return prompt_tokens
    return min(prompt_tokens, keep)


def _max_tokens(body: Json, kind: EndpointKind) -> tuple[str, int | None]:
    """(the field the output bound is read from, the bound or None: none but the context).
    A completion's default is only the router's reading of the engines' rule: the body
    goes on without it, for the engine to apply its own."""
    if kind == "completions":
        # Neither engine's completion request has `max_completion_tokens` (chat's name):
        # both ignore it there, so it bounds nothing.
        if "max_tokens" not in body:
            return "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS
        keys: tuple[str, ...] = ("max_tokens",)
    else:
        keys = ("max_completion_tokens", "max_tokens")
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        number = json_int(value)
        if number is None or number < 1:
            raise BadRequest(f"'{key}' must be a positive integer", param=key)
        return key, number
    return "max_tokens", None


def _prompt_size(body: Json, vocab_size: int | None) -> tuple[int, int | None]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt), None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        # A batch of one prompt, as the engines take it: text, or token ids.
        prompt = prompt[0]
        if isinstance(prompt, str):
            return len(prompt), None
    if isinstance(prompt, list) and prompt:
        ids = [i for i in map(json_int, prompt) if i is not None]
        if len(ids) == len(prompt):
            _check_vocabulary(ids, vocab_size)
            return 0, len(prompt)
    raise BadRequest(
        "'prompt' must be a string or a list of token ids (batched prompts are not supported)",
        param="prompt",
    )


def _check_vocabulary(ids: list[int], vocab_size: int | None) -> None:
    """Refuse a token id no model has (negative) or this one lacks (engine.vocab_size):
    SGLang 0.5.23 passes ids to its embedding unchecked, and one out of range kills the
    scheduler, so the request must never reach an engine (nor be retried onto another)."""
    top = vocab_size - 1 if vocab_size is not None else None
    for index, token in enumerate(ids):
        if token < 0 or (top is not None and token > top):
            allowed = f"0..{top} (engine.vocab_size {vocab_size})" if top is not None else ">= 0"
            raise BadRequest(
                f"'prompt' token id {token} at index {index} is outside the vocabulary: "
                f"ids must be {allowed}",
                param="prompt",
            )


def _chat_chars(body: Json) -> int:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    total = 0
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{index}] must be an object", param="messages")
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    total += len(part["text"])
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        # Chat templates render the schemas into the prompt as JSON, often thousands of
        # tokens: an estimate from the messages alone would miss most of the prompt.
        total += len(json.dumps(tools, ensure_ascii=False))
    return total


def prompt_text(request: ClientRequest) -> str:
    """The prompt as text, for the approximate prefix index: a completion's prompt, or
    a chat's tools and messages in order, each field apart, so that two conversations
    share a text prefix exactly as far as they share messages. Empty for token ids."""
    body = request.body
    if request.kind != "chat":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        return prompt if isinstance(prompt, str) else ""
    parts: list[str] = []
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        parts.append(json.dumps(tools, ensure_ascii=False, sort_keys=True))
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        if not isinstance(message, dict):
            continue
        parts.append(str(message.get("role")))
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(
                part["text"]
                for part in content
                if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
    # Field boundaries count (role "user" then "hi" is not "use" then "rhi"); an
    # approximate index may confuse the rare text that holds NULs itself.
    return "\x00".join(parts)
