"""What each engine dialect expects on the wire, without doing any I/O.

vLLM + NIXL (engine-protocols notes §1): the prefill leg is the client body with
`kv_transfer_params.do_remote_decode`, `stream: false`, no `stream_options` (vLLM
rejects it when not streaming), `max_tokens` 1 and `min_tokens` clamped to 1; the
decode leg is the original body plus the prefill response's `kv_transfer_params`,
passed through verbatim because its keys change between vLLM versions. Both legs carry
the same X-Request-Id.

SGLang (§5): both legs get the same body with `bootstrap_host/port/room` and are sent
concurrently; the engines pair by room. Unlike vLLM, an SGLang server's role is fixed when
it is launched (`--disaggregation-mode prefill|decode`, or none for an aggregate server),
and a disaggregated one refuses any generation request without `bootstrap_room` (400).
"""

from __future__ import annotations

import json
import secrets
from typing import Literal

import attrs

Json = dict[str, object]
EndpointKind = Literal["completions", "chat"]

ENDPOINT_PATHS: dict[EndpointKind, bytes] = {
    "completions": b"/v1/completions",
    "chat": b"/v1/chat/completions",
}

_PREFILL_KV_REQUEST: Json = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

SGLANG_DEFAULT_BOOTSTRAP_PORT = 8998


@attrs.frozen
class Dialect:
    name: Literal["vllm", "sglang"]
    concurrent_legs: bool
    # Whether /tokenize renders chat messages with the engine's template. SGLang's takes
    # only `prompt` (a string or a list of strings) and answers 400 "Invalid prompt type"
    # to anything else (engine-protocols notes §5.4).
    tokenizes_chat: bool
    # The completion fields that both /tokenize and the completions endpoint take and
    # that change the count.
    completion_tokenize_fields: tuple[str, ...]
    # Why an engine of this dialect cannot change role at run time, or None when it can.
    fixed_role: str | None = None
    health_path: bytes = b"/health"
    tokenize_path: bytes = b"/tokenize"
    # A cheap GET the engine guards when started with --api-key, unlike its health route:
    # vLLM's middleware guards /v1 only, SGLang's every path but /health* and /metrics*
    # (newer SGLang: every route of the normal auth level, which /v1/models is).
    key_check_path: bytes = b"/v1/models"


VLLM = Dialect(
    "vllm",
    concurrent_legs=False,
    tokenizes_chat=True,
    # CompletionRequest and TokenizeCompletionRequest both take add_special_tokens (default
    # true, vllm completion/protocol.py, serve/tokenize/protocol.py): a prompt sent without
    # its BOS is charged without it.
    completion_tokenize_fields=("add_special_tokens",),
)
SGLANG = Dialect(
    "sglang",
    concurrent_legs=True,
    tokenizes_chat=False,
    # Its CompletionRequest has no add_special_tokens: completions always add them, as its
    # /tokenize does by default, so the request's flag is not passed on.
    completion_tokenize_fields=(),
    fixed_role=(
        "an sglang server's role is fixed when it is launched (--disaggregation-mode "
        "prefill|decode, or none for aggregate), and a disaggregated one refuses requests "
        "without bootstrap_room"
    ),
)

# The chat completion fields vLLM's chat /tokenize also takes that change the rendered
# prompt (TokenizeChatRequest, notes §3.1): tool schemas go into the template and can
# outweigh the messages. A field the client left out is left out here too, so the engine
# applies the same default to both requests (add_generation_prompt true,
# continue_final_message and add_special_tokens false).
_CHAT_TOKENIZE_FIELDS = (
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
)


def dialect_for(name: str) -> Dialect:
    return SGLANG if name == "sglang" else VLLM


def vllm_prefill_body(body: Json) -> Json:
    leg = dict(body)
    leg["kv_transfer_params"] = dict(_PREFILL_KV_REQUEST)
    leg["stream"] = False
    leg.pop("stream_options", None)
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    for key in ("min_tokens", "min_completion_tokens"):
        value = leg.get(key)
        # vLLM validates min_tokens <= max_tokens; clamping keeps "at least one token".
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            leg[key] = 1
    return leg


