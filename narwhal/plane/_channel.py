"""A duplex message channel between the decision core and one worker process
(docs/architecture.md#workers).

Owns
  `Channel`: calls (answered once, or with the exception the handler raised) and notes
  (one way, never answered) over one stream, a unix socketpair between two processes of
  the same Narwhal. Frames are a 4-byte length and a pickle: both ends are the same code,
  started by the core itself, so nothing outside the host ever writes to it.

Invariants
  Nothing waits on a peer that is gone. When the stream ends or breaks, every call still
  waiting raises `PeerGone`, later calls raise it at once, notes are dropped, and the
  handlers' tasks of the calls the peer made are cancelled: what they held for it (a
  queue place, an engine slot) is released by their own `async with`. A caller cancelled
  while its call runs tells the peer, which cancels that call's task. Writes are coalesced:
  every frame queued while one write runs goes out in the next. The frames queued but not
  yet written are bounded by `max_outbox_bytes`; a peer that does not read past that is
  treated as gone.

Errors
  `PeerGone` names the peer and why. A frame longer than `max_frame_bytes` ends the
  channel (`PeerGone`): only a bug on the other side writes one.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import attrs
import trio

# A call's handler: given the call's name and payload, and `reply`, which answers at once
# and lets the handler run on (a hold answers when granted and keeps its resource until
# the call is cancelled). Its return value answers the call unless `reply` did.
CallHandler = Callable[[str, object, Callable[[object], None]], Awaitable[object]]
NoteHandler = Callable[[str, object], None]

log = logging.getLogger("narwhal.plane")

_HEADER = struct.Struct("!I")
_CALL, _REPLY, _RAISE, _NOTE, _CANCEL = range(5)
MAX_FRAME_BYTES = 16 * 1024 * 1024
MAX_OUTBOX_BYTES = 64 * 1024 * 1024
_READ_BYTES = 256 * 1024


class PeerGone(Exception):
    """The process at the other end of a channel is gone, or stopped reading."""


class RemoteFailure(Exception):
    """A call's handler raised an exception that could not be sent back as itself."""


@attrs.frozen
class ChannelStatistics:
    calls_waiting: int
    calls_running: int
    outbox_bytes: int
    frames_sent: int
    writes: int


@attrs.define(eq=False)
class _Waiting:
    done: trio.Event = attrs.field(factory=trio.Event)
    ok: bool = False
    value: object = None


