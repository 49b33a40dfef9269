"""State records as JSON: the one conversion of every part of /narwhal/state.

Owns
  `to_json(record)`: a frozen attrs record (and the records, mappings, tuples and enums
  it holds) as the JSON object /narwhal/state and narwhalctl show; the field markers
  `key(...)`, `OPTIONAL` and `SPLICED`; `json_fields(cls)`, the keys a record class
  converts to, for the schema test.

Invariants
  Conversion decides the structure only, never a value: owners build their records with
  the values shown (rounded, None for null). A record's keys come in its fields' order,
  each under its name or its `key`; mappings keep their order; tuples become lists and
  enums their values. An `OPTIONAL` field is left out while None; a `SPLICED` field's
  keys (a record's fields, or a mapping's items) take its place, and none while None.
  A plain walk over the fields, not a cattrs converter: the style guide wants none
  shared, and one made per call took a state document from 0.1 ms (dicts) to 1.9 ms,
  where records and this walk take 0.4 ms.

See
  docs/observability.md (the schema), tests/docs/test_observability.py (the page against
  the records).
"""

from __future__ import annotations

import enum
import typing
from collections.abc import Mapping

import attrs

_KEY = "narwhal.json_key"
_SHAPE = "narwhal.json_shape"

OPTIONAL: Mapping[str, object] = {_SHAPE: "optional"}
"""Field metadata: the key is absent while the value is None (not null)."""

SPLICED: Mapping[str, object] = {_SHAPE: "spliced"}
"""Field metadata: the value's own keys stand in the parent, in the field's place."""


def key(name: str) -> Mapping[str, object]:
    """Field metadata: the JSON key, where it cannot be the field's name (`from`)."""
    return {_KEY: name}


JsonObject = dict[str, object]


def to_json(record: attrs.AttrsInstance) -> JsonObject:
    """`record` as the JSON object it is shown as."""
    out: JsonObject = {}
    for field in attrs.fields(type(record)):
        value = getattr(record, field.name)
        shape = field.metadata.get(_SHAPE)
        if shape is not None and value is None:
            continue
        shown = _json_value(value)
        if shape == "spliced":
            assert isinstance(shown, dict), f"{field.name}: only a record or a mapping splices"
            out.update(shown)
        else:
            out[field.metadata.get(_KEY, field.name)] = shown
    return out


def _json_value(value: object) -> object:
    # Most values are plain JSON: they go first, and Mapping's ABC check last.
    if value is None or isinstance(value, str | int | float):
        return value
    if attrs.has(type(value)):
        return to_json(value)  # type: ignore[arg-type]
    if isinstance(value, tuple | list):
        return [_json_value(item) for item in value]
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {key: _json_value(item) for key, item in value.items()}
    return value


def json_fields(cls: type[attrs.AttrsInstance]) -> dict[str, object]:
    """The keys `cls` converts to, each with its field's type (None taken out of an
    optional one), spliced records' keys in their place. A spliced mapping's keys are
    known only to whoever fills it, and are left out."""
    hints = typing.get_type_hints(cls)
    out: dict[str, object] = {}
    for field in attrs.fields(cls):
        hint = _without_none(hints[field.name])
        if field.metadata.get(_SHAPE) == "spliced":
            if isinstance(hint, type) and attrs.has(hint):
                out.update(json_fields(hint))
            continue
        out[field.metadata.get(_KEY, field.name)] = hint
    return out


def _without_none(hint: object) -> object:
    args = typing.get_args(hint)
    if type(None) in args:
        rest = tuple(arg for arg in args if arg is not type(None))
        return rest[0] if len(rest) == 1 else typing.Union[rest]  # noqa: UP007
    return hint
