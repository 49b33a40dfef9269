"""An engine's load and availability change only through the fleet's methods, so that a
grep for `operator_`, `reload_`, `recovery_`, `note_` or `.load.` shows who changes what:
no code outside narwhal/fleet stores to one of those attributes of another object."""

from __future__ import annotations

import ast
from pathlib import Path

import attrs
import pytest

import narwhal
from narwhal.config import Config, EngineSpec
from narwhal.fleet import EngineState, LoadStatistics

PACKAGE = Path(narwhal.__file__).parent
FLEET = PACKAGE / "fleet"

AVAILABILITY = frozenset(
    {
        "drained",
        "pinned",
        "removed",
        "auth_refused",
        "auth_refusals",
        "model_missing",
        "model_refusals",
        "ejected",
        "unreachable",
        "held_until",
        "quarantined_until",
    }
)
LOAD = frozenset(attrs.fields_dict(LoadStatistics)) | {"placed"}
GUARDED = frozenset(name for plain in AVAILABILITY | LOAD for name in (plain, f"_{plain}"))


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return [node.target]
    return []


def _flatten(target: ast.expr) -> list[ast.expr]:
    if isinstance(target, ast.Tuple | ast.List):
        return [leaf for element in target.elts for leaf in _flatten(element)]
    if isinstance(target, ast.Starred):
        return _flatten(target.value)
    return [target]


def outside_stores(source: str) -> list[str]:
    """Where `source` stores to a guarded attribute of anything but `self`, or names one
    in a setattr."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        leaves = (leaf for target in _targets(node) for leaf in _flatten(target))
        found.extend(
            f"{leaf.lineno}: {ast.unparse(leaf)}"
            for leaf in leaves
            if isinstance(leaf, ast.Attribute)
            and leaf.attr in GUARDED
            and not (isinstance(leaf.value, ast.Name) and leaf.value.id == "self")
        )
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in GUARDED
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_code_outside_the_fleet_stores_engine_load_or_availability() -> None:
    stores = {
        str(path.relative_to(PACKAGE)): found
        for path in sorted(PACKAGE.rglob("*.py"))
        if FLEET not in path.parents and (found := outside_stores(path.read_text()))
    }
    assert stores == {}


@pytest.mark.parametrize(
    "source",
    [
        "engine.drained = True",
        "record.engine.held_until = math.inf",
        "engine.decode_tokens -= tokens",
        "engine.load._prefill_inflight += 1",
        "a.pinned, b.role = True, 'decode'",
        "setattr(engine, 'ejected', None)",
        "engine.quarantined_until: float = until",
    ],
)
def test_the_scan_sees_each_kind_of_store(source: str) -> None:
    assert outside_stores(source) != []


def test_the_scan_leaves_an_objects_own_state_and_reads_alone() -> None:
    source = "self.unreachable = False\nx = engine.drained\nengine.role = 'decode'\n"
    assert outside_stores(source) == []


def test_an_engines_load_and_availability_are_read_only_outside_their_methods() -> None:
    spec = EngineSpec(id="d0", url="http://127.0.0.1:9", role="decode")
    engine = EngineState(spec, Config(engines=(spec,)))
    for name in sorted(AVAILABILITY):
        with pytest.raises(AttributeError):
            setattr(engine, name, getattr(engine, name))
    for name in sorted(LOAD):
        with pytest.raises(AttributeError):
            setattr(engine.load, name, 0)
