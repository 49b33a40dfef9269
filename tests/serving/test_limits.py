"""Disconnects, byte limits, the retained-request ceiling, the queue and backpressure."""

from __future__ import annotations

import contextlib
import json
import logging
import socket

import httpx
import pytest
import trio
import trio.testing

from narwhal.serving import state_document

from ..support import open_sse, send_raw_request, wait_for
from .conftest import MODEL, StartStack
from .test_failures import phases, post, settled

BODY = {"model": MODEL, "prompt": "hello there", "max_tokens": 50, "stream": True}
QUEUEING = {
    "max_connections": 1,
    "queue_capacity": 1,
    "queue_timeout_s": 0.3,
    "prefill_concurrency": 1,
    "decode_concurrency": 1,
    "handoff_timeout_s": 5.0,
}


async def test_disconnect_mid_stream_aborts_the_decode_and_frees_everything(
    start_stack: StartStack,
) -> None:
    stack = await start_stack(speed=2.0)
    async with open_sse(stack.url, "/v1/completions", BODY) as reader:
        assert reader.status == 200
        assert await reader.event() is not None
    await wait_for(lambda: phases(stack, 1, "aborted") == ["decode"])
    state = await settled(stack)
    assert state["requests"]["outcomes"] == {"client_disconnected": 1}


async def test_disconnect_during_prefill_aborts_the_prefill(start_stack: StartStack) -> None:
    stack = await start_stack()
    stack.fleet[0].set_faults(stall_before_first_token_s=10, leg="prefill")
    sock = await send_raw_request(stack.url, "/v1/completions", json.dumps(BODY).encode())
    await wait_for(lambda: any(r.stage == "prefill" for r in stack.ctx.records.values()))
    await wait_for(lambda: stack.fleet[0].state()["counters"]["requests"]["prefill"] == 1)
    await sock.aclose()
    await wait_for(lambda: phases(stack, 0, "aborted") == ["prefill"])
    await settled(stack)
    assert stack.fleet[1].state()["counters"]["requests"]["decode"] == 0


