"""narwhal-sim answers the conformance corpus as the real engines did (tests/conformance/
recorded.json for vLLM, recorded-sglang.json for SGLang).

No engine runs here: each recording is of the pinned engine, and the simulator plays the
build the recording names. A difference is a behaviour Narwhal relies on that the simulator
gets wrong (or a pin move the simulator has not followed).
"""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from narwhal.sim import ENGINE_VERSION, VLLM_BUILDS, SimEngineSpec, SimTiming, serve_fleet

from .harness import (
    DIALECTS,
    NARWHAL_METRICS,
    RECORDED,
    compare,
    load_corpus,
    load_recorded,
    run_corpus,
)

ROOT = Path(__file__).resolve().parents[2]


async def sim_answers(nursery: trio.Nursery, dialect: str, version: str) -> dict[str, object]:
    corpus = load_corpus()
    timing = attrs.evolve(SimTiming.zero(), max_model_len=corpus.max_model_len)
    serve = partial(
        serve_fleet,
        engines=3,
        spec=SimEngineSpec(stock_version=True),
        model=corpus.model,
        timing=timing,
    )
    if dialect == "vllm":
        serve = partial(serve, vllm_version=version, kv_connectors=[False, True, True])
    else:
        serve = partial(serve, dialect="sglang", disaggregation_modes=["null", "prefill", "decode"])
    fleet = await nursery.start(serve)
    urls = {"plain": fleet[0].url, "prefill": fleet[1].url, "decode": fleet[2].url}
    async with httpx.AsyncClient() as client:
        return await run_corpus(client, urls, corpus, dialect=dialect)


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_the_simulator_answers_the_corpus_as_the_engine_did(
    nursery: trio.Nursery, dialect: str
) -> None:
    recorded = load_recorded(RECORDED[dialect])
    version = recorded[f"{dialect}_version"]
    plays = tuple(VLLM_BUILDS) if dialect == "vllm" else (ENGINE_VERSION["sglang"],)
    assert version in plays, (
        f"the recording is of {dialect} {version}, which narwhal-sim does not play "
        f"(it plays {', '.join(plays)}): make it follow (narwhal/sim)"
    )
    answers = await sim_answers(nursery, dialect, version)
    assert compare(recorded["answers"], answers) == []


def test_the_corpus_checks_every_metric_name_narwhal_reads() -> None:
    read: set[str] = set()
    for path in (ROOT / "narwhal").rglob("*.py"):
        if "sim" in path.relative_to(ROOT / "narwhal").parts:
            continue
        read.update(
            re.findall(r'"((?:vllm|sglang):[a-z_]+|process_start_time_seconds)"', path.read_text())
        )
    assert read, "no metric names found in narwhal/: has the pattern gone stale?"
    checked = {name for names in NARWHAL_METRICS.values() for name in names}
    assert read <= checked, sorted(read - checked)
