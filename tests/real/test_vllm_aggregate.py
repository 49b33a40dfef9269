"""An aggregate fleet (role both, no KV connector) is profiled, checked and served with
predictive admission, the default.

Such an engine answers the router's prefill leg with `kv_transfer_params: null`: it can
hand no KV over. narwhal-profile measured crossed handoffs on every pair all the same and
failed on the first ("returned no kv_transfer_params"), so nothing was written and the
daemon's default admission refused to start.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from narwhal.cli import check as check_cli, profile as profile_cli
from narwhal.config import load_config
from narwhal.probe import CheckPlan, SweepPlan
from narwhal.profiles import read_store

from .conftest import MODEL, aggregate_config, narwhal_in_front
from .engines import RealFleet

# About 60 tokens: inside every measured region of the fast sweep.
PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    return len(argv)\n" * 2


async def test_an_aggregate_fleet_is_profiled_checked_and_served_predictively(
    vllm: RealFleet, tmp_path: Path
) -> None:
    store_path = tmp_path / "profiles.json"
    document = aggregate_config(
        vllm,
        serving={"admission": "predictive"},
        profiles={"path": str(store_path)},
        # A shared 2-core box: the test is whether requests are priced, not how fast.
        slo={"ttft_s": 30.0},
    )
    config = load_config(document)
    # narwhal-profile --fast: the engines are measured one after the other.
    plan = attrs.evolve(SweepPlan.fast(), budget_s=240.0)
    with trio.fail_after(300):
        assert await profile_cli.run(config, plan, str(store_path), quiet=True) == 0
    store, problems = read_store(store_path)
    assert store is not None, problems
    # Each engine's prefill and decode were measured on itself.
    assert {e: p.kv_connector for e, p in store.engines.items()} == {
        "agg0": "none",
        "agg1": "none",
    }
    assert {e: (p.prefill.points > 0, p.decode.points > 0) for e, p in store.engines.items()} == {
        "agg0": (True, True),
        "agg1": (True, True),
    }
    assert dict(store.handoffs) == {}

    report = tmp_path / "check.json"
    with trio.fail_after(300):
        code = await check_cli.run(
            config, CheckPlan(), record=False, json_path=str(report), quiet=True
        )
    rows: dict[tuple[str, str], dict[str, Any]] = {
        (row["check"], row["target"]): row for row in json.loads(report.read_text())["rows"]
    }
    assert code == 0, rows
    for engine in ("agg0", "agg1"):
        for check in ("handoff", "lease", "handoff-wait"):
            row = rows[(check, engine)]
            assert (row["status"], row["measured"]) == ("skip", "n/a: no KV connector"), row
            assert "kv_transfer_params: null" in row["note"]
        assert rows[("health", engine)]["status"] == "pass"
        assert rows[("profile", engine)]["status"] in ("pass", "warn")  # a busy box fits poorly
    first = rows[("first-token", "fleet")]
    assert (first["status"], first["measured"]) == ("skip", "n/a: no KV connector")

    async with narwhal_in_front(document) as stack, httpx.AsyncClient(timeout=120) as client:
        state = await stack.state()
        assert state["profiles"]["usable_engines"] == ["agg0", "agg1"]
        assert state["profiles"]["problems"] == []
        for stream in (False, True):
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": stream}
            with trio.fail_after(120):
                answer = await client.post(f"{stack.url}/v1/completions", json=body)
            assert answer.status_code == 200, answer.text
        with trio.fail_after(30):
            metrics = (await client.get(f"{stack.admin_url}/metrics")).text
    # The streamed request's first token was compared with its admission's projection.
    (count,) = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("narwhal_ttft_prediction_error_ratio_count")
    ]
    assert count >= 1
