"""A hostile engine (hostile.py) on either side of a P/D pair: whatever it sends, the
client gets a success or a well-formed error within its deadline that names neither the
engine nor its address, the router hangs up on every leg it gives up on, and nothing
stays held. And hostile clients: without the API key (or with a wrong one, in every
shape) they get 401 and no engine work, and the admin surface is not on their port.
Then clients that use HTTP/1.1's corners (RFC 9112), and reloads that meet a file that
is not one, against a live router under load: the same promises hold."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from narwhal.config import config_to_dict

from ..support import fifo, wait_for
from . import hostile as h
from .campaign import Campaign, StartCampaign, start_beside_hostile
from .client import Exchange, is_error_event

TIMEOUT_S = 1.5
SETTINGS: dict[str, Any] = {
    "serving": {
        "request_timeout_s": TIMEOUT_S,
        "prefill_timeout_s": 0.5,
        "max_attempts": 1,
        "handoff_timeout_s": 1.0,
        "max_response_bytes": 65536,
    },
    "engine": {"first_token_timeout_s": 0.5, "decode_read_timeout_s": 0.3},
    # Keep the hostile engine in placement however often it fails.
    "recovery": {"breaker": {"failure_threshold": 100_000}},
}

# (behaviour, stream, what the client must see, how the hostile leg must end)
DECODE_CASES = [
    (h.endless_tokens, True, "stream_error:expired", "aborted"),
    (h.endless_pings, True, "stream_error:first_token_timeout", "aborted"),
    (h.fat_role_chunks, True, "stream_error:response_too_large", "aborted"),
    (h.garbage_lines, True, "ok", "done"),
    (h.oversized_event, True, "stream_error:engine_bad_stream", "aborted"),
    (h.oversized_first_event, True, "stream_error:response_too_large", "aborted"),
    (h.no_terminator, True, "stream_error:engine_stream_truncated", "done"),
    (h.cut_mid_stream, True, "stream_error:engine_connection_lost", "done"),
    (h.garbage_headers, True, "stream_error:engine_connection_lost", "aborted"),
    (h.oversized_headers, True, "stream_error:engine_connection_lost", "aborted"),
    # Not HTTP: refused at its first line, not left to the timer.
    (h.not_http, True, "stream_error:engine_connection_lost", "aborted"),
    (h.not_http_unterminated, True, "stream_error:engine_connection_lost", "aborted"),
    (h.not_http_then_close, True, "stream_error:engine_connection_lost", "done"),
    (h.silent, True, "stream_error:first_token_timeout", "aborted"),
    # A non-streaming request's decode leg is a stream too (manual 6): its timers apply.
    (h.silent, False, "error:first_token_timeout", "aborted"),
    (h.drip, True, "stream_error:first_token_timeout", "aborted"),
    (h.token_then_drip, True, "stream_error:expired", "aborted"),
    # A JSON answer to a streamed leg is named for what it is, from its head.
    (h.endless_json_body, False, "error:engine_bad_response", "aborted"),
    (h.not_json_body, False, "error:engine_bad_response", "done"),
    (h.short_body, False, "error:engine_bad_response", "done"),
    (h.html_500, False, "error:engine_http_500", "done"),
    (h.html_500, True, "stream_error:engine_http_500", "done"),
    (h.json_for_a_stream, True, "stream_error:engine_bad_response", "done"),
    # Without a content type saying so, a body that is not an event stream never ends
    # with [DONE].
    (h.untyped_json_for_a_stream, True, "stream_error:engine_stream_truncated", "done"),
    (h.nested_json_body, False, "error:engine_bad_response", "done"),
    (h.nested_event, True, "ok", "done"),
    (h.nested_error_event, True, "stream_error:engine_stream_truncated", "done"),
    (h.nested_error_status, False, "error:engine_http_503", "done"),
]
PREFILL_CASES = [
    (h.sane, True, "ok", "done"),  # no kv_transfer_params: the decode computes the prompt
    (h.not_json_body, True, "error:engine_bad_response", "done"),
    (h.endless_json_body, False, "error:response_too_large", "aborted"),
    (h.silent, True, "error:prefill_timeout", "aborted"),
    (h.garbage_headers, False, "error:engine_connection_lost", "aborted"),
    (h.oversized_headers, True, "error:engine_connection_lost", "aborted"),
    (h.not_http, False, "error:engine_connection_lost", "aborted"),
    (h.not_http_unterminated, False, "error:engine_connection_lost", "aborted"),
    (h.not_http_then_close, False, "error:engine_connection_lost", "done"),
    (h.short_body, True, "error:engine_connection_lost", "done"),
    (h.html_500, False, "error:engine_http_500", "done"),
    (h.nested_json_body, False, "error:engine_bad_response", "done"),
    (h.nested_error_status, True, "error:engine_http_503", "done"),
]
CASES = [
    pytest.param("decode", *case, id=f"decode-{case[0].__name__}-{'sse' if case[1] else 'json'}")
    for case in DECODE_CASES
] + [
    pytest.param("prefill", *case, id=f"prefill-{case[0].__name__}-{'sse' if case[1] else 'json'}")
    for case in PREFILL_CASES
]


@pytest.mark.parametrize(("side", "behaviour", "stream", "expect", "leg_end"), CASES)
async def test_hostile_engine(
    start: StartCampaign,
    nursery: trio.Nursery,
    side: str,
    behaviour: h.Behaviour,
    stream: bool,
    expect: str,
    leg_end: str,
) -> None:
    c, engine = await start_beside_hostile(
        start,
        nursery,
        f"hostile-{side}",
        side,
        behaviour,
        # Short KV leases: a prefill whose decode went to the hostile engine is never
        # pulled, and the check waits for its lease to expire.
        sim={"lease_s": 4.0},
        **SETTINGS,
    )

    async def plan(i: int) -> None:
        await c.send(i, c.body(stream=stream, max_tokens=4))

    await c.run(2, plan, concurrency=1, within_s=30)
    # An endless writer notices the router hung up at its next write.
    await wait_for(lambda: engine.open_legs == 0, within_s=5)
    report = await c.check(other_legs=[engine.ring()])
    report.assert_ok()
    assert [c.label_of(ex) for ex in c.exchanges] == [expect] * 2
    legs = [leg for leg in engine.legs if leg.leg == side]
    assert [leg.ended for leg in legs] == [leg_end] * 2, legs
    # The log names the hostile engine; the client's message does not.
    host_port = engine.url.removeprefix("http://")
    for message in filter(None, map(error_message, c.exchanges)):
        assert " engine h" not in message, message
        assert host_port not in message, message
    if expect.endswith(":expired"):
        assert all(TIMEOUT_S <= ex.duration < TIMEOUT_S + 1.0 for ex in c.exchanges)


def error_message(ex: Exchange) -> str | None:
    """The message of the error a client got: an HTTP error's, or a stream's last event's."""
    if ex.status != 200:
        document = json.loads(ex.body)
    else:
        events = ex.events()
        if not events or not is_error_event(events[-1]):
            return None
        document = json.loads(events[-1])
    message: str = document["error"]["message"]
    return message