async def test_disconnect_with_a_pipelined_request_behind_aborts_the_legs(
    start_stack: StartStack,
) -> None:
    # While a request is answered with the next one's bytes buffered behind it, the HTTP
    # server does not read the connection: the client leaving must still be seen, not
    # left to the decode gap timer (which would also blame the engine).
    stack = await start_stack()
    stack.fleet[1].set_faults(stall_after_tokens=1, leg="decode")
    body = json.dumps({**BODY, "stream": False}).encode()
    host, port = stack.supervisor.bound[0]
    sock = await trio.open_tcp_stream(host, port)
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body)
    await sock.send_all(head + body + b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    await wait_for(lambda: stack.fleet[1].state()["counters"]["stalls_injected"] == 1)
    await sock.aclose()
    await wait_for(lambda: phases(stack, 1, "aborted") == ["decode"])
    state = await settled(stack)
    assert state["requests"]["outcomes"] == {"client_disconnected": 1}


async def test_disconnect_while_queued_frees_the_slot(start_stack: StartStack) -> None:
    stack = await start_stack(serving={**QUEUEING, "queue_timeout_s": 30.0})
    stack.fleet[1].set_faults(stall_after_tokens=1, leg="decode")
    async with open_sse(stack.url, "/v1/completions", BODY) as first:
        assert await first.event() is not None
        sock = await send_raw_request(stack.url, "/v1/completions", json.dumps(BODY).encode())
        await wait_for(lambda: stack.ctx.gate.statistics().waiting == 1)
        await sock.aclose()
        await wait_for(lambda: stack.ctx.gate.statistics().waiting == 0)
        assert stack.ctx.retained == 1
    await settled(stack)


async def test_body_over_the_limit_is_refused_before_it_is_read(start_stack: StartStack) -> None:
    stack = await start_stack(serving={"max_request_bytes": 1000})
    big = {**BODY, "prompt": "x" * 5000}
    response = await post(stack, big)
    assert response.status_code == 413
    assert (
        response.json()["error"]["message"]
        == (
            f"request body of {len(json.dumps({'model': MODEL, 'prompt': 'the quick brown fox jumps over the lazy dog', **big}))}"
            " bytes exceeds serving.max_request_bytes=1000"
        )
        or "exceeds serving.max_request_bytes=1000" in response.json()["error"]["message"]
    )
    # Without a content-length the limit is enforced while reading.
    sock = await send_raw_request(
        stack.url, "/v1/completions", b"", headers={"transfer-encoding": "chunked"}
    )
    chunk = b"y" * 800
    await sock.send_all(b"%x\r\n%s\r\n" % (len(chunk), chunk) * 2)
    reply = b""
    with trio.fail_after(5):
        while b"\r\n\r\n" not in reply:
            reply += await sock.receive_some(65536)
    assert reply.startswith(b"HTTP/1.1 413")
    await sock.aclose()


async def test_a_client_refused_while_sending_its_body_can_finish_and_read_the_answer(
    start_stack: StartStack,
) -> None:
    # The connection closed with the rest of the body unread, which reset it: the
    # client's next write failed (broken pipe), and a client that stops there never
    # read the 413 it had been sent.
    stack = await start_stack(serving={"max_request_bytes": 1000})
    sock = await send_raw_request(
        stack.url, "/v1/completions", b"x" * 1000, headers={"content-length": "100000"}
    )
    status, headers, body = await read_response(sock)
    assert status.startswith(b"HTTP/1.1 413")
    assert headers[b"connection"] == b"close"
    assert json.loads(body)["error"]["code"] == "request_too_large"
    await assert_closed(sock)  # its sending side, at the answer
    # The first write after the server's close would still succeed (the reset it
    # provokes fails the next one).
    await sock.send_all(b"x" * 1000)
    await sock.send_all(b"x" * 98000)
    await sock.send_eof()
    await sock.aclose()


async def test_response_over_the_limit_fails_the_attempt(start_stack: StartStack) -> None:
    stack = await start_stack(serving={"max_response_bytes": 200})
    response = await post(stack, {"max_tokens": 50})
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "response_too_large"


async def test_retained_ceiling_refuses_before_parsing(start_stack: StartStack) -> None:
    stack = await start_stack(serving={"max_connections": 1})
    stack.fleet[1].set_faults(stall_after_tokens=1, leg="decode")
    async with open_sse(stack.url, "/v1/completions", BODY) as first:
        assert await first.event() is not None
        async with httpx.AsyncClient(timeout=10) as client:
            response = await client.post(f"{stack.url}/v1/completions", content=b"not even json")
        assert response.status_code == 429
        assert response.json()["error"]["code"] == "retained_ceiling"
        assert response.headers["retry-after"] == "1"
    state = await settled(stack)
    assert state["admission"]["unsized_offers"] == 1


async def read_response(sock: trio.SocketStream) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """One HTTP/1.1 response: its status line, headers and (content-length) body."""
    data = b""
    with trio.fail_after(5):
        while b"\r\n\r\n" not in data:
            data += await sock.receive_some(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        status, *lines = head.split(b"\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines)}
        while len(body) < int(headers[b"content-length"]):
            body += await sock.receive_some(65536)
    return status, headers, body


async def read_reply(sock: trio.SocketStream) -> tuple[bytes, dict[bytes, bytes]]:
    """One HTTP/1.1 response's status line and headers; its body is read and dropped."""
    status, headers, _ = await read_response(sock)
    return status, headers


async def assert_closed(sock: trio.SocketStream) -> None:
    """The server closes the connection (after the response already read)."""
    with trio.fail_after(5):
        while await sock.receive_some(65536):
            pass


async def assert_reusable(sock: trio.SocketStream) -> None:
    """The connection serves another request after the one just answered."""
    await sock.send_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    status, _ = await read_reply(sock)
    assert status.startswith(b"HTTP/1.1 200")


async def test_a_refusal_before_parsing_keeps_the_connection_when_the_body_came(
    start_stack: StartStack,
) -> None:
    # Past the ceiling the body is read and dropped, not parsed: the client's pooled
    # connection survives the 429 (a flood of refusals is not a flood of new connections).
    stack = await start_stack(serving={"max_connections": 1, "client_stall_s": 0.3})
    stack.fleet[1].set_faults(stall_after_tokens=1, leg="decode")
    async with open_sse(stack.url, "/v1/completions", BODY) as first:
        assert await first.event() is not None
        sock = await send_raw_request(stack.url, "/v1/completions", b"x" * 100)
        status, headers = await read_reply(sock)
        assert status.startswith(b"HTTP/1.1 429")
        assert b"connection" not in headers
        await assert_reusable(sock)
        await sock.aclose()
    await settled(stack)


@pytest.mark.parametrize(
    ("declared", "sent"),
    [
        (100, b""),  # the body never comes: given up after serving.client_stall_s
        (5000, b"x" * 5000),  # over serving.max_request_bytes: not read at all
    ],
)
async def test_a_refusal_with_the_body_unread_closes_the_connection(
    start_stack: StartStack, declared: int, sent: bytes
) -> None:
    # The regression: hypercorn drops a connection whose request body it has not read,
    # and a client that was not told so reused it and got "server disconnected".
    stack = await start_stack(
        serving={"max_connections": 1, "client_stall_s": 0.3, "max_request_bytes": 1000}
    )
    stack.fleet[1].set_faults(stall_after_tokens=1, leg="decode")
    async with open_sse(stack.url, "/v1/completions", BODY) as first:
        assert await first.event() is not None
        sock = await send_raw_request(
            stack.url, "/v1/completions", sent, headers={"content-length": str(declared)}
        )
        status, headers = await read_reply(sock)
        assert status.startswith(b"HTTP/1.1 429")
        assert headers[b"connection"] == b"close"
        with trio.fail_after(5):
            while await sock.receive_some(65536):  # closed, as announced
                pass
        await sock.aclose()
    await settled(stack)


@pytest.mark.parametrize(
    ("serving", "limit"),
    [
        ({"body_timeout_s": 0.5}, "serving.body_timeout_s=0.5"),
        # The request's deadline caps the body's: still the client's slow body, a 408.
        ({"body_timeout_s": 30.0, "request_timeout_s": 0.5}, "serving.request_timeout_s=0.5"),
    ],
)
async def test_a_trickling_body_is_refused_at_its_deadline_and_frees_its_slot(
    start_stack: StartStack, serving: dict[str, float], limit: str
) -> None:
    # Slowloris: a byte every 50 ms resets any gap timer, and without a deadline for the
    # whole body the request held the only retained slot for serving.request_timeout_s.
    stack = await start_stack(serving={"max_connections": 1, **serving})
    started = trio.current_time()
    sock = await send_raw_request(
        stack.url, "/v1/completions", b"", headers={"content-length": "1000"}
    )

    async def trickle() -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while True:
                await sock.send_all(b" ")
                await trio.sleep(0.05)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trickle)
        await wait_for(lambda: stack.ctx.retained == 1)
        refused = await post(stack, {"max_tokens": 2})
        assert refused.json()["error"]["code"] == "retained_ceiling"
        status, headers, body = await read_response(sock)
        elapsed = trio.current_time() - started
        nursery.cancel_scope.cancel()
    assert status.startswith(b"HTTP/1.1 408")
    assert json.loads(body)["error"] == {
        "message": f"request body not complete within {limit}",
        "type": "timeout_error",
        "param": None,
        "code": "body_timeout",
    }
    assert 0.5 <= elapsed < 2.0
    assert headers[b"connection"] == b"close"
    await assert_closed(sock)
    await sock.aclose()
    served = await post(stack, {"max_tokens": 2})
    assert served.status_code == 200
    state = await settled(stack)
    assert state["requests"]["outcomes"] == {"body_timeout": 1, "ok": 1, "retained_ceiling": 1}
    # The client's fault, as a 413 is: not an SLO miss, and not an offer the ceiling refused.
    assert state["admission"]["unsized_offers"] == 1
    slo = stack.ctx.slo.counts(trio.current_time())
    assert slo["refused"] == 1
    assert sum(slo.values()) == 2  # the ceiling's refusal and the served request


async def test_a_body_arriving_in_pieces_within_its_deadline_is_served(
    start_stack: StartStack,
) -> None:
    stack = await start_stack(serving={"body_timeout_s": 2.0})
    body = json.dumps({**BODY, "stream": False, "max_tokens": 2}).encode()
    sock = await send_raw_request(
        stack.url, "/v1/completions", body[:10], headers={"content-length": str(len(body))}
    )
    await trio.sleep(0.3)  # the rest comes later, as from a slow but honest client
    await sock.send_all(body[10:])
    status, headers, _ = await read_response(sock)
    assert status.startswith(b"HTTP/1.1 200")
    assert b"connection" not in headers
    await assert_reusable(sock)
    await sock.aclose()
    state = await settled(stack)
    assert state["requests"]["outcomes"] == {"ok": 1}


async def test_a_refusal_after_the_body_was_read_keeps_the_connection(
    start_stack: StartStack,
) -> None:
    stack = await start_stack()
    sock = await send_raw_request(stack.url, "/v1/completions", b"not json")
    status, headers = await read_reply(sock)
    assert status.startswith(b"HTTP/1.1 400")
    assert b"connection" not in headers
    await assert_reusable(sock)
    await sock.aclose()
    # A route that never reads a body answers with its body unread.
    sock = await send_raw_request(stack.url, "/v1/embeddings", b"", headers={"content-length": "9"})
    status, headers = await read_reply(sock)
    assert status.startswith(b"HTTP/1.1 404")
    assert headers[b"connection"] == b"close"
    await sock.aclose()


async def test_a_request_with_both_body_framings_closes_its_connection(
    start_stack: StartStack,
) -> None:
    # RFC 9112 6.3: a proxy in front may have framed it by the content-length, and then
    # the bytes after it are a request the proxy never saw; the connection must end.
    stack = await start_stack()
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    sock = await send_raw_request(
        stack.url,
        "/v1/completions",
        chunked,
        headers={"transfer-encoding": "chunked", "content-length": "3"},
    )
    status, headers = await read_reply(sock)
    assert status.startswith(b"HTTP/1.1 200")
    assert headers[b"connection"] == b"close"
    with trio.fail_after(5):
        while await sock.receive_some(65536):  # closed, as announced
            pass
    await sock.aclose()


async def test_queue_timeout(start_stack: StartStack) -> None:
    stack = await start_stack(serving=QUEUEING)
    stack.fleet[1].set_faults(stall_after_tokens=1, leg="decode")
    async with open_sse(stack.url, "/v1/completions", BODY) as first:
        assert await first.event() is not None
        started = trio.current_time()
        response = await post(stack, {"max_tokens": 3})
        elapsed = trio.current_time() - started
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "queue_timeout"
    assert response.headers["retry-after"] == "1"
    assert 0.3 <= elapsed < 1.3


async def test_queue_wait_is_capped_by_the_request_deadline(start_stack: StartStack) -> None:
    stack = await start_stack(
        serving={
            **QUEUEING,
            "queue_timeout_s": 20.0,
            "request_timeout_s": 0.5,
            "handoff_timeout_s": 0.4,
        }
    )
    stack.fleet[1].set_faults(stall_after_tokens=1, leg="decode")
    async with open_sse(stack.url, "/v1/completions", BODY) as first:
        assert await first.event() is not None
        started = trio.current_time()
        response = await post(stack, {"max_tokens": 3})
        elapsed = trio.current_time() - started
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "expired"
    assert 0.5 <= elapsed < 1.5


@pytest.mark.parametrize(
    ("raw", "message", "param"),
    [
        (b"{not json", "request body is not valid JSON", None),
        (b"\xff\xfe", "request body is not valid UTF-8", None),
        (b"[1, 2]", "request body must be a JSON object", None),
        (
            json.dumps({"model": MODEL, "prompt": "x", "stream": "yes"}).encode(),
            "'stream' must be a boolean",
            "stream",
        ),
        (json.dumps({"model": MODEL, "prompt": 5}).encode(), "'prompt' must be a string", "prompt"),
        (
            json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 0}).encode(),
            "'max_tokens' must be a positive integer",
            "max_tokens",
        ),
        (
            json.dumps({"model": MODEL, "prompt": "x", "n": 2}).encode(),
            "n=2 is served only by an aggregate engine (role `both`)",
            "n",
        ),
        # Engine pairing fields: from a client they would make an engine hold KV for a
        # handoff nobody takes, or connect to a host of the client's choosing.
        *(
            (
                json.dumps({"model": MODEL, "prompt": "x", key: value}).encode(),
                f"'{key}' is set by the router for each engine leg",
                key,
            )
            for key, value in [
                ("kv_transfer_params", {"do_remote_prefill": True, "remote_host": "10.0.0.1"}),
                ("kv_transfer_params", None),
                ("bootstrap_host", "10.0.0.1"),
                ("bootstrap_port", 8998),
                ("bootstrap_room", 7),
            ]
        ),
    ],
)
async def test_malformed_requests_are_400(
    start_stack: StartStack, raw: bytes, message: str, param: str | None
) -> None:
    stack = await start_stack()
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.post(f"{stack.url}/v1/completions", content=raw)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"].startswith(message)
    assert error["param"] == param
    assert stack.fleet[0].state()["counters"]["requests"]["prefill"] == 0


