"""A campaign client: one HTTP/1.1 exchange on its own connection, recorded exactly.

httpx hides what the invariants need (when the first event arrived, whether the body
ended with its framing intact or the connection was cut, what a client that hangs up
half-way had seen), so this is a bare h11 client. Every exchange is bounded by
`give_up_s` of its own: a router that breaks its deadline shows up as an exchange the
client had to abandon (`timed_out`), never as a hung test.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import attrs
import h11
import trio

_READ = 65536


@attrs.define(eq=False)
class Exchange:
    """What one client saw of one request."""

    request_id: str
    stream: bool
    label: str = ""
    started: float = 0.0
    ended: float = 0.0
    ended_wall: float = 0.0  # time.time() at `ended`, comparable with other processes
    head_wall: float = 0.0  # time.time() when the response head arrived (0: it never did)
    status: int | None = None
    headers: dict[str, str] = attrs.Factory(dict)
    body: bytes = b""
    # The response ended with its HTTP framing intact (EndOfMessage).
    complete: bool = False
    # Why the response stopped short when the client did not ask it to (EOF, reset,
    # bytes that are not HTTP); None for a complete response.
    cut: str | None = None
    # The client hung up on purpose; the value says when (a stage, "after 3 events"...).
    hung_up: str | None = None
    # The client's own bound ran out: the router kept it waiting past every deadline.
    timed_out: bool = False
    # A write of the request failed: the router answered and closed while it was sent.
    upload_cut: bool = False
    first_output_at: float | None = None
    _changed: trio.Event = attrs.Factory(trio.Event)

    @property
    def duration(self) -> float:
        return self.ended - self.started

    def events(self) -> list[str]:
        """The SSE payloads received in full (a trailing partial event is left out)."""
        text = self.body.decode("utf-8", errors="replace")
        blocks = text.split("\n\n")[:-1]
        out = []
        for block in blocks:
            lines = [line for line in block.split("\n") if line.startswith("data:")]
            out.append("\n".join(line[5:].lstrip(" ") for line in lines))
        return out

    async def wait_changed(self) -> None:
        """Return after the next bytes of the response arrive (or it ends)."""
        await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


HangUp = Callable[[Exchange], Awaitable[str]]
"""Runs beside the exchange; when it returns, the client closes the connection and the
returned text is recorded as `hung_up`."""


def after_events(count: int) -> HangUp:
    async def hang_up(exchange: Exchange) -> str:
        while len(exchange.events()) < count:
            await exchange.wait_changed()
        return f"after {count} events"

    return hang_up


def when(predicate: Callable[[], bool], label: str, *, within_s: float = 10.0) -> HangUp:
    """Hang up once `predicate` holds (bounded polling of state in this process)."""

    async def hang_up(exchange: Exchange) -> str:
        with trio.fail_after(within_s):
            while not predicate():  # noqa: ASYNC110 - router state has no event to await
                await trio.sleep(0.002)
        return label

    return hang_up


def _split(url: str) -> tuple[str, int]:
    rest = url.split("://", 1)[1]
    host, _, port = rest.partition(":")
    return host, int(port.split("/", 1)[0])


async def exchange(
    url: str,
    body: bytes | Mapping[str, Any],
    *,
    request_id: str,
    path: str = "/v1/completions",
    stream: bool | None = None,
    label: str = "",
    headers: Sequence[tuple[str, str]] = (),
    content_length: bool = True,
    body_pieces: int = 1,
    body_pause_s: float = 0.0,
    stall_body: bool = False,
    before: bytes = b"",
    after: bytes = b"",
    half_close: bool = False,
    hang_up: HangUp | None = None,
    read: bool = True,
    receive_buffer: int | None = None,
    local_address: str | None = None,
    give_up_s: float = 30.0,
    on_start: Callable[[Exchange], None] | None = None,
) -> Exchange:
    """POST `body` and record the response.

    `body_pieces`/`body_pause_s` trickle the body (a slow uploader); `stall_body`
    sends half of it and then nothing, without ever ending the request. Without
    `content_length` the body goes chunked. `before` goes ahead of the request head and
    `after` right behind it, in the same writes; `half_close` ends the sending side once
    the request is sent (`shutdown(SHUT_WR)`, as `nc -N` does), and the client reads on. `read=False` with a small `receive_buffer`
    is a client that stops reading (the router must disconnect it); it needs a
    `hang_up` to end. Network errors never escape: they are what the exchange records.
    `on_start` gets the exchange as soon as it exists, to watch it while it runs.
    `local_address` is the client's own (another loopback address is another client).
    """
    assert read or hang_up is not None, "a client that never reads needs a hang_up"
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    if stream is None:
        stream = bool(isinstance(body, Mapping) and body.get("stream"))
    ex = Exchange(request_id=request_id, stream=stream, label=label)
    ex.started = trio.current_time()
    if on_start is not None:
        on_start(ex)
    host, port = _split(url)
    conn = h11.Connection(h11.CLIENT)
    sock: trio.SocketStream | None = None
    try:
        with trio.move_on_after(give_up_s) as bound:
            sock = await _connect(host, port, receive_buffer, local_address)
            head = [
                ("host", f"{host}:{port}"),
                ("content-type", "application/json"),
                ("x-request-id", request_id),
                *headers,
            ]
            if content_length:
                head.append(("content-length", str(len(raw))))
            else:
                head.append(("transfer-encoding", "chunked"))
            async with trio.open_nursery() as nursery:

                async def hang_up_task(hang: HangUp) -> None:
                    ex.hung_up = await hang(ex)
                    nursery.cancel_scope.cancel()

                if hang_up is not None:
                    nursery.start_soon(hang_up_task, hang_up)
                if stall_body:
                    out = conn.send(h11.Request(method="POST", target=path, headers=head)) or b""
                    out += conn.send(h11.Data(data=raw[: len(raw) // 2])) or b""
                    await sock.send_all(before + out)
                else:
                    await _send_request(
                        sock, conn, path, head, raw, body_pieces, body_pause_s, ex, before, after
                    )
                if half_close and not ex.upload_cut:
                    await sock.send_eof()
                if read:
                    await _read_response(sock, conn, ex)
                    nursery.cancel_scope.cancel()
        if bound.cancelled_caught and ex.hung_up is None:
            ex.timed_out = True
    finally:
        ex.ended = trio.current_time()
        ex.ended_wall = time.time()
        if sock is not None:
            with trio.move_on_after(1.0, shield=True):
                await trio.aclose_forcefully(sock)
        ex._notify()
    return ex


async def _connect(
    host: str, port: int, receive_buffer: int | None, local_address: str | None
) -> trio.SocketStream:
    if receive_buffer is None:
        return await trio.open_tcp_stream(host, port, local_address=local_address)
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    if local_address is not None:
        await sock.bind((local_address, 0))
    await sock.connect((host, port))
    return trio.SocketStream(sock)


async def _send_request(
    sock: trio.SocketStream,
    conn: h11.Connection,
    path: str,
    head: list[tuple[str, str]],
    raw: bytes,
    pieces: int,
    pause_s: float,
    ex: Exchange,
    before: bytes = b"",
    after: bytes = b"",
) -> None:
    out = before + (conn.send(h11.Request(method="POST", target=path, headers=head)) or b"")
    size = max(1, -(-len(raw) // max(1, pieces)))
    parts = [raw[i : i + size] for i in range(0, len(raw), size)] or [b""]
    try:
        for index, part in enumerate(parts):
            if part:
                out += conn.send(h11.Data(data=part)) or b""
            if index == len(parts) - 1:
                out += (conn.send(h11.EndOfMessage()) or b"") + after
            await sock.send_all(out)
            out = b""
            if pause_s and index < len(parts) - 1:
                await trio.sleep(pause_s)  # pacing the upload, not ordering anything
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        # The router may answer (413, 504) and close before the upload ends; the
        # response, if any, is still in our receive buffer.
        ex.cut = f"send failed: {exc!r}"
        ex.upload_cut = True


async def _read_response(sock: trio.SocketStream, conn: h11.Connection, ex: Exchange) -> None:
    parts: list[bytes] = []
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            ex.cut = f"not HTTP: {exc}"
            return
        if event is h11.NEED_DATA:
            try:
                data = await sock.receive_some(_READ)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                ex.cut = f"receive failed: {exc!r}"
                return
            try:
                conn.receive_data(data)
            except RuntimeError:
                pass
            continue
        if isinstance(event, h11.Response):
            ex.head_wall = time.time()
            ex.status = event.status_code
            ex.headers = {k.decode(): v.decode("latin-1") for k, v in event.headers}
            ex.cut = None
            ex._notify()
        elif isinstance(event, h11.InformationalResponse):
            continue
        elif isinstance(event, h11.Data):
            data = bytes(event.data)
            parts.append(data)
            ex.body = b"".join(parts)
            if ex.first_output_at is None and _has_output(ex):
                ex.first_output_at = trio.current_time()
            ex._notify()
        elif isinstance(event, h11.EndOfMessage):
            ex.complete = True
            ex.cut = None
            return
        elif isinstance(event, h11.ConnectionClosed):
            ex.cut = "connection closed before the response ended"
            return
        else:
            ex.cut = f"unexpected {event!r}"
            return


def _has_output(ex: Exchange) -> bool:
    if not ex.stream or ex.status != 200:
        return False
    return any(not is_error_event(e) for e in ex.events())


def is_error_event(payload: str) -> bool:
    try:
        document = json.loads(payload)
    except (ValueError, RecursionError):
        return False
    return isinstance(document, dict) and "error" in document