KEY = "sk-campaign-0123456789abcdef"
TOKEN = "admin-campaign-token-0123"
# What a client without the key tries: (Authorization headers, the code it must get).
WRONG_KEYS: list[tuple[list[tuple[str, str]], str]] = [
    ([], "missing_api_key"),
    ([("authorization", "Bearer")], "missing_api_key"),
    ([("authorization", f"Basic {KEY}")], "missing_api_key"),
    ([("authorization", f"Bearer {KEY[:-1]}")], "invalid_api_key"),  # a prefix
    ([("authorization", f"Bearer {KEY}x")], "invalid_api_key"),  # one byte more
    ([("authorization", f"Bearer {KEY.upper()}")], "invalid_api_key"),
    ([("authorization", f"Bearer {TOKEN}")], "invalid_api_key"),  # the admin's token
    ([("authorization", "Bearer " + "k" * 8000)], "invalid_api_key"),
    ([("authorization", f"Bearer {KEY}"), ("authorization", "Bearer x")], "invalid_api_key"),
    ([("authorization", f"Bearer {KEY}\x7f")], "invalid_api_key"),
]


async def test_hostile_clients_without_the_key_get_401_and_no_admin_surface(
    start: StartCampaign,
) -> None:
    c: Campaign = await start(
        "hostile-clients",
        ["prefill", "decode"],
        listen={"api_keys": [KEY]},
        admin={"token": TOKEN},
    )
    honest = [("authorization", f"Bearer {KEY}")]

    async def plan(i: int) -> None:
        if i % 3 == 0:
            await c.send(i, c.body(stream=i % 2 == 0, max_tokens=4), headers=honest)
            return
        headers, code = WRONG_KEYS[i % len(WRONG_KEYS)]
        await c.send(i, c.body(stream=i % 2 == 0), label=code, headers=headers)

    await c.run(60, plan, concurrency=6, within_s=30)
    report = await c.check()
    report.assert_ok()
    for ex in c.exchanges:
        expected = "ok" if not ex.label else f"error:{ex.label}"
        assert c.label_of(ex) == expected, (ex.label, ex.status, ex.body[:200])
        if ex.label:
            assert ex.status == 401
            assert ex.headers["www-authenticate"].startswith("Bearer")
    # Only the honest requests reached an engine.
    assert c.total("requests") == 2 * sum(1 for ex in c.exchanges if not ex.label)
    # The admin surface is not on the client port, key or no key; on its own listener
    # it wants its token, not a client's key.
    stack = c.stack
    async with httpx.AsyncClient(timeout=10) as client:
        for path in ("/narwhal/state", "/metrics"):
            for headers in ({}, dict(honest), {"authorization": f"Bearer {TOKEN}"}):
                answer = await client.get(f"{stack.url}{path}", headers=headers)
                assert answer.status_code == 404, (path, headers)
                assert answer.json()["error"]["code"] == "not_found"
            admin = await client.get(f"{stack.admin_url}{path}", headers=dict(honest))
            assert (admin.status_code, admin.json()["error"]["code"]) == (401, "invalid_token")
            assert (await client.get(f"{stack.admin_url}{path}")).status_code == 401
        state = await stack.state()
    assert KEY not in json.dumps(state)
    assert TOKEN not in json.dumps(state)


