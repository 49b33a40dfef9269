"""Loading a JSON configuration document into a `Config`, reporting every problem at once.

Three checks in one pass, each collecting rather than stopping at the first failure:

1. structuring with a private cattrs converter: strict JSON types and unknown keys;
2. the per-field range rules from the model metadata, by a walker over the result;
3. the cross-field rules of `_cross`.

When structuring fails there is no `Config` to check, yet an operator who mistyped one
key should still learn everything else that is wrong. So the loader repairs a copy of the
document (drops unknown and mistyped keys, so they take their defaults, and fills required
ones with placeholders) and checks that, field rules and cross-field rules alike. A
cross-field rule that reads a value standing in for an invalid one (a mistyped, missing
or out-of-range value, or the key an unknown one was probably meant as) is not run: its
verdict would be about a value that is not in the file. `ConfigError.unchecked` names
those values, so the operator knows a second run may find more.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import attrs
import cattrs
from cattrs.errors import (
    AttributeValidationNote,
    BaseValidationError,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from .._errors import os_reason
from .._files import FileTooLarge, read_file
from ..tokenizer import load_tokenizer
from ._cross import cross_rules
from ._model import RESOLVED, Config, Ctl, Secret
from ._paths import Path, field_pattern, format_path
from ._resolve import config_folder, resolve_paths
from ._secrets import MAX_CLIENT_KEYS, read_keys, read_token

T = TypeVar("T")
_INT64 = 2**63
_SHOW_LIMIT = 40
# Repairing a document can expose a deeper problem (a replaced engine now lacks its
# required keys); the schema is three levels deep, so a few rounds always suffice.
_REPAIR_ROUNDS = 4
# An API key is one short token; a bigger file is the wrong file.
KEY_FILE_LIMIT = 4096
# A configuration of thousands of engines is a few hundred kB.
CONFIG_FILE_LIMIT = 4 * 1024 * 1024
# What vLLM and SGLang compare after "Bearer ": visible ASCII. Spaces and other
# whitespace would be trimmed or split by HTTP parsers on the way, control characters
# and line breaks would inject headers, and non-ASCII text is decoded differently by
# the two ends.
_KEY_CHARS = frozenset(range(0x21, 0x7F))


class ConfigError(Exception):
    """A configuration document is invalid; `messages` holds one line per problem.
    `unchecked`: the invalid values (field patterns, `engines[].url`) that kept
    cross-field rules from running, so a run once they are fixed may find more."""

    def __init__(
        self, messages: Sequence[str], *, source: str = "<config>", unchecked: Sequence[str] = ()
    ) -> None:
        self.messages = list(messages)
        self.source = source
        self.unchecked = list(unchecked)
        super().__init__("\n".join(self.messages))

    def __str__(self) -> str:
        return "\n".join(self.messages)


def load_config(
    document: object,
    *,
    source: str = "<config>",
    api_keys: bool = True,
    folder: str | None = None,
) -> Config:
    """Structure and check an already-parsed JSON value.

    Raises ConfigError listing every problem, each message starting with the dotted path
    of the offending value (`source` stands for the whole document). Blocking: it reads
    the files the document names (engine API keys, the admin token, the clients' keys,
    the model's tokenizer), unless `api_keys` is false (a caller that only needs other
    settings, run by a user who may not read them); those are then left out.
    `folder`: the folder relative paths are taken from (`_resolve`); None leaves them
    relative, to the working directory.
    """
    converter = _make_converter()
    problems: list[Problem] = []
    # Field patterns of the values a repair replaced, in every round.
    replaced: set[str] = set()
    try:
        structured = converter.structure(document, Config)
    except (BaseValidationError, _Mismatch) as exc:
        problems = _structure_problems(exc, ())
        # A document that is no object holds nothing to check further.
        whole = any(not problem.path for problem in problems)
        repaired, replaced = (
            (None, set()) if whole else _repaired_config(converter, document, problems)
        )
        if repaired is None:
            raise ConfigError(
                _in_document_order(document, problems, source), source=source
            ) from None
        structured = repaired
    config = _resolved(structured, folder)
    problems.extend(field_problems(config))
    messages = _in_document_order(document, problems, source)
    broken = replaced | {field_pattern(problem.path) for problem in problems}
    unchecked: set[str] = set()
    for rule in cross_rules():
        hidden = rule.hidden_by(broken)
        if hidden:
            unchecked.update(hidden)
        else:
            messages.extend(rule.check(config))
    if api_keys:
        config, key_problems = _with_api_keys(config)
        messages.extend(key_problems)
        config, credential_problems = _with_credential_files(config, broken)
        messages.extend(credential_problems)
        config, tokenizer_problem = _with_tokenizer(config, broken)
        messages.extend(tokenizer_problem)
    if messages:
        raise ConfigError(messages, source=source, unchecked=sorted(unchecked))
    return config


def load_config_file(path: str | os.PathLike[str], *, api_keys: bool = True) -> Config:
    """Read, parse and check a JSON configuration file (`api_keys`: see `load_config`).
    Its relative paths are taken from its folder, not the working directory.

    Blocking, though within bounds (`narwhal._files.read_file`, for this file and every
    key file): from async code call it through `trio.to_thread.run_sync`.
    """
    source = os.fspath(path)
    document, duplicates = _parse_json(_read_text(path, source), source)
    try:
        config = load_config(document, source=source, api_keys=api_keys, folder=config_folder(path))
    except ConfigError as exc:
        raise ConfigError(
            duplicates + exc.messages, source=source, unchecked=exc.unchecked
        ) from None
    if duplicates:
        raise ConfigError(duplicates, source=source)
    return config


def load_ctl_socket(path: str | os.PathLike[str]) -> str:
    """The control socket path a configuration file names (a relative one taken from
    the file's folder, as the daemon takes it), checking only `ctl`.

    For narwhalctl, which needs nothing else: whether the rest of the file is valid is
    the running daemon's to judge (a reload of it is refused with every problem), and a
    problem elsewhere must not keep an operator from reaching the daemon at all.
    """
    source = os.fspath(path)
    document, _ = _parse_json(_read_text(path, source), source)
    if not isinstance(document, dict):
        raise ConfigError([f"{source}: expected an object, got {_show(document)}"], source=source)
    problems: list[Problem] = []
    try:
        ctl = resolve_paths(
            _make_converter().structure(document.get("ctl", {}), Ctl), config_folder(path)
        )
    except (BaseValidationError, _Mismatch) as exc:
        problems = _structure_problems(exc, ("ctl",))
    else:
        _walk(ctl, ("ctl",), problems)
    if problems:
        raise ConfigError(_in_document_order(document, problems, source), source=source)
    return ctl.socket


def _resolved(config: Config, folder: str | None) -> Config:
    return config if folder is None else resolve_paths(config, folder)


def _read_text(path: str | os.PathLike[str], source: str) -> str:
    try:
        return read_file(path, limit=CONFIG_FILE_LIMIT).decode("utf-8")
    except FileNotFoundError:
        raise ConfigError([f"{source}: no such file"], source=source) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [f"{source}: not utf-8 text (invalid byte at offset {exc.start})"], source=source
        ) from None
    except OSError as exc:
        reason = os_reason(exc)
        raise ConfigError([f"{source}: cannot read file: {reason}"], source=source) from None


def config_to_dict(config: Config) -> dict[str, Any]:
    """The JSON-ready form of `config`, every default filled in."""
    unstructured: dict[str, Any] = _make_converter().unstructure(config)
    return unstructured


# --- engine API keys ----------------------------------------------------------------------


def _with_api_keys(config: Config) -> tuple[Config, list[str]]:
    """`config` with each engine's key read from its effective `api_key_file`.

    Read on every load, so a reload picks up a rotated key. Messages name the file but
    never its content.
    """
    problems: list[str] = []
    shared: Secret | None = None
    if config.engine.api_key_file is not None:
        shared, problem = read_api_key(config.engine.api_key_file)
        if problem is not None:
            problems.append(f"engine.api_key_file: {problem}")
    engines = []
    for index, spec in enumerate(config.engines):
        key = shared
        if spec.api_key_file is not None:
            key, problem = read_api_key(spec.api_key_file)
            if problem is not None:
                problems.append(f"engines[{index}].api_key_file: {problem}")
        engines.append(attrs.evolve(spec, api_key=key))
    return attrs.evolve(config, engines=tuple(engines)), problems


def _with_credential_files(config: Config, broken: set[str]) -> tuple[Config, list[str]]:
    """`config` with the clients' keys and the admin token read from the files it names
    (but a path that broke its own rule, in `broken`). Read on every load, so a reload
    picks up rotated ones."""
    problems: list[str] = []

    def read(
        setting: str, path: str | None, reader: Callable[[str], tuple[T, str | None]]
    ) -> T | None:
        if path is None or setting in broken:
            return None
        value, problem = reader(path)
        if problem is not None:
            problems.append(f"{setting}: {problem}")
        return value

    keys = read("listen.api_keys_file", config.listen.api_keys_file, read_keys)
    listen = attrs.evolve(config.listen, file_api_keys=keys or ())
    token = read("admin.token_file", config.admin.token_file, read_token)
    admin = attrs.evolve(config.admin, file_token=token)
    count = len(set(listen.client_keys()))
    if count > MAX_CLIENT_KEYS:
        problems.append(
            f"listen.api_keys: {count} keys with listen.api_keys_file's; at most "
            f"{MAX_CLIENT_KEYS} in all"
        )
    return attrs.evolve(config, admin=admin, listen=listen), problems


def _with_tokenizer(config: Config, broken: set[str]) -> tuple[Config, list[str]]:
    """`config` with the tokenizer `engine.tokenizer_path` names, read on every load (so
    a reload picks up a new one, and a broken one refuses the reload)."""
    path = config.engine.tokenizer_path
    if path is None or "engine.tokenizer_path" in broken:
        return config, []
    tokenizer, problem = load_tokenizer(path)
    if problem is not None:
        return config, [f"engine.tokenizer_path: {problem}"]
    return attrs.evolve(config, engine=attrs.evolve(config.engine, tokenizer=tokenizer)), []


def read_api_key(path: str) -> tuple[Secret | None, str | None]:
    """The key in the file at `path`, or why it cannot be used (a message without it)."""
    shown = json.dumps(path)
    try:
        raw = read_file(path, limit=KEY_FILE_LIMIT)
    except FileNotFoundError:
        return None, f"{shown}: no such file"
    except FileTooLarge:
        return None, f"{shown}: larger than {KEY_FILE_LIMIT} bytes; expected one line, the key"
    except OSError as exc:
        reason = os_reason(exc)
        return None, f"{shown}: cannot read file: {reason}"
    except ValueError:
        return None, f"{shown}: a path cannot contain a NUL character"
    # Editors and `echo` end the file with a newline; the key is the line before it.
    if raw.endswith(b"\r\n"):
        raw = raw[:-2]
    elif raw.endswith(b"\n"):
        raw = raw[:-1]
    if not raw:
        return None, f"{shown}: the file is empty; expected the engines' API key"
    if not _KEY_CHARS.issuperset(raw):
        return None, (
            f"{shown}: the key holds a character that cannot be sent in an HTTP header "
            "(space, line break, control or non-ASCII character); expected one line of "
            "printable ASCII"
        )
    return Secret(raw.decode("ascii")), None


@attrs.frozen
class Problem:
    path: Path
    text: str
    kind: Literal["invalid", "unknown", "missing"] = "invalid"
    # For an unknown key: the known key it is close to, probably the one meant.
    meant: str | None = None

    def pattern(self) -> str:
        """The field pattern of the value this problem leaves standing in for the file's."""
        if self.meant is not None:
            return field_pattern((*self.path[:-1], self.meant))
        return field_pattern(self.path)


def field_problems(config: Config) -> list[Problem]:
    """Every per-field rule failure in `config`, in model order."""
    out: list[Problem] = []
    _walk(config, (), out)
    return out


def _walk(node: attrs.AttrsInstance, path: Path, out: list[Problem]) -> None:
    for field in attrs.fields(type(node)):
        if field.metadata.get(RESOLVED):
            continue
        value = getattr(node, field.name)
        here = (*path, field.name)
        if _is_section(value):
            _walk(value, here, out)
        elif isinstance(value, tuple):
            for index, item in enumerate(value):
                if _is_section(item):
                    _walk(item, (*here, index), out)
                else:
                    _check(field, item, (*here, index), out)
        elif value is not None:
            _check(field, value, here, out)


def _is_section(value: object) -> bool:
    """An object of the document (a section, an engine), not a value (a Secret is attrs
    too)."""
    return attrs.has(type(value)) and not isinstance(value, Secret)


def _check(field: attrs.Attribute[Any], value: object, path: Path, out: list[Problem]) -> None:
    for rule in field.metadata.get("rules", ()):
        text = rule.check(value)
        if text is not None:
            out.append(Problem(path, text))


# --- structuring --------------------------------------------------------------------------


class _Mismatch(ValueError):
    """A JSON value of the wrong type (or magnitude) for its field. `secret`: the value
    is a credential's, shown only by its JSON type."""

    def __init__(self, expected: str, value: object, hint: str = "", *, secret: bool = False):
        self.expected = expected
        self.value = value
        self.secret = secret
        shown = f"{_kind(value)} (not shown: a credential)" if secret else _show(value)
        super().__init__(f"expected {expected}, got {shown}{hint}")


def _kind(value: object) -> str:
    """What JSON calls `value`'s type, with its article."""
    if isinstance(value, bool):
        return "a boolean"
    kinds = {int: "a number", float: "a number", list: "a list", dict: "an object"}
    return "null" if value is None else kinds.get(type(value), "a value")


def _show(value: object) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        # Not JSON (a Python caller's object) or an int past the str-conversion limit.
        text = f"<{type(value).__name__}>"
    if len(text) > _SHOW_LIMIT:
        text = text[: _SHOW_LIMIT - 3] + "..."
    return text


def _make_converter() -> cattrs.Converter:
    # A fresh converter per load: hooks are registered once here and never mutated, and
    # nothing is shared between loads (style guide: no module-global converter).
    converter = cattrs.Converter(forbid_extra_keys=True)
    converter.register_structure_hook(int, _structure_int)
    converter.register_structure_hook(float, _structure_float)
    converter.register_structure_hook(bool, _structure_bool)
    converter.register_structure_hook(str, _structure_str)
    converter.register_structure_hook(Secret, _structure_secret)
    converter.register_unstructure_hook(Secret, str)
    converter.register_structure_hook_factory(_is_literal, _literal_hook)
    converter.register_structure_hook_factory(
        _is_optional, lambda tp: _optional_hook(converter, tp)
    )
    converter.register_structure_hook_factory(
        _is_homogeneous_tuple, lambda tp: _tuple_hook(converter, tp)
    )
    converter.register_structure_hook_factory(attrs.has, lambda cl: _object_hook(converter, cl))
    converter.register_unstructure_hook_factory(
        attrs.has,
        lambda cl: make_dict_unstructure_fn(cl, converter, **_resolved_omitted(cl)),
    )
    return converter


def _resolved_omitted(cl: type[Any]) -> dict[str, Any]:
    # Resolved fields are filled in by the loader, not read from or written to documents:
    # the document has no such key, and the API key must never be printed.
    return {
        field.name: override(omit=True)
        for field in attrs.fields(cl)
        if field.metadata.get(RESOLVED)
    }


def _structure_int(value: object, _: object) -> int:
    # bool is an int subclass, and cattrs would otherwise call int("3") or int(3.7).
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Mismatch("an integer", value)
    if not -_INT64 <= value < _INT64:
        raise _Mismatch("a 64-bit integer", value)
    return value


def _structure_float(value: object, _: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Mismatch("a number", value)
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise _Mismatch("a finite number", value)
    return number


def _structure_bool(value: object, _: object) -> bool:
    if not isinstance(value, bool):
        raise _Mismatch("true or false", value)
    return value


def _structure_str(value: object, _: object) -> str:
    if not isinstance(value, str):
        raise _Mismatch("a string", value)
    return value


def _structure_secret(value: object, _: object) -> Secret:
    if not isinstance(value, str):
        raise _Mismatch("a string", value, secret=True)
    return Secret(value)


def _is_literal(tp: Any) -> bool:
    return get_origin(tp) is Literal


def _literal_hook(tp: Any) -> Callable[[object, object], str]:
    choices: tuple[str, ...] = get_args(tp)

    def structure(value: object, _: object) -> str:
        if isinstance(value, str) and value in choices:
            return value
        expected = "one of " + ", ".join(repr(choice) for choice in choices)
        hint = _did_you_mean(value, choices) if isinstance(value, str) else ""
        raise _Mismatch(expected, value, hint)

    return structure


def _did_you_mean(word: str, candidates: Sequence[str]) -> str:
    close = _closest(word, candidates)
    return f"; did you mean {close!r}?" if close is not None else ""


def _closest(word: str, candidates: Sequence[str]) -> str | None:
    close = difflib.get_close_matches(word, candidates, n=1)
    return close[0] if close else None


def _is_optional(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType) and type(None) in get_args(tp)


def _optional_hook(
    converter: cattrs.Converter, tp: Any
) -> Callable[[object, object], object | None]:
    (inner,) = (arg for arg in get_args(tp) if arg is not type(None))
    structure_inner = converter.get_structure_hook(inner)

    def structure(value: object, _: object) -> object | None:
        if value is None:
            return None
        try:
            structured: object = structure_inner(value, inner)
        except _Mismatch as exc:
            raise _Mismatch(f"{exc.expected} or null", value, secret=exc.secret) from None
        return structured

    return structure


def _is_homogeneous_tuple(tp: Any) -> bool:
    args = get_args(tp)
    return get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis


def _tuple_hook(
    converter: cattrs.Converter, tp: Any
) -> Callable[[object, object], tuple[Any, ...]]:
    item_type = get_args(tp)[0]
    structure_item = converter.get_structure_hook(item_type)

    def structure(value: object, _: object) -> tuple[Any, ...]:
        # cattrs accepts any iterable here: a string would become a tuple of characters.
        if not isinstance(value, list):
            raise _Mismatch("a list", value)
        items: list[Any] = []
        errors: list[Exception] = []
        for index, item in enumerate(value):
            try:
                items.append(structure_item(item, item_type))
            except Exception as exc:
                exc.add_note(IterableValidationNote(f"@ index {index}", index, item_type))
                errors.append(exc)
        if errors:
            raise IterableValidationError(f"while structuring {tp}", errors, tp)
        return tuple(items)

    return structure


def _object_hook(converter: cattrs.Converter, cl: type[Any]) -> Callable[[object, object], Any]:
    structure_fields = make_dict_structure_fn(
        cl, converter, _cattrs_forbid_extra_keys=True, **_resolved_omitted(cl)
    )

    def structure(value: object, _: object) -> Any:
        # The generated function indexes its input: a list or string would raise
        # TypeError deep inside rather than say what was expected.
        if not isinstance(value, dict):
            raise _Mismatch("an object", value)
        if not all(isinstance(key, str) for key in value):
            raise _Mismatch("an object with string keys", value)
        return structure_fields(value, cl)

    return structure


def _note(exc: BaseException, kind: type[str]) -> str | None:
    for note in getattr(exc, "__notes__", ()):
        if type(note) is kind:
            return note
    return None


def _structure_problems(exc: BaseException, path: Path) -> list[Problem]:
    """Translate cattrs' nested exception groups into path-named problems."""
    if isinstance(exc, _Mismatch):
        return [Problem(path, str(exc))]
    if isinstance(exc, KeyError):
        # The generated structure function indexes required keys directly.
        return [Problem(path, "required key is missing", "missing")]
    if isinstance(exc, ClassValidationError):
        out: list[Problem] = []
        for sub in exc.exceptions:
            if isinstance(sub, ForbiddenExtraKeysError):
                out.extend(_unknown_keys(sub, path))
                continue
            note = _note(sub, AttributeValidationNote)
            if not isinstance(note, AttributeValidationNote):
                raise exc
            out.extend(_structure_problems(sub, (*path, note.name)))
        return out
    if isinstance(exc, IterableValidationError):
        out = []
        for sub in exc.exceptions:
            note = _note(sub, IterableValidationNote)
            if not isinstance(note, IterableValidationNote) or not isinstance(note.index, int):
                raise exc
            out.extend(_structure_problems(sub, (*path, note.index)))
        return out
    # Anything else is a bug in the loader, not a configuration problem: let it surface.
    raise exc


def _unknown_keys(exc: ForbiddenExtraKeysError, path: Path) -> list[Problem]:
    known = [field.name for field in attrs.fields(exc.cl) if not field.metadata.get(RESOLVED)]
    out: list[Problem] = []
    for key in sorted(exc.extra_fields):
        hint = _did_you_mean(key, known)
        out.append(Problem((*path, key), "unknown key" + hint, "unknown", _closest(key, known)))
    return out


# --- repair, so field rules can run despite structure errors ------------------------------

_DELETE = object()


def _repaired_config(
    converter: cattrs.Converter, document: object, problems: list[Problem]
) -> tuple[Config | None, set[str]]:
    """The document repaired until it structures (None if it still does not), and the
    field patterns of every value the repair replaced."""
    replaced: set[str] = set()
    for _ in range(_REPAIR_ROUNDS):
        for problem in problems:
            replaced.add(problem.pattern())
            document = _repair(document, problem)
        try:
            return converter.structure(document, Config), replaced
        except (BaseValidationError, _Mismatch) as exc:
            problems = _structure_problems(exc, ())
    return None, replaced


def _repair(document: object, problem: Problem) -> object:
    if not problem.path:
        return {}
    if problem.kind == "unknown":
        return _replace(document, problem.path, _DELETE)
    tp, has_default = _schema_at(problem.path)
    if problem.kind == "invalid" and has_default:
        return _replace(document, problem.path, _DELETE)
    return _replace(document, problem.path, _placeholder(tp))


def _schema_at(path: Path) -> tuple[Any, bool]:
    """The declared type at a schema path, and whether an absent value has a default."""
    tp: Any = Config
    has_default = True
    for segment in path:
        if isinstance(segment, int):
            tp, has_default = get_args(tp)[0], False
        else:
            field = attrs.fields_dict(tp)[segment]
            tp, has_default = get_type_hints(tp)[segment], field.default is not attrs.NOTHING
    return tp, has_default


def _placeholder(tp: Any) -> object:
    # Required values exist only for str fields, list items (objects) and `engines`;
    # the placeholders carry no range rules, so they add no messages of their own.
    if tp is Secret:
        return "placeholder"  # passes the credential rule, so it adds no message
    if attrs.has(tp):
        return {}
    if tp is str:
        return ""
    if get_origin(tp) is tuple:
        return []
    return None


def _replace(node: object, path: Path, new: object) -> object:
    """A copy of `node` with the value at `path` replaced (or deleted), sharing the rest."""
    head, rest = path[0], path[1:]
    if isinstance(node, dict):
        copy = dict(node)
        if rest:
            copy[head] = _replace(node[head], rest, new)
        elif new is _DELETE:
            copy.pop(head, None)
        else:
            copy[head] = new
        return copy
    if isinstance(node, list) and isinstance(head, int):
        items = list(node)
        items[head] = _replace(node[head], rest, new) if rest else new
        return items
    return node


# --- ordering and rendering ---------------------------------------------------------------


def _in_document_order(document: object, problems: list[Problem], source: str) -> list[str]:
    ordered = sorted(problems, key=lambda problem: _position(document, problem.path))
    return [f"{format_path(p.path) or source}: {p.text}" for p in ordered]


def _position(document: object, path: Path) -> tuple[int, ...]:
    # Where the value sits in the file: an operator reads the messages top to bottom
    # alongside it. A missing required key sorts after its object's present keys.
    position: list[int] = []
    node: object = document
    for segment in path:
        if isinstance(node, dict) and segment in node:
            position.append(list(node).index(segment))
            node = node[segment]
        elif isinstance(node, list) and isinstance(segment, int) and segment < len(node):
            position.append(segment)
            node = node[segment]
        else:
            position.append(len(node) if isinstance(node, dict | list) else 0)
            node = None
    return tuple(position)


# --- JSON files ---------------------------------------------------------------------------


def _parse_json(text: str, source: str) -> tuple[object, list[str]]:
    """Parse `text`; also return a message for every duplicated object key.

    The json module silently keeps the last of duplicated keys: a config with two
    `serving` objects would lose half its settings without a word.
    """
    duplicated: dict[int, list[str]] = {}

    def object_pairs(pairs: list[tuple[str, object]]) -> dict[str, object]:
        obj: dict[str, object] = {}
        again: list[str] = []
        for key, value in pairs:
            if key in obj and key not in again:
                again.append(key)
            obj[key] = value
        if again:
            duplicated[id(obj)] = again
        return obj

    try:
        document = json.loads(text, object_pairs_hook=object_pairs)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            [f"{source}: invalid json at line {exc.lineno} column {exc.colno}: {_lower(exc.msg)}"],
            source=source,
        ) from None
    except RecursionError:
        raise ConfigError([f"{source}: invalid json: nested too deeply"], source=source) from None
    except ValueError as exc:
        # Integers past Python's str-conversion limit (4300 digits).
        raise ConfigError([f"{source}: invalid json: {_lower(str(exc))}"], source=source) from None
    messages = [
        f"{format_path(path)}: duplicate key; only its last value would be used"
        for path in _duplicate_key_paths(document, duplicated)
    ]
    return document, messages


def _lower(text: str) -> str:
    return text[:1].lower() + text[1:]


def _duplicate_key_paths(document: object, duplicated: dict[int, list[str]]) -> Iterator[Path]:
    if not duplicated:
        return
    # Iterative: a document nested near the parser's depth limit must not overflow here.
    stack: list[tuple[Path, object]] = [((), document)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            for key in duplicated.get(id(node), ()):
                yield (*path, key)
            stack.extend(((*path, key), value) for key, value in reversed(node.items()))
        elif isinstance(node, list):
            stack.extend(((*path, index), item) for index, item in reversed(list(enumerate(node))))
