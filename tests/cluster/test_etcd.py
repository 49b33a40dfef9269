"""The etcd client (narwhal.cluster._etcd) against real etcd: keys, leases, the two
transactions, watches, and what happens when members die or hang."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager

import httpx
import pytest
import trio

from narwhal.cluster._etcd import (
    Compacted,
    Etcd,
    EtcdError,
    EtcdUnavailable,
    KeyValue,
    LeaseLost,
    WatchEvent,
    prefix_end,
)

from .conftest import EtcdCluster, free_ports


@asynccontextmanager
async def opened(endpoints: list[str], timeout_s: float = 5.0) -> AsyncIterator[Etcd]:
    etcd = Etcd(endpoints, timeout_s=timeout_s)
    try:
        yield etcd
    finally:
        await etcd.aclose()


async def watched(
    etcd: Etcd, prefix: bytes, start_revision: int, count: int, within: float = 10.0
) -> list[WatchEvent]:
    """The first `count` events of a watch (all its batches' events in order)."""
    events: list[WatchEvent] = []
    with trio.fail_after(within):
        async with aclosing(etcd.watch_prefix(prefix, start_revision=start_revision)) as batches:
            async for batch in batches:
                assert batch, "an empty batch was yielded"
                events.extend(batch)
                if len(events) >= count:
                    return events
    raise AssertionError("the watch ended")


async def compact(endpoint: str, revision: int) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
        response = await client.post(
            f"{endpoint}/v3/kv/compaction", json={"revision": str(revision), "physical": True}
        )
    assert response.status_code == 200, response.text


def dead_endpoints(count: int) -> list[str]:
    return [f"http://127.0.0.1:{port}" for port in free_ports(count)]


def test_prefix_end_is_etcds_rule() -> None:
    assert prefix_end(b"a/") == b"a0"
    assert prefix_end(b"a\x00") == b"a\x01"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"a\xfe\xff\xff") == b"a\xff"
    assert prefix_end(b"\xff\xff") == b"\x00"
    assert prefix_end(b"") == b"\x00"


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match=r"^etcd needs at least one endpoint$"):
        Etcd([], timeout_s=1)
    with pytest.raises(ValueError, match=r"^etcd endpoint '127.0.0.1:2379' must start with"):
        Etcd(["127.0.0.1:2379"], timeout_s=1)


async def test_put_get_delete_round_trip_binary_keys(etcd_one: EtcdCluster) -> None:
    key, value = b"\x00bin\xff\n/key", b"\x00\x01\xfe\xffvalue"
    async with opened(etcd_one.endpoints) as etcd:
        assert await etcd.get(key) is None
        first = await etcd.put(key, value)
        assert first > 1
        assert await etcd.get(key) == KeyValue(key, value, first, first, 0)
        second = await etcd.put(key, b"")
        assert second == first + 1
        assert await etcd.get(key) == KeyValue(key, b"", first, second, 0)
        assert await etcd.delete(key) == 1
        assert await etcd.get(key) is None
        assert await etcd.delete(key) == 0


async def test_get_prefix_is_sorted_and_bounded(etcd_one: EtcdCluster) -> None:
    async with opened(etcd_one.endpoints) as etcd:
        for key in [b"p/\xff", b"p/b", b"p0", b"p/a", b"o", b"q\xff", b"q\xff\x01", b"r"]:
            last = await etcd.put(key, key + b"!")
        kvs, revision = await etcd.get_prefix(b"p/")
        assert [kv.key for kv in kvs] == [b"p/a", b"p/b", b"p/\xff"]
        assert [kv.value for kv in kvs] == [b"p/a!", b"p/b!", b"p/\xff!"]
        assert revision == last
        # A prefix ending in 0xff: its range ends at the byte before it, incremented.
        kvs, _ = await etcd.get_prefix(b"q\xff")
        assert [kv.key for kv in kvs] == [b"q\xff", b"q\xff\x01"]
        assert await etcd.get_prefix(b"nothing/") == ([], revision)


async def test_create_wins_once(etcd_one: EtcdCluster) -> None:
    async with opened(etcd_one.endpoints) as etcd:
        lease = await etcd.grant(30)
        assert await etcd.create(b"leader", b"a", lease=lease)
        assert not await etcd.create(b"leader", b"b", lease=lease)
        held = await etcd.get(b"leader")
        assert held is not None
        assert (held.value, held.lease) == (b"a", lease)
        assert held.create_revision == held.mod_revision