def vllm_decode_body(body: Json, kv_transfer_params: Json | None) -> Json:
    if not kv_transfer_params:
        # Like vLLM's own proxies: without params the decode engine prefills locally.
        return body
    leg = dict(body)
    leg["kv_transfer_params"] = kv_transfer_params
    return leg


def vllm_kv_params(prefill_response: object) -> Json | None:
    if isinstance(prefill_response, dict):
        params = prefill_response.get("kv_transfer_params")
        if isinstance(params, dict) and params:
            return params
    return None


def sglang_pd_body(body: Json, *, host: str, port: int, room: int) -> Json:
    leg = dict(body)
    leg["bootstrap_host"] = host
    leg["bootstrap_port"] = port
    leg["bootstrap_room"] = room
    return leg


def new_bootstrap_room() -> int:
    """A room identifies one request pairing; SGLang takes 0 .. 2**63 - 1."""
    return secrets.randbits(63)


def with_usage_report(body: Json, dialect: Dialect) -> tuple[Json, bool]:
    """A streamed leg's body, asking the engine for its final usage chunk, and whether
    that chunk is the router's alone (the client did not ask for it, so it is not relayed).

    The router needs `usage.completion_tokens` because an event can carry several tokens:
    vLLM merges deltas when its API server falls behind the engine, speculative decoding
    accepts several tokens per step, and SGLang batches them by --stream-interval. Counting
    events would under-count resident KV and over-state the token interval.

    `include_usage` defaults to true in vLLM once `stream_options` is present and to false
    in SGLang (engine-protocols notes §4.4, §5). `continuous_usage_stats` is left out when
    the router adds the chunk, or the client would see usage in every chunk. A
    `stream_options` that is neither an object nor null is left for the engine to refuse.
    A vLLM run with --enable-force-include-usage sends usage to every stream; through the
    router, clients get it only when they ask.
    """
    options = body.get("stream_options")
    if options is None:
        added: Json = {"include_usage": True}
    elif isinstance(options, dict):
        if options.get("include_usage", dialect.name == "vllm"):
            return body, False
        added = {k: v for k, v in options.items() if k != "continuous_usage_stats"}
        added["include_usage"] = True
    else:
        return body, False
    leg = dict(body)
    leg["stream_options"] = added
    return leg, True


def tokenize_body(dialect: Dialect, kind: EndpointKind, body: Json) -> Json | None:
    """The /tokenize request that counts a client body's prompt as the engine will, or
    None when the dialect's /tokenize cannot (a chat body on SGLang)."""
    request: Json = {}
    if "model" in body:
        request["model"] = body["model"]
    if kind == "chat":
        if not dialect.tokenizes_chat:
            return None
        request["messages"] = body.get("messages")
        for key in _CHAT_TOKENIZE_FIELDS:
            if key in body:
                request[key] = body[key]
        return request
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        # A one-prompt list is that prompt to either engine's completions. vLLM's
        # /tokenize takes only a string, and SGLang's answers a list with a list of
        # counts, which is not one prompt's integer count.
        prompt = prompt[0]
    request["prompt"] = prompt
    for key in dialect.completion_tokenize_fields:
        if key in body:
            request[key] = body[key]
    return request


def tokenize_count(response: object) -> int | None:
    """The integer `count` of a /tokenize answer for one prompt (vLLM, and SGLang given
    a string); a list of counts answers a batch and is not read."""
    if isinstance(response, dict):
        count = response.get("count")
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            return count
    return None


def usage_tokens(response: object, key: str) -> int | None:
    """An integer count from a completion's `usage` object (`prompt_tokens`,
    `completion_tokens`), or None when the answer has none."""
    usage = response.get("usage") if isinstance(response, dict) else None
    value = usage.get(key) if isinstance(usage, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def encode(document: Json) -> bytes:
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()
