"""A chat request's prompt text, rendered from its messages as vLLM's chat completions render it.

Owns
  `ChatTemplate`: the model's chat template compiled in the environment transformers'
  `apply_chat_template` uses (a sandbox with trim_blocks, lstrip_blocks, loop controls,
  `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII and HTML as is, and
  the `{% generation %}` tag), and `render(body)`: the text vLLM tokenises for `body`,
  or why it cannot be had here.

Invariants
  Rendered only where the result is vLLM's, field for field (vLLM 0.32's chat renderer,
  `parse_chat_messages` then `apply_chat_template`): messages of role system, user or
  assistant with `content` text (a string, null, or text parts, joined by newlines) and
  an optional string `name`; the template gets `messages`, `tools` and `documents` as
  null, `add_generation_prompt` (default true) and the tokenizer's named special tokens.
  Anything that shapes the prompt otherwise is a miss with its reason (`MISS_REASONS`),
  never rendered approximately: tools, documents, `chat_template`,
  `chat_template_kwargs`, `continue_final_message`, `reasoning_effort`,
  `add_special_tokens`, tool and developer messages, tool calls, multimodal parts, and a
  template that loops over message content (vLLM then hands it content as parts).

Errors
  `Miss` from `render`, with the reason (a template that raises is `template_error`).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from ._local import Miss

if TYPE_CHECKING:
    from collections.abc import Mapping

    import jinja2.parser

    from ..engines import Json

_ROLES = frozenset({"system", "user", "assistant"})
_MESSAGE_KEYS = frozenset({"role", "content", "name"})
# vLLM strips this line from system text (it changes on every request): such a system
# message renders otherwise than its text says.
_BILLING_HEADER = "x-anthropic-billing-header"
# Body fields that change what vLLM renders or tokenises, when set (not null): a request
# with one of them is left to the engine's /tokenize.
_SHAPING_FIELDS = (
    "tools",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "reasoning_effort",
)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's
    tokens with it; rendered, it is its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's extension protocol)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: jinja2.runtime.Macro) -> str:
        text: str = caller()
        return text


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:  # noqa: A002 (the name templates call it with)
    return datetime.now().strftime(format)


class ChatTemplate:
    """A chat template compiled once, with the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_Generation, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(source)
        self._special_tokens = dict(special_tokens)
        # vLLM renders content as a list of parts for a template that loops over it.
        self.loops_over_content = _loops_over_content(env.parse(source))

    def render(self, body: Json) -> str:
        """The prompt text vLLM renders for the chat `body`; raises `Miss`."""
        for field in _SHAPING_FIELDS:
            if body.get(field) is not None:
                raise Miss("fields")
        generation = body.get("add_generation_prompt", True)
        if not isinstance(generation, bool):
            raise Miss("fields")
        # vLLM tokenises the rendered text without adding special tokens (the template
        # writes them); a build that honours `add_special_tokens: true` adds them, one
        # that does not ignores it: the engine's count settles which.
        if body.get("continue_final_message", False) is not False:
            raise Miss("fields")
        if body.get("add_special_tokens", False) is not False:
            raise Miss("fields")
        if self.loops_over_content:
            raise Miss("template_parts")
        messages = _conversation(body.get("messages"))
        if messages is None:
            raise Miss("messages")
        try:
            text = self._template.render(
                {
                    **self._special_tokens,
                    "messages": messages,
                    "tools": None,
                    "documents": None,
                    "add_generation_prompt": generation,
                }
            )
        except Exception:
            # A template may raise anything (`raise_exception` for a role order it
            # refuses): the engine's answer says why.
            raise Miss("template_error") from None
        return text


def _conversation(messages: object) -> list[dict[str, str]] | None:
    """The messages as vLLM hands them to the template, or None for a shape this
    module does not render."""
    if not isinstance(messages, list) or not messages:
        return None
    out: list[dict[str, str]] = []
    for message in messages:
        if not isinstance(message, dict) or not message.keys() <= _MESSAGE_KEYS:
            return None
        role = message.get("role")
        name = message.get("name")
        content = _text(message.get("content"))
        if role not in _ROLES or content is None:
            return None
        if role == "system" and content.startswith(_BILLING_HEADER):
            return None
        entry = {"role": role, "content": content}
        if name is not None:
            if not isinstance(name, str):
                return None
            entry["name"] = name
        out.append(entry)
    return out


def _text(content: object) -> str | None:
    """A message's content as one text (vLLM joins text parts with newlines), or None."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts: list[str] = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif (
            isinstance(part, dict)
            and part.keys() == {"type", "text"}
            and part["type"] == "text"
            and isinstance(part["text"], str)
        ):
            texts.append(part["text"])
        else:
            return None
    return "\n".join(texts)


def _loops_over_content(root: jinja2.nodes.Template) -> bool:
    """Whether a `for` loop may iterate message content: one whose iterable mentions
    `content` at all, or, in a macro, iterates a parameter. Broader than vLLM's own
    detection (which follows the variables), so no template vLLM hands parts is
    rendered here with text."""
    for loop in root.find_all(jinja2.nodes.For):
        if any(_names_content(node) for node in _subtree(loop.iter)):
            return True
    for macro in root.find_all(jinja2.nodes.Macro):
        params = {arg.name for arg in macro.args}
        for loop in macro.find_all(jinja2.nodes.For):
            if isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name in params:
                return True
    return False


def _subtree(node: jinja2.nodes.Node) -> list[jinja2.nodes.Node]:
    return [node, *node.find_all(jinja2.nodes.Node)]


def _names_content(node: jinja2.nodes.Node) -> bool:
    if isinstance(node, jinja2.nodes.Name):
        return node.name == "content"
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    return False
