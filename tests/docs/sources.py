"""What the source says Narwhal can emit, read from its syntax trees: error codes and
log events. The docs tests compare these with the tables in docs/.

Error codes have one source, the `ErrorCode` enum (narwhal/_codes.py): a code in an
error's code position must name one of its members (or pass on a parameter, an
attribute, a table of them), never be written as a string.

The collectors fail loudly on anything they cannot read (a code or an event name that
is neither a literal nor a pass-through they know), so that a new way of emitting one
cannot slip past the docs: teach the collector, then document what it finds.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

import attrs

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "narwhal"
# Tools beside the daemon: the simulator, the profiler and checker, the CLIs, the demo.
# What they emit is not the daemon's contract.
_NOT_THE_DAEMON = ("sim", "probe", "cli", "ctl", "demo.py", "__main__.py")


def daemon_modules() -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] in _NOT_THE_DAEMON:
            continue
        yield path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(REPO)}:{getattr(node, 'lineno', '?')}"


class UnreadableSource(Exception):
    """The collector met a construct it cannot resolve to literal names."""


# ------------------------------------------------------------------ error codes

ERROR_ROOT = "NarwhalError"
CODES = "ErrorCode"
# A template member (`ENGINE_HTTP`, "engine_http_<status>") filled in: still that code.
_FILL = "with_status"
# The error codes clients see come from the daemon's request path; the control socket's
# (`ctl`) are narwhalctl's, and the tools' are their own.
_NOT_CLIENT_FACING = (*_NOT_THE_DAEMON, "ctl")


# HTTP's own numbers, not error codes.
_NOT_ERROR_CODES = frozenset({"status_code", "exit_code"})


def _is_code_name(name: str | None) -> bool:
    return name is not None and (
        name == "code" or (name.endswith("_code") and name not in _NOT_ERROR_CODES)
    )


def _callee(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


@attrs.frozen
class _Module:
    path: Path
    tree: ast.Module
    constants: dict[str, ast.expr]
    """Module-level names bound once to a literal, a member or a dict of them."""
    codes: dict[str, str]
    """`ErrorCode`'s members, name -> code, wherever the sources define it."""


def _constants(tree: ast.Module) -> dict[str, ast.expr]:
    found: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and (
            isinstance(value, ast.Constant | ast.Dict) or _member(value) is not None
        ):
            found[target.id] = value
    return found


def _member(expr: ast.expr) -> str | None:
    """The member name of `ErrorCode.NAME`, else None."""
    if (
        isinstance(expr, ast.Attribute)
        and isinstance(expr.value, ast.Name)
        and expr.value.id == CODES
    ):
        return expr.attr
    return None


def _enum_codes(trees: Iterable[ast.Module]) -> dict[str, str]:
    """The members of every `class ErrorCode` in `trees`: name -> code."""
    codes: dict[str, str] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ClassDef) and node.name == CODES):
                continue
            for item in node.body:
                if (
                    isinstance(item, ast.Assign)
                    and len(item.targets) == 1
                    and isinstance(item.targets[0], ast.Name)
                    and isinstance(item.value, ast.Constant)
                    and isinstance(item.value.value, str)
                ):
                    codes[item.targets[0].id] = item.value.value
    return codes


def _code_of(expr: ast.expr, module: _Module, at: str) -> str | None:
    """The code `ErrorCode.NAME` stands for; None when `expr` is not a member."""
    name = _member(expr)
    if name is None:
        return None
    if name not in module.codes:
        raise UnreadableSource(f"{at}: `{ast.unparse(expr)}` is not a member of {CODES}")
    return module.codes[name]


