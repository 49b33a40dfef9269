"""Each simulated engine's dialect is one protocol class: nothing outside the protocol
modules tests which engine family it plays."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from narwhal.sim import SimEngine, SimEngineSpec
from narwhal.sim._sglang import SGLangProtocol
from narwhal.sim._vllm import VLLMProtocol

SIM = Path(__file__).resolve().parents[2] / "narwhal" / "sim"
# The protocol modules: the interface, and each dialect's class with its checks, shapes
# and build table.
PROTOCOL_MODULES = ("_protocol.py", "_vllm*.py", "_sglang*.py")
# Where the dialect is chosen: the spec validates the launch mode it allows.
CONFIGURATION = ("_spec.py",)
# What only one dialect has: reading one of these in a decision is a dialect test.
DIALECT_ATTRIBUTES = frozenset({"dialect", "sglang", "disaggregation_mode", "vllm", "wire_032"})
DIALECT_NAMES = frozenset({"vllm", "sglang"})


def _reads_dialect(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr in DIALECT_ATTRIBUTES:
            return True
        if isinstance(sub, ast.Name) and sub.id in {"dialect", "sglang"}:
            return True
        if isinstance(sub, ast.Constant) and sub.value in DIALECT_NAMES:
            return True
    return False


def _tests_room(node: ast.Compare) -> bool:
    """`x.room is (not) None`: only SGLang's pair has a bootstrap room."""
    operands = [node.left, *node.comparators]
    return any(isinstance(o, ast.Attribute) and o.attr == "room" for o in operands) and any(
        isinstance(o, ast.Constant) and o.value is None for o in operands
    )


def dialect_tests(source: str) -> list[int]:
    """The lines of `source` that decide something by the dialect."""
    lines: list[int] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.stmt | ast.expr | ast.comprehension):
            continue
        tests: list[ast.AST] = []
        if isinstance(node, ast.If | ast.IfExp | ast.While | ast.Assert):
            tests.append(node.test)
        elif isinstance(node, ast.Compare | ast.BoolOp):
            tests.append(node)
        elif isinstance(node, ast.Match):
            tests.append(node.subject)
        elif isinstance(node, ast.comprehension):
            tests.extend(node.ifs)
        if any(_reads_dialect(t) for t in tests) or (
            isinstance(node, ast.Compare) and _tests_room(node)
        ):
            lines.append(node.iter.lineno if isinstance(node, ast.comprehension) else node.lineno)
    return sorted(set(lines))


def _outside_the_protocols() -> list[Path]:
    inside = {p for pattern in PROTOCOL_MODULES + CONFIGURATION for p in SIM.glob(pattern)}
    return sorted(p for p in SIM.glob("*.py") if p not in inside)


def test_the_guard_finds_a_dialect_test() -> None:
    source = (
        "if self.sglang:\n    pass\n"
        "x = 1 if spec.dialect == 'vllm' else 2\n"
        "ok = ctx.room is not None\n"
        "if e.spec.vllm.wire_032 and chat:\n    pass\n"
        "if self.rooms.get(room.room) is room:\n    pass\n"
    )
    assert dialect_tests(source) == [1, 3, 4, 5]


def test_no_dialect_test_outside_the_protocol_modules() -> None:
    modules = _outside_the_protocols()
    assert {p.name for p in modules} >= {"_api.py", "_engine.py", "_run.py", "_kv.py"}
    found = {
        f"{p.name}:{line}" for p in modules for line in dialect_tests(p.read_text(encoding="utf-8"))
    }
    assert found == set()


@pytest.mark.parametrize(
    ("spec", "protocol"),
    [
        (SimEngineSpec(), VLLMProtocol),
        (SimEngineSpec(dialect="sglang", disaggregation_mode="prefill"), SGLangProtocol),
    ],
)
def test_an_engine_speaks_the_protocol_of_its_dialect(
    spec: SimEngineSpec, protocol: type[object]
) -> None:
    engine = SimEngine(spec, index=0, host="127.0.0.1", port=0)
    assert type(engine.protocol) is protocol