async def test_delete_if_lease_deletes_only_the_holders_key(etcd_one: EtcdCluster) -> None:
    async with opened(etcd_one.endpoints) as etcd:
        mine, theirs = await etcd.grant(30), await etcd.grant(30)
        assert await etcd.create(b"leader", b"a", lease=mine)
        assert not await etcd.delete_if_lease(b"leader", theirs)
        assert await etcd.get(b"leader") is not None
        assert await etcd.delete_if_lease(b"leader", mine)
        assert await etcd.get(b"leader") is None
        assert not await etcd.delete_if_lease(b"leader", mine)


async def test_revoke_deletes_the_leases_keys(etcd_one: EtcdCluster) -> None:
    async with opened(etcd_one.endpoints) as etcd:
        lease = await etcd.grant(30)
        assert 25 <= await etcd.keepalive(lease) <= 30
        await etcd.put(b"k", b"v", lease=lease)
        held = await etcd.get(b"k")
        assert held is not None
        assert held.lease == lease
        await etcd.revoke(lease)
        assert await etcd.get(b"k") is None
        await etcd.revoke(lease)  # gone already: fine
        with pytest.raises(LeaseLost, match=rf"^etcd keepalive: lease {lease:x} is gone"):
            await etcd.keepalive(lease)
        with pytest.raises(
            LeaseLost, match=r"^etcd put at http://127.0.0.1:\d+: .*lease not found"
        ):
            await etcd.put(b"k", b"v", lease=lease)
        with pytest.raises(LeaseLost, match=r"^etcd create at "):
            await etcd.create(b"k", b"v", lease=lease)


async def test_a_lease_kept_alive_lives_and_one_left_expires(etcd_one: EtcdCluster) -> None:
    async with opened(etcd_one.endpoints) as etcd:
        lease = await etcd.grant(2)
        start = await etcd.put(b"lease/k", b"v", lease=lease)
        deadline = trio.current_time() + 3
        while trio.current_time() < deadline:
            assert await etcd.keepalive(lease) == 2
            await trio.sleep(0.3)
        assert await etcd.get(b"lease/k") is not None
        expired = await watched(etcd, b"lease/", start + 1, 1)
        assert [(e.kind, e.key) for e in expired] == [("delete", b"lease/k")]
        with pytest.raises(LeaseLost):
            await etcd.keepalive(lease)


async def test_watch_yields_puts_and_deletes_in_order(etcd_one: EtcdCluster) -> None:
    async with opened(etcd_one.endpoints) as etcd:
        start = await etcd.put(b"w/1", b"one")
        await etcd.put(b"x/outside", b"no")
        await etcd.put(b"w/2", b"two")
        await etcd.delete(b"w/1")
        await etcd.put(b"w/2", b"")
        events = await watched(etcd, b"w/", start, 4)
        assert events == [
            WatchEvent("put", b"w/1", b"one", start),
            WatchEvent("put", b"w/2", b"two", start + 2),
            WatchEvent("delete", b"w/1", b"", start + 3),
            WatchEvent("put", b"w/2", b"", start + 4),
        ]
        # And what happens after the watch started.
        async with trio.open_nursery() as nursery:

            async def later() -> None:
                await trio.sleep(0.2)
                await etcd.put(b"w/3", b"three")

            nursery.start_soon(later)
            events = await watched(etcd, b"w/", start + 5, 1)
        assert events == [WatchEvent("put", b"w/3", b"three", start + 5)]


async def test_watch_from_a_compacted_revision_raises_compacted(etcd_one: EtcdCluster) -> None:
    async with opened(etcd_one.endpoints) as etcd:
        first = await etcd.put(b"c/k", b"1")
        await etcd.put(b"c/k", b"2")
        last = await etcd.put(b"c/k", b"3")
        await compact(etcd_one.endpoints[0], last)
        with pytest.raises(
            Compacted,
            match=rf"^etcd watch at .*: revision {first} is compacted \(etcd keeps from {last}\)$",
        ):
            await watched(etcd, b"c/", first, 1)
        events = await watched(etcd, b"c/", last, 1)
        assert events == [WatchEvent("put", b"c/k", b"3", last)]