def _parents(tree: ast.Module) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _enclosing_params(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> set[str]:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            return {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
    return set()


DEFAULT = "<default>"
"""A code expression that may be None: the error class's `default_code` applies."""


def _resolve(expr: ast.expr, module: _Module, params: set[str], at: str) -> set[str]:
    """The codes `expr` (in a code position) can be. Empty: it passes through a
    parameter or an attribute whose values the call sites and constructors supply."""
    if isinstance(expr, ast.Constant) and expr.value is None:
        return {DEFAULT}
    if isinstance(expr, ast.Constant | ast.JoinedStr):
        raise UnreadableSource(
            f"{at}: the error code `{ast.unparse(expr)}` is written as a string; name it "
            f"as a member of {CODES} (narwhal/_codes.py), its one source"
        )
    code = _code_of(expr, module, at)
    if code is not None:
        return {code}
    if (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Attribute)
        and expr.func.attr == _FILL
    ):
        return _resolve(expr.func.value, module, params, at)
    if isinstance(expr, ast.IfExp):
        return _resolve(expr.body, module, params, at) | _resolve(expr.orelse, module, params, at)
    if isinstance(expr, ast.BoolOp):
        return set().union(*(_resolve(value, module, params, at) for value in expr.values))
    if isinstance(expr, ast.Name):
        if expr.id in params and _is_code_name(expr.id):
            return set()
        constant = module.constants.get(expr.id)
        if constant is not None and not isinstance(constant, ast.Dict):
            return _resolve(constant, module, params, at)
    if isinstance(expr, ast.Attribute) and _is_code_name(expr.attr):
        return set()
    table = _table(expr, module, at)
    if table is not None:
        return table
    raise UnreadableSource(
        f"{at}: cannot tell which error codes `{ast.unparse(expr)}` can be; teach "
        "tests/docs/sources.py to read it"
    )


def _table(expr: ast.expr, module: _Module, at: str) -> set[str] | None:
    """`TABLE[key]` or `TABLE.get(key)` of a module-level dict of codes."""
    name: str | None = None
    default: set[str] = set()
    key: str | int | None = None
    if isinstance(expr, ast.Subscript) and isinstance(expr.value, ast.Name):
        name = expr.value.id
        if isinstance(expr.slice, ast.Constant) and isinstance(expr.slice.value, str | int):
            key = expr.slice.value
    elif (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Attribute)
        and expr.func.attr == "get"
        and isinstance(expr.func.value, ast.Name)
    ):
        name = expr.func.value.id
        default = {DEFAULT} if len(expr.args) == 1 else set()
    table = module.constants.get(name or "")
    if not isinstance(table, ast.Dict):
        return None
    entries = {
        k.value if isinstance(k, ast.Constant) else None: _resolve(v, module, set(), at)
        for k, v in zip(table.keys, table.values, strict=True)
    }
    if key is not None:
        return entries[key]
    return set().union(*entries.values()) | default


@attrs.frozen
class _ErrorClass:
    name: str
    base: str
    default_code: str | None
    status: int | None


@attrs.frozen
class ErrorClass:
    default_code: str
    status: int | None
    """The class's own `status`, None when each error is given its own."""


def _error_classes(modules: list[_Module]) -> dict[str, ErrorClass]:
    """Every NarwhalError subclass (and NarwhalError) by name."""
    classes: dict[str, _ErrorClass] = {}
    for module in modules:
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.ClassDef):
                continue
            base = next((b.id for b in node.bases if isinstance(b, ast.Name)), "")
            attributes: dict[str, object] = {}
            for item in node.body:
                if not isinstance(item, ast.Assign):
                    continue
                at = where(module.path, item)
                for target in item.targets:
                    if not isinstance(target, ast.Name):
                        continue
                    if isinstance(item.value, ast.Constant):
                        attributes[target.id] = item.value.value
                    elif target.id == "default_code":
                        attributes[target.id] = _code_of(item.value, module, at)
            default = attributes.get("default_code")
            status = attributes.get("status")
            classes[node.name] = _ErrorClass(
                node.name,
                base,
                None if default is None else str(default),
                status if isinstance(status, int) else None,
            )

    def inherited(name: str, attribute: str) -> object:
        cls = classes.get(name)
        if cls is None:
            return None
        value = getattr(cls, attribute)
        return value if value is not None else inherited(cls.base, attribute)

    def is_error(name: str) -> bool:
        return name == ERROR_ROOT or (name in classes and is_error(classes[name].base))

    def status_of(name: str) -> int | None:
        value = inherited(name, "status")
        return value if isinstance(value, int) else None

    return {
        name: ErrorClass(str(inherited(name, "default_code") or ""), status_of(name))
        for name in classes
        if is_error(name)
    }


def _code_positions(modules: list[_Module]) -> dict[str, list[int]]:
    """Callable name -> positions (0-based, after self) of its code parameters: functions
    and methods (`__init__` under its class's name) and attrs classes' fields."""
    positions: dict[str, list[int]] = {}
    for module in modules:
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ClassDef):
                fields = [
                    item.target.id
                    for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                ]
                found = [i for i, name in enumerate(fields) if _is_code_name(name)]
                if found and not any(
                    isinstance(item, ast.FunctionDef) and item.name == "__init__"
                    for item in node.body
                ):
                    positions[node.name] = found
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                        names = [a.arg for a in item.args.args[1:]]
                        found = [i for i, name in enumerate(names) if _is_code_name(name)]
                        if found:
                            positions[node.name] = found
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names = [a.arg for a in node.args.args]
                if names and names[0] == "self":
                    names = names[1:]
                found = [i for i, name in enumerate(names) if _is_code_name(name)]
                if found:
                    positions[node.name] = found
    return positions


