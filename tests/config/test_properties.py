"""Whatever the document, load_config returns a Config or raises ConfigError whose every
message starts with a dotted path: never any other exception."""

from __future__ import annotations

import json
from typing import Any, Literal, get_args, get_origin, get_type_hints

import attrs
from hypothesis import HealthCheck, given, settings, strategies as st

from narwhal.config import Config, ConfigError, config_to_dict, load_config

from .helpers import PATH_PREFIX, REPO

# Each load builds a fresh converter (~12 ms), so examples are kept to a few hundred.
_SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**62, max_value=2**70)
    | st.floats()
    | st.text(max_size=6)
)
_json: st.SearchStrategy[Any] = st.recursive(
    _leaves,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=10,
)


def _check(doc: object) -> None:
    messages: list[str] = []
    config: Config | None = None
    try:
        config = load_config(doc)
    except ConfigError as exc:
        messages = exc.messages
    if config is None:
        assert messages
        for message in messages:
            assert PATH_PREFIX.match(message), message
    else:
        assert load_config(config_to_dict(config)) == config


def _plausible(tp: Any) -> st.SearchStrategy[Any]:
    """Values of roughly the right kind, so documents get past the type checks often."""
    if get_origin(tp) is Literal:
        return st.sampled_from([*get_args(tp), "other"])
    if get_origin(tp) is tuple:
        return st.lists(_plausible(get_args(tp)[0]), min_size=0, max_size=4)
    if attrs.has(tp):
        return _shaped(tp)
    if tp is bool:
        return st.booleans()
    if tp is str:
        return st.sampled_from(["a", "b", "", "http://127.0.0.1:8100", "http://h:8101/", "x:1"])
    return st.integers(min_value=-2, max_value=70000) | st.floats(min_value=-1, max_value=300)


def _shaped(cls: type[Any]) -> st.SearchStrategy[dict[str, Any]]:
    hints = get_type_hints(cls)
    optional = {field.name: _plausible(hints[field.name]) | _json for field in attrs.fields(cls)}
    return st.fixed_dictionaries({}, optional=optional)


@_SETTINGS
@given(_json)
def test_arbitrary_json_values(doc: object) -> None:
    _check(doc)


@_SETTINGS
@given(_shaped(Config))
def test_schema_shaped_documents(doc: dict[str, Any]) -> None:
    _check(doc)


def _leaf_paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(node, dict):
        return [path] + [p for key, value in node.items() for p in _leaf_paths(value, (*path, key))]
    if isinstance(node, list):
        return [path] + [p for i, value in enumerate(node) for p in _leaf_paths(value, (*path, i))]
    return [path]


_VALID: dict[str, Any] = json.loads((REPO / "conf" / "narwhal.json").read_text())
_PATHS = [path for path in _leaf_paths(_VALID) if path]


def _mutate(doc: Any, path: tuple[Any, ...], action: str, value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    copy: Any = dict(doc) if isinstance(doc, dict) else list(doc)
    if rest:
        copy[head] = _mutate(doc[head], rest, action, value)
    elif action == "delete" and isinstance(copy, dict):
        del copy[head]
    elif action == "add" and isinstance(doc[head], dict):
        copy[head] = {**doc[head], "extra": value}
    else:
        copy[head] = value
    return copy


@_SETTINGS
@given(
    st.lists(
        st.tuples(
            st.sampled_from(_PATHS),
            st.sampled_from(["set", "delete", "add"]),
            _json | st.integers(min_value=-1, max_value=1000) | st.floats(-1, 1000),
        ),
        min_size=1,
        max_size=3,
    )
)
def test_mutations_of_a_valid_document(mutations: list[tuple[tuple[Any, ...], str, Any]]) -> None:
    doc: Any = _VALID
    for path, action, value in mutations:
        try:
            doc = _mutate(doc, path, action, value)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed or replaced this path
    _check(doc)


def test_the_valid_document_is_valid() -> None:
    _check(_VALID)
    load_config(_VALID)