async def test_a_dead_first_endpoint_fails_over(etcd_one: EtcdCluster) -> None:
    async with opened(dead_endpoints(1) + etcd_one.endpoints, timeout_s=2) as etcd:
        revision = await etcd.put(b"k", b"v")
        assert await etcd.get(b"k") == KeyValue(b"k", b"v", revision, revision, 0)
        assert await watched(etcd, b"k", revision, 1) == [WatchEvent("put", b"k", b"v", revision)]


async def test_all_endpoints_dead_is_unavailable_naming_each(etcd_one: EtcdCluster) -> None:
    dead = dead_endpoints(2)
    async with opened(dead, timeout_s=2) as etcd:
        with pytest.raises(EtcdUnavailable) as caught:
            await etcd.get(b"k")
        message = str(caught.value)
        assert message.startswith("etcd get: no endpoint answered: ")
        assert f"{dead[0]}: ConnectError" in message
        assert f"{dead[1]}: ConnectError" in message
        with pytest.raises(EtcdUnavailable, match=r"^etcd watch: no endpoint answered: "):
            await watched(etcd, b"k", 1, 1)


async def test_a_hung_member_is_passed_over_and_the_next_call_starts_elsewhere(
    etcd_three: EtcdCluster,
) -> None:
    # Generous: if the hung member led, the next one answers only after an election.
    async with opened(etcd_three.endpoints, timeout_s=2.0) as etcd:
        await etcd.put(b"k", b"v")
        etcd_three.pause(0)
        began = trio.current_time()
        assert await etcd.get(b"k") is not None
        assert trio.current_time() - began >= 2.0  # waited out the hung member
        began = trio.current_time()
        assert await etcd.get(b"k") is not None
        assert trio.current_time() - began < 1.5  # started with the member that answered
        # Member 1, or member 2 if 1 was still electing a leader.
        assert repr(etcd) in {
            f"<Etcd [{', '.join(etcd_three.endpoints)}] preferred {i}>" for i in (1, 2)
        }


async def test_killing_one_of_three_members_keeps_the_client_working(
    etcd_three: EtcdCluster,
) -> None:
    async with opened(etcd_three.endpoints, timeout_s=5.0) as etcd:
        revision = await etcd.put(b"k/1", b"v")
        broken = trio.Event()

        async def watch() -> None:
            # Opened on member 0, the one that answered last.
            with pytest.raises(EtcdUnavailable, match=r"^etcd watch at .*: the stream "):
                await watched(etcd, b"k/", revision + 1, 1)
            broken.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            await trio.sleep(0.3)
            etcd_three.kill(0)
            with trio.fail_after(10):
                await broken.wait()
        later = await etcd.put(b"k/2", b"w")
        assert later > revision
        kvs, _ = await etcd.get_prefix(b"k/")
        assert [kv.key for kv in kvs] == [b"k/1", b"k/2"]
        lease = await etcd.grant(10)
        assert await etcd.create(b"k/3", b"x", lease=lease)
        assert await etcd.keepalive(lease) >= 9
        assert await watched(etcd, b"k/", revision + 1, 2) == [
            WatchEvent("put", b"k/2", b"w", later),
            WatchEvent("put", b"k/3", b"x", later + 1),
        ]


async def test_a_member_without_quorum_ends_its_watch_and_answers_unavailable(
    etcd_three: EtcdCluster,
) -> None:
    async with opened(etcd_three.endpoints[2:], timeout_s=1.0) as etcd:
        revision = await etcd.put(b"k", b"v")
        ended = trio.Event()

        async def watch() -> None:
            with pytest.raises(EtcdUnavailable, match=r"no leader"):
                await watched(etcd, b"k", revision + 1, 1, within=15)
            ended.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            await trio.sleep(0.3)
            etcd_three.pause(0)
            etcd_three.pause(1)
            with pytest.raises(EtcdUnavailable, match=r"^etcd put: no endpoint answered: "):
                await etcd.put(b"k", b"w")
            with trio.fail_after(15):
                await ended.wait()


async def test_etcds_own_errors_name_the_operation_and_endpoint(etcd_one: EtcdCluster) -> None:
    async with opened(etcd_one.endpoints) as etcd:
        with pytest.raises(
            EtcdError, match=r"^etcd put at http://127.0.0.1:\d+: HTTP 400: .*key is not provided"
        ):
            await etcd.put(b"", b"v")
