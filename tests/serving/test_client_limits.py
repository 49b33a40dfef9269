"""One client address must not lock out the rest: the caps on connections open and on
request bodies still arriving per client address, on a live router. The greedy client
connects from 127.0.0.1, the others from 127.0.0.2 (the listener binds 127.0.0.1; any
127/8 source address reaches it on Linux)."""

from __future__ import annotations

import json
import logging
import re

import pytest
import trio
import trio.testing

from ..support import wait_for
from .conftest import MODEL, StartStack
from .test_failures import settled
from .test_limits import assert_closed, read_response

OTHER = "127.0.0.2"
BODY = json.dumps({"model": MODEL, "prompt": "hello there", "max_tokens": 2}).encode()


def post_head(length: int) -> bytes:
    return (
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {length}\r\n\r\n"
    ).encode()


Answer = tuple[bytes, dict[bytes, bytes], bytes]


async def answer_of(sock: trio.SocketStream, into: list[Answer]) -> None:
    """Record the one response `sock` gets, whenever it comes."""
    with trio.move_on_after(30):
        into.append(await read_response(sock))


def assert_refused(answers: list[Answer], message: str, code: str) -> None:
    """Each answer is the 429 that refuses a client over one of its limits."""
    for status, headers, body in answers:
        assert status == b"HTTP/1.1 429 Too Many Requests"
        assert headers[b"retry-after"] == b"1"
        assert headers[b"connection"] == b"close"
        assert json.loads(body)["error"] == {
            "message": message,
            "type": "rate_limit_error",
            "param": None,
            "code": code,
        }


async def served_from(host: str, port: int, local: str) -> bytes:
    sock = await trio.open_tcp_stream(host, port, local_address=local)
    async with sock:
        await sock.send_all(post_head(len(BODY)) + BODY)
        status, _, body = await read_response(sock)
    assert status.startswith(b"HTTP/1.1 200"), body
    return status


async def test_slow_bodies_from_one_address_leave_the_retained_ceiling_to_the_others(
    start_stack: StartStack, caplog: pytest.LogCaptureFixture
) -> None:
    # The slowloris of issue 29: one address opens more slow POSTs than the ceiling
    # holds (16 here) and would hold every retained request for serving.body_timeout_s.
    # It may have 8 bodies arriving at once (the derived floor); the rest are refused,
    # and a client from another address is served.
    caplog.set_level(logging.INFO, logger="narwhal.server")
    stack = await start_stack(serving={"max_connections": 16})
    host, port = stack.supervisor.bound[0]
    slow = []
    answers: list[Answer] = []
    async with trio.open_nursery() as nursery:
        for _ in range(24):
            sock = await trio.open_tcp_stream(host, port)
            await sock.send_all(post_head(1000) + b"{")
            slow.append(sock)
            nursery.start_soon(answer_of, sock, answers)
        await wait_for(lambda: stack.ctx.retained + len(answers) == 24)
        assert (stack.ctx.retained, len(answers)) == (8, 16)
        await served_from(host, port, OTHER)
        assert_refused(
            answers,
            "client 127.0.0.1 already has 8 request bodies arriving: narwhal reads at most 8 "
            "at once from one client address (serving.max_pending_bodies_per_client)",
            "pending_bodies_per_client",
        )
        nursery.cancel_scope.cancel()
    for sock in slow:
        await sock.aclose()
    state = await settled(stack)
    assert state["requests"]["outcomes"] == {
        "client_disconnected": 8,
        "ok": 1,
        "pending_bodies_per_client": 16,
    }
    assert state["clients"]["pending_bodies"] == {
        "limit_per_client": 8,
        "counted": 0,
        "clients": 0,
        "busiest": 0,
        "refused_total": 16,
        "refusing": 0,
    }
    # Not an offer the service refused: not an SLO miss, not an unsized offer.
    assert state["admission"]["unsized_offers"] == 0
    assert stack.ctx.slo.counts(trio.current_time())["refused"] == 0
    metrics = stack.ctx.metrics.render().decode()
    assert 'narwhal_refusals_total{reason="pending_bodies_per_client"} 16.0' in metrics
    # One line when the refusals begin, one when the address has none left pending.
    lines = [
        (r.levelname, r.getMessage())
        for r in caplog.records
        if getattr(r, "event", None) == "client_limit"
    ]
    assert lines[0] == (
        "WARNING",
        "client 127.0.0.1 has 8 request bodies arriving, "
        "serving.max_pending_bodies_per_client=8: more are refused with 429 "
        "pending_bodies_per_client",
    )
    assert [level for level, _ in lines] == ["WARNING", "INFO"]
    assert re.fullmatch(
        r"client 127\.0\.0\.1: 16 refused with 429 pending_bodies_per_client over "
        r"\d+\.\d s \(request bodies arriving now: 0\)",
        lines[1][1],
    )


