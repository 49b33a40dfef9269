"""A tiny hostile engine: what the simulator cannot produce.

It answers the control endpoints (/health, /version, /metrics, /tokenize) like a sane
vLLM so the router keeps it in placement, and answers completion legs with a scripted
`Behaviour` that writes raw bytes: endless streams, garbage lines, events larger than
any limit, streams without a terminator, oversized or garbage HTTP headers, replies
that are not HTTP at all, silence, a body that drips one byte at a time.

Every completion leg is recorded with how it ended: `done` (the behaviour finished and
we closed) or `aborted` (the router closed the connection while we were still
sending or waiting), so a campaign can check that the router hung up on every leg it
gave up on.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import h11
import trio
import trio.lowlevel

_METRICS = (
    b'vllm:num_requests_running{model_name="m",engine="0"} 0.0\n'
    b'vllm:num_requests_waiting{model_name="m",engine="0"} 0.0\n'
    b'vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.0\n'
)


@attrs.define
class Leg:
    request_id: str
    leg: str
    path: str
    body: dict[str, Any]
    ended: str = "running"  # done | aborted


class PeerGone(Exception):
    """The router closed the connection (what a real engine sees as an abort)."""


class Wire:
    """The raw connection of one completion leg, for a behaviour to misuse."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream

    async def send(self, data: bytes) -> None:
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise PeerGone from exc

    async def until_closed(self) -> None:
        """Wait for the router to hang up (it has nothing more to send us)."""
        try:
            while await self.stream.receive_some(65536):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        raise PeerGone


Behaviour = Callable[[Leg, Wire], Awaitable[None]]


def head(status: int = 200, headers: list[tuple[str, str]] | None = None) -> bytes:
    reason = {200: "OK", 500: "Internal Server Error"}.get(status, "Whatever")
    lines = [f"HTTP/1.1 {status} {reason}"]
    lines += [f"{k}: {v}" for k, v in (headers or [])]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


SSE_HEAD = head(200, [("content-type", "text/event-stream"), ("transfer-encoding", "chunked")])
LAST_CHUNK = b"0\r\n\r\n"


def token_event(text: str = " tok") -> bytes:
    document = {
        "id": "cmpl-h",
        "object": "text_completion",
        "choices": [{"index": 0, "text": text, "finish_reason": None}],
    }
    return b"data: " + json.dumps(document).encode() + b"\n\n"


def json_response(document: object, status: int = 200) -> bytes:
    body = json.dumps(document).encode()
    return (
        head(status, [("content-type", "application/json"), ("content-length", str(len(body)))])
        + body
    )


def prefill_document() -> dict[str, Any]:
    """A vLLM prefill answer without KV params: the decode then computes the prompt."""
    return {
        "id": "cmpl-h",
        "object": "text_completion",
        "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
        "kv_transfer_params": None,
    }


async def sane(leg: Leg, wire: Wire) -> None:
    """What a working engine would answer (a short stream, or one JSON body)."""
    if leg.body.get("stream"):
        events = token_event(" a") + token_event(" b") + b"data: [DONE]\n\n"
        await wire.send(SSE_HEAD + chunk(events) + LAST_CHUNK)
    else:
        await wire.send(json_response(prefill_document()))


