"""Helpers shared by the integration tests: SSE parsing, a raw SSE reader, bounded waits."""

from __future__ import annotations

import json
import os
import random
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, ClassVar

import h11
import httpx
import trio

from narwhal.fleet import Claim, EngineState, EngineView
from narwhal.serving import DecodeGaps, OpenFileLimit, ServingContext
from narwhal.sim import Fleet
from narwhal.supervisor import Supervisor

StartFleet = Callable[..., Awaitable[Fleet]]


class InFront:
    """What a test reads of a Narwhal running in-process in front of a fleet (simulated
    or real): its client url, its admin url, its serving context, and its `/narwhal/state`
    and `/metrics` (read on the admin listener, with its token when one is set)."""

    supervisor: Supervisor
    state_timeout_s: ClassVar[float] = 5.0

    @property
    def url(self) -> str:
        return self.supervisor.url

    @property
    def admin_url(self) -> str:
        return self.supervisor.admin_url

    @property
    def ctx(self) -> ServingContext:
        assert self.supervisor.ctx is not None
        return self.supervisor.ctx

    def client(self) -> httpx.AsyncClient:
        """A client of the client listener (relative urls), which waits up to 30 s."""
        return httpx.AsyncClient(base_url=self.url, timeout=30)

    def admin_headers(self) -> dict[str, str]:
        token = self.ctx.config.admin.bearer_token()
        return {} if token is None else {"authorization": f"Bearer {token.reveal()}"}

    async def _admin_get(self, path: str) -> httpx.Response:
        async with httpx.AsyncClient(timeout=self.state_timeout_s) as client:
            response = await client.get(f"{self.admin_url}{path}", headers=self.admin_headers())
        response.raise_for_status()
        return response

    async def state(self) -> dict[str, Any]:
        document: dict[str, Any] = (await self._admin_get("/narwhal/state")).json()
        return document

    async def metrics(self) -> str:
        return (await self._admin_get("/metrics")).text


class FakeFileLimit:
    """An RLIMIT_NOFILE for a Supervisor, so that tests neither depend on nor change the
    test process's own; `refuse`: what setrlimit raises."""

    def __init__(self, soft: int = 65536, hard: int = 65536, refuse: OSError | None = None):
        self.soft = soft
        self.hard = hard
        self.refuse = refuse
        self.set_to: list[tuple[int, int]] = []

    def get(self) -> tuple[int, int]:
        return self.soft, self.hard

    def set(self, soft: int, hard: int) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.set_to.append((soft, hard))
        self.soft, self.hard = soft, hard

    def limit(self) -> OpenFileLimit:
        return OpenFileLimit(self.get, self.set)


async def wait_for(predicate: Callable[[], bool], *, within_s: float = 5.0) -> None:
    """Bounded polling of the simulator's own state, for the few waits no event covers
    (the state lives in another task or behind a socket, so there is no event to await)."""
    with trio.fail_after(within_s):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.005)


def sse_payloads(raw: bytes) -> list[str]:
    """Split an SSE body into its `data:` payloads, asserting vLLM's exact framing."""
    text = raw.decode()
    assert text.endswith("\n\n"), text[-80:]
    events = text[:-2].split("\n\n")
    out = []
    for event in events:
        assert event.startswith("data: "), event
        assert "\n" not in event, event
        out.append(event[len("data: ") :])
    return out


def sse_json(raw: bytes) -> list[Any]:
    payloads = sse_payloads(raw)
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


async def post_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], **kw: Any
) -> tuple[int, dict[str, str], bytes]:
    async with client.stream("POST", url, json=body, **kw) as resp:
        data = b"".join([chunk async for chunk in resp.aiter_raw()])
        return resp.status_code, dict(resp.headers), data


class SseReader:
    """A bare h11 SSE reader for tests that stop reading half-way.

    httpx's nested async generators warn when abandoned mid-stream (filterwarnings=error),
    and these tests need exact control over when the connection closes anyway.
    """

    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self._conn = h11.Connection(h11.CLIENT)
        self._buffer = b""
        self.status = 0
        self.headers: dict[str, str] = {}
        self.ended = False

    async def _send(
        self, method: str, target: str, host: str, body: bytes, headers: dict[str, str]
    ) -> None:
        hdrs = [
            ("host", host),
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
            *headers.items(),
        ]
        out = self._conn.send(h11.Request(method=method, target=target, headers=hdrs)) or b""
        out += self._conn.send(h11.Data(data=body)) or b""
        out += self._conn.send(h11.EndOfMessage()) or b""
        await self._stream.send_all(out)
        while True:
            event = await self._next()
            if isinstance(event, h11.Response):
                self.status = event.status_code
                self.headers = {k.decode(): v.decode() for k, v in event.headers}
                return

    async def _next(self) -> Any:
        while True:
            event = self._conn.next_event()
            if event is h11.NEED_DATA:
                self._conn.receive_data(await self._stream.receive_some(65536))
                continue
            return event

    async def event(self) -> str | None:
        """The next SSE payload (without `data: `), or None at the end of the body."""
        while b"\n\n" not in self._buffer:
            if self.ended:
                return None
            ev = await self._next()
            if isinstance(ev, h11.Data):
                self._buffer += bytes(ev.data)
            elif isinstance(ev, h11.EndOfMessage):
                self.ended = True
            else:
                raise h11.RemoteProtocolError(f"unexpected {ev!r}")
        raw, self._buffer = self._buffer.split(b"\n\n", 1)
        text = raw.decode()
        assert text.startswith("data: "), text
        return text[len("data: ") :]

    async def aclose(self) -> None:
        await self._stream.aclose()


