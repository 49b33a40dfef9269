"""The SGLang conformance recording (tests/conformance/recorded-sglang.json) still matches
live SGLang: a pin move that changes an answer Narwhal relies on fails here until
`tools/engines/record_conformance.py --dialect sglang` records it again (and narwhal-sim
follows).
"""

from __future__ import annotations

from ..sglang_engines import SGLangFleet
from ..test_conformance import matches_the_recording


async def test_the_recording_matches_the_live_sglang_engines(sglang: SGLangFleet) -> None:
    urls = {
        "plain": sglang["agg"].url,
        "prefill": sglang["prefill"].url,
        "decode": sglang["decode"].url,
    }
    await matches_the_recording(urls, "sglang")