class HostileEngine:
    def __init__(self) -> None:
        self.behaviours: dict[str, Behaviour] = {}
        self.legs: list[Leg] = []
        self.port = 0
        self.open_legs = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ended(self, how: str) -> list[Leg]:
        return [leg for leg in self.legs if leg.ended == how]

    def ring(self) -> dict[str, object]:
        """The legs in the shape of the simulator's outcome ring, for the leg checks:
        `done` reads as ok (the engine thinks it answered), `aborted` as aborted."""
        outcomes = [
            {
                "request_id": leg.request_id,
                "internal_id": leg.request_id,
                "phase": leg.leg,
                "outcome": "ok" if leg.ended == "done" else leg.ended,
                "status": 200,
                "tokens": 0,
                "at": index,
            }
            for index, leg in enumerate(self.legs)
        ]
        return {"engine": "hostile", "outcomes": outcomes}

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listener.socket.getsockname()[1]
        async with listener, trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._connection, [listener])
            task_status.started()

    async def _connection(self, stream: trio.SocketStream) -> None:
        async with stream:
            conn = h11.Connection(h11.SERVER)
            while True:
                request = await self._read(stream, conn)
                if request is None:
                    return
                method, path, headers, body = request
                if method == "POST" and path.startswith("/v1/"):
                    await self._leg(stream, path, headers, body)
                    return  # the behaviour owned the wire; the connection is spent
                await stream.send_all(self._control(conn, method, path, body))
                if conn.our_state is not h11.DONE:
                    return
                conn.start_next_cycle()

    async def _read(
        self, stream: trio.SocketStream, conn: h11.Connection
    ) -> tuple[str, str, dict[str, str], bytes] | None:
        head_event: h11.Request | None = None
        body = b""
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                return None
            if event is h11.NEED_DATA:
                try:
                    data = await stream.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return None
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Request):
                head_event = event
            elif isinstance(event, h11.Data):
                body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage) and head_event is not None:
                headers = {k.decode(): v.decode() for k, v in head_event.headers}
                return head_event.method.decode(), head_event.target.decode(), headers, body
            else:
                return None

    def _control(self, conn: h11.Connection, method: str, path: str, body: bytes) -> bytes:
        if path == "/health":
            status, payload, kind = 200, b"", "application/json"
        elif path == "/version":
            status, payload, kind = 200, b'{"version": "hostile"}', "application/json"
        elif path == "/metrics":
            status, payload, kind = 200, _METRICS, "text/plain"
        elif path == "/tokenize":
            status, kind = 200, "application/json"
            payload = json.dumps({"count": 12, "max_model_len": 8192, "tokens": [1] * 12}).encode()
        else:
            status, payload, kind = 404, b'{"detail": "Not Found"}', "application/json"
        out = conn.send(
            h11.Response(
                status_code=status,
                headers=[("content-type", kind), ("content-length", str(len(payload)))],
            )
        )
        out = (out or b"") + (conn.send(h11.Data(data=payload)) or b"")
        return out + (conn.send(h11.EndOfMessage()) or b"")

    async def _leg(
        self, stream: trio.SocketStream, path: str, headers: dict[str, str], raw: bytes
    ) -> None:
        body = json.loads(raw)
        params = body.get("kv_transfer_params") or {}
        kind = "aggregate"
        if params.get("do_remote_decode"):
            kind = "prefill"
        elif params.get("do_remote_prefill") or "kv_transfer_params" in body:
            kind = "decode"
        leg = Leg(headers.get("x-request-id", ""), kind, path, body)
        self.legs.append(leg)
        behaviour = self.behaviours.get(kind, sane)
        self.open_legs += 1
        try:
            await behaviour(leg, Wire(stream))
            leg.ended = "done"
        except PeerGone:
            leg.ended = "aborted"
        finally:
            self.open_legs -= 1


# ---------------------------------------------------------------------------- behaviours


async def endless_tokens(leg: Leg, wire: Wire) -> None:
    await wire.send(SSE_HEAD)
    while True:
        await wire.send(chunk(token_event()))
        await trio.sleep(0.01)


async def endless_pings(leg: Leg, wire: Wire) -> None:
    """Comments and role chunks forever, never a token."""
    await wire.send(SSE_HEAD)
    while True:
        await wire.send(chunk(b": ping\n\n"))
        await trio.sleep(0.02)


async def fat_role_chunks(leg: Leg, wire: Wire) -> None:
    """Pre-output metadata without end (chat role chunks): bounded by the buffer limit."""
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    event = b"data: " + json.dumps(role).encode() + b"\n\n"
    await wire.send(SSE_HEAD)
    while True:
        await wire.send(chunk(event * 64))
        await trio.lowlevel.checkpoint()


async def garbage_lines(leg: Leg, wire: Wire) -> None:
    """Junk between well-framed events, then a proper end."""
    junk = (
        b"data: not json at all\n\n"
        b"garbage without a field name\n\n"
        b'data: {"choices": 5}\n\n'
        b"event: odd\nid: 7\n\n"
        b"data: \xff\xfe\n\n"
    )
    await wire.send(SSE_HEAD + chunk(token_event() + junk + token_event()))
    await wire.send(chunk(b"data: [DONE]\n\n") + LAST_CHUNK)


async def oversized_event(leg: Leg, wire: Wire) -> None:
    """A token, then one event that never ends (no separator), past every limit."""
    await wire.send(SSE_HEAD + chunk(token_event()))
    await wire.send(chunk(b'data: {"choices": [{"text": "'))
    block = b"x" * 65536
    while True:
        await wire.send(chunk(block))


async def oversized_first_event(leg: Leg, wire: Wire) -> None:
    """An event that never ends before any token: the pre-output buffer limit."""
    await wire.send(SSE_HEAD + chunk(b'data: {"choices": [{"text": "'))
    block = b"x" * 65536
    while True:
        await wire.send(chunk(block))


async def no_terminator(leg: Leg, wire: Wire) -> None:
    """Tokens, then a properly ended HTTP body without `data: [DONE]`."""
    await wire.send(SSE_HEAD + chunk(token_event() + token_event()) + LAST_CHUNK)


