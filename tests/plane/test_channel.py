from __future__ import annotations

import pickle
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
import trio
import trio.lowlevel
import trio.testing

from narwhal._codes import ErrorCode
from narwhal._errors import Refused
from narwhal.admission import PathQuote
from narwhal.plane import Channel, PeerGone, RemoteFailure
from narwhal.plane._channel import _CALL, _CANCEL

QUOTE = PathQuote("p0", "disaggregated", wait_s=0.5, ttft_s=0.75, idle_ttft_s=0.25, in_domain=True)

Reply = Callable[[object], None]


class Peer:
    """One end's handlers: calls named `echo`, `fail`, `odd`, `hold` and `slow`."""

    def __init__(self) -> None:
        self.notes: list[tuple[str, object]] = []
        self.held = 0
        self.released = 0
        self.release = trio.Event()

    async def on_call(self, name: str, payload: object, reply: Reply) -> object:
        if name == "echo":
            return payload
        if name == "fail":
            refusal = Refused("queue is full", code=ErrorCode.QUEUE_FULL, retry_after_s=1.0)
            refusal.quote = QUOTE  # set after construction, as admission does
            raise refusal
        if name == "odd":
            raise _Unpicklable(lambda: None)
        if name == "odd_answer":
            return lambda: None
        if name == "hold":
            self.held += 1
            try:
                reply("granted")
                await trio.sleep_forever()
            finally:
                self.released += 1
                self.release.set()
        if name == "slow":
            try:
                await trio.sleep_forever()
            finally:
                self.released += 1
                self.release.set()
        raise AssertionError(name)

    def on_note(self, name: str, payload: object) -> None:
        if name == "bad":
            raise ValueError("cannot apply it")
        self.notes.append((name, payload))


class _Unpicklable(Exception):
    def __init__(self, thing: object) -> None:
        super().__init__("cannot travel")
        self.thing = thing


@asynccontextmanager
async def pair(**limits: int) -> AsyncIterator[tuple[Channel, Channel, Peer, Peer]]:
    a, b = trio.socket.socketpair()
    left, right = Peer(), Peer()
    one = Channel(
        trio.SocketStream(a), peer="right", on_call=left.on_call, on_note=left.on_note, **limits
    )
    two = Channel(trio.SocketStream(b), peer="left", on_call=right.on_call, on_note=right.on_note)
    async with trio.open_nursery() as nursery:
        await nursery.start(one.run)
        await nursery.start(two.run)
        yield one, two, left, right
        nursery.cancel_scope.cancel()


async def test_a_call_is_answered_and_a_note_arrives_in_order() -> None:
    async with pair() as (one, _two, _left, right):
        with trio.fail_after(5):
            assert await one.call("echo", {"tokens": 1200, "model": "m"}) == {
                "tokens": 1200,
                "model": "m",
            }
            one.note("kv_freed", 1)
            one.note("kv_freed", 2)
            assert await one.call("echo", 3) == 3  # after the notes: one stream, in order
        assert right.notes == [("kv_freed", 1), ("kv_freed", 2)]


async def test_the_handlers_exception_is_raised_at_the_caller_as_itself() -> None:
    async with pair() as (one, *_):
        with trio.fail_after(5), pytest.raises(Refused, match=r"^queue is full$") as caught:
            await one.call("fail")
        assert caught.value.code == ErrorCode.QUEUE_FULL
        assert caught.value.retry_after_s == 1.0
        assert caught.value.quote == QUOTE
        with (
            trio.fail_after(5),
            pytest.raises(RemoteFailure, match=r"^_Unpicklable: cannot travel$"),
        ):
            await one.call("odd")


async def test_a_cancelled_caller_cancels_the_peers_task_and_what_it_held() -> None:
    async with pair() as (one, two, _left, right):
        with trio.fail_after(5):
            assert await one.call("hold") == "granted"  # answered early, still held
            assert right.held == 1
            assert two.statistics().calls_running == 1
            with trio.move_on_after(0.05):
                await one.call("slow")
            await right.release.wait()
            assert right.released == 1
            assert two.statistics().calls_running == 1  # the hold is still there


