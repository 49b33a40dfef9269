"""narwhal-sim answers the conformance corpus as real vLLM did (tests/conformance/recorded.json).

No vLLM runs here: the recording is of the pinned vLLM, and the simulator plays the build
the recording names. A difference is a behaviour Narwhal relies on that the simulator
gets wrong (or a pin move the simulator has not followed).
"""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path

import attrs
import httpx
import trio

from narwhal.sim import VLLM_BUILDS, SimEngineSpec, SimTiming, serve_fleet

from .harness import (
    NARWHAL_METRICS,
    compare,
    load_corpus,
    load_recorded,
    run_corpus,
)

ROOT = Path(__file__).resolve().parents[2]


async def sim_answers(nursery: trio.Nursery, vllm_version: str) -> dict[str, object]:
    corpus = load_corpus()
    timing = attrs.evolve(SimTiming.zero(), max_model_len=corpus.max_model_len)
    fleet = await nursery.start(
        partial(
            serve_fleet,
            engines=3,
            spec=SimEngineSpec(stock_version=True),
            model=corpus.model,
            timing=timing,
            vllm_version=vllm_version,
            kv_connectors=[False, True, True],
        )
    )
    urls = {"plain": fleet[0].url, "prefill": fleet[1].url, "decode": fleet[2].url}
    async with httpx.AsyncClient() as client:
        return await run_corpus(client, urls, corpus)


async def test_the_simulator_answers_the_corpus_as_vllm_did(nursery: trio.Nursery) -> None:
    recorded = load_recorded()
    version = recorded["vllm_version"]
    assert version in VLLM_BUILDS, (
        f"the recording is of vLLM {version}, which narwhal-sim has no build of "
        f"(it has {', '.join(VLLM_BUILDS)}): add one in narwhal/sim/_vllm.py"
    )
    answers = await sim_answers(nursery, version)
    assert compare(recorded["answers"], answers) == []


def test_the_corpus_checks_every_metric_name_narwhal_reads() -> None:
    read: set[str] = set()
    for path in (ROOT / "narwhal").rglob("*.py"):
        if "sim" in path.relative_to(ROOT / "narwhal").parts:
            continue
        read.update(re.findall(r'"(vllm:[a-z_]+|process_start_time_seconds)"', path.read_text()))
    assert read, "no metric names found in narwhal/: has the pattern gone stale?"
    assert read <= set(NARWHAL_METRICS), sorted(read - set(NARWHAL_METRICS))
