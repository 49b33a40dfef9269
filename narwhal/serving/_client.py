"""Writing to the client through ASGI: JSON responses, SSE streams, terminal errors."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import trio

from .._errors import BadRequest, NarwhalError, PayloadTooLarge

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class ClientGone(Exception):
    """The client closed its connection."""


def eager(receive: Receive) -> Receive:
    """`receive` without a trip through the scheduler when a message is already waiting.

    hypercorn hands the app its memory channel's `receive`, which yields to the scheduler
    even when the request body is already queued: two passes of the event loop per
    request (the body, then the disconnect watch), each one a full queue under load,
    before the first engine request goes out. Taking a queued message at once and
    waiting only when there is none changes nothing else (the caller's next await
    checkpoints). Any other callable is returned as is."""
    channel = getattr(receive, "__self__", None)
    if not isinstance(channel, trio.MemoryReceiveChannel):
        return receive

    async def receive_eagerly() -> MutableMapping[str, Any]:
        try:
            message: MutableMapping[str, Any] = channel.receive_nowait()
        except trio.WouldBlock:
            message = await channel.receive()
        return message

    return receive_eagerly


def json_bytes(document: object) -> bytes:
    return json.dumps(document, separators=(",", ":")).encode()


class ClientChannel:
    """One response. `started` means the response is committed: no other status, no
    retry.

    A stream's status line goes out with its first bytes (`start_stream` only commits
    it), so until then a client error (a 4xx: an engine refusing the request inside its
    stream, which comes before any output) can still be answered as the HTTP error it
    is (`send_error`). A client therefore gets a stream's headers with its first event,
    not before the engine has answered.

    With `close_connection` the response says `connection: close`. Callers set it while
    the request's body may be unread: hypercorn cannot reuse a
    connection whose request it has not read to the end and closes it after the response,
    and a pooling client (httpx, the OpenAI SDKs) that was not told so sends its next
    request on it and sees "server disconnected without sending a response".

    An error's message goes out without the engine ids and urls it may name unless
    `engine_details` (serving.expose_engine_details; see `NarwhalError.public`).
    """

    __slots__ = (
        "_request_id",
        "_send",
        "_stream_pending",
        "close_connection",
        "engine_details",
        "finished",
        "started",
        "status",
    )

    def __init__(
        self,
        send: Send,
        request_id: str,
        *,
        close_connection: bool = False,
        engine_details: bool = False,
    ) -> None:
        self._send = send
        self._request_id = request_id.encode()
        self.close_connection = close_connection
        self.engine_details = engine_details
        self.started = False
        self.finished = False
        self.status = 0
        # A stream committed whose status line has not gone out yet.
        self._stream_pending = False

    async def _start(self, status: int, headers: Sequence[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.status = status
        closing = [(b"connection", b"close")] if self.close_connection else []
        await self._send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [*headers, *closing, (b"x-request-id", self._request_id)],
            }
        )

    async def send_json(
        self, status: int, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()
    ) -> None:
        self._stream_pending = False
        await self._start(
            status,
            [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(body)),
                *headers,
            ],
        )
        self.finished = True
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    async def start_stream(self) -> None:
        """Commit a 200 event stream; its status line goes out with its first bytes."""
        self.started = True
        self.status = 200
        self._stream_pending = True
        await trio.lowlevel.checkpoint()

    async def _stream_head(self) -> None:
        self._stream_pending = False
        await self._start(
            200, [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        )

    async def send_chunk(self, data: bytes) -> None:
        if self._stream_pending:
            await self._stream_head()
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end_stream(self) -> None:
        if self._stream_pending:
            await self._stream_head()
        self.finished = True
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})

    async def send_error(self, error: NarwhalError) -> None:
        """An HTTP error before the response started, else a terminal SSE error event.

        A client error (4xx) on a stream whose status line has not gone out yet is an
        HTTP error too. The error event carries the status the error would have had
        (`status`), and is never followed by `data: [DONE]`: clients must be able to
        tell a failed stream from a finished one (docs/design.md#streaming-failures).
        """
        if self.finished:
            return
        envelope = error.envelope(engine_details=self.engine_details)
        if not self.started or (self._stream_pending and 400 <= error.status < 500):
            await self.send_json(error.status, json_bytes(envelope), error.headers())
            return
        if self._stream_pending:
            await self._stream_head()
        fields = envelope["error"]
        assert isinstance(fields, dict)
        event = {"error": {**fields, "status": error.status}}
        self.finished = True
        await self._send(
            {
                "type": "http.response.body",
                "body": b"data: " + json_bytes(event) + b"\n\n",
                "more_body": False,
            }
        )


def has_body(headers: Sequence[tuple[bytes, bytes]]) -> bool:
    """Whether the request announces body bytes (RFC 9112 6.3: a length or chunked)."""
    for name, value in headers:
        if name == b"transfer-encoding":
            return True
        if name == b"content-length":
            try:
                return int(value) > 0
            except ValueError:
                return True  # refused as a bad request, with its bytes unread
    return False


async def read_body(receive: Receive, content_length: int | None, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed `limit`."""
    if content_length is not None and content_length > limit:
        raise PayloadTooLarge(
            f"request body of {content_length} bytes exceeds serving.max_request_bytes={limit}"
        )
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds serving.max_request_bytes={limit}")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def discard_body(
    receive: Receive, content_length: int | None, limit: int, within_s: float
) -> bool:
    """Read and drop the body of a request that will not be served, so that its connection
    stays reusable. False when it cannot be done cheaply: a body over `limit` bytes, one
    that has not ended within `within_s`, or a client that left; the response then closes
    the connection (`ClientChannel.close_connection`)."""
    if content_length is not None and content_length > limit:
        return False
    size = 0
    with trio.move_on_after(within_s):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return False
            size += len(message.get("body", b""))
            if size > limit:
                return False
            if not message.get("more_body", False):
                return True
    return False


def content_length(headers: Sequence[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                raise BadRequest("invalid content-length header") from None
    return None


async def watch_disconnect(receive: Receive, on_gone: Callable[[], None]) -> None:
    """After the body is read, the next ASGI message can only be a disconnect."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_gone()
            return
        await trio.lowlevel.checkpoint()
