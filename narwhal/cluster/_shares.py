"""What a replica's view of the cluster implies, decided without I/O.

Owns
  `share_for`: this replica's `Share` of the fleet's capacity from its membership view
  and the clock; `isolated`: whether it has been cut off from etcd past its lease.

Invariants
  A replica counts itself a member even while its key is missing (between a lapsed lease
  and its new registration): it never takes the whole fleet because it cannot see itself.
  While cut off, it keeps its last part until its lease could have lapsed; past that the
  others may have split its part between them, so it keeps only `isolated_share` of it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..fleet import Share


def isolated(connected: bool, lease_ok_until: float, now: float) -> bool:
    """Cut off from etcd for longer than etcd surely kept this replica's lease alive."""
    return not connected and now >= lease_ok_until


def share_for(
    members: Sequence[str],
    me: str,
    *,
    connected: bool,
    lease_ok_until: float,
    now: float,
    isolated_share: float,
) -> Share:
    ordered = sorted({*members, me})
    scale = isolated_share if isolated(connected, lease_ok_until, now) else 1.0
    return Share(index=ordered.index(me), count=len(ordered), scale=scale)
