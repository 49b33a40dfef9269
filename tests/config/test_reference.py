"""docs/configuration.md is generated from the model, must be current, says truly what a
reload does with each field, and keeps its table cells to two sentences."""

from __future__ import annotations

import types
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import attrs
import pytest

from narwhal.config import (
    Config,
    FieldDoc,
    ReloadEffect,
    describe_fields,
    diff,
    keep_running,
    load_config,
)
from narwhal.config._model import Secret
from narwhal.config.reference import render

from ..docs.markdown import code_spans, read, sentences, tables
from .helpers import REPO

FIELDS = list(describe_fields())


def test_committed_reference_is_current() -> None:
    committed = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == render(), (
        "docs/configuration.md is stale: "
        "run `python -m narwhal.config.reference > docs/configuration.md`"
    )


def test_reference_lists_every_field_and_cross_rule() -> None:
    text = render()
    for field in FIELDS:
        assert f"| `{field.path}` |" in text
    assert "16. `recovery.health.min_samples` is at most" in text


def test_no_table_cell_runs_past_two_sentences() -> None:
    long = [
        f"{table.heading}: {cell[:60]}... ({len(sentences(cell))} sentences)"
        for table in tables(read("configuration.md"))
        for row in table.rows
        for cell in row.values()
        if len(sentences(cell)) > 2
    ]
    assert not long, "move the rest into the field's `notes`:\n" + "\n".join(long)


def test_the_sentence_count_sees_what_a_reader_does() -> None:
    assert len(sentences("One `a.b` c. Two, `0.5` s. (more)")) == 2
    assert len(sentences("One. `0` two. Three ([more](#x)).")) == 3
    assert len(sentences("Rejected (see [the design](design.md#a.b)). Then e.g. this.")) == 2


# ------------------------------------------------------------------ the reload column

BASE: dict[str, Any] = {
    "engines": [
        {"id": "p0", "url": "http://127.0.0.1:9001", "role": "prefill"},
        {"id": "d0", "url": "http://127.0.0.1:9002", "role": "decode"},
    ],
}


def _documented_effects() -> dict[str, str]:
    """`On reload` of every field, as docs/configuration.md says it."""
    return {
        code_spans(row["Field"])[0]: row["On reload"]
        for table in tables(read("configuration.md"))
        if "On reload" in table.columns
        for row in table.rows
    }


def _other(value: object, tp: Any) -> object:
    """A value of type `tp` other than `value` (validity aside: diff does not validate)."""
    origin = get_origin(tp)
    if origin is Literal:
        return next(choice for choice in get_args(tp) if choice != value)
    if origin in (Union, types.UnionType):
        inner = next(arg for arg in get_args(tp) if arg is not type(None))
        return _other(None, inner) if value is None else None
    if origin is tuple:
        return (*value, Secret("sk-other")) if isinstance(value, tuple) else (Secret("sk-x"),)
    if tp is Secret:
        return Secret("sk-other" if value is None else value.reveal() + "x")  # type: ignore[attr-defined]
    if tp is bool:
        return not value
    if tp is int:
        return (value or 0) + 1  # type: ignore[operator]
    if tp is float:
        return (value or 0.0) + 0.5  # type: ignore[operator]
    assert tp is str, tp
    return f"{value or ''}x"


def _changed(obj: Any, names: list[str]) -> Any:
    """`obj` with the field at the dotted `names` changed."""
    head, *rest = names
    if rest:
        return attrs.evolve(obj, **{head: _changed(getattr(obj, head), rest)})
    tp = get_type_hints(type(obj))[head]
    return attrs.evolve(obj, **{head: _other(getattr(obj, head), tp)})


def _changed_config(config: Config, field: FieldDoc) -> Config:
    if field.path == "engines":
        extra = attrs.evolve(config.engines[0], id="extra", url="http://127.0.0.1:9003")
        return attrs.evolve(config, engines=(*config.engines, extra))
    if field.path.startswith("engines[]."):
        first = _changed(config.engines[0], field.path.removeprefix("engines[].").split("."))
        return attrs.evolve(config, engines=(first, *config.engines[1:]))
    changed: Config = _changed(config, field.path.split("."))
    return changed


def _effect_of_reload(old: Config, new: Config) -> ReloadEffect:
    """What a reload from `old` to `new` does, read from the plan the supervisor follows
    and the configuration it puts in force."""
    plan = diff(old, new)
    in_force = keep_running(new, old)
    if plan.restart_required:
        assert in_force == old, "a setting that needs a restart must keep its running value"
        return "restart"
    assert plan.changes, "a reload that sees no change applies nothing"
    assert in_force == new
    if plan.engines_replaced or (plan.engines_added and plan.engines_removed):
        return "new engine"
    return "applies"


@pytest.mark.parametrize("field", FIELDS, ids=[field.path for field in FIELDS])
def test_the_reload_column_says_what_a_reload_does(field: FieldDoc) -> None:
    old = load_config(BASE)
    observed = _effect_of_reload(old, _changed_config(old, field))
    assert field.reload == observed
    assert _documented_effects()[field.path] == observed


def test_the_reload_column_covers_every_field() -> None:
    assert set(_documented_effects()) == {field.path for field in FIELDS}
