"""This replica's membership of its cluster, and the election of one leader, in etcd.

Owns
  `Membership`, a service (start protocol): a lease of ttl_s kept alive every ttl_s/3,
  the member key `prefix + b"members/" + id` under it (JSON: id, started, info), a
  watch of the whole prefix (keys other than these two kinds are ignored) that keeps
  `view` (`View`: the members, the leader, whether etcd answers) and calls `on_change`
  with each new view, and with `elect` a campaign for the leader key
  `prefix + b"leader"` (value: the id) under the same lease.

Invariants
  Every key of this replica lives under its lease, so a replica that dies or is cut off
  leaves within the TTL, and its leadership with it: a campaign that lost waits for
  the leader key's deletion (seen by the watch, at or after the revision it lost at)
  and tries again. A lease etcd expired (a partition longer than the TTL) is replaced:
  a new lease, the member key again, a new campaign. Unreachable etcd is retried every
  ttl_s/3, never faster; `lease_ok_until` says until when the lease is surely alive
  (the TTL etcd gave, from the moment the renewal was sent). The watch is read again
  from a listing after a compaction, a broken stream, and a reconnection (a stream
  from before an outage may be dead without knowing). Leaving (cancellation) resigns
  and revokes, each shielded and bounded by CLEANUP_S.

Errors
  `EtcdError` from `run` when the replica id's member key is held by another lease (two
  replicas with one id), and, before started(), when etcd does not answer.
"""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Callable, Mapping
from contextlib import aclosing
from types import MappingProxyType

import attrs
import trio

from ._etcd import Compacted, Etcd, EtcdError, EtcdUnavailable, KeyValue, LeaseLost, WatchEvent

log = logging.getLogger("narwhal.cluster")

# Bound on each of resigning and revoking when leaving.
CLEANUP_S = 1.0
# Attempts at the member key at registration while its holder keeps changing between a
# failed create and the read that names it.
_CLAIM_TRIES = 3

_NO_INFO: Mapping[str, object] = MappingProxyType({})


class ReplicaIdInUse(EtcdError):
    """Another lease holds this replica's member key: a second replica with the id, or
    this one's previous process, killed before its lease lapsed."""


@attrs.frozen
class View:
    """What this replica knows of the cluster."""

    members: tuple[str, ...]  # sorted ids with a member key (this replica's once registered)
    leader: str | None  # the id in the leader key
    connected: bool  # the last etcd call (keepalive, listing, watch) succeeded
    since: float  # trio time `connected` last changed (0.0 before run)
    # Trio time until which this replica's lease is surely alive: past it, cut off, etcd
    # may have expired it (and others no longer count this replica).
    lease_ok_until: float


