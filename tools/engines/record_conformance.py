"""Record real engines' answers to the conformance corpus (tests/conformance/recorded*.json).

Run it when an engine pin moves (tools/engines/vllm-constraints.txt or
sglang-constraints.txt), then commit the new recording and make narwhal-sim follow it:

    .venv/bin/python tools/engines/record_conformance.py                   # vLLM, own engines
    .venv/bin/python tools/engines/record_conformance.py --dialect sglang
    NARWHAL_REAL_FLEET=/tmp/real-fleet.json .venv/bin/python tools/engines/record_conformance.py

Without a state file (--fleet, or NARWHAL_REAL_FLEET / NARWHAL_SGLANG_FLEET) it launches the
three engines the corpus needs (vLLM: an aggregate engine and a NixlConnector pair, ~10 GB;
SGLang: an aggregate engine and a Mooncake pair, ~5 GB) from the engines' venv and stops them
at the end. `--check` compares the live answers with the recording instead of writing it,
and exits 1 listing the differences.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import httpx
import trio

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.conformance.harness import (  # noqa: E402
    DIALECTS,
    RECORDED,
    compare,
    engine_version,
    load_corpus,
    load_recorded,
    run_corpus,
)
from tests.real.engines import real_fleet  # noqa: E402
from tests.real.sglang_engines import sglang_fleet  # noqa: E402

# The corpus' engine names -> each family's fleet's.
FLEET_NAMES = {
    "vllm": {"plain": "agg0", "prefill": "prefill", "decode": "decode"},
    "sglang": {"plain": "agg", "prefill": "prefill", "decode": "decode"},
}


@contextmanager
def engine_urls(dialect: str, state: str | None) -> Iterator[dict[str, str]]:
    """The corpus' engine names -> URLs, of the fleet in `state` or of one launched here."""
    names = FLEET_NAMES[dialect]
    directory = None
    if not state:
        directory = Path(tempfile.mkdtemp(prefix=f"nw-conformance-{dialect}-"))
        print(f"launching {', '.join(names.values())} in {directory} ...", flush=True)
    if dialect == "vllm":
        fleet_cm = real_fleet(directory, list(names.values()), state=state)
    else:
        fleet_cm = sglang_fleet(directory, state=state)
    with fleet_cm as fleet:
        yield {case_engine: fleet[name].url for case_engine, name in names.items()}


async def record(urls: Mapping[str, str], dialect: str) -> dict[str, object]:
    corpus = load_corpus()
    async with httpx.AsyncClient() as client:
        version = await engine_version(client, urls["plain"], dialect)
        answers = await run_corpus(client, urls, corpus, dialect=dialect)
    return {
        "about": f"Real {dialect}'s answers to tests/conformance/corpus.json, normalised "
        "(tests/conformance/harness.py); written by tools/engines/record_conformance.py.",
        f"{dialect}_version": version,
        "answers": answers,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dialect", choices=DIALECTS, default="vllm", help="engine family")
    parser.add_argument("--fleet", help="state file of a running fleet of that family")
    parser.add_argument("--out", help="where to write the recording (default: the family's)")
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else RECORDED[args.dialect]
    key = f"{args.dialect}_version"
    with engine_urls(args.dialect, args.fleet) as urls:
        recording = trio.run(partial(record, urls, args.dialect))
    answers = recording["answers"]
    assert isinstance(answers, dict)
    if args.check:
        recorded = load_recorded(out)
        lines = []
        if recorded[key] != recording[key]:
            lines.append(
                f"{args.dialect} {recording[key]} answers; the recording is of {recorded[key]}"
            )
        lines += compare(recorded["answers"], answers)
        for line in lines:
            print(line)
        return 1 if lines else 0
    out.write_text(json.dumps(recording, indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(answers)} answers of {args.dialect} {recording[key]} in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
