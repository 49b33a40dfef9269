"""docs/observability.md against a running Narwhal and the source: the state document's
keys (as its records convert, and as a live daemon shows them), the metric families, the
log events."""

from __future__ import annotations

import ast
import textwrap
import typing
from typing import Any

import attrs
import httpx
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from narwhal._records import json_fields
from narwhal.serving import StateDocument, state_document
from narwhal.supervisor import STATE_SECTIONS

from ..serving import test_predictive as predictive
from ..serving.conftest import MODEL, Stack, StartStack
from ..support import wait_for
from .markdown import code_spans, read, tables
from .sources import REPO, log_events

PAGE = "observability.md"


def _rows(first_column: str) -> list[dict[str, str]]:
    return [
        row
        for table in tables(read(PAGE))
        if table.columns and table.columns[0] == first_column
        for row in table.rows
    ]


async def _busy_stack(start_stack: StartStack) -> Stack:
    """Two simulated engines behind a Narwhal with predictive admission and the role
    controller on, after one request and the controller's first evaluation: every
    section of the state and every metric family is there."""
    stack = await start_stack(
        ["prefill", "decode"],
        slo={"ttft_s": 2.0, "tpot_s": 0.05},
        serving={"admission": "predictive"},
        controller={"enabled": True, "monitor_interval_s": 0.05},
        profiles=predictive.LawProfiles(),
    )
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 3},
        )
    assert response.status_code == 200, response.text
    await wait_for(lambda: "demand" in _section(state_document(stack.ctx), "controller"))
    return stack


def _section(document: dict[str, object], key: str) -> dict[str, object]:
    section = document.get(key)
    return section if isinstance(section, dict) else {}


# ------------------------------------------------------------------ the state document


def _live_keys(document: dict[str, Any]) -> set[str]:
    """Top-level keys and the keys one level down (`engines[].id` for a list of objects)."""
    keys: set[str] = set()
    for key, value in document.items():
        keys.add(key)
        if isinstance(value, list) and value and isinstance(value[0], dict):
            keys.update(f"{key}[].{child}" for child in value[0])
        elif isinstance(value, dict):
            keys.update(f"{key}.{child}" for child in value)
    return keys


def _documented_keys() -> set[str]:
    return {code_spans(row["Key"])[0] for row in _rows("Key")}


def _record_keys() -> set[str]:
    """The keys the state's records convert to, as `_live_keys` reads a document: every
    section (the serving ones, then those the supervisor adds) and its fields."""
    sections = {**json_fields(StateDocument), **STATE_SECTIONS}
    keys: set[str] = set()
    for key, hint in sections.items():
        keys.add(key)
        if typing.get_origin(hint) is tuple:
            (element, _) = typing.get_args(hint)
            keys.update(f"{key}[].{child}" for child in json_fields(element))
        elif isinstance(hint, type) and attrs.has(hint):
            keys.update(f"{key}.{child}" for child in json_fields(hint))
    return keys


def test_the_state_schema_names_every_key_of_the_state_records_and_no_other() -> None:
    records, documented = _record_keys(), _documented_keys()
    assert not records - documented, f"in the records, not in docs/{PAGE}: {records - documented}"
    assert not documented - records, f"in docs/{PAGE}, not in the records: {documented - records}"


async def test_the_state_schema_names_every_key_of_a_live_state_and_no_other(
    start_stack: StartStack,
) -> None:
    stack = await _busy_stack(start_stack)
    assert [key for key, _ in stack.ctx.state_providers] == list(STATE_SECTIONS)
    live = _live_keys(await stack.state())
    documented = _documented_keys()
    assert not live - documented, f"in /narwhal/state, not in docs/{PAGE}: {live - documented}"
    assert not documented - live, f"in docs/{PAGE}, not in /narwhal/state: {documented - live}"


# ------------------------------------------------------------------ metrics


def _exported(registry: CollectorRegistry) -> dict[str, tuple[str, frozenset[str]]]:
    """Every family as scraped: name (a counter's with `_total`) -> (type, label names).
    A labelled family with no child yet has no sample: its labels are read off the
    metric object."""
    declared: dict[str, tuple[str, ...]] = {
        name: collector._labelnames
        for collector, names in registry._collector_to_names.items()
        if isinstance(collector, MetricWrapperBase)
        for name in names
    }
    families: dict[str, tuple[str, frozenset[str]]] = {}
    for family in registry.collect():
        labels = set(declared.get(family.name, ())) | set(getattr(family, "_labelnames", ()))
        for sample in family.samples:
            labels |= set(sample.labels) - {"le", "quantile"}
        name = f"{family.name}_total" if family.type == "counter" else family.name
        families[name] = (family.type, frozenset(labels))
    return families


def _catalogue() -> dict[str, tuple[str, frozenset[str]]]:
    return {
        code_spans(row["Metric"])[0]: (row["Type"], frozenset(code_spans(row["Labels"])))
        for row in _rows("Metric")
    }


async def test_the_metric_catalogue_and_the_registry_agree(start_stack: StartStack) -> None:
    stack = await _busy_stack(start_stack)
    exported = _exported(stack.ctx.metrics.registry)
    catalogue = _catalogue()
    assert not set(exported) - set(catalogue), (
        f"exported, not in docs/{PAGE}: {sorted(set(exported) - set(catalogue))}"
    )
    assert not set(catalogue) - set(exported), (
        f"in docs/{PAGE}, not exported: {sorted(set(catalogue) - set(exported))}"
    )
    differ = {
        name: {"exported": exported[name], "documented": catalogue[name]}
        for name in exported
        if exported[name] != catalogue[name]
    }
    assert not differ, f"type or labels differ: {differ}"
    scraped = await stack.metrics()
    for name in catalogue:
        assert f"# TYPE {name} " in scraped, name


# ------------------------------------------------------------------ log events


def _events() -> dict[str, dict[str, str]]:
    return {code_spans(row["Event"])[0]: row for row in _rows("Event")}


def test_the_log_event_catalogue_names_every_event_and_no_other() -> None:
    logged, documented = set(log_events()), set(_events())
    assert not logged - documented, f"logged, not in docs/{PAGE}: {sorted(logged - documented)}"
    assert not documented - logged, f"in docs/{PAGE}, never logged: {documented - logged}"


def test_each_event_has_its_levels_and_fields() -> None:
    documented = _events()
    for event, use in log_events().items():
        row = documented.get(event)
        if row is None:
            continue  # the test above names it
        levels = {level.strip() for level in row["Level"].split(",")}
        assert levels == use.levels, f"{event}: logged at {sorted(use.levels)}"
        missing = use.fields - set(code_spans(row["Fields"]))
        assert not missing, f"{event}: fields logged and not documented: {sorted(missing)}"


def test_the_event_collector_reads_spreads_renames_and_computed_levels() -> None:
    source = textwrap.dedent(
        """
        def f(ok):
            extra = {"event": "reload", "source": path}
            log.info("x", extra={**extra, "outcome": "started"})
            log.error("x", extra={**extra, "event": "reload_error", "problem": p})
            level = logging.INFO if ok else logging.WARNING
            fields = {"event": "probe", "engine": e}
            log.log(level, "x", extra=fields)
        """
    )
    found = log_events([(REPO / "narwhal" / "example.py", ast.parse(source))])
    assert {name: (use.levels, use.fields) for name, use in found.items()} == {
        "reload": ({"info"}, {"source", "outcome"}),
        "reload_error": ({"error"}, {"source", "problem"}),
        "probe": ({"info", "warning"}, {"engine"}),
    }