class Membership:
    def __init__(
        self,
        etcd: Etcd,
        *,
        prefix: bytes,
        replica_id: str,
        ttl_s: int,
        info: Mapping[str, object] = _NO_INFO,
        elect: bool = True,
        on_change: Callable[[View], None] | None = None,
    ) -> None:
        if not replica_id:
            raise ValueError("a replica id must not be empty")
        if ttl_s < 1:
            raise ValueError(f"lease ttl_s={ttl_s}; must be >= 1")
        if reserved := sorted({"id", "started"} & set(info)):
            raise ValueError(f"member info must not set {', '.join(reserved)}: Membership does")
        self._etcd = etcd
        self._prefix = prefix
        self._members_prefix = prefix + b"members/"
        self._leader_key = prefix + b"leader"
        self.replica_id = replica_id
        self._member_key = self._members_prefix + replica_id.encode()
        self._ttl_s = ttl_s
        self._interval = ttl_s / 3
        self._info = dict(info)
        self._elect = elect
        self._on_change = on_change
        # For people reading the member keys: a wall-clock time means the same to every
        # replica, a trio time to none but this one. Nothing decides by it.
        self._started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        self._lease = 0
        self._members: dict[bytes, str] = {}
        self._leader: str | None = None
        self._revision = 0  # the newest revision the listing and the watch have applied
        self._changed = trio.Event()
        self._connected = False
        self._since = 0.0
        self._lease_ok_until = 0.0
        self._running = False
        self._watch_scope: trio.CancelScope | None = None
        self.view = View(members=(), leader=None, connected=False, since=0.0, lease_ok_until=0.0)

    def __repr__(self) -> str:
        view = self.view
        lead = f"leader {view.leader}" if view.leader is not None else "no leader"
        link = "connected" if view.connected else "cut off"
        return (
            f"<Membership {self.replica_id} [{len(view.members)} members, {lead}, {link}]"
            f" lease {self._lease:x}>"
        )

    @property
    def lease(self) -> int:
        """This replica's current lease (0 before registering and after leaving)."""
        return self._lease

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            # Outside the nursery, so a refusal reaches the caller of start() as itself.
            await self._register()
            kvs, revision = await self._etcd.get_prefix(self._prefix)
            self._load(kvs, revision)
            self._running = True
            self._log_registered("registered")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch, revision)
                task_status.started()
                await self._hold()
        finally:
            self._running = False
            await self._leave()

    # ------------------------------------------------------------ the lease

    async def _register(self) -> None:
        """A new lease, and the member key under it (the id must be free)."""
        sent = trio.current_time()
        lease = await self._etcd.grant(self._ttl_s)
        # Kept at once so leaving revokes it even if the claim below fails.
        self._lease = lease
        value = json.dumps({"id": self.replica_id, "started": self._started, **self._info})
        for _ in range(_CLAIM_TRIES):
            if await self._etcd.create(self._member_key, value.encode(), lease=lease):
                break
            holder = await self._etcd.get(self._member_key)
            if holder is None:
                continue  # gone since: try again
            if holder.lease == lease:
                break  # ours: a create whose reply was lost and was sent again
            raise ReplicaIdInUse(
                f"replica id {self.replica_id!r} is in use: {self._member_key!r} is held "
                f"by lease {holder.lease:x} (two replicas with one cluster.replica_id? a "
                f"stopped replica's key lapses within its lease TTL)"
            )
        else:
            raise EtcdError(
                f"replica id {self.replica_id!r}: {self._member_key!r} kept changing "
                f"during {_CLAIM_TRIES} attempts to register"
            )
        # etcd grants at least the TTL asked for: ttl_s is a safe bound until renewed.
        self._lease_ok_until = sent + self._ttl_s
        self._set_connected(True, None)
        self._publish()

    async def _hold(self) -> None:
        """Keep the lease (and campaign under it); replace it whenever etcd lost it."""
        while True:
            async with trio.open_nursery() as session:
                if self._elect:
                    session.start_soon(self._campaign, self._lease)
                await self._keep_alive(self._lease)
                session.cancel_scope.cancel()
            await self._reregister()

    async def _keep_alive(self, lease: int) -> None:
        """Renew `lease` every ttl_s/3 until etcd says it is gone."""
        next_at = trio.current_time() + self._interval
        while True:
            await trio.sleep_until(next_at)
            sent = trio.current_time()
            next_at = sent + self._interval
            try:
                ttl = await self._etcd.keepalive(lease)
            except LeaseLost:
                self._answered()
                log.warning(
                    "etcd expired the lease of %s (cut off longer than its TTL?): "
                    "registering again",
                    self.replica_id,
                    extra={
                        "event": "cluster_lease_lost",
                        "replica": self.replica_id,
                        "lease": f"{lease:x}",
                    },
                )
                return
            except EtcdError as exc:
                self._set_connected(False, str(exc))
                self._publish()
                continue
            self._lease_ok_until = sent + ttl
            self._answered()
            self._publish()

    def _answered(self) -> None:
        """The keepalive reached etcd: connected, and after an outage the watch reads
        anew (its stream predates the outage and may be dead without knowing)."""
        if not self._connected and self._watch_scope is not None:
            self._watch_scope.cancel()
        self._set_connected(True, None)

    async def _reregister(self) -> None:
        while True:
            try:
                await self._register()
            except (EtcdUnavailable, LeaseLost) as exc:
                self._set_connected(not isinstance(exc, EtcdUnavailable), str(exc))
                self._publish()
                await trio.sleep(self._interval)
                continue
            self._log_registered("registered again")
            return

    def _log_registered(self, how: str) -> None:
        log.info(
            "%s as %s in the cluster (lease %x, %d members, leader %s)",
            how,
            self.replica_id,
            self._lease,
            len(self.view.members),
            self.view.leader,
            extra={
                "event": "cluster_registered",
                "replica": self.replica_id,
                "lease": f"{self._lease:x}",
                "members": list(self.view.members),
                "leader": self.view.leader,
            },
        )

    async def _leave(self) -> None:
        lease, self._lease = self._lease, 0
        if not lease:
            return
        if self._elect:
            with trio.move_on_after(CLEANUP_S, shield=True):
                try:
                    await self._etcd.delete_if_lease(self._leader_key, lease)
                except EtcdError as exc:
                    log.warning(
                        "could not resign the leadership: %s",
                        exc,
                        extra={"event": "cluster_leave_failed", "step": "resign"},
                    )
        with trio.move_on_after(CLEANUP_S, shield=True) as scope:
            try:
                await self._etcd.revoke(lease)
            except EtcdError as exc:
                log.warning(
                    "could not revoke the lease (it lapses within its TTL): %s",
                    exc,
                    extra={"event": "cluster_leave_failed", "step": "revoke"},
                )
            else:
                log.info(
                    "%s left the cluster",
                    self.replica_id,
                    extra={"event": "cluster_left", "replica": self.replica_id},
                )
        if scope.cancelled_caught:
            log.warning(
                "could not revoke the lease within %s s (it lapses within its TTL)",
                CLEANUP_S,
                extra={"event": "cluster_leave_failed", "step": "revoke"},
            )

    # ------------------------------------------------------------ the election

    async def _campaign(self, lease: int) -> None:
        """Hold the leader key under `lease`, or wait for it to be free and try again."""
        leading = False
        while True:
            try:
                await self._etcd.create(self._leader_key, self.replica_id.encode(), lease=lease)
                # Read back rather than trust create's answer: a create whose reply was
                # lost, sent again, says False for the key it made.
                holder = await self._etcd.get(self._leader_key)
            except LeaseLost:
                return  # the keepalive finds out too, and campaigns again under a new lease
            except EtcdError:
                await trio.sleep(self._interval)
                continue
            if holder is None:
                continue  # freed since: try again
            if holder.lease == lease and not leading:
                leading = True
                log.info(
                    "%s leads the cluster",
                    self.replica_id,
                    extra={"event": "cluster_elected", "replica": self.replica_id},
                )
            await self._wait_leader_gone(holder)
            leading = False

    async def _wait_leader_gone(self, holder: KeyValue) -> None:
        """Until the watch has seen `holder` and then no leader key."""
        while self._revision < holder.mod_revision or self._leader is not None:
            await self._changed.wait()

    # ------------------------------------------------------------ the watch

    async def _watch(self, revision: int) -> None:
        """Follow the prefix from after `revision`; read it anew when the stream ends."""
        while True:
            try:
                with trio.CancelScope() as scope:
                    self._watch_scope = scope
                    watch = self._etcd.watch_prefix(self._prefix, start_revision=revision + 1)
                    async with aclosing(watch) as batches:
                        async for batch in batches:
                            self._apply(batch)
                            revision = self._revision
            except Compacted as exc:
                reason = str(exc)
            except EtcdError as exc:
                reason = str(exc)
                self._set_connected(False, reason)
                self._publish()
                await trio.sleep(self._interval)
            else:
                reason = "reconnected"
            finally:
                self._watch_scope = None
            log.info(
                "reading the cluster again: %s",
                reason,
                extra={"event": "cluster_watch_restart", "reason": reason},
            )
            while True:
                try:
                    kvs, revision = await self._etcd.get_prefix(self._prefix)
                    break
                except EtcdError as exc:
                    self._set_connected(False, str(exc))
                    self._publish()
                    await trio.sleep(self._interval)
            self._set_connected(True, None)
            self._load(kvs, revision)

    def _load(self, kvs: list[KeyValue], revision: int) -> None:
        """Take a listing of the whole prefix at `revision`."""
        self._members = {
            kv.key: _member_id(kv.key, self._members_prefix)
            for kv in kvs
            if kv.key.startswith(self._members_prefix)
        }
        self._leader = next(
            (kv.value.decode(errors="replace") for kv in kvs if kv.key == self._leader_key), None
        )
        self._revision = max(self._revision, revision)
        self._wake()
        self._publish()

    def _apply(self, batch: list[WatchEvent]) -> None:
        for event in batch:
            if event.key.startswith(self._members_prefix):
                if event.kind == "put":
                    self._members[event.key] = _member_id(event.key, self._members_prefix)
                else:
                    self._members.pop(event.key, None)
            elif event.key == self._leader_key:
                self._leader = event.value.decode(errors="replace") if event.kind == "put" else None
            self._revision = max(self._revision, event.mod_revision)
        self._wake()
        self._publish()

    # ------------------------------------------------------------ the view

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _set_connected(self, connected: bool, problem: str | None) -> None:
        if connected == self._connected:
            return
        self._connected = connected
        self._since = trio.current_time()
        if not self._running:
            return
        if connected:
            log.info(
                "etcd answers again",
                extra={"event": "cluster_connected", "replica": self.replica_id},
            )
        else:
            log.warning(
                "cannot reach etcd: %s; the lease is surely alive for %.1f s more",
                problem,
                max(0.0, self._lease_ok_until - self._since),
                extra={
                    "event": "cluster_disconnected",
                    "replica": self.replica_id,
                    "problem": problem,
                    "lease_ok_for_s": round(max(0.0, self._lease_ok_until - self._since), 3),
                },
            )

    def _publish(self) -> None:
        """Make the current state the view; say so if it changed (and who leads, if
        that did)."""
        view = View(
            members=tuple(sorted(set(self._members.values()))),
            leader=self._leader,
            connected=self._connected,
            since=self._since,
            lease_ok_until=self._lease_ok_until,
        )
        if view == self.view:
            return
        before, self.view = self.view, view
        if self._running and view.members != before.members:
            log.info(
                "cluster members: %s",
                ", ".join(view.members) or "none",
                extra={
                    "event": "cluster_members",
                    "members": list(view.members),
                    "joined": sorted(set(view.members) - set(before.members)),
                    "left": sorted(set(before.members) - set(view.members)),
                },
            )
        if self._running and view.leader != before.leader:
            log.info(
                "cluster leader: %s",
                view.leader or "none",
                extra={"event": "cluster_leader", "leader": view.leader, "was": before.leader},
            )
        if self._on_change is not None:
            self._on_change(view)


def _member_id(key: bytes, members_prefix: bytes) -> str:
    return key[len(members_prefix) :].decode(errors="replace")