async def test_connections_from_one_address_leave_room_for_the_others(
    start_stack: StartStack,
) -> None:
    # One address opens as many connections as the router keeps open (40) and trickles a
    # request head on each: at the limit, a new connection used to close the connection
    # idle longest, which was another client's keep-alive connection. One address may
    # have 16 open; past that, each new one takes the place of its own oldest.
    stack = await start_stack(
        listen={"max_open_connections": 40, "max_open_connections_per_client": 16},
        serving={"max_connections": 8},
    )
    host, port = stack.supervisor.bound[0]
    other = await trio.open_tcp_stream(host, port, local_address=OTHER)
    health = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    await other.send_all(health)
    status, _, _ = await read_response(other)
    assert status.startswith(b"HTTP/1.1 200")
    greedy = []
    for _ in range(40):
        sock = await trio.open_tcp_stream(host, port)
        await sock.send_all(b"GET /health HTTP/1.1\r\n")
        greedy.append(sock)
        await trio.testing.wait_all_tasks_blocked()
    # The other client's connection is still open, and serves its next request.
    await other.send_all(health)
    status, _, _ = await read_response(other)
    assert status.startswith(b"HTTP/1.1 200")
    for sock in greedy[:24]:
        await assert_closed(sock)
    stats = stack.ctx.connections.statistics()
    assert (stats.open, stats.shed, stats.per_client.busiest) == (17, 24, 16)
    assert stats.per_client.refused == 0
    for sock in [*greedy, other]:
        await sock.aclose()
    await wait_for(lambda: stack.ctx.connections.statistics().open == 0)
    assert stack.ctx.connections.statistics().per_client.clients == 0


async def test_a_connection_over_the_limit_with_none_idle_is_answered_429_at_once(
    start_stack: StartStack, caplog: pytest.LogCaptureFixture
) -> None:
    # Every connection of the address has a request in flight (bodies still arriving):
    # there is none of its own to close, and the new one is answered before its request.
    caplog.set_level(logging.INFO, logger="narwhal.server")
    stack = await start_stack(
        listen={"max_open_connections_per_client": 4}, serving={"max_connections": 8}
    )
    host, port = stack.supervisor.bound[0]
    slow = []
    for _ in range(4):
        sock = await trio.open_tcp_stream(host, port)
        await sock.send_all(post_head(1000) + b"{")
        slow.append(sock)
    await wait_for(lambda: stack.ctx.retained == 4)
    refused = await trio.open_tcp_stream(host, port)
    answer = await read_response(refused)
    assert_refused(
        [answer],
        "client 127.0.0.1 already has 4 connections open: narwhal keeps at most 4 open "
        "from one client address (listen.max_open_connections_per_client)",
        "connections_per_client",
    )
    await assert_closed(refused)
    await served_from(host, port, OTHER)
    assert stack.ctx.connections.statistics().per_client.refused == 1
    metrics = stack.ctx.metrics.render().decode()
    assert "narwhal_client_connections_refused_total 1.0" in metrics
    assert [
        (r.levelname, r.getMessage())
        for r in caplog.records
        if getattr(r, "event", None) == "client_limit"
    ] == [
        (
            "WARNING",
            "client 127.0.0.1 has 4 connections open, listen.max_open_connections_per_client"
            "=4: more are refused with 429 connections_per_client",
        )
    ]
    for sock in [*slow, refused]:
        await sock.aclose()
    await settled(stack)
