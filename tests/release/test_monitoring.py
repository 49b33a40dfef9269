"""conf/prometheus rules pass `promtool check rules`, and every metric the rules and the
Grafana dashboard name is one a running Narwhal exports."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess

import httpx

from ..serving.conftest import StartStack

REPO = pathlib.Path(__file__).resolve().parents[2]
RULES = sorted((REPO / "conf" / "prometheus").glob("*.rules.yml"))
DASHBOARD = REPO / "conf" / "grafana" / "narwhal.json"
_METRIC = re.compile(r"\b(?:narwhal|process)_[a-z0-9_]+\b")
_RECORDED = re.compile(r"\bnarwhal:[a-z0-9_:]+\b")


def test_promtool_checks_the_rules() -> None:
    promtool = shutil.which("promtool")
    assert promtool is not None, (
        "promtool is not installed: tools/test.sh installs it (Debian's `prometheus` package)"
    )
    assert len(RULES) == 2
    proc = subprocess.run(
        [promtool, "check", "rules", *map(str, RULES)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _texts() -> list[str]:
    """The rule files whole (expressions and annotations) and the dashboard's queries."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    queries = [target["expr"] for panel in panels for target in panel["targets"]]
    return [rules.read_text() for rules in RULES] + queries


def _exported(text: str) -> set[str]:
    """Series names a scrape can hold: each family's name with its type's suffixes."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            # The text format names a counter's family with its _total already.
            name = name.removesuffix("_total") if kind == "counter" else name
            suffixes = {
                "counter": ["_total"],
                "histogram": ["_bucket", "_sum", "_count"],
                "gauge": [""],
            }[kind]
            names.update(name + suffix for suffix in suffixes)
    return names


async def test_every_metric_the_rules_and_dashboard_name_is_exported(
    start_stack: StartStack,
) -> None:
    stack = await start_stack(controller={"enabled": True, "advisory": True})
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.post(
            f"{stack.url}/v1/completions",
            json={"model": "sim-llama-3-8b", "prompt": "hi", "max_tokens": 4},
        )
    assert response.status_code == 200
    exported = _exported(await stack.metrics())
    named = {name for expr in _texts() for name in _METRIC.findall(expr)}
    assert named, "no metric names found in the rules and the dashboard"
    assert sorted(named - exported) == []
    recorded = set(re.findall(r"record: (\S+)", "".join(r.read_text() for r in RULES)))
    used = {name for expr in _texts() for name in _RECORDED.findall(expr)}
    assert sorted(used - recorded) == []
