"""A flat description of every configuration field, for the generated reference."""

from __future__ import annotations

import inspect
import json
import types
from collections.abc import Iterator
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import attrs

from ._diff import ReloadEffect, reload_effect
from ._model import RESOLVED, Config, Secret

_TYPE_NAMES: dict[object, str] = {
    int: "integer",
    float: "number",
    bool: "boolean",
    str: "string",
    Secret: "string",
}


@attrs.frozen
class FieldDoc:
    path: str
    """Dotted path; `engines[].url` stands for the field of every engine."""
    section: str
    """Path of the enclosing object: `serving`, `engines[]`, or `""` for the top level."""
    section_doc: str
    type: str
    default: str | None
    """JSON text of the default; None for a required field."""
    allowed: str
    """The field's own range or choices; cross-field rules are described separately."""
    doc: str
    """At most two sentences: the reference's meaning cell."""
    notes: str
    """The rest, printed under the section's table; "" when there is none."""
    reload: ReloadEffect


def describe_fields() -> Iterator[FieldDoc]:
    """Every leaf field of the configuration, in model order."""
    yield from _describe(Config, "")


def _describe(cls: type[Any], section: str) -> Iterator[FieldDoc]:
    hints = get_type_hints(cls)
    section_doc = inspect.getdoc(cls) or ""
    prefix = f"{section}." if section else ""
    for field in attrs.fields(cls):
        if field.metadata.get(RESOLVED):
            continue
        tp = hints[field.name]
        path = prefix + field.name
        if attrs.has(tp):
            yield from _describe(tp, path)
            continue
        metadata = field.metadata
        yield FieldDoc(
            path=path,
            section=section,
            section_doc=section_doc,
            type=_type_name(tp),
            default=None if field.default is attrs.NOTHING else json.dumps(field.default),
            allowed=_allowed(tp, metadata.get("rules", ())),
            doc=metadata["doc"],
            notes=metadata.get("notes", ""),
            reload=reload_effect(path),
        )
        if get_origin(tp) is tuple and attrs.has(get_args(tp)[0]) and get_args(tp)[0] is not Secret:
            yield from _describe(get_args(tp)[0], f"{path}[]")


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "string"
    if origin is tuple:
        return (
            "list of objects"
            if attrs.has(get_args(tp)[0]) and get_args(tp)[0] is not Secret
            else "list of strings"
        )
    if origin in (Union, types.UnionType):
        (inner,) = (arg for arg in get_args(tp) if arg is not type(None))
        return f"{_type_name(inner)} or null"
    return _TYPE_NAMES[tp]


def _allowed(tp: Any, rules: tuple[Any, ...]) -> str:
    if get_origin(tp) in (Union, types.UnionType):
        (inner,) = (arg for arg in get_args(tp) if arg is not type(None))
        if get_origin(inner) is Literal:
            return _allowed(inner, rules) + ", null"
    if get_origin(tp) is Literal:
        return ", ".join(json.dumps(choice) for choice in get_args(tp))
    if tp is bool:
        return "true, false"
    return " and ".join(rule.describe() for rule in rules)
