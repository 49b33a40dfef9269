"""Fuzzing the SSE scanner the relay depends on (tests/engines/test_wire.py covers one
well-formed stream cut at random places; this covers arbitrary bytes).

Properties, for any byte stream and any way of cutting it into transport chunks:
- the scanner never raises, except SseOverflow past its pending limit;
- relay is lossless and verbatim: the raw events plus what is pending are the input;
- the events do not depend on the chunking;
- DONE is exactly a data payload of `[DONE]`; ERROR carries the engine's error fields.
"""

from __future__ import annotations

import itertools
import json

from hypothesis import given, settings, strategies as st

from narwhal.engines import SseKind, SseScanner

PIECES = st.sampled_from(
    [
        b"data: ",
        b"data:",
        b"\n",
        b"\r\n",
        b"\n\n",
        b"\r\n\r\n",
        b"[DONE]",
        b": ping",
        b"event: x",
        b'{"error": {"message": "boom"}}',
        b'{"error": "flat"}',
        b'{"choices": [{"text": "a"}]}',
        b"\xff",
        b" ",
    ]
)
STREAMS = st.one_of(
    st.binary(max_size=400),
    st.lists(PIECES, max_size=40).map(b"".join),
)


def scan(data: bytes, cuts: list[int]) -> tuple[list[tuple[SseKind, bytes, bytes]], int]:
    scanner = SseScanner()
    bounds = [0, *sorted({c % (len(data) + 1) for c in cuts}), len(data)]
    events = []
    for start, end in itertools.pairwise(bounds):
        events.extend(scanner.feed(data[start:end]))
    return [(e.kind, e.payload, e.raw) for e in events], scanner.pending


@settings(max_examples=400)
@given(STREAMS, st.lists(st.integers(min_value=0, max_value=400), max_size=10))
def test_scanner_on_arbitrary_bytes(data: bytes, cuts: list[int]) -> None:
    events, pending = scan(data, cuts)
    whole, whole_pending = scan(data, [])
    assert events == whole
    assert pending == whole_pending
    assert b"".join(raw for _, _, raw in events) + data[len(data) - pending :] == data
    for kind, payload, raw in events:
        assert raw.endswith((b"\n\n", b"\r\n\r\n"))
        if kind is SseKind.DONE:
            assert payload.strip() == b"[DONE]"
        if kind is SseKind.ERROR:
            document = json.loads(payload)
            assert isinstance(document, dict)
            assert "error" in document


@given(st.integers(min_value=1, max_value=8))
def test_an_event_without_end_is_refused_past_the_limit(chunks: int) -> None:
    from narwhal.engines._sse import SseOverflow

    scanner = SseScanner()
    block = b"x" * (1024 * 1024)
    raised = False
    try:
        scanner.feed(b"data: ")
        for _ in range(chunks):
            scanner.feed(block)
    except SseOverflow:
        raised = True
    assert raised == (chunks * len(block) + 6 > 4 * 1024 * 1024)
