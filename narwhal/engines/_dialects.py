"""What each engine dialect expects on the wire, without doing any I/O.

vLLM + NIXL (docs/design.md#vllm-nixl-handoff): the prefill leg is the client body with
`kv_transfer_params.do_remote_decode`, `stream: false`, no `stream_options` (vLLM
rejects it when not streaming), `max_tokens` 1 and `min_tokens` clamped to 1; the
decode leg is the original body plus the prefill response's `kv_transfer_params`,
passed through verbatim because its keys change between vLLM versions. Both legs carry
the same X-Request-Id.

SGLang (docs/design.md#sglang-bootstrap): both legs get the same body with
`bootstrap_host/port/room` and are sent concurrently; the engines pair by room. Unlike vLLM, an
SGLang server's role is fixed when it is launched (`--disaggregation-mode prefill|decode`, or none
for an aggregate server), and a disaggregated one refuses any generation request without
`bootstrap_room` (400).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Generic, Literal, TypeVar

import attrs

from .._values import json_int

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
    # The chat completion fields the chat form of /tokenize also takes that change the
    # rendered prompt. A field the client left out is left out here too, so the engine
    # applies the same default to both requests.
    chat_tokenize_fields: tuple[str, ...]
    # The completion fields that both /tokenize and the completions endpoint take and
    # that change the count.
    completion_tokenize_fields: tuple[str, ...]
    # Whether some builds' /tokenize have no chat form, so each engine's support is learnt
    # from its answer (`chat_tokenize_refused`, `ChatTokenizeRefusals`).
    chat_tokenize_optional: bool = False
    # Why an engine of this dialect cannot change role at run time, or None when it can.
    fixed_role: str | None = None
    health_path: bytes = b"/health"
    tokenize_path: bytes = b"/tokenize"
    # A cheap GET the engine guards when started with --api-key, unlike its health route:
    # vLLM's middleware guards /v1 only, SGLang's every path but /health* and /metrics*
    # (newer SGLang: every route of the normal auth level, which /v1/models is).
    key_check_path: bytes = b"/v1/models"
    # Whether /tokenize's `max_model_len` is the server's context length, which bounds
    # prompt plus max_tokens (vLLM: the model config's), not only the tokenizer's (SGLang:
    # tokenizer.model_max_length, or -1).
    tokenize_reports_context: bool = False
    # Where the engine says whether it cuts an over-long request down instead of refusing
    # it (SGLang's --allow-auto-truncate, among /get_server_info's server args); None
    # when it always refuses (vLLM truncates only for a request that asks).
    truncation_path: bytes | None = None
    # Whether a request's `truncate_prompt_tokens` cuts its prompt to its last k tokens
    # before the engine checks or runs it (vLLM: k of at least 1, or -1 for
    # max_model_len; SGLang's request models have no such field and ignore it).
    request_truncation: bool = False


VLLM = Dialect(
    "vllm",
    concurrent_legs=False,
    # TokenizeChatRequest (docs/design.md#tokenize): tool schemas go into the template and can
    # outweigh the messages. Its defaults are the chat completion's: add_generation_prompt true,
    # continue_final_message and add_special_tokens false.
    chat_tokenize_fields=(
        "tools",
        "chat_template",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
    ),
    # CompletionRequest and TokenizeCompletionRequest both take add_special_tokens (default
    # true, vllm completion/protocol.py, serve/tokenize/protocol.py): a prompt sent without
    # its BOS is charged without it.
    completion_tokenize_fields=("add_special_tokens",),
    tokenize_reports_context=True,
    request_truncation=True,
)
SGLANG = Dialect(
    "sglang",
    concurrent_legs=True,
    # Newer SGLang's TokenizeRequest takes `messages` besides `prompt` and renders them the
    # way its chat completions do, from a ChatCompletionRequest built of the body less
    # prompt and add_special_tokens (sglang protocol.py@004c82e0). Its chat requests have
    # no add_generation_prompt or chat_template field; these are the fields that shape the
    # prompt. Older builds require `prompt` and refuse the form (`chat_tokenize_refused`).
    chat_tokenize_fields=(
        "tools",
        "tool_choice",
        "reasoning_effort",
        "reasoning",
        "chat_template_kwargs",
        "continue_final_message",
    ),
    # Its CompletionRequest has no add_special_tokens: completions always add them, as its
    # /tokenize does by default, so the request's flag is not passed on.
    completion_tokenize_fields=(),
    chat_tokenize_optional=True,
    truncation_path=b"/get_server_info",
    fixed_role=(
        "an sglang server's role is fixed when it is launched (--disaggregation-mode "
        "prefill|decode, or none for aggregate), and a disaggregated one refuses requests "
        "without bootstrap_room"
    ),
)

# How long an engine's refusal of the chat form of /tokenize stands before a chat request
# asks again. An upgrade restarts the engine, and a restart recovery sees takes it out of
# placement, which forgets the refusal at once; this catches one nobody saw.
CHAT_TOKENIZE_RECHECK_S = 300.0


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
        value = json_int(leg.get(key))
        # vLLM validates min_tokens <= max_tokens; clamping keeps "at least one token".
        if value is not None and value > 1:
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


_RELEASE = re.compile(r"v?(\d+)\.(\d+)")
# vLLM 0.32's StreamOptions.include_usage defaults to false; the builds before it read a
# present stream_options as asking for usage (docs/design.md#usage-chunks).
VLLM_USAGE_OPT_IN_FROM = (0, 32)


def release(version: str | None) -> tuple[int, int] | None:
    """The (major, minor) release an engine's /version names, or None when it names none."""
    found = _RELEASE.match(version or "")
    return None if found is None else (int(found.group(1)), int(found.group(2)))


