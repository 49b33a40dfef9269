"""Record real vLLM's answers to the conformance corpus (tests/conformance/recorded.json).

Run it when the vLLM pin moves (tools/engines/vllm-constraints.txt), then commit the new
recording and make narwhal-sim follow it (a build in narwhal/sim/_vllm.py):

    .venv/bin/python tools/engines/record_conformance.py             # own engines
    NARWHAL_REAL_FLEET=/tmp/real-fleet.json .venv/bin/python tools/engines/record_conformance.py

Without NARWHAL_REAL_FLEET (or --fleet) it launches the three engines the corpus needs
(an aggregate one and a NixlConnector pair, ~10 GB, minutes) from the engines' venv and
stops them at the end. `--check` compares the live answers with the recording instead of
writing it, and exits 1 listing the differences.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import httpx
import trio

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.conformance.harness import (  # noqa: E402
    RECORDED,
    compare,
    load_corpus,
    load_recorded,
    run_corpus,
)
from tests.real.engines import RealFleet  # noqa: E402

# The corpus' engine names -> the real fleet's.
FLEET_NAMES = {"plain": "agg0", "prefill": "prefill", "decode": "decode"}


async def record(urls: dict[str, str]) -> dict[str, object]:
    corpus = load_corpus()
    async with httpx.AsyncClient() as client:
        version = (await client.get(urls["plain"] + "/version")).json()["version"]
        answers = await run_corpus(client, urls, corpus)
    return {
        "about": "Real vLLM's answers to tests/conformance/corpus.json, normalised "
        "(tests/conformance/harness.py); written by tools/engines/record_conformance.py.",
        "vllm_version": version,
        "answers": answers,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fleet", help="state file of a running fleet (NARWHAL_REAL_FLEET)")
    parser.add_argument("--out", default=str(RECORDED), help="where to write the recording")
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    state = args.fleet or os.environ.get("NARWHAL_REAL_FLEET")
    own: RealFleet | None = None
    if state:
        fleet = RealFleet.attach(Path(state))
        fleet.wait_ready()
    else:
        directory = Path(tempfile.mkdtemp(prefix="nw-conformance-"))
        print(f"launching agg0, prefill, decode in {directory} ...", flush=True)
        fleet = own = RealFleet.launch(directory, list(FLEET_NAMES.values()))
    try:
        urls = {case_engine: fleet[name].url for case_engine, name in FLEET_NAMES.items()}
        recording = trio.run(partial(record, urls))
    finally:
        if own is not None:
            own.stop()
    if args.check:
        recorded = load_recorded(Path(args.out))
        lines = []
        if recorded["vllm_version"] != recording["vllm_version"]:
            lines.append(
                f"vLLM {recording['vllm_version']} answers; the recording is of "
                f"{recorded['vllm_version']}"
            )
        answers = recording["answers"]
        assert isinstance(answers, dict)
        lines += compare(recorded["answers"], answers)
        for line in lines:
            print(line)
        return 1 if lines else 0
    Path(args.out).write_text(json.dumps(recording, indent=1, sort_keys=True) + "\n")
    answers = recording["answers"]
    assert isinstance(answers, dict)
    print(f"recorded {len(answers)} answers of vLLM {recording['vllm_version']} in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
