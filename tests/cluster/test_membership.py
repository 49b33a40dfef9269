"""Membership and leader election (narwhal.cluster._membership) against real etcd."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import pytest
import trio

from narwhal.cluster._etcd import Etcd, EtcdError, LeaseLost
from narwhal.cluster._membership import Membership, View

from .conftest import EtcdCluster

PREFIX = b"/narwhal/test/"


class Views:
    """What on_change said, and a wait for a view that satisfies a condition."""

    def __init__(self) -> None:
        self.seen: list[View] = []
        self._changed = trio.Event()

    def __call__(self, view: View) -> None:
        self.seen.append(view)
        self._changed.set()
        self._changed = trio.Event()

    async def until(self, condition: Callable[[View], bool], within: float = 10.0) -> View:
        """The first view from the latest one on that satisfies `condition` (none
        skipped: several may come between two wakeups)."""
        index = max(0, len(self.seen) - 1)
        with trio.fail_after(within):
            while True:
                for view in self.seen[index:]:
                    if condition(view):
                        return view
                index = len(self.seen)
                await self._changed.wait()


class CampaignEtcd(Etcd):
    """The real client, telling when a campaign lost (a create of the leader key that
    found it held)."""

    def __init__(self, endpoints: list[str], *, timeout_s: float) -> None:
        super().__init__(endpoints, timeout_s=timeout_s)
        self.lost = trio.Event()

    async def create(self, key: bytes, value: bytes, *, lease: int) -> bool:
        created = await super().create(key, value, lease=lease)
        if key == PREFIX + b"leader" and not created:
            self.lost.set()
        return created


@attrs.frozen
class Replica:
    membership: Membership
    views: Views
    etcd: CampaignEtcd
    scope: trio.CancelScope  # cancel to stop it


@asynccontextmanager
async def replica(
    nursery: trio.Nursery,
    endpoints: list[str],
    replica_id: str,
    *,
    ttl_s: int = 5,
    timeout_s: float = 1.0,
    elect: bool = True,
) -> AsyncIterator[Replica]:
    """A started replica."""
    etcd = CampaignEtcd(endpoints, timeout_s=timeout_s)
    views = Views()
    membership = Membership(
        etcd,
        prefix=PREFIX,
        replica_id=replica_id,
        ttl_s=ttl_s,
        info={"url": f"http://{replica_id}"},
        elect=elect,
        on_change=views,
    )
    scope = trio.CancelScope()
    stopped = trio.Event()

    async def run(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            with scope:
                await membership.run(task_status=task_status)
        finally:
            stopped.set()

    try:
        await nursery.start(run)
        yield Replica(membership, views, etcd, scope)
    finally:
        scope.cancel()
        with trio.move_on_after(5, shield=True):
            await stopped.wait()
            await etcd.aclose()


@asynccontextmanager
async def opened(endpoints: list[str]) -> AsyncIterator[Etcd]:
    etcd = Etcd(endpoints, timeout_s=5.0)
    try:
        yield etcd
    finally:
        await etcd.aclose()


def events(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        str(getattr(record, "event", ""))
        for record in caplog.records
        if record.name == "narwhal.cluster"
    ]


async def test_two_replicas_see_each_other_and_one_leads(etcd_one: EtcdCluster) -> None:
    endpoints = etcd_one.endpoints
    async with (
        trio.open_nursery() as nursery,
        replica(nursery, endpoints, "a") as a,
        replica(nursery, endpoints, "b") as b,
        opened(endpoints) as etcd,
    ):
        # Started once registered and its first listing read.
        assert b.membership.view.members == ("a", "b")

        def settled(view: View) -> bool:
            return view.members == ("a", "b") and view.leader is not None

        seen_by_a = await a.views.until(settled)
        seen_by_b = await b.views.until(settled)
        assert seen_by_a.leader == seen_by_b.leader
        assert repr(b.membership) == (
            f"<Membership b [2 members, leader {seen_by_b.leader}, connected]"
            f" lease {b.membership.lease:x}>"
        )
        assert seen_by_a.connected
        assert seen_by_b.connected
        now = trio.current_time()
        assert now < a.membership.view.lease_ok_until <= now + 5

        leader = await etcd.get(PREFIX + b"leader")
        assert leader is not None
        holder = a if seen_by_a.leader == "a" else b
        assert (leader.value.decode(), leader.lease) == (
            holder.membership.replica_id,
            holder.membership.lease,
        )
        record = await etcd.get(PREFIX + b"members/b")
        assert record is not None
        assert record.lease == b.membership.lease
        stored = json.loads(record.value)
        assert stored["id"] == "b"
        assert stored["url"] == "http://b"
        assert "started" in stored
        nursery.cancel_scope.cancel()


async def test_a_leader_that_stops_hands_over_at_once(
    etcd_one: EtcdCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.cluster")
    endpoints = etcd_one.endpoints
    async with (
        trio.open_nursery() as nursery,
        # A long TTL: only the resign and revoke can make the handover prompt.
        replica(nursery, endpoints, "a", ttl_s=30) as a,
        replica(nursery, endpoints, "b", ttl_s=30) as b,
        opened(endpoints) as etcd,
    ):
        await a.views.until(lambda view: view.leader == "a")
        with trio.fail_after(5):
            await b.etcd.lost.wait()  # b campaigned, lost, and waits
        a_lease = a.membership.lease
        a.scope.cancel()
        await b.views.until(lambda view: view.leader == "b" and view.members == ("b",), within=3)
        assert await etcd.get(PREFIX + b"members/a") is None
        with pytest.raises(LeaseLost):
            await etcd.keepalive(a_lease)  # revoked
        nursery.cancel_scope.cancel()
    assert "cluster_elected" in events(caplog)
    assert "cluster_left" in events(caplog)


async def test_a_follower_that_does_not_campaign_never_leads(etcd_one: EtcdCluster) -> None:
    endpoints = etcd_one.endpoints
    async with (
        trio.open_nursery() as nursery,
        replica(nursery, endpoints, "a") as a,
        replica(nursery, endpoints, "b", elect=False) as b,
    ):
        await a.views.until(lambda view: view.leader == "a")
        a.scope.cancel()
        view = await b.views.until(lambda view: view.members == ("b",), within=3)
        assert view.leader is None
        with trio.move_on_after(0.5):
            await b.views.until(lambda view: view.leader is not None)
            pytest.fail("a replica with elect=False took the lead")
        nursery.cancel_scope.cancel()


async def test_an_expired_lease_is_replaced_and_the_replica_comes_back(
    etcd_one: EtcdCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.cluster")
    endpoints = etcd_one.endpoints
    async with (
        trio.open_nursery() as nursery,
        replica(nursery, endpoints, "a", ttl_s=2) as a,
        opened(endpoints) as etcd,
    ):
        await a.views.until(lambda view: view.leader == "a")
        old = a.membership.lease
        # What etcd does to a replica cut off past its TTL: its lease and keys go.
        await etcd.revoke(old)
        await a.views.until(lambda view: view.members == ())
        view = await a.views.until(lambda view: view.members == ("a",) and view.leader == "a")
        assert view.connected
        assert a.membership.lease not in (0, old)
        record = await etcd.get(PREFIX + b"members/a")
        assert record is not None
        assert record.lease == a.membership.lease
        leader = await etcd.get(PREFIX + b"leader")
        assert leader is not None
        assert leader.lease == a.membership.lease
        nursery.cancel_scope.cancel()
    assert events(caplog).count("cluster_registered") == 2
    lost = [r for r in caplog.records if getattr(r, "event", None) == "cluster_lease_lost"]
    assert [r.levelno for r in lost] == [logging.WARNING]


async def test_a_second_replica_with_the_same_id_refuses_to_start(etcd_one: EtcdCluster) -> None:
    endpoints = etcd_one.endpoints
    async with (
        trio.open_nursery() as nursery,
        replica(nursery, endpoints, "a") as a,
        opened(endpoints) as etcd,
    ):
        twin = Membership(etcd, prefix=PREFIX, replica_id="a", ttl_s=5)
        with pytest.raises(EtcdError, match=r"^replica id 'a' is in use: "):
            await nursery.start(twin.run)
        assert twin.lease == 0  # it revoked its own lease on the way out
        record = await etcd.get(PREFIX + b"members/a")
        assert record is not None
        assert record.lease == a.membership.lease
        nursery.cancel_scope.cancel()


async def test_unreachable_etcd_turns_disconnected_and_back(
    etcd_one: EtcdCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.cluster")
    ttl = 2
    async with (
        trio.open_nursery() as nursery,
        replica(nursery, etcd_one.endpoints, "a", ttl_s=ttl, timeout_s=0.5) as a,
    ):
        before = await a.views.until(lambda view: view.leader == "a")
        old = a.membership.lease
        etcd_one.pause(0)
        paused = trio.current_time()
        try:
            cut = await a.views.until(lambda view: not view.connected, within=2 * ttl)
            assert cut.since - paused <= 2 * ttl
            # The lease is surely alive until at most a TTL after the last renewal.
            assert cut.lease_ok_until <= cut.since + ttl
            assert cut.lease_ok_until >= before.lease_ok_until
            # Cut off past the lease: etcd expires it once it runs again.
            await trio.sleep_until(cut.lease_ok_until + 1)
            assert not a.membership.view.connected
        finally:
            etcd_one.resume(0)
        back = await a.views.until(
            lambda view: view.connected and view.members == ("a",) and view.leader == "a",
            within=15,
        )
        assert back.since > cut.since
        assert a.membership.lease not in (0, old)
        nursery.cancel_scope.cancel()
    logged = events(caplog)
    assert logged.index("cluster_disconnected") < logged.index("cluster_connected")
    assert logged.index("cluster_disconnected") < logged.index("cluster_lease_lost")


async def test_membership_survives_losing_one_of_three_members(etcd_three: EtcdCluster) -> None:
    endpoints = etcd_three.endpoints
    async with (
        trio.open_nursery() as nursery,
        replica(nursery, endpoints, "a", ttl_s=3, timeout_s=1.5) as a,
        replica(nursery, endpoints[::-1], "b", ttl_s=3, timeout_s=1.5) as b,
    ):
        await a.views.until(lambda view: view.members == ("a", "b") and view.leader is not None)
        etcd_three.kill(0)  # a's first endpoint, and its watch's
        b.scope.cancel()
        view = await a.views.until(lambda view: view.members == ("a",) and view.leader == "a")
        assert view.connected
        nursery.cancel_scope.cancel()


async def test_arguments_are_checked() -> None:
    async with opened(["http://127.0.0.1:1"]) as etcd:
        with pytest.raises(ValueError, match=r"^member info must not set id, started: "):
            Membership(etcd, prefix=PREFIX, replica_id="a", ttl_s=5, info={"id": "b", "started": 0})
        with pytest.raises(ValueError, match=r"^lease ttl_s=0; must be >= 1$"):
            Membership(etcd, prefix=PREFIX, replica_id="a", ttl_s=0)
        with pytest.raises(ValueError, match=r"^a replica id must not be empty$"):
            Membership(etcd, prefix=PREFIX, replica_id="", ttl_s=5)