def usage_by_default(dialect: Dialect, version: str | None) -> bool:
    """Whether a stream_options without include_usage asks this engine for the usage
    chunk: only on vLLM builds known to be older than 0.32 (an unknown build is read as a
    current one)."""
    found = release(version)
    return dialect.name == "vllm" and found is not None and found < VLLM_USAGE_OPT_IN_FROM


def with_usage_report(
    body: Json, dialect: Dialect, version: str | None = None
) -> tuple[Json, bool]:
    """A streamed leg's body, asking the engine for its final usage chunk, and whether
    that chunk is the router's alone (the client did not ask for it, so it is not relayed).

    The router needs `usage.completion_tokens` because an event can carry several tokens:
    vLLM merges deltas when its API server falls behind the engine, speculative decoding
    accepts several tokens per step, and SGLang batches them by --stream-interval. Counting
    events would under-count resident KV and over-state the token interval.

    `include_usage` defaults to false in SGLang and in vLLM from 0.32, and to true in
    older vLLM builds once `stream_options` is present (`usage_by_default`; `version` is
    the engine's /version). `continuous_usage_stats` is left out when
    the router adds the chunk, or the client would see usage in every chunk. A
    `stream_options` that is neither an object nor null is left for the engine to refuse.
    A vLLM run with --enable-force-include-usage sends usage to every stream; through the
    router, clients get it only when they ask.
    """
    options = body.get("stream_options")
    if options is None:
        added: Json = {"include_usage": True}
    elif isinstance(options, dict):
        if options.get("include_usage", usage_by_default(dialect, version)):
            return body, False
        added = {k: v for k, v in options.items() if k != "continuous_usage_stats"}
        added["include_usage"] = True
    else:
        return body, False
    leg = dict(body)
    leg["stream_options"] = added
    return leg, True


def tokenize_body(dialect: Dialect, kind: EndpointKind, body: Json) -> Json:
    """The /tokenize request that counts a client body's prompt as the engine will. A chat
    body on SGLang gets the chat form, which older SGLang builds refuse
    (`chat_tokenize_refused`)."""
    request: Json = {}
    if "model" in body:
        request["model"] = body["model"]
    if kind == "chat":
        request["messages"] = body.get("messages")
        fields = dialect.chat_tokenize_fields
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            # A one-prompt list is that prompt to either engine's completions. vLLM's
            # /tokenize takes only a string, and SGLang's answers a list with a list of
            # counts, which is not one prompt's integer count.
            prompt = prompt[0]
        request["prompt"] = prompt
        fields = dialect.completion_tokenize_fields
    for key in fields:
        if key in body:
            request[key] = body[key]
    return request


