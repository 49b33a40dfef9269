"""The model's own tokenizer in the router: exact prompt counts without asking an engine.

Owns
  `load_tokenizer(path)`: the tokenizer an operator names (`engine.tokenizer_path`, a
  model folder or its tokenizer.json), read with the `tokenizers` library (the Rust
  tokenizer the engines' transformers tokenizers wrap), and the chat template beside it
  (chat_template.jinja, else tokenizer_config.json's `chat_template`). `LocalTokenizer
  .count(kind, body, dialects)`: the prompt length the engines will charge, or the miss
  reason that sends the request to the engine's /tokenize as if none were configured.

Invariants
  Completions: the prompt text encoded with special tokens unless the body sets
  `add_special_tokens: false`, which vLLM honours and SGLang ignores (a fleet where
  the two would differ is the miss `dialect`). Chat: vLLM only (`_chat`); an SGLang
  engine in the fleet is the miss `dialect`. Loading imports `tokenizers` and `jinja2`
  (the `tokenizer` extra), so a daemon without the option never does. Two loads of the
  same bytes compare equal (`digest`): a reload that changes nothing changes nothing.

Errors
  `load_tokenizer` returns the problem as text that names the file (the loader puts
  the setting before it); `count` raises nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Collection
from typing import TYPE_CHECKING

from .._files import read_bounded

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from ..engines import Json
    from ..engines._dialects import EndpointKind
    from ._chat import ChatTemplate

# Why a prompt is not counted here (`narwhal_token_count_local_misses_total{reason}`).
MISS_REASONS = (
    "prompt",  # a completion prompt that is not one text (token ids are counted apart)
    "dialect",  # engines that would count it differently (SGLang's chat, special tokens)
    "no_template",  # a chat, and the tokenizer's folder has no chat template
    "template_parts",  # the template loops over content, which vLLM hands it as parts
    "fields",  # fields that reshape the chat prompt (tools, chat_template_kwargs, ...)
    "messages",  # messages not rendered here (tool, developer, tool calls, images, ...)
    "template_error",  # the template raised (the engine's answer says why)
)
# tokenizer.json of the largest open models is tens of MB.
TOKENIZER_FILE_LIMIT = 256 << 20
CONFIG_FILE_LIMIT = 4 << 20
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# A processor's template (a multimodal model's) comes first in vLLM, and renders parts.
PROCESSOR_FILES = ("chat_template.json", "processor_config.json", "preprocessor_config.json")
# transformers' named special tokens, each given to the chat template by its name.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class Miss(Exception):
    """A request not counted here as the engines count it; `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class LocalTokenizer:
    """A model's tokenizer and chat template, as `load_tokenizer` read them."""

    __slots__ = ("chat", "digest", "encoder", "path")

    def __init__(
        self, path: str, digest: str, encoder: Tokenizer, chat: ChatTemplate | None
    ) -> None:
        self.path = path  # the tokenizer.json read
        self.digest = digest  # sha256 of it, its tokenizer_config.json and chat template
        self.encoder = encoder
        self.chat = chat

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LocalTokenizer):
            return NotImplemented
        return (self.path, self.digest) == (other.path, other.digest)

    def __hash__(self) -> int:
        return hash((self.path, self.digest))

    def __repr__(self) -> str:
        return f"<LocalTokenizer {self.path} sha256:{self.digest[:12]}>"

    def __reduce__(self) -> tuple[object, ...]:
        # A worker process (narwhal.plane) gets its core's configuration pickled: it reads
        # the same files itself, and must find the same tokenizer there.
        return (_reloaded, (self.path, self.digest))

    def count(self, kind: EndpointKind, body: Json, dialects: Collection[str]) -> int | str:
        """The prompt length engines of `dialects` charge `body`, or the miss reason."""
        ids = self.ids(kind, body, dialects)
        return ids if isinstance(ids, str) else len(ids)

    def ids(self, kind: EndpointKind, body: Json, dialects: Collection[str]) -> list[int] | str:
        """The prompt's token ids as engines of `dialects` see them, or the miss reason."""
        if kind == "chat":
            if self.chat is None:
                return "no_template"
            if set(dialects) - {"vllm"}:
                return "dialect"
            try:
                text = self.chat.render(body)
            except Miss as miss:
                return miss.reason
            return self._ids(text, special=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return "prompt"
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            return "prompt"
        # SGLang's completions take no `add_special_tokens`: they always add them.
        if not special and "sglang" in dialects:
            return "dialect"
        return self._ids(prompt, special=special)

    def _ids(self, text: str, *, special: bool) -> list[int]:
        # The batch form without offsets: the same ids in half the time of `encode`
        # (which computes offsets), and it releases the GIL.
        [encoding] = self.encoder.encode_batch_fast([text], add_special_tokens=special)
        ids: list[int] = encoding.ids
        return ids


def _reloaded(path: str, digest: str) -> LocalTokenizer:
    tokenizer, problem = load_tokenizer(path)
    if tokenizer is None:
        raise ValueError(f"engine.tokenizer_path: {problem}")
    if tokenizer.digest != digest:
        raise ValueError(f"engine.tokenizer_path: {path} changed since the core read it")
    return tokenizer


def load_tokenizer(path: str) -> tuple[LocalTokenizer | None, str | None]:
    """The tokenizer at `path` (a folder holding tokenizer.json, or the file), or why
    it cannot be used. Blocking: it reads and parses files (tens of MB for a large
    vocabulary, in a fraction of a second)."""
    file = os.path.join(path, TOKENIZER_FILE) if os.path.isdir(path) else path
    folder = os.path.dirname(file)
    shown = json.dumps(file)
    raw, problem = read_bounded(file, TOKENIZER_FILE_LIMIT)
    if raw is None:
        return None, problem
    try:
        from tokenizers import Tokenizer

        from ._chat import ChatTemplate
    except ImportError as exc:
        return None, (
            f"needs the {exc.name} package, in Narwhal's `tokenizer` extra "
            "(pip install 'narwhal[tokenizer]')"
        )
    try:
        encoder = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as exc:
        return None, f"{shown}: not a tokenizer the tokenizers library reads: {_first_line(exc)}"
    digest = hashlib.sha256(raw)
    settings, template, problem = _beside(folder)
    if problem is not None:
        return None, problem
    digest.update(json.dumps(settings, sort_keys=True).encode())
    chat = None
    if template is not None:
        digest.update(template.encode())
        try:
            chat = ChatTemplate(template, _special_tokens(settings))
        except Exception as exc:
            return None, f"{os.path.join(folder, '')}: its chat template does not compile: {exc}"
    return LocalTokenizer(file, digest.hexdigest(), encoder, chat), None


def _beside(folder: str) -> tuple[dict[str, object], str | None, str | None]:
    """tokenizer_config.json's settings (empty without one) and the chat template
    vLLM would use (None where it is a processor's or there is none), or a problem."""
    settings: dict[str, object] = {}
    config_path = os.path.join(folder, TOKENIZER_CONFIG_FILE)
    if os.path.exists(config_path):
        raw, problem = read_bounded(config_path, CONFIG_FILE_LIMIT)
        if raw is None:
            return {}, None, problem
        try:
            parsed = json.loads(raw)
        except (UnicodeDecodeError, ValueError, RecursionError):
            parsed = None
        if not isinstance(parsed, dict):
            return {}, None, f"{json.dumps(config_path)}: not a JSON object"
        settings = parsed
    if any(os.path.exists(os.path.join(folder, name)) for name in PROCESSOR_FILES):
        return settings, None, None
    template_path = os.path.join(folder, CHAT_TEMPLATE_FILE)
    if os.path.exists(template_path):
        raw, problem = read_bounded(template_path, CONFIG_FILE_LIMIT)
        if raw is None:
            return {}, None, problem
        try:
            return settings, raw.decode("utf-8"), None
        except UnicodeDecodeError:
            return {}, None, f"{json.dumps(template_path)}: not utf-8 text"
    return settings, _default_template(settings.get("chat_template")), None


def _default_template(value: object) -> str | None:
    """tokenizer_config.json's template: a string, or named ones of which a request
    without tools gets `default`."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for item in value:
            if isinstance(item, dict) and item.get("name") == "default":
                template = item.get("template")
                return template if isinstance(template, str) else None
    return None


def _special_tokens(settings: dict[str, object]) -> dict[str, str]:
    """The named special tokens as transformers gives them to a template: a string,
    or an added token's `content`."""
    out: dict[str, str] = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = settings.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
