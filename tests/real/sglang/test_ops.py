"""Operating Narwhal in front of real SGLang: profile and check the Mooncake pair with the
real commands (`narwhal-profile --fast`, `narwhal-check`), as an operator runs them, then
serve it with predictive admission on the measured profile."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import trio

from ...support import post_stream
from ..client import post_json, sse_events, unique_text
from ..conftest import MODEL, narwhal_in_front
from ..sglang_engines import SGLangFleet
from .conftest import pair_config

# A small sweep: the point is that the commands work on real engines, not a precise fit
# (this shared 2-core box fits poorly, which warns, not fails).
PROFILE_ARGS = [
    "--fast",
    "--prefill-sizes",
    "16,256,1024",
    "--prefill-repeats",
    "2",
    "--decode-active",
    "1,4",
    "--decode-contexts",
    "128",
    "--handoff-sizes",
    "64,512",
    "--handoff-repeats",
    "1",
    "--quiet",
]
CHECK_ARGS = ["--handoff-samples", "1", "--handoff-sizes", "64", "--quiet"]
# Targets this CPU box can meet.
SLO = {"ttft_s": 20.0, "tpot_s": 2.0}


async def run_command(module: str, *args: str) -> tuple[int, str, str]:
    result = await trio.run_process(
        [sys.executable, "-m", module, *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


async def test_profile_and_check_the_pair_then_serve_it_with_predictive_admission(
    sglang: SGLangFleet, tmp_path: Path
) -> None:
    store = tmp_path / "profiles.json"
    document = pair_config(
        sglang,
        profiles={"path": str(store)},
        serving={"admission": "predictive"},
        slo=SLO,
    )
    config = tmp_path / "narwhal.json"
    config.write_text(json.dumps(document))

    with trio.fail_after(300):
        code, out, err = await run_command(
            "narwhal.cli.profile", "--config", str(config), *PROFILE_ARGS
        )
    assert code == 0, err
    assert out.startswith(f"wrote {store}: 2 engine profile(s), 1 handoff pair(s) in "), out
    profiles = json.loads(store.read_text())
    assert sorted(profiles["engines"]) == ["decode", "prefill"]

    report = tmp_path / "check.json"
    with trio.fail_after(300):
        code, out, err = await run_command(
            "narwhal.cli.check", "--config", str(config), "--json", str(report), *CHECK_ARGS
        )
    rows = {(row["check"], row["target"]): row for row in json.loads(report.read_text())["rows"]}
    failed = [row for row in rows.values() if row["status"] == "fail"]
    assert (code, failed) == (0, []), out + err
    for check, target in [
        ("launch-mode", "prefill"),
        ("launch-mode", "decode"),
        ("metrics", "decode"),
        ("handoff", "prefill -> decode"),
    ]:
        assert rows[(check, target)]["status"] == "pass", rows[(check, target)]
    for engine in ("prefill", "decode"):
        # A busy box fits the profile poorly, which warns.
        assert rows[("profile", engine)]["status"] in ("pass", "warn"), rows

    async with (
        narwhal_in_front(document) as stack,
        httpx.AsyncClient(timeout=120.0) as client,
    ):
        state = await stack.state()
        assert state["admission"]["mode"] == "predictive"
        assert state["admission"]["profiles_loaded"] is True
        body = {"model": MODEL, "prompt": unique_text(40), "max_tokens": 6, "ignore_eos": True}
        got = await post_json(client, f"{stack.url}/v1/completions", body)
        assert got["usage"]["completion_tokens"] == 6
        streamed = {
            **body,
            "prompt": unique_text(40),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        status, _, raw = await post_stream(client, f"{stack.url}/v1/completions", streamed)
        assert status == 200, raw
        assert sse_events(raw)[-1]["usage"]["completion_tokens"] == 6
        outcomes = (await stack.state())["requests"]["outcomes"]
    assert outcomes == {"ok": 2}, outcomes