# Where a validation error names the missing `prompt`: ('body', 'prompt') in FastAPI's
# error list as Python prints it, ["body","prompt"] in its JSON.
_PROMPT_MISSING = re.compile(r"""['"]body['"],\s*['"]prompt['"]""")
# FastAPI's answer for a path no route serves.
_NO_ROUTE = re.compile(r'"detail"\s*:\s*"Not Found"')


def chat_tokenize_refused(dialect: Dialect, status: int, message: str) -> bool:
    """Whether the engine's answer to the chat form of /tokenize says its build has none,
    rather than that this request's messages are wrong.

    An SGLang build from before the chat form requires `prompt`, so FastAPI refuses the
    body, and SGLang's validation handler answers 400 in its flat envelope (FastAPI's own
    answers 422 with `detail`); a handler reached with no `prompt` says "Invalid prompt
    type"; a build from before /tokenize answers FastAPI's 404 for a path without a route.
    A newer build refusing a body names the body's fault instead, never a missing `prompt`.
    """
    if not dialect.chat_tokenize_optional:
        return False
    if status == 404:
        return _NO_ROUTE.search(message) is not None
    if status not in (400, 422):
        return False
    return _PROMPT_MISSING.search(message) is not None or "Invalid prompt type" in message


_Engine = TypeVar("_Engine")


class ChatTokenizeRefusals(Generic[_Engine]):
    """The engines whose /tokenize refused the chat form, so that no chat request is sent
    there for a certain refusal (the estimate's reason stays `unsupported`).

    A refusal is forgotten when the engine may have changed: on a reload (another config
    object), once the engine has been out of placement (`forget`: a restart hold, an
    ejection, a drain), or when it counts a chat after all. `recheck_s` after it was learnt
    the engine is asked again, and a refusal then is not news. Engines are keyed by
    identity, so one a reload replaced is a new engine.
    """

    def __init__(self, recheck_s: float = CHAT_TOKENIZE_RECHECK_S) -> None:
        self.recheck_s = recheck_s
        self._since: dict[_Engine, float] = {}
        self._rechecking: set[_Engine] = set()
        self._config: object = None

    def _under(self, config: object) -> None:
        # A reload (another config object) forgets every refusal.
        if config is not self._config:
            self._since.clear()
            self._rechecking.clear()
            self._config = config

    def known(self, engine: _Engine, config: object, now: float) -> bool:
        """Whether `engine` is known to refuse the chat form under `config`."""
        self._under(config)
        since = self._since.get(engine)
        if since is None:
            return False
        if now - since >= self.recheck_s:
            del self._since[engine]
            self._rechecking.add(engine)
            return False
        return True

    def refused(self, engine: _Engine, now: float) -> bool:
        """Record a refusal; whether it is news (not known, nor the answer to a recheck)."""
        news = engine not in self._since and engine not in self._rechecking
        self._rechecking.discard(engine)
        self._since[engine] = now
        return news

    def learnt(self, config: object) -> list[tuple[_Engine, float]]:
        """(engine, when its refusal was learnt) for every refusal standing under
        `config`."""
        self._under(config)
        return list(self._since.items())

    def forget(self, engine: _Engine) -> bool:
        """Forget `engine`'s refusal; whether there was one."""
        was = engine in self._since or engine in self._rechecking
        self._since.pop(engine, None)
        self._rechecking.discard(engine)
        return was


def tokenize_count(response: object) -> int | None:
    """The integer `count` of a /tokenize answer for one prompt (vLLM, and SGLang given
    a string); a list of counts answers a batch and is not read."""
    if isinstance(response, dict):
        count = json_int(response.get("count"))
        if count is not None and count >= 0:
            return count
    return None


# A top-level integer of a /tokenize answer. Narwhal never asks for token strings, so the
# rest of the answer is numbers, and neither key can occur inside a value.
_TOKENIZE_INT = re.compile(rb'"(count|max_model_len)"\s*:\s*(-?\d+)')
_TOKENIZE_TAIL = 64  # bytes kept between chunks: a key, its value and some whitespace
# The most bytes one token takes in an answer's id list (", 128255" and then some), so
# an answer is bounded by this many bytes for each byte of the text it counts.
TOKEN_ID_BYTES = 8