async def test_a_call_cancelled_in_the_same_read_as_it_is_not_left_holding() -> None:
    a, b = trio.socket.socketpair()
    peer = Peer()
    channel = Channel(trio.SocketStream(a), peer="raw", on_call=peer.on_call, on_note=peer.on_note)
    raw = trio.SocketStream(b)

    def frame(*fields: object) -> bytes:
        data = pickle.dumps(fields)
        return struct.pack("!I", len(data)) + data

    async with trio.open_nursery() as nursery:
        await nursery.start(channel.run)
        with trio.fail_after(5):
            # A call and its cancel in one read: dispatched before the call's task runs.
            await raw.send_all(frame(_CALL, 1, "hold", None) + frame(_CANCEL, 1, "", None))
            await trio.testing.wait_all_tasks_blocked()
            assert channel.statistics().calls_running == 0
            assert peer.held == peer.released
        nursery.cancel_scope.cancel()
    await raw.aclose()


async def test_calls_made_and_waiting_fail_at_once_when_the_peer_goes() -> None:
    async with pair() as (one, two, _left, right):
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                failures: list[str] = []

                async def waiting() -> None:
                    try:
                        await one.call("slow")
                    except PeerGone as exc:
                        failures.append(str(exc))

                nursery.start_soon(waiting)
                await trio.testing.wait_all_tasks_blocked()
                two.close("the worker was killed")
            assert failures == ["right is gone: it closed the channel"]
            # Its handler's task is cancelled with the channel: what it held is released.
            await right.release.wait()
            with pytest.raises(PeerGone, match=r"^right is gone: it closed the channel$"):
                await one.call("echo", 1)
            one.note("dropped")  # a note to a gone peer is dropped, not an error


async def test_writes_are_coalesced() -> None:
    async with pair() as (one, *_):
        with trio.fail_after(5):
            for i in range(100):
                one.note("n", i)
            assert await one.call("echo", 0) == 0
        stats = one.statistics()
        assert stats.frames_sent == 101
        assert stats.writes <= 3


async def test_a_peer_that_does_not_read_is_taken_for_gone_at_the_outbox_bound() -> None:
    a, b = trio.socket.socketpair()
    peer = Peer()
    one = Channel(
        trio.SocketStream(a),
        peer="stuck",
        on_call=peer.on_call,
        on_note=peer.on_note,
        max_outbox_bytes=1_000_000,
    )
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(one.run)
            # Nobody reads b: the socket buffer fills, then the outbox.
            for _ in range(10_000):
                one.note("n", b"x" * 4096)
                if one.gone is not None:
                    break
                await trio.lowlevel.checkpoint()
            assert one.gone is not None
            assert one.gone.startswith("it left ")
            assert one.gone.endswith(" bytes unread (at most 1000000)")
    b.close()


async def test_a_frame_past_the_bound_ends_the_channel() -> None:
    async with pair(max_frame_bytes=1024) as (one, two, _left, _right):
        with trio.fail_after(5):
            # two -> one: one takes frames of at most 1 KiB.
            two.note("big", b"x" * 4096)
            assert (await one.wait_gone()).startswith("it sent a frame of 4")


async def test_an_answer_that_cannot_travel_fails_its_call_not_the_channel() -> None:
    async with pair() as (one, *_):
        with trio.fail_after(5):
            with pytest.raises(RemoteFailure, match=r"^the answer could not be sent: "):
                await one.call("odd_answer")
            assert await one.call("echo", 2) == 2
            # What the caller itself cannot send is the caller's bug, raised there.
            with pytest.raises(AttributeError, match=r"^Can't pickle local object"):
                await one.call("echo", lambda: None)
            assert await one.call("echo", 3) == 3
        assert one.statistics().calls_waiting == 0


async def test_a_note_that_cannot_be_applied_ends_the_channel_not_the_process(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with pair() as (one, two, *_):
        with trio.fail_after(5):
            one.note("bad")
            assert await two.wait_gone() == "its note `bad` could not be applied: ValueError"
            with pytest.raises(PeerGone):
                await one.call("echo", 1)
    assert "note 'bad' from left failed" in caplog.text
