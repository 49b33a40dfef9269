"""The conformance recording (tests/conformance/recorded.json) still matches live vLLM.

The fast tier checks narwhal-sim against the recording; this checks the recording against
the engines, so a vLLM pin move that changes an answer Narwhal relies on fails here until
tools/engines/record_conformance.py records it again (and the simulator follows).
"""

from __future__ import annotations

import httpx

from ..conformance.harness import compare, load_corpus, load_recorded, run_corpus
from .engines import RealFleet


async def test_the_recording_matches_the_live_engines(vllm: RealFleet) -> None:
    recorded = load_recorded()
    urls = {"plain": vllm["agg0"].url, "prefill": vllm["prefill"].url, "decode": vllm["decode"].url}
    async with httpx.AsyncClient() as client:
        version = (await client.get(urls["plain"] + "/version")).json()["version"]
        assert version == recorded["vllm_version"], (
            f"the engines run vLLM {version}, the recording is of {recorded['vllm_version']}: "
            "run tools/engines/record_conformance.py and make narwhal-sim follow"
        )
        answers = await run_corpus(client, urls, load_corpus())
    assert compare(recorded["answers"], answers) == []
