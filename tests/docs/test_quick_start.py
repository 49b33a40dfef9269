"""The README's quick starts agree with the configs they run.

Quick start B is a script (a real-engine test runs it with `MODEL` replaced): the fenced
bash block whose first line is `# quick-start-b`. Here it is only parsed and held against
conf/vllm-pd.json; quick start A against conf/demo.json. `quick_start("b")` is what a
test that runs the script reads.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from narwhal.config import load_config

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"

_BLOCK = re.compile(r"^```bash\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def quick_start(which: str) -> str:
    """Quick start B's script (`which="b"`), or quick start A's commands (`"a"`)."""
    blocks = _BLOCK.findall(README.read_text(encoding="utf-8"))
    if which == "b":
        found = [b for b in blocks if b.startswith("# quick-start-b\n")]
    else:
        found = [b for b in blocks if "narwhal-sim" in b and "conf/demo.json" in b]
    assert len(found) == 1, f"README.md has {len(found)} quick start {which} blocks"
    return str(found[0])


def _config(script: str) -> tuple[Path, dict[str, Any]]:
    paths = set(re.findall(r"--config (\S+)", script))
    assert len(paths) == 1, f"one config throughout, not {sorted(paths)}"
    path = REPO / paths.pop()
    return path, json.loads(path.read_text())


def _ports(document: dict[str, Any]) -> list[int]:
    return [urlsplit(engine["url"]).port or 80 for engine in document["engines"]]


def test_quick_start_b_is_one_bash_script() -> None:
    script = quick_start("b")
    assert script.splitlines()[1] == "set -euo pipefail"
    checked = subprocess.run(
        ["bash", "-n"], input=script, text=True, capture_output=True, check=False
    )
    assert checked.returncode == 0, checked.stderr
    assert "MODEL=/path/to/model" in script  # the one line a reader replaces


def test_quick_start_b_launches_the_engines_its_config_routes_to() -> None:
    script = quick_start("b")
    path, document = _config(script)
    assert path == REPO / "conf" / "vllm-pd.json"
    launched = [int(port) for port in re.findall(r"api_server .*?--port (\d+)", script, re.DOTALL)]
    assert launched == _ports(document)
    assert set(re.findall(r"--served-model-name (\S+)", script)) == {
        engine["model"] for engine in document["engines"]
    }
    roles = {engine["role"] for engine in document["engines"]}
    assert roles == {"prefill", "decode"}
    # Every engine the controller may move is launched kv_both, as the config says.
    assert {engine.get("kv_role") for engine in document["engines"]} == {"kv_both"}
    assert '"kv_role":"kv_both"' in script
    listen = f"http://{document['listen']['host']}:{document['listen']['port']}"
    assert f"{listen}/v1/completions" in script
    assert f"{listen}/health" in script


def test_quick_start_b_goes_validate_profile_check_serve_curl_state() -> None:
    script = quick_start("b")
    commands = [
        line.split()[0]
        for line in script.splitlines()
        if line.split() and line.split()[0] in {"narwhal", "narwhal-profile", "narwhal-check"}
    ]
    assert commands == ["narwhal", "narwhal-profile", "narwhal-check", "narwhal"]
    order = ["narwhal validate", "narwhal-profile", "narwhal-check", "narwhal serve", "curl -sS"]
    at = [script.index(step) for step in [*order, "narwhalctl --config"]]
    assert at == sorted(at)


def test_quick_start_a_serves_the_demo_fleet() -> None:
    script = quick_start("a")
    path, document = _config(script)
    assert path == REPO / "conf" / "demo.json"
    sim = shlex.split(next(line for line in script.splitlines() if "narwhal-sim" in line))
    first = int(sim[sim.index("--port") + 1])
    count = int(sim[sim.index("--engines") + 1])
    assert _ports(document) == list(range(first, first + count))
    model = sim[sim.index("--model") + 1]
    assert {engine["model"] for engine in document["engines"]} == {model}
    assert f'"model": "{model}"' in script
    drained = re.search(r"drain (\w+)", script)
    assert drained is not None
    assert drained.group(1) in {engine["id"] for engine in document["engines"]}


@pytest.mark.parametrize("which", ["a", "b"])
def test_the_commands_a_quick_start_runs_are_installed(which: str) -> None:
    script = quick_start(which)
    pyproject = (REPO / "pyproject.toml").read_text()
    for command in ("narwhal", "narwhalctl", "narwhal-sim", "narwhal-profile", "narwhal-check"):
        if re.search(rf"(?<![\w-]){re.escape(command)} ", script):
            assert re.search(rf'^{re.escape(command)} = "', pyproject, re.MULTILINE), command


def _json_blocks(page: Path) -> list[object]:
    text = page.read_text(encoding="utf-8")
    return [
        json.loads(block)
        for block in re.findall(r"^```json\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)
    ]


@pytest.mark.parametrize(
    "page", [README, *sorted((REPO / "docs").glob("*.md"))], ids=lambda p: p.name
)
def test_every_config_shown_in_the_docs_loads(page: Path) -> None:
    for document in _json_blocks(page):
        if isinstance(document, dict) and "engines" in document:
            load_config(document, source=page.name, api_keys=False)


def test_the_vllm_guide_shows_conf_vllm_pd_json_as_it_is() -> None:
    shown = _json_blocks(REPO / "docs" / "getting-started-vllm.md")
    assert shown == [json.loads((REPO / "conf" / "vllm-pd.json").read_text())]
