"""The README's quick start B, as a person with only the README runs it: in a fresh clone,
the script block as written, with the model line pointing at the tier's tiny model.

It installs Narwhal into the clone's own .venv (from the package registry, as CI can),
reuses the engines' venv the test command made (the script's own `vllm-venv.sh` call
checks it and returns), starts a real vLLM P/D pair on 8100/8101, then validates,
profiles, checks and serves, and sends one completion through Narwhal.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

from ...docs.test_quick_start import quick_start
from ..engines import ROOT, build_model, engine_env

LOG_TAIL = 6000


def _script(model: Path) -> str:
    script = quick_start("b")
    placeholder = re.compile(r"^MODEL=/path/to/model\b.*$", re.MULTILINE)
    assert len(placeholder.findall(script)) == 1, "the script's model line changed"
    return placeholder.sub(f"MODEL={model}", script)


def test_quick_start_b_serves_a_completion_through_a_real_vllm_pair(tmp_path: Path) -> None:
    model = build_model(tmp_path / "model")
    clone = tmp_path / "narwhal"
    subprocess.run(
        ["git", "clone", "--quiet", "--local", str(ROOT), str(clone)], check=True, timeout=120
    )
    script = clone / "quick-start-b.sh"
    script.write_text(_script(model))
    # The engines' environment (offline, no usage stats) without the test run's own venv.
    env = engine_env()
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = os.pathsep.join(
        p for p in env["PATH"].split(os.pathsep) if not p.startswith(str(ROOT))
    )
    process = subprocess.Popen(
        ["bash", str(script)],
        cwd=clone,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the engines' own children go with the group at the end
    )
    try:
        output, _ = process.communicate(timeout=1500)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    logs = "".join(
        f"\n--- {log.name} ---\n{log.read_text(errors='replace')[-LOG_TAIL:]}"
        for log in sorted((clone / "runs").glob("*.log"))
    )
    assert process.returncode == 0, output[-LOG_TAIL:] + logs

    # The one curl: a completion of the pair, through Narwhal.
    answers = [json.loads(line) for line in output.splitlines() if line.startswith('{"id":')]
    assert len(answers) == 1, output[-LOG_TAIL:]
    assert answers[0]["model"] == "tiny-llama", answers
    assert answers[0]["usage"]["completion_tokens"] >= 1, answers
    # `narwhalctl state`: both engines in their roles, available, nothing in flight.
    table = output[output.rindex("\nENGINE ") + 1 :].splitlines()
    rows = {line.split()[0]: line.split()[1:5] for line in table[1:3]}
    assert rows == {
        "p0": ["prefill", "yes", "closed/closed", "up"],
        "d0": ["decode", "yes", "closed/closed", "up"],
    }, "\n".join(table)
    assert "degraded: no" in output, output[-LOG_TAIL:]