async def test_requests_the_server_cannot_parse_are_enveloped_counted_and_logged(
    start_stack: StartStack, caplog: pytest.LogCaptureFixture
) -> None:
    # hypercorn answered these itself, a bare 400 (or a 500 for the websocket, the app
    # raising), and neither /metrics nor the log heard of them.
    caplog.set_level(logging.INFO, logger="narwhal.request")
    stack = await start_stack()
    host, port = stack.supervisor.bound[0]
    replies = []
    for raw in [
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: many\r\n\r\n",
        b"GET /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\n"
        b"upgrade: websocket\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"sec-websocket-version: 13\r\n\r\n",
        # A request line of HTTP/2.0: served as HTTP/1.1 (without the Host 1.1 requires).
        b"GET /v1/models HTTP/2.0\r\n\r\n",
    ]:
        async with await trio.open_tcp_stream(host, port) as client:
            await client.send_all(raw)
            status, headers, body = await read_response(client)
            replies.append((status, headers[b"content-type"], json.loads(body)["error"]))
    assert replies == [
        (
            b"HTTP/1.1 400 Bad Request",
            b"application/json",
            {
                "message": "malformed HTTP/1.1 request: bad Content-Length",
                "type": "invalid_request_error",
                "param": None,
                "code": "malformed_request",
            },
        ),
        (
            b"HTTP/1.1 400 Bad Request",
            b"application/json",
            {
                "message": "narwhal serves HTTP only; a websocket upgrade is not supported",
                "type": "invalid_request_error",
                "param": None,
                "code": "upgrade_unsupported",
            },
        ),
        (
            b"HTTP/1.1 505 HTTP Version Not Supported",
            b"application/json",
            {
                "message": "HTTP/2.0 request refused: this listener serves HTTP/1.1 only",
                "type": "invalid_request_error",
                "param": None,
                "code": "http_version_not_supported",
            },
        ),
    ]
    metrics = stack.ctx.metrics.render().decode()
    assert 'narwhal_client_protocol_errors_total{status="400"} 2.0' in metrics
    assert 'narwhal_client_protocol_errors_total{status="505"} 1.0' in metrics
    assert (await stack.state())["connections"]["protocol_errors"] == {"400": 2, "505": 1}
    assert [
        (r.levelname, r.getMessage(), getattr(r, "code", None))
        for r in caplog.records
        if getattr(r, "event", None) == "client_protocol_error"
    ] == [
        (
            "INFO",
            "client protocol error, answered 400: malformed HTTP/1.1 request: bad Content-Length",
            "malformed_request",
        ),
        (
            "INFO",
            "client protocol error, answered 400: narwhal serves HTTP only; a websocket "
            "upgrade is not supported",
            "upgrade_unsupported",
        ),
        (
            "INFO",
            "client protocol error, answered 505: HTTP/2.0 request refused: this listener "
            "serves HTTP/1.1 only",
            "http_version_not_supported",
        ),
    ]