@asynccontextmanager
async def open_sse(
    url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> AsyncIterator[SseReader]:
    parts = httpx.URL(url)
    stream = await trio.open_tcp_stream(parts.host, parts.port or 80)
    reader = SseReader(stream)
    try:
        await reader._send(
            "POST", path, f"{parts.host}:{parts.port}", json.dumps(body).encode(), headers or {}
        )
        yield reader
    finally:
        await reader.aclose()


async def send_raw_request(
    url: str, path: str, body: bytes, headers: dict[str, str] | None = None
) -> trio.SocketStream:
    """Send one HTTP/1.1 request and hand back the socket without reading anything."""
    parts = httpx.URL(url)
    stream = await trio.open_tcp_stream(parts.host, parts.port or 80)
    head = [
        f"POST {path} HTTP/1.1",
        f"host: {parts.host}:{parts.port}",
        "content-type: application/json",
    ]
    head.extend(f"{k}: {v}" for k, v in (headers or {"content-length": str(len(body))}).items())
    await stream.send_all(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    return stream


def engine_view(engine_id: str, role: str, **fields: object) -> EngineView:
    """An idle, available engine view; keyword arguments override any field."""
    values: dict[str, object] = {
        "id": engine_id,
        "role": role,
        "prefill_blocked": None,
        "decode_blocked": None,
        "prefill_inflight": 0,
        "prefill_tokens_inflight": 0,
        "prefill_slots_free": float("inf"),
        "decode_active": 0,
        "decode_tokens": 0,
        "decode_slots_free": float("inf"),
    }
    values.update(fields)
    return EngineView(**values)  # type: ignore[arg-type]


def claims(take: Callable[[int], Claim], count: int, tokens: int = 0) -> list[Claim]:
    """`count` claims on an engine's load ledger sharing `tokens` as evenly as whole
    tokens allow, as `count` requests' legs would take them:
    `claims(engine.load.decode, 3, 1200)` is three decode streams holding 1200 tokens."""
    share, rest = divmod(tokens, count)
    return [take(share + (i < rest)) for i in range(count)]


class GapRecorder:
    """ServingSignals that keeps the decode gap summary each stream reports, in order
    (install it as `ctx.signals`)."""

    def __init__(self) -> None:
        self.summaries: list[DecodeGaps] = []

    def first_token_timeout(self, engine: EngineState) -> None:
        pass

    def ttft_breach(self) -> None:
        pass

    def decode_gaps(self, engine: EngineState, gaps: DecodeGaps) -> None:
        self.summaries.append(gaps)


@contextmanager
def fifo(path: Path, *, unblock_every_s: float = 30.0) -> Iterator[str]:
    """A FIFO at `path` that nobody writes to (its path, as a string). Opening it to read
    waits for a writer: every `unblock_every_s` (real time) and at exit one comes and
    goes, so a reader left waiting (code that did not refuse FIFOs) gets an empty file
    and the test fails instead of hanging."""
    os.mkfifo(path)
    done = threading.Event()

    def unblock() -> None:
        try:
            writer = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            pass  # no reader waiting: ENXIO
        else:
            os.close(writer)

    def watchdog() -> None:
        while not done.wait(unblock_every_s):
            unblock()

    threading.Thread(target=watchdog, name="fifo watchdog", daemon=True).start()
    try:
        yield str(path)
    finally:
        done.set()
        unblock()


def free_port() -> int:
    """A loopback port free at the time of asking (the caller binds it soon after)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_HANDED_OUT: set[int] = set()


def late_port() -> int:
    """A loopback port free now and below the kernel's ephemeral range, for a server that
    binds it long after it is chosen (a real engine: tens of seconds). Meanwhile any
    outgoing connection may take a port of the ephemeral range as its source: CI lost a
    vLLM fleet so, NIXL's side channel finding its port in use. Never the same twice."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    chooser = random.Random()
    for _ in range(1000):
        port = chooser.randrange(20000, max(20001, low))
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free loopback port below {low} in 1000 tries")