class Channel:
    """One end of a core-worker channel; `run` must be running for calls and notes."""

    def __init__(
        self,
        stream: trio.abc.HalfCloseableStream,
        *,
        peer: str,
        on_call: CallHandler,
        on_note: NoteHandler,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        max_outbox_bytes: int = MAX_OUTBOX_BYTES,
    ) -> None:
        self.peer = peer
        self._stream = stream
        self._on_call = on_call
        self._on_note = on_note
        self._max_frame = max_frame_bytes
        self._max_outbox = max_outbox_bytes
        self._ids = itertools.count(1)
        self._waiting: dict[int, _Waiting] = {}
        self._running: dict[int, trio.CancelScope] = {}
        self._outbox: list[bytes] = []
        self._outbox_bytes = 0
        self._wake = trio.Event()
        self._gone: str | None = None
        self._frames_sent = 0
        self._writes = 0
        self._stopped = trio.CancelScope()
        self._calls: trio.Nursery | None = None
        self._ended = trio.Event()

    def __repr__(self) -> str:
        state = "gone" if self._gone is not None else "open"
        return (
            f"<Channel {self.peer} [{state}, {len(self._waiting)} waiting,"
            f" {len(self._running)} running]>"
        )

    @property
    def gone(self) -> str | None:
        """Why the peer is gone; None while the channel is open."""
        return self._gone

    def statistics(self) -> ChannelStatistics:
        return ChannelStatistics(
            calls_waiting=len(self._waiting),
            calls_running=len(self._running),
            outbox_bytes=self._outbox_bytes,
            frames_sent=self._frames_sent,
            writes=self._writes,
        )

    # ---------------------------------------------------------------- the service

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Read and write until the peer goes or `close` is called; then fail every
        waiting call, cancel every running one, and close the stream."""
        try:
            with self._stopped:
                async with trio.open_nursery() as nursery:
                    self._calls = nursery
                    nursery.start_soon(self._write_loop)
                    task_status.started()
                    await self._read_loop()
                    nursery.cancel_scope.cancel()
        finally:
            self._lost(self._gone or "the channel was closed")
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self._stream)
            self._ended.set()

    async def wait_gone(self) -> str:
        """Once `run` has ended: why the peer is gone."""
        await self._ended.wait()
        assert self._gone is not None
        return self._gone

    def close(self, reason: str = "the channel was closed") -> None:
        """Stop `run`: the peer reads an end of stream and takes us for gone."""
        self._lost(reason)
        self._stopped.cancel()

    # ---------------------------------------------------------------- calls and notes

    async def call(self, name: str, payload: object = None) -> object:
        """The peer's answer to `name`; raises what its handler raised, or `PeerGone`."""
        _, value = await self._call(name, payload)
        return value

    @asynccontextmanager
    async def hold(self, name: str, payload: object = None) -> AsyncIterator[object]:
        """Hold what the peer's `name` handler grants (its early `reply`) for the body:
        leaving the body cancels the handler's task, whose own `async with` releases it.
        A peer that goes away releases everything held of it the same way."""
        call_id, value = await self._call(name, payload)
        try:
            yield value
        finally:
            if self._gone is None:
                self._queue((_CANCEL, call_id, "", None))

    async def _call(self, name: str, payload: object) -> tuple[int, object]:
        if self._gone is not None:
            raise PeerGone(f"{self.peer} is gone: {self._gone}")
        call_id = next(self._ids)
        waiting = self._waiting[call_id] = _Waiting()
        try:
            self._queue((_CALL, call_id, name, payload))
            await waiting.done.wait()
        except BaseException:
            if not waiting.done.is_set() and self._gone is None:
                self._queue((_CANCEL, call_id, "", None))
            elif waiting.ok and self._gone is None:
                # Granted as we were cancelled: what was granted is ours to give back.
                self._queue((_CANCEL, call_id, "", None))
            raise
        finally:
            self._waiting.pop(call_id, None)
        if waiting.ok:
            return call_id, waiting.value
        assert isinstance(waiting.value, BaseException)
        raise waiting.value

    def note(self, name: str, payload: object = None) -> None:
        """Send `name` one way; dropped when the peer is gone."""
        if self._gone is None:
            self._queue((_NOTE, 0, name, payload))

    # ---------------------------------------------------------------- reading

    async def _read_loop(self) -> None:
        buffer = bytearray()
        while True:
            try:
                data = await self._stream.receive_some(_READ_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self._gone = self._gone or f"its stream broke ({type(exc).__name__})"
                return
            if not data:
                self._gone = self._gone or "it closed the channel"
                return
            buffer += data
            start = 0
            while len(buffer) - start >= _HEADER.size:
                (length,) = _HEADER.unpack_from(buffer, start)
                if length > self._max_frame:
                    self._gone = f"it sent a frame of {length} bytes (at most {self._max_frame})"
                    return
                end = start + _HEADER.size + length
                if len(buffer) < end:
                    break
                frame = pickle.loads(memoryview(buffer)[start + _HEADER.size : end])
                start = end
                self._dispatch(frame)
            del buffer[:start]

    def _dispatch(self, frame: tuple[int, int, str, object]) -> None:
        kind, call_id, name, payload = frame
        if kind == _NOTE:
            try:
                self._on_note(name, payload)
            except Exception as exc:
                # A note that cannot be applied leaves this end's books wrong for the
                # peer's requests: the peer goes (its requests released, a worker
                # restarted) rather than the whole process.
                log.exception("note %r from %s failed", name, self.peer)
                self.close(f"its note `{name}` could not be applied: {type(exc).__name__}")
        elif kind == _CALL:
            assert self._calls is not None
            # Registered now, not when its task first runs: a cancel read in the same
            # pass as the call must find it.
            scope = self._running[call_id] = trio.CancelScope()
            self._calls.start_soon(self._serve_call, scope, call_id, name, payload)
        elif kind in (_REPLY, _RAISE):
            waiting = self._waiting.get(call_id)
            if waiting is not None:  # else its caller was cancelled meanwhile
                waiting.ok = kind == _REPLY
                waiting.value = payload
                waiting.done.set()
        elif kind == _CANCEL:
            running = self._running.get(call_id)
            if running is not None:
                running.cancel()

    async def _serve_call(
        self, scope: trio.CancelScope, call_id: int, name: str, payload: object
    ) -> None:
        replied = False

        def reply(value: object) -> None:
            nonlocal replied
            if not replied:
                replied = True
                self._queue((_REPLY, call_id, "", value))

        with scope:
            try:
                value = await self._on_call(name, payload, reply)
            except Exception as exc:
                if not replied:
                    replied = True
                    self._queue((_RAISE, call_id, "", _sendable(exc)))
            else:
                reply(value)
            finally:
                del self._running[call_id]

    # ---------------------------------------------------------------- writing

    def _queue(self, frame: tuple[int, int, str, object]) -> None:
        if self._gone is not None:
            return
        try:
            data = pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            kind, call_id, name, _ = frame
            if kind != _REPLY:
                raise  # the caller's own bug: raised where it sent it
            # An answer that cannot travel fails its call, not the channel.
            failure = RemoteFailure(f"the answer could not be sent: {type(exc).__name__}: {exc}")
            data = pickle.dumps((_RAISE, call_id, name, failure), protocol=pickle.HIGHEST_PROTOCOL)
        self._outbox.append(_HEADER.pack(len(data)))
        self._outbox.append(data)
        self._outbox_bytes += _HEADER.size + len(data)
        if self._outbox_bytes > self._max_outbox:
            self.close(f"it left {self._outbox_bytes} bytes unread (at most {self._max_outbox})")
            return
        self._wake.set()

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            frames, self._outbox = self._outbox, []
            self._outbox_bytes = 0
            self._frames_sent += len(frames) // 2
            self._writes += 1
            try:
                await self._stream.send_all(b"".join(frames))
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self.close(f"its stream broke ({type(exc).__name__})")
                return

    def _lost(self, reason: str) -> None:
        if self._gone is None:
            self._gone = reason
        gone = PeerGone(f"{self.peer} is gone: {self._gone}")
        for waiting in self._waiting.values():
            if not waiting.done.is_set():
                waiting.value = gone
                waiting.done.set()
        self._outbox.clear()
        self._outbox_bytes = 0


def _sendable(exc: Exception) -> Exception:
    """`exc` itself when it survives a pickle round trip, else a `RemoteFailure`
    naming it."""
    try:
        pickle.loads(pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:
        return RemoteFailure(f"{type(exc).__name__}: {exc}")
    return exc
