"""What a replica's view of the cluster implies (narwhal.cluster._shares), without etcd."""

from __future__ import annotations

from narwhal.cluster._shares import isolated, share_for
from narwhal.fleet import Share


def test_a_replica_takes_its_place_among_the_members_in_name_order() -> None:
    members = ["b", "c", "a"]
    shares = {
        me: share_for(members, me, connected=True, lease_ok_until=0.0, now=5.0, isolated_share=0.5)
        for me in members
    }
    assert shares == {"a": Share(0, 3), "b": Share(1, 3), "c": Share(2, 3)}


def test_a_replica_missing_from_the_listing_still_counts_itself() -> None:
    # Between a lapsed lease and its new registration: never the whole fleet.
    share = share_for(["a"], "b", connected=True, lease_ok_until=0.0, now=0.0, isolated_share=1)
    assert share == Share(index=1, count=2)


def test_cut_off_a_replica_keeps_its_part_until_its_lease_could_have_lapsed() -> None:
    def at(now: float) -> Share:
        return share_for(
            ["a", "b"], "a", connected=False, lease_ok_until=10.0, now=now, isolated_share=0.25
        )

    assert at(9.99) == Share(0, 2, 1.0)
    assert at(10.0) == Share(0, 2, 0.25)
    assert isolated(False, 10.0, 10.0)
    assert not isolated(True, 10.0, 99.0)  # connected: never isolated
