"""Bad input from clients: malformed, truncated and wrongly typed JSON, invalid UTF-8,
deep nesting, huge bodies with and without a content-length, slow and stalled uploads,
odd methods, and hypothesis-generated bodies POSTed to a live router.

Whatever a client sends, it gets a well-formed answer (never an internal error, never
a dropped connection), within the request deadline, and the router is left idle.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings, strategies as st

from narwhal.serving._server import _LINGER_S

from ..serving.conftest import MODEL
from ..support import send_raw_request, wait_for
from .campaign import Campaign, StartCampaign
from .client import exchange

VALID = {"model": MODEL, "prompt": "hello there", "max_tokens": 4}
VALID_RAW = json.dumps(VALID).encode()

MALFORMED: list[bytes] = [
    b"",
    b"{",
    b"{not json",
    b'{"model": "x",}',
    b"[1, 2]",
    b"null",
    b'"a string"',
    b"12",
    b"\xff\xfe\xfd",
    b'{"prompt": "\xff"}',
    b'{"prompt": "caf\xc3"}',
    b"\xef\xbb\xbf" + VALID_RAW,  # a UTF-8 BOM
    b'{"prompt": "\\ud800", "max_tokens": 2}',  # a lone surrogate, escaped: valid JSON
    b"[" * 100_000 + b"]" * 100_000,
    b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"prompt": "x", "max_tokens": 1e999}',
    b'{"prompt": "x", "max_tokens": 99999999999999999999999999}',
    b'{"prompt": "x", "max_tokens": NaN}',
    b'{"prompt": "x", "model": "x", "model": "y"}',
    *[VALID_RAW[:cut] for cut in (1, 5, 10, 20, len(VALID_RAW) - 1)],
]
WRONG_TYPES: list[dict[str, Any]] = [
    VALID,  # the control: the campaign must not be all refusals
    {**VALID, "model": 5},
    {**VALID, "model": "no-such-model"},
    {**VALID, "prompt": {"a": 1}},
    {**VALID, "prompt": [True, False]},
    {**VALID, "prompt": ["a", "b"]},
    {**VALID, "prompt": []},
    {**VALID, "max_tokens": "5"},
    {**VALID, "max_tokens": -1},
    {**VALID, "max_tokens": True},
    {**VALID, "stream": "yes"},
    {**VALID, "stream": 1},
    {**VALID, "n": 3},
    {**VALID, "stream_options": "x"},
    {**VALID, "kv_transfer_params": "x"},
    {**VALID, "kv_transfer_params": {"do_remote_prefill": True, "remote_port": "x"}},
    {**VALID, "bootstrap_room": -1},
    {"model": MODEL, "messages": "hello", "max_tokens": 2},
    {"model": MODEL, "messages": [], "max_tokens": 2},
    {"model": MODEL, "messages": [1, 2], "max_tokens": 2},
    {"model": MODEL, "messages": [{"role": 5, "content": {"x": 1}}], "max_tokens": 2},
]


def asks_to_stream(raw: bytes) -> bool:
    try:
        document = json.loads(raw)
    except (ValueError, RecursionError):
        return False
    return isinstance(document, dict) and document.get("stream") is True


async def posted(c: Campaign, index: int, raw: bytes, **kw: Any) -> None:
    ex = await exchange(
        c.stack.url,
        raw,
        request_id=c.request_id(index),
        stream=asks_to_stream(raw),
        on_start=c.exchanges.append,
        give_up_s=c.config.serving.request_timeout_s + 10,
        **kw,
    )
    assert ex.status is not None, ex.cut
    if ex.status != 200:
        code = json.loads(ex.body)["error"]["code"]
        # A client's body is never the router's internal error.
        assert code != "internal_error", (raw[:80], ex.body)
        assert ex.status < 500 or code.startswith("engine_") or code == "expired", ex.body


async def test_malformed_and_wrongly_typed_bodies(start: StartCampaign) -> None:
    c = await start("badjson", ["prefill", "decode"])
    bodies = MALFORMED + [json.dumps(doc).encode() for doc in WRONG_TYPES]

    async def plan(i: int) -> None:
        await posted(c, i, bodies[i])

    await c.run(len(bodies), plan, concurrency=4, within_s=60)
    report = await c.check()
    report.assert_ok()
    statuses = {c.label_of(ex) for ex in c.exchanges}
    assert "ok" in statuses  # the control
    assert any(label.startswith("error:invalid") for label in statuses)


async def test_huge_bodies_with_and_without_content_length(start: StartCampaign) -> None:
    limit = 65536
    c = await start("huge", ["prefill", "decode"], serving={"max_request_bytes": limit})
    huge = json.dumps({**VALID, "prompt": "x" * (8 * limit)}).encode()

    # Declared too large: refused before a byte of the body is read.
    sock = await send_raw_request(
        c.stack.url, "/v1/completions", b"", headers={"content-length": str(10**12)}
    )
    reply = b""
    with trio.fail_after(5):
        while b"\r\n\r\n" not in reply:
            reply += await sock.receive_some(65536)
    await sock.aclose()
    assert reply.startswith(b"HTTP/1.1 413"), reply[:100]
    await wait_for(lambda: c.stack.ctx.retained == 0)
    c.outcomes_before = dict(c.stack.ctx.outcomes)  # that one is not in c.exchanges

    async def plan(i: int) -> None:
        # With a content-length, and chunked (enforced while reading); both sent in
        # pieces so the refusal can overtake the upload.
        await posted(c, i, huge, content_length=i % 2 == 0, body_pieces=64)

    await c.run(4, plan, concurrency=2, within_s=30)
    for ex in c.exchanges:
        assert ex.status == 413, (ex.status, ex.cut)
        assert json.loads(ex.body)["error"]["code"] == "request_too_large"
    report = await c.check()
    report.assert_ok()


async def test_slow_and_stalled_uploads_are_bounded_by_the_request_deadline(
    start: StartCampaign,
) -> None:
    timeout_s = 1.0
    c = await start(
        "slowbody",
        ["prefill", "decode"],
        serving={"request_timeout_s": timeout_s, "handoff_timeout_s": 0.5},
    )

    async def plan(i: int) -> None:
        if i % 2 == 0:
            # A trickle: the whole body, one piece every 0.1 s, for longer than the deadline.
            await posted(c, i, VALID_RAW, body_pieces=30, body_pause_s=0.1)
        else:
            # Half a body and then nothing: a content-length the client never honours.
            await posted(c, i, VALID_RAW, stall_body=True)

    await c.run(4, plan, concurrency=4, within_s=30)
    for ex in c.exchanges:
        # The client's slow body, not the service's: 408, named by the deadline that
        # capped serving.body_timeout_s (30 s).
        assert ex.status == 408, (ex.status, ex.cut, ex.body)
        assert json.loads(ex.body)["error"] == {
            "message": f"request body not complete within serving.request_timeout_s={timeout_s}",
            "type": "timeout_error",
            "param": None,
            "code": "body_timeout",
        }
        # The trickler reads only once a write fails: the server, which ended its side
        # with the 408, takes what it still sends for up to _LINGER_S before closing.
        assert timeout_s <= ex.duration < timeout_s + _LINGER_S + 1.0
    report = await c.check()
    report.assert_ok()


async def test_odd_methods_paths_and_non_http_bytes(start: StartCampaign) -> None:
    c = await start("odd", ["prefill", "decode"])
    host, port = c.stack.supervisor.bound[0]
    for raw in (
        b"GET /v1/completions HTTP/1.1\r\nhost: x\r\n\r\n",
        b"PUT /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: abc\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 200_000 + b"\r\n\r\n",
        b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,  # a TLS hello
    ):
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            try:
                await stream.send_all(raw)
            except trio.BrokenResourceError:
                pass
            reply = b""
            with trio.fail_after(5):
                try:
                    while chunk := await stream.receive_some(65536):
                        reply += chunk
                        if b"\r\n\r\n" in reply:
                            break
                except trio.BrokenResourceError:
                    pass
        # An HTTP error or a closed connection; never a hang, never a 2xx.
        assert reply == b"" or reply.startswith((b"HTTP/1.1 4", b"HTTP/1.0 4")), reply[:80]
    # The router still serves, and nothing is left held.
    ex = await c.send(0, c.body(stream=True))
    assert c.label_of(ex) == "ok"
    report = await c.check()
    report.assert_ok()


# ---------------------------------------------------------------------------- fuzzing

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)
request_like = st.fixed_dictionaries(
    {},
    optional={
        "model": st.one_of(st.just(MODEL), json_values),
        "prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(0, 100)), json_values),
        "messages": st.one_of(
            st.lists(
                st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=20)}),
                max_size=3,
            ),
            json_values,
        ),
        "stream": st.one_of(st.booleans(), json_values),
        "max_tokens": st.one_of(st.integers(-5, 40), json_values),
        "n": st.one_of(st.just(1), json_values),
        "stream_options": json_values,
        "kv_transfer_params": json_values,
    },
)
bodies = st.one_of(
    st.binary(max_size=300),
    request_like.map(lambda d: json.dumps(d).encode()),
    st.tuples(request_like, st.integers(0, 200)).map(lambda p: json.dumps(p[0]).encode()[: p[1]]),
)


def scale(ci: int, long: int) -> list[Any]:
    return [pytest.param(ci, id="ci"), pytest.param(long, id="long", marks=pytest.mark.slow)]


@pytest.mark.parametrize("examples", scale(60, 1500))
async def test_fuzzed_bodies_over_http(start: StartCampaign, examples: int) -> None:
    """Hypothesis generates bodies (bytes, request-shaped documents with any types,
    truncations); each is POSTed to one live router, to both endpoints and with either
    stream flag the body may carry. The examples run in a worker thread that hands each
    request back to this trio run."""
    c = await start("fuzz", ["prefill", "decode"], serving={"request_timeout_s": 3.0})
    count = 0

    async def one(raw: bytes, chat: bool) -> None:
        nonlocal count
        count += 1
        path = "/v1/chat/completions" if chat else "/v1/completions"
        await posted(c, count, raw, path=path)

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(bodies, st.booleans())
    def fuzz(raw: bytes, chat: bool) -> None:
        trio.from_thread.run(one, raw, chat)

    await trio.to_thread.run_sync(fuzz)
    assert len(c.exchanges) == count >= examples // 2
    report = await c.check()
    report.assert_ok()