def _status_positions(modules: list[_Module]) -> dict[str, int]:
    """attrs class name -> the position of its `status` field (a table's rows, say)."""
    positions: dict[str, int] = {}
    for module in modules:
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.ClassDef) or any(
                isinstance(item, ast.FunctionDef) and item.name == "__init__" for item in node.body
            ):
                continue
            fields = [
                item.target.id
                for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            ]
            if "status" in fields:
                positions[node.name] = fields.index("status")
    return positions


def _status_defaults(modules: list[_Module]) -> dict[str, int]:
    """Function name -> the default of its `status` parameter, where it has one."""
    defaults: dict[str, int] = {}
    for module in modules:
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            args = node.args
            pairs = [
                *zip(args.args[len(args.args) - len(args.defaults) :], args.defaults, strict=True),
                *((a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d),
            ]
            for arg, default in pairs:
                value = default.value if isinstance(default, ast.Constant) else None
                if arg.arg == "status" and isinstance(value, int):
                    defaults[node.name] = value
    return defaults


@attrs.define
class CodeUse:
    """Where the daemon emits an error code, and the HTTP statuses the source shows it
    with (where a site says; many pass it on from an engine or a verdict)."""

    sites: list[str] = attrs.field(factory=list)
    statuses: set[int] = attrs.field(factory=set)


def client_facing_modules() -> Iterator[tuple[Path, ast.Module]]:
    for path, tree in daemon_modules():
        if path.relative_to(PACKAGE).parts[0] not in _NOT_CLIENT_FACING:
            yield path, tree


def error_codes(
    sources: Iterable[tuple[Path, ast.Module]] | None = None,
) -> dict[str, CodeUse]:
    """Every error code the daemon (or `sources`) can put in an error envelope. An
    f-string's fields read `<expr>`: `engine_http_<status>`."""
    given = list(client_facing_modules() if sources is None else sources)
    members = _enum_codes(tree for _, tree in given)
    modules = [_Module(path, tree, _constants(tree), members) for path, tree in given]
    classes = _error_classes(modules)
    positions = _code_positions(modules)
    status_defaults = _status_defaults(modules)
    status_positions = _status_positions(modules)
    found: dict[str, CodeUse] = {}
    for module in modules:
        parents = _parents(module.tree)
        for call in ast.walk(module.tree):
            if not isinstance(call, ast.Call):
                continue
            at = where(module.path, call)
            params = _enclosing_params(call, parents)
            callee = _callee(call) or ""
            exprs = [kw.value for kw in call.keywords if _is_code_name(kw.arg)]
            exprs += [call.args[i] for i in positions.get(callee, []) if i < len(call.args)]
            codes: set[str] = set()
            for expr in exprs:
                codes |= _resolve(expr, module, params, at)
            if callee in classes and not exprs and isinstance(call.func, ast.Name):
                codes.add(DEFAULT)
            if DEFAULT in codes:
                codes.discard(DEFAULT)
                if callee not in classes:
                    raise UnreadableSource(f"{at}: a code that may be None outside an error class")
                codes.add(classes[callee].default_code)
            status = _site_status(call, callee, classes, status_defaults, status_positions)
            for code in codes:
                use = found.setdefault(code, CodeUse())
                use.sites.append(at)
                if status is not None:
                    use.statuses.add(status)
    return found


def _site_status(
    call: ast.Call,
    callee: str,
    classes: dict[str, ErrorClass],
    defaults: dict[str, int],
    positions: dict[str, int],
) -> int | None:
    given = next((kw.value for kw in call.keywords if kw.arg == "status"), None)
    if given is None and positions.get(callee, len(call.args)) < len(call.args):
        given = call.args[positions[callee]]
    if given is not None:
        literal = given.value if isinstance(given, ast.Constant) else None
        return literal if isinstance(literal, int) else None
    if callee in classes:
        return classes[callee].status
    return defaults.get(callee)


# ------------------------------------------------------------------ log events

_LEVELS = {"debug", "info", "warning", "error", "critical"}
_METHODS = {**{level: level for level in _LEVELS}, "exception": "error"}


@attrs.define
class EventUse:
    """Where a structured log event is logged, at which levels, with which fields (those
    the source names; a `**spread` of something computed adds more)."""

    sites: list[str] = attrs.field(factory=list)
    levels: set[str] = attrs.field(factory=set)
    fields: set[str] = attrs.field(factory=set)


def logging_modules() -> Iterator[tuple[Path, ast.Module]]:
    """Every module of the daemon and its tools, but the simulator (its own program)."""
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] != "sim":
            yield path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _scopes(tree: ast.Module) -> Iterator[ast.AST]:
    yield tree
    yield from (
        node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    )


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of `scope`, not those of functions nested in it."""
    for child in ast.iter_child_nodes(scope):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        yield child
        yield from _own_nodes(child)


def _levels_in(expr: ast.expr) -> set[str]:
    return {
        node.attr.lower()
        for node in ast.walk(expr)
        if isinstance(node, ast.Attribute) and node.attr.lower() in _LEVELS
    }


def _dict_event(node: ast.Dict) -> str | None:
    for key, value in zip(node.keys, node.values, strict=True):
        if isinstance(key, ast.Constant) and key.value == "event":
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                return value.value
            raise UnreadableSource(f"an event named by `{ast.unparse(value)}`")
    return None


def log_events(sources: Iterable[tuple[Path, ast.Module]] | None = None) -> dict[str, EventUse]:
    """Every structured log event (`extra={"event": ...}`) of the daemon (or `sources`).

    Each logging call with `extra=` must name its event in a dict literal, directly or
    through a local dict it spreads or passes; its level is the method's, or for
    `log.log(LEVEL, ...)` the `logging.X` constants LEVEL can be."""
    found: dict[str, EventUse] = {}
    for path, tree in logging_modules() if sources is None else sources:
        for scope in _scopes(tree):
            nodes = list(_own_nodes(scope))
            dicts: dict[str, list[ast.Dict]] = {}
            levels: dict[str, set[str]] = {}
            for node in nodes:
                target, value = None, None
                if isinstance(node, ast.Assign) and len(node.targets) == 1:
                    target, value = node.targets[0], node.value
                elif isinstance(node, ast.AnnAssign):
                    target, value = node.target, node.value
                if not isinstance(target, ast.Name) or value is None:
                    continue
                if isinstance(value, ast.Dict):
                    dicts.setdefault(target.id, []).append(value)
                elif _levels_in(value):
                    levels.setdefault(target.id, set()).update(_levels_in(value))
            for node in nodes:
                if isinstance(node, ast.Call):
                    _log_call(node, path, dicts, levels, found)
    return found


def _log_call(
    call: ast.Call,
    path: Path,
    dicts: dict[str, list[ast.Dict]],
    levels: dict[str, set[str]],
    found: dict[str, EventUse],
) -> None:
    func = call.func
    extra = next((kw.value for kw in call.keywords if kw.arg == "extra"), None)
    if extra is None or not isinstance(func, ast.Attribute):
        return
    at = where(path, call)
    if func.attr == "log":
        level_expr = call.args[0]
        called = (
            levels.get(level_expr.id, set())
            if isinstance(level_expr, ast.Name)
            else _levels_in(level_expr)
        )
    elif func.attr in _METHODS:
        called = {_METHODS[func.attr]}
    else:
        return
    if not called:
        raise UnreadableSource(f"{at}: cannot tell the level of this log call")
    # The dicts this call's extra is made of: its own literal and those it spreads or names.
    parts: list[ast.Dict] = []
    if isinstance(extra, ast.Name):
        parts = dicts.get(extra.id, [])
    elif isinstance(extra, ast.Dict):
        parts = [extra]
        for key, value in zip(extra.keys, extra.values, strict=True):
            if key is None and isinstance(value, ast.Name):
                parts.extend(dicts.get(value.id, []))
    events = {event for part in parts if (event := _dict_event(part)) is not None}
    if isinstance(extra, ast.Dict) and (own := _dict_event(extra)) is not None:
        events = {own}  # `{**extra, "event": "other"}` renames the spread's event
    if not events:
        raise UnreadableSource(f"{at}: a log call with extra= but no event it names")
    fields = {
        key.value
        for part in parts
        for key in part.keys
        if isinstance(key, ast.Constant) and isinstance(key.value, str) and key.value != "event"
    }
    for event in events:
        use = found.setdefault(event, EventUse())
        use.sites.append(at)
        use.levels |= called
        use.fields |= fields