# ------------------------------------------------------------------ hostile clients

# (how the client sends its request, what it must see)
WIRE_CASES: list[tuple[dict[str, Any], str]] = [
    # RFC 9112 2.2: empty lines before a request line are ignored.
    ({"before": b"\r\n\r\n"}, "ok"),
    # 9.6: what follows a request that closes its connection is dropped unread.
    (
        {
            "headers": [("connection", "close")],
            "after": b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n" + b"GARBAGE" * 2000,
        },
        "ok",
    ),
    # A client with nothing more to send ends its side (`nc -N`) and reads its answer.
    ({"half_close": True}, "ok"),
    # One that ends its side in the middle of the body is told so.
    ({"stall_body": True, "half_close": True}, "error:request_incomplete"),
]


async def _raw(host: str, port: int, request: bytes) -> bytes:
    """What a client that sends `request` and half-closes reads back."""
    async with await trio.open_tcp_stream(host, port) as client:
        await client.send_all(request)
        await client.send_eof()
        reply = b""
        with trio.fail_after(5):
            while chunk := await client.receive_some(65536):
                reply += chunk
    return reply


async def test_hostile_clients_on_the_wire(start: StartCampaign) -> None:
    c = await start("wire", ["prefill", "decode"])
    host, port = c.stack.supervisor.bound[0]

    async def plan(i: int) -> None:
        options, _ = WIRE_CASES[i % len(WIRE_CASES)]
        stream = i // len(WIRE_CASES) % 2 == 1
        await c.send(i, c.body(stream=stream), label=str(i % len(WIRE_CASES)), **options)

    await c.run(8 * len(WIRE_CASES), plan, concurrency=4, within_s=30)
    for ex in c.exchanges:
        assert c.label_of(ex) == WIRE_CASES[int(ex.label)][1], (ex.label, ex.cut, ex.body[:200])
    # Beside them, outside the exchanges (none of these reaches the app's accounting):
    # a head cut short by a half-close, and an HTTP/1.0 request with bytes behind it.
    cut = await _raw(host, port, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-")
    assert cut.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert json.loads(cut.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_incomplete"
    old = await _raw(host, port, b"GET /health HTTP/1.0\r\n\r\nGET /health HTTP/1.0\r\n\r\n")
    assert old.count(b"HTTP/1.1 ") == 1
    assert old.startswith(b"HTTP/1.1 200 OK\r\n")
    report = await c.check()
    report.assert_ok()
    cut_short = sum(ex.label == str(len(WIRE_CASES) - 1) for ex in c.exchanges)
    state = await c.stack.state()
    assert state["connections"]["protocol_errors"] == {"400": cut_short + 1}


async def test_reloads_that_meet_a_named_pipe_leave_serving_alone(
    start: StartCampaign, tmp_path: Path
) -> None:
    # A reload read the FIFO, waiting for a writer: it never ended, and every later
    # reload and the shutdown waited behind it.
    c = await start("fifo", ["prefill", "decode"])
    supervisor = c.stack.supervisor
    path = tmp_path / "narwhal.json"
    supervisor.config_path = str(path)
    document = config_to_dict(c.config)
    problem = (
        f"engine.api_key_file: {json.dumps(str(tmp_path / 'key'))}: cannot read file: it is "
        "a named pipe, not a regular file"
    )
    reloads = 0

    async def plan(i: int) -> None:
        await c.send(i, c.body(stream=i % 2 == 0))

    async def reload_meanwhile() -> None:
        nonlocal reloads
        with fifo(tmp_path / "key") as key:
            piped = {**document, "engine": {**document["engine"], "api_key_file": key}}
            for attempts in (2, 3, 2):
                valid = {**document, "serving": {**document["serving"], "max_attempts": attempts}}
                for doc, expected in ((piped, (False, (problem,))), (valid, (True, ()))):
                    path.write_text(json.dumps(doc))
                    with trio.fail_after(5):
                        result = await supervisor.reload("SIGHUP")
                    assert (result.applied, result.errors) == expected
                    reloads += 1
                    await trio.sleep(0.05)  # spread over the load

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reload_meanwhile)
        await c.run(24, plan, concurrency=4, within_s=30)
    report = await c.check()
    report.assert_ok()
    assert {c.label_of(ex) for ex in c.exchanges} == {"ok"}
    assert reloads == 6