class TokenizeScan:
    """A /tokenize answer's `count` and `max_model_len`, read as its body arrives.

    The answer lists every token id (vLLM before the count, SGLang after it): some 6-8
    bytes a token, 700 KB for a 100,000-token prompt. Held and parsed whole for two
    numbers, that was a cost per request growing with the prompt, so an answer is scanned
    chunk by chunk and only a short tail is kept.
    """

    def __init__(self) -> None:
        self._tail = b""
        self._values: dict[bytes, int] = {}

    def feed(self, chunk: bytes, *, final: bool = False) -> None:
        data = self._tail + chunk
        for match in _TOKENIZE_INT.finditer(data):
            # A number at the very end may go on in the next chunk.
            if final or match.end() < len(data):
                self._values.setdefault(match[1], int(match[2]))
        self._tail = data[-_TOKENIZE_TAIL:]

    def count(self) -> int | None:
        """The count of one prompt (a batch's counts are a list, not read)."""
        self.feed(b"", final=True)
        count = self._values.get(b"count")
        return count if count is not None and count >= 0 else None

    def context(self, dialect: Dialect) -> int | None:
        """The server's context length, where the dialect's answer gives that
        (`Dialect.tokenize_reports_context`); None otherwise."""
        limit = self._values.get(b"max_model_len")
        if not dialect.tokenize_reports_context or limit is None or limit <= 0:
            return None
        return limit


def _model_cards(answer: object) -> list[dict[str, object]] | None:
    """The model cards of a /v1/models answer; None when it has no `data` list."""
    cards = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(cards, list):
        return None
    return [card for card in cards if isinstance(card, dict)]


def lists_model(answer: object, model: str) -> bool | None:
    """Whether a /v1/models answer lists `model`; None when it is no model list."""
    cards = _model_cards(answer)
    if cards is None:
        return None
    return any(card.get("id") == model for card in cards)


def card_context(answer: object, model: str) -> int | str:
    """The context length a /v1/models answer gives `model`: its card's `max_model_len`,
    or why there is none.

    vLLM's card carries its model config's max_model_len (docs/design.md#model-card); SGLang's its
    model config's context_len, the limit its tokenizer manager checks each request against, where
    /tokenize's `max_model_len` is only the tokenizer's and /get_server_info's `context_length` only
    the --context-length flag (null unless set)."""
    cards = _model_cards(answer)
    if cards is None:
        return "its /v1/models answer has no `data` list"
    for card in cards:
        if card.get("id") == model:
            value = card.get("max_model_len")
            length = json_int(value)
            if length is not None and length > 0:
                return length
            return f"its /v1/models card for {model!r} has no positive max_model_len ({value!r})"
    listed = ", ".join(repr(card.get("id")) for card in cards)
    return f"its /v1/models answer lists no model {model!r} (it lists {listed or 'none'})"


def truncates_requests(answer: object) -> bool | str:
    """Whether an SGLang server cuts over-long requests down instead of refusing them
    (`allow_auto_truncate`, one of /get_server_info's server args), or why its answer does
    not say. A build older than the flag has no such key and refuses them."""
    if not isinstance(answer, dict):
        return "its /get_server_info answer is not a JSON object"
    value = answer.get("allow_auto_truncate", False)
    if not isinstance(value, bool):
        return f"its /get_server_info allow_auto_truncate is not a boolean ({value!r})"
    return value


def usage_tokens(response: object, key: str) -> int | None:
    """An integer count from a completion's `usage` object (`prompt_tokens`,
    `completion_tokens`), or None when the answer has none."""
    usage = response.get("usage") if isinstance(response, dict) else None
    return json_int(usage.get(key)) if isinstance(usage, dict) else None


def usage_cached_tokens(response: object) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens`: the prompt tokens the engine found in
    its prefix cache (vLLM with --enable-prompt-tokens-details; null without). None when
    the answer does not say."""
    usage = response.get("usage") if isinstance(response, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    return json_int(details.get("cached_tokens")) if isinstance(details, dict) else None


def encode(document: Json) -> bytes:
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()