async def cut_mid_stream(leg: Leg, wire: Wire) -> None:
    """Tokens, then the connection closes inside the chunked body."""
    await wire.send(SSE_HEAD + chunk(token_event()) + b"20\r\ndata: {")


async def garbage_headers(leg: Leg, wire: Wire) -> None:
    await wire.send(b"HTTP/1.1 200 OK\r\nthis is not a header\r\n\x00\x01\r\n\r\n")
    await wire.until_closed()


async def oversized_headers(leg: Leg, wire: Wire) -> None:
    await wire.send(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
    while True:
        await wire.send(b"x-padding: " + b"a" * 8000 + b"\r\n")


async def not_http(leg: Leg, wire: Wire) -> None:
    await wire.send(b"SSH-2.0-OpenSSH_9.6\r\n\x00\x00\x00\x1c\x06\x14garbage")
    await wire.until_closed()


async def not_http_unterminated(leg: Leg, wire: Wire) -> None:
    """A first line that can no longer become a status line, and no end of line."""
    await wire.send(b"SSH-2.0-OpenSSH_9.6")
    await wire.until_closed()


async def not_http_then_close(leg: Leg, wire: Wire) -> None:
    await wire.send(b"SSH-2.0-OpenSSH_9.6\r\n")


async def silent(leg: Leg, wire: Wire) -> None:
    await wire.until_closed()


async def drip(leg: Leg, wire: Wire) -> None:
    """Headers, then one byte of an event that never completes, every 20 ms."""
    await wire.send(SSE_HEAD)
    while True:
        await wire.send(chunk(b"d"))
        await trio.sleep(0.02)


async def token_then_drip(leg: Leg, wire: Wire) -> None:
    """One token, then partial-line bytes forever: each resets the gap timer."""
    await wire.send(SSE_HEAD + chunk(token_event()))
    while True:
        await wire.send(chunk(b"d"))
        await trio.sleep(0.02)


async def endless_json_body(leg: Leg, wire: Wire) -> None:
    """A non-streaming answer whose body never ends."""
    await wire.send(
        head(200, [("content-type", "application/json"), ("transfer-encoding", "chunked")])
    )
    await wire.send(chunk(b'{"choices": [{"text": "'))
    while True:
        await wire.send(chunk(b"y" * 65536))


async def not_json_body(leg: Leg, wire: Wire) -> None:
    body = b"<html>hello</html>"
    await wire.send(
        head(200, [("content-type", "application/json"), ("content-length", str(len(body)))]) + body
    )


async def short_body(leg: Leg, wire: Wire) -> None:
    """Content-Length says 1000; 10 bytes arrive, then the connection closes."""
    await wire.send(head(200, [("content-type", "application/json"), ("content-length", "1000")]))
    await wire.send(b'{"choices"')


async def html_500(leg: Leg, wire: Wire) -> None:
    body = b"<html><body>502 Bad Gateway from some proxy</body></html>"
    await wire.send(
        head(500, [("content-type", "text/html"), ("content-length", str(len(body)))]) + body
    )


async def json_for_a_stream(leg: Leg, wire: Wire) -> None:
    """An engine that ignores stream=true and answers one JSON document."""
    await wire.send(json_response(prefill_document()))


async def untyped_json_for_a_stream(leg: Leg, wire: Wire) -> None:
    """The same, with no content type."""
    body = json.dumps(prefill_document()).encode()
    await wire.send(head(200, [("content-length", str(len(body)))]) + body)


NESTED = b"[" * 10_000 + b"]" * 10_000


async def nested_json_body(leg: Leg, wire: Wire) -> None:
    """A 200 body of deeply nested arrays (a JSON parser's recursion limit)."""
    body = b'{"choices": ' + NESTED + b"}"
    await wire.send(
        head(200, [("content-type", "application/json"), ("content-length", str(len(body)))]) + body
    )


async def nested_event(leg: Leg, wire: Wire) -> None:
    """A stream whose first event is deeply nested, then a proper end."""
    await wire.send(SSE_HEAD + chunk(b"data: " + NESTED + b"\n\n" + token_event()))
    await wire.send(chunk(b"data: [DONE]\n\n") + LAST_CHUNK)


async def nested_error_event(leg: Leg, wire: Wire) -> None:
    """A token, then an error event whose body is deeply nested."""
    await wire.send(SSE_HEAD + chunk(token_event()))
    await wire.send(chunk(b'data: {"error": ' + NESTED + b"}\n\n") + LAST_CHUNK)


async def nested_error_status(leg: Leg, wire: Wire) -> None:
    """A 503 whose error body is deeply nested."""
    body = b'{"error": ' + NESTED + b"}"
    await wire.send(
        head(503, [("content-type", "application/json"), ("content-length", str(len(body)))]) + body
    )
