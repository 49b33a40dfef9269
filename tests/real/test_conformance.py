"""The conformance recording (tests/conformance/recorded.json) still matches live vLLM
(tests/real/sglang/test_conformance.py: the SGLang one).

The fast tier checks narwhal-sim against the recording; this checks the recording against
the engines, so a vLLM pin move that changes an answer Narwhal relies on fails here until
tools/engines/record_conformance.py records it again (and the simulator follows).
"""

from __future__ import annotations

from collections.abc import Mapping

import httpx

from ..conformance.harness import (
    RECORDED,
    compare,
    engine_version,
    load_corpus,
    load_recorded,
    run_corpus,
)
from .engines import RealFleet


async def matches_the_recording(urls: Mapping[str, str], dialect: str) -> None:
    recorded = load_recorded(RECORDED[dialect])
    async with httpx.AsyncClient() as client:
        version = await engine_version(client, urls["plain"], dialect)
        assert version == recorded[f"{dialect}_version"], (
            f"the engines run {dialect} {version}, the recording is of "
            f"{recorded[f'{dialect}_version']}: run tools/engines/record_conformance.py "
            f"--dialect {dialect} and make narwhal-sim follow"
        )
        answers = await run_corpus(client, urls, load_corpus(), dialect=dialect)
    assert compare(recorded["answers"], answers) == []


async def test_the_recording_matches_the_live_engines(vllm: RealFleet) -> None:
    urls = {"plain": vllm["agg0"].url, "prefill": vllm["prefill"].url, "decode": vllm["decode"].url}
    await matches_the_recording(urls, "vllm")
