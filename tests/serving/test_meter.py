"""The stream meter's decisions, read by read, without sockets or a clock."""

from __future__ import annotations

import json

import pytest

from narwhal.serving._failure import FailureKind
from narwhal.serving._meter import MAX_GAPS, StreamMeter

ROLE = b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


def token(text: str = "a") -> bytes:
    return b"data: " + json.dumps({"choices": [{"text": text}]}).encode() + b"\n\n"


def usage(completion_tokens: int) -> bytes:
    chunk = {"choices": [], "usage": {"completion_tokens": completion_tokens}}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def meter(*, limit: int = 1 << 20, own_usage: bool = False) -> StreamMeter:
    return StreamMeter(limit=limit, own_usage=own_usage)


def test_events_before_the_first_token_go_out_with_it() -> None:
    m = meter()
    step = m.feed(ROLE, 1.0, release=True)
    assert (step.send, step.first, step.tokens) == (None, False, 0)
    assert m.held
    step = m.feed(token(), 1.5, release=True)
    assert step.send == ROLE + token()
    assert step.first
    assert step.tokens == 1
    assert m.first_at == 1.5
    assert m.take_held() == b""


def test_nothing_is_sent_until_output_is_released() -> None:
    # An SGLang pair's decode stream, while its prefill leg has not answered.
    m = meter()
    assert m.feed(ROLE + token("a"), 1.0, release=False).send is None
    step = m.feed(token("b"), 2.0, release=False)
    assert step.send is None
    assert step.tokens == 1
    assert m.feed(token("c"), 3.0, release=True).send == ROLE + token("a") + token("b") + token("c")
    m.feed(token("d") + DONE, 4.0, release=False)
    assert m.done
    assert m.take_held() == token("d") + DONE
    assert not m.held


def test_a_reads_tokens_share_the_time_since_the_last_read() -> None:
    m = meter()
    m.feed(token(), 1.0, release=True)
    step = m.feed(token() * 4, 3.0, release=True)
    assert (step.tokens, step.gaps) == (4, 4)
    assert m.gaps == [0.5] * 4
    assert m.tokens == 5
    assert m.last_at == 3.0
    assert m.tpot_s(m.tokens) == pytest.approx(0.5)


def test_gaps_are_bounded_per_stream() -> None:
    m = meter()
    m.feed(token(), 0.0, release=True)
    for i in range(MAX_GAPS + 10):
        m.feed(token(), float(i + 1), release=True)
    assert len(m.gaps) == MAX_GAPS
    assert m.tokens == MAX_GAPS + 11


def test_the_routers_own_usage_chunk_is_dropped_and_the_clients_is_relayed() -> None:
    mine = meter(own_usage=True)
    mine.feed(token(), 1.0, release=True)
    step = mine.feed(usage(7) + DONE, 2.0, release=True)
    assert step.send == DONE
    assert step.tokens == 0
    assert mine.reported == 7
    assert mine.done
    theirs = meter(own_usage=False)
    theirs.feed(token(), 1.0, release=True)
    assert theirs.feed(usage(7) + DONE, 2.0, release=True).send == usage(7) + DONE
    assert theirs.reported == 7


def test_the_usage_report_rescales_events_to_tokens() -> None:
    m = meter()
    m.feed(token(), 0.0, release=True)
    m.feed(token() * 2, 1.0, release=True)  # 3 events for 7 tokens: 2 tokens per event
    m.feed(usage(7) + DONE, 1.0, release=True)
    generated, gaps = m.outcome(n=1)
    assert generated == 7
    assert gaps == pytest.approx([0.5 * 2 / 6] * 2)
    # n sequences interleave: no intervals, and each made a share.
    assert m.outcome(n=2) == (3, [])


def test_events_after_done_are_ignored() -> None:
    m = meter()
    step = m.feed(token() + DONE + token("late"), 1.0, release=True)
    assert step.send == token() + DONE
    assert step.tokens == 1
    assert m.done


def test_an_error_event_fails_the_stream_before_what_it_follows_is_sent() -> None:
    m = meter()
    error = b'data: {"error": {"message": "boom", "code": 500}}\n\n'
    step = m.feed(token() + error, 1.0, release=True)
    assert step.send is None
    assert step.first
    assert step.tokens == 0
    assert step.fault is not None
    assert step.fault.event is not None
    assert step.fault.event.error == {"message": "boom", "code": 500}


def test_held_output_is_bounded() -> None:
    m = meter(limit=len(ROLE) + 4)
    assert m.feed(ROLE, 1.0, release=True).fault is None
    step = m.feed(b"data: {", 1.0, release=True)  # a partial line counts too
    assert step.fault is not None
    assert step.fault.kind is FailureKind.HELD_TOO_LARGE
    assert "serving.max_response_bytes" in step.fault.detail


def test_an_event_over_the_scanners_bound_is_a_bad_stream() -> None:
    step = meter().feed(b"data: " + b"x" * (4 * 1024 * 1024 + 1), 1.0, release=True)
    assert step.fault is not None
    assert step.fault.kind is FailureKind.BAD_STREAM