async def test_a_client_that_stops_reading_is_disconnected(start_stack: StartStack) -> None:
    # 8000 tokens take the engine ~2.4 s at speed 20, ten times the stall window: it is
    # still generating when the router gives up. (At speed 1000 it could finish into the
    # loopback socket buffers first, and then its leg ends "done", not "aborted".)
    stack = await start_stack(sim={"timing": None}, speed=20.0, serving={"client_stall_s": 0.2})
    body = json.dumps({**BODY, "max_tokens": 8000, "prompt": "a"}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
    host, port = stack.supervisor.bound[0]
    await stream.socket.connect((host, port))
    head = f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    await stream.send_all(head.encode() + body)
    # Never read: the router's writes must stall, and it must give up on us.
    await wait_for(lambda: phases(stack, 1, "aborted") == ["decode"], within_s=20)
    state = await settled(stack)
    assert state["requests"]["outcomes"] == {"client_disconnected": 1}
    await stream.aclose()


async def test_phase_concurrency_caps_what_each_engine_holds(start_stack: StartStack) -> None:
    stack = await start_stack(serving={"prefill_concurrency": 1, "decode_concurrency": 2})
    stack.fleet[0].set_faults(stall_before_first_token_s=0.3, leg="prefill")
    stack.fleet[1].set_faults(stall_after_tokens=1, stall_s=0.5, leg="decode")

    async def one() -> None:
        response = await post(stack, {"max_tokens": 3})
        assert response.status_code == 200

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(one)
        await wait_for(lambda: stack.ctx.retained == 4)
        await wait_for(lambda: stack.fleet[0].state()["counters"]["requests"]["prefill"] == 1)
        prefill = stack.ctx.fleet.get("p0")
        assert prefill is not None
        assert prefill.prefill_limiter.borrowed_tokens == 1
        assert prefill.prefill_limiter.statistics().tasks_waiting == 3
        await wait_for(
            lambda: stack.fleet[1].state()["counters"]["requests"]["decode"] == 2, within_s=10
        )
        decode = stack.ctx.fleet.get("d1")
        assert decode is not None
        assert decode.decode_limiter.borrowed_tokens == 2
        assert stack.fleet[1].state()["running"] + stack.fleet[1].state()["waiting"] <= 2
    await settled(stack)


async def test_a_burst_spreads_over_decode_engines(start_stack: StartStack) -> None:
    """Decode engines are chosen at placement, a prefill before their decode leg starts;
    requests placed in that window must see each other's load, not all tie on d1."""
    stack = await start_stack(["prefill", "decode", "decode"])
    stack.fleet[0].set_faults(stall_before_first_token_s=0.2, leg="prefill")
    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(post, stack, {"max_tokens": 2})
    legs = [len([o for o in h.state()["outcomes"] if o["phase"] == "decode"]) for h in stack.fleet]
    assert legs == [0, 2, 2]
    await settled(stack)


# The fake open-file limit the stack runs under, and what a cap of 4 with two engines needs.
OPEN_FILES = {
    "soft": 65536,
    "hard": 65536,
    "needed": 4 + 2 * (2 + 4) + 200,  # two engines' pools, and the rest
    "reserve": 2 * (2 + 4) + 200,
    "raised_from": None,
    "note": None,
}


async def test_at_listen_max_open_connections_a_slowloris_connection_makes_room(
    start_stack: StartStack, caplog: pytest.LogCaptureFixture
) -> None:
    # Connections that trickle a request head hold a socket each and no request: at the
    # limit the longest idle of them is closed for a new connection, which is served.
    caplog.set_level(logging.INFO, logger="narwhal.server")
    stack = await start_stack(listen={"max_open_connections": 4}, serving={"max_connections": 2})
    host, port = stack.supervisor.bound[0]
    connections = stack.ctx.connections
    slow = []
    for _ in range(4):
        slow.append(await trio.open_tcp_stream(host, port))
        await slow[-1].send_all(b"GET /health HTTP/1.1\r\n")
        await wait_for(lambda: connections.statistics().idle == len(slow))
    fresh = await trio.open_tcp_stream(host, port)
    await fresh.send_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    status, _ = await read_reply(fresh)
    assert status.startswith(b"HTTP/1.1 200")
    await assert_closed(slow[0])  # the longest idle
    await wait_for(lambda: connections.statistics().idle == 4)  # fresh is idle too
    at_limit = {
        "open": 4,
        "idle": 4,
        "limit": 4,
        "configured_limit": 4,
        "at_limit": True,
        "limit_reached_total": 1,
        "shed_total": 1,
        "accept_failing": False,
        "accept_failures_total": 0,
        "protocol_errors": {},
        "open_files": OPEN_FILES,
    }
    assert state_document(stack.ctx)["connections"] == at_limit
    metrics = stack.ctx.metrics.render().decode()
    assert 'narwhal_client_connections{state="idle"} 4.0' in metrics
    assert 'narwhal_client_connections{state="busy"} 0.0' in metrics
    assert "narwhal_client_connection_limit 4.0" in metrics
    assert "narwhal_client_connection_limit_configured 4.0" in metrics
    assert "narwhal_client_connection_limit_reached_total 1.0" in metrics
    assert "narwhal_client_connections_shed_total 1.0" in metrics
    # The others are served as before: one of them ends its head.
    await slow[1].send_all(b"host: x\r\n\r\n")
    status, _ = await read_reply(slow[1])
    assert status.startswith(b"HTTP/1.1 200")
    for sock in slow[2:]:
        await sock.aclose()
    await wait_for(lambda: connections.statistics().open == 2)
    state = await stack.state()
    # The same but for the counts: 2 open and idle, under the limit (the state is read on
    # the admin listener, whose connections these are not); and the two that left in the
    # middle of their heads, each a request cut short.
    assert state["connections"] == {
        **at_limit,
        "open": 2,
        "idle": 2,
        "at_limit": False,
        "protocol_errors": {"400": 2},
    }
    assert [
        (r.levelname, r.getMessage())
        for r in caplog.records
        if getattr(r, "event", None) == "connection_limit"
    ] == [
        (
            "WARNING",
            "4 client connections open, listen.max_open_connections=4: the longest idle are "
            "closed to make room, and new connections wait in the listen backlog while none "
            "is idle",
        ),
        ("INFO", "3 client connections open, under listen.max_open_connections=4 again"),
    ]
    for sock in [*slow[:2], fresh]:
        await sock.aclose()
