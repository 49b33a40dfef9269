"""This replica's place in the cluster, applied to the request path.

Owns
  `ClusterService`: runs the membership (`Membership`: a lease, the member list, the
  controller's leadership) and applies what the view implies: this replica's part of
  the capacity (`share_for`, `ServingContext.apply_share`) and whether its role
  controller may move roles (`leads`); the cluster's profile store (`profiles`,
  `SharedProfiles`); the replicas' loads (`narwhal.cluster._loads`): this replica's
  published every cluster.load_interval_s, the others' booked prefill work added to the
  engines' queues (`BacklogBook.heard`) and their legs given to the engines
  (`EngineState.saw_replica_loads`). `ClusterSection` for /narwhal/state, and the
  `narwhal_cluster_*` gauges.

Invariants
  The request path never waits on etcd: a view change or the clock crossing the lease
  re-splits the limits the request path reads. Roles move only from the leader, and only
  while it can reach etcd: a cut-off replica freezes them (another may lead by then).
  With no `cluster.endpoints` nothing runs and the section says `enabled: false`.

Errors
  `ClusterUnavailable` from `run` when no etcd member answers within the lease TTL at
  start, or when the replica id is in use (`EtcdError`): the daemon does not start
  without knowing its part.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Iterator, Mapping
from contextlib import aclosing

import attrs
import trio

from ..config import Config
from ..fleet import EngineState, Share
from ..serving import ServingContext
from ._etcd import Etcd, EtcdError, EtcdUnavailable
from ._facts import VERDICTS, Fact, Hold, What, apply, decode, encode, fact_of, key_of
from ._loads import EngineWord, Heard, Word, decode_word, encode_word, refresh_s, trust_s
from ._membership import Membership, ReplicaIdInUse, View
from ._profiles import SharedProfiles, Source
from ._shares import isolated, share_for

log = logging.getLogger("narwhal.cluster")

Gauge = tuple[str, str, list[str], list[tuple[list[str], float]]]


class ClusterUnavailable(Exception):
    """The replica cannot join its cluster; the message names the setting."""


@attrs.frozen
class ClusterSection:
    """/narwhal/state `cluster`."""

    enabled: bool
    replica_id: str | None
    members: tuple[str, ...]
    leader: str | None
    leading: bool
    connected: bool
    isolated: bool
    # Seconds since `connected` last changed (null before the first word from etcd).
    connected_for_s: float | None
    # This replica's part of serving.max_connections (all of it for one replica).
    max_admitted: int
    # Where the profile store this replica prices with came from, and its sha256's first
    # 12 hex digits (null without a cluster, or without a store).
    profiles_source: Source | None = None
    profiles_digest: str | None = None
    # Engines another replica's ejection or quarantine holds out here, by engine id.
    holds: Mapping[str, HoldSection] = attrs.field(factory=dict)
    # Every other member's load word is recent: admission prices their legs and prefill
    # work with them (false: with the engines' scrape, `engines[].other_replicas`).
    loads_heard: bool = False


@attrs.frozen
class HoldSection:
    what: str
    by: str
    reason: str
    for_s: float


def replica_name(config: Config) -> str:
    """cluster.replica_id, else the host name and listen.port (the process id for port
    0, which each start picks anew)."""
    if config.cluster.replica_id:
        return config.cluster.replica_id
    port = config.listen.port
    return f"{socket.gethostname()}:{port or f'pid{os.getpid()}'}"[:64]


class ClusterService:
    def __init__(self, config: Config, replica_id: str) -> None:
        self.config = config
        self.replica_id = replica_id
        self.view: View | None = None
        self._changed = trio.Event()
        self._share = Share()
        self._etcd: Etcd | None = None
        # Facts this replica changed and has not written yet (the newest value of each
        # is written: a later change replaces an earlier one).
        self._unwritten: dict[tuple[str, What], Fact] = {}
        self._write_wanted = trio.Event()
        # Facts naming engines this replica does not have yet (a reload to come).
        self._waiting: dict[tuple[str, What], Fact] = {}
        self.profiles = SharedProfiles(
            config.cluster.prefix.encode(),
            replica_id=replica_id,
            retry_s=config.cluster.lease_ttl_s / 3,
        )
        # The other replicas' verdicts holding engines out here: engine id -> the fact.
        self.holds: dict[str, Fact] = {}
        # The other replicas' last words on their loads (`_watch_loads`).
        self.heard = Heard()

    def leads(self) -> bool:
        """May this replica's role controller move roles now."""
        view = self.view
        if not self.config.cluster.enabled:
            return True
        return view is not None and view.connected and view.leader == self.replica_id

    def share(self, now: float) -> Share:
        view = self.view
        if view is None or not self.config.cluster.enabled:
            return Share()
        return share_for(
            view.members,
            self.replica_id,
            connected=view.connected,
            lease_ok_until=view.lease_ok_until,
            now=now,
            isolated_share=self.config.cluster.isolated_share,
        )

    def reconfigure(self, config: Config) -> None:
        """A reload: cluster.isolated_share applies; the rest needs a restart."""
        self.config = config
        self._changed.set()

    async def run(self, ctx: ServingContext, *, task_status: trio.TaskStatus[None]) -> None:
        cluster = self.config.cluster
        etcd = Etcd(cluster.endpoints, timeout_s=cluster.request_timeout_s)
        membership = Membership(
            etcd,
            prefix=cluster.prefix.encode(),
            replica_id=self.replica_id,
            ttl_s=cluster.lease_ttl_s,
            elect=True,
            on_change=self._on_view,
        )
        self._etcd = etcd
        try:
            async with trio.open_nursery() as nursery:
                revision = await self._join(nursery, membership, ctx)
                self._on_view(membership.view)
                self._apply_share(ctx)
                nursery.start_soon(self._watch_facts, ctx, revision)
                nursery.start_soon(self._write_facts)
                nursery.start_soon(self._watch_loads, ctx)
                nursery.start_soon(self._write_loads, ctx, membership)
                # Before serving: this replica prices with the cluster's profile store.
                await nursery.start(self.profiles.run, etcd)
                task_status.started()
                await self._follow(ctx)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                await etcd.aclose()

    async def _join(
        self, nursery: trio.Nursery, membership: Membership, ctx: ServingContext
    ) -> int:
        """Register and read the shared facts; the revision they were read at.

        A restart after a crash finds its previous process's member key until that
        lease lapses: waiting out one lease TTL (and a request's deadline) lets it
        rejoin, where refusing at once would have systemd restart it into the same
        refusal. A second live replica with the id is still refused after that wait."""
        cluster = self.config.cluster
        bound_s = cluster.lease_ttl_s + 2 * cluster.request_timeout_s
        deadline = trio.current_time() + bound_s
        last = "no answer yet"
        try:
            with trio.fail_at(deadline):
                while True:
                    try:
                        await nursery.start(membership.run)
                        return await self._read_facts(ctx)
                    except ReplicaIdInUse as exc:
                        if trio.current_time() + cluster.lease_ttl_s / 3 >= deadline:
                            raise ClusterUnavailable(f"cluster: {exc}") from None
                        log.warning(
                            "%s; trying again until it lapses",
                            exc,
                            extra={"event": "cluster_id_in_use", "replica": self.replica_id},
                        )
                    except EtcdUnavailable as exc:
                        # etcd starting with the hosts, or a member restarting: a
                        # refused connection is not yet a reason to give up.
                        last = str(exc)
                    await trio.sleep(cluster.lease_ttl_s / 3)
        except trio.TooSlowError:
            raise ClusterUnavailable(
                f"cannot join the cluster within {bound_s:g} s (cluster.lease_ttl_s plus two "
                f"cluster.request_timeout_s) at cluster.endpoints={list(cluster.endpoints)}: "
                f"{last}"
            ) from None
        except EtcdError as exc:
            raise ClusterUnavailable(f"cluster: {exc}") from None

    # ------------------------------------------------------------ shared facts

    @property
    def _prefix(self) -> bytes:
        return self.config.cluster.prefix.encode()

    def share_facts(self, engine: EngineState, *whats: What) -> None:
        """This replica changed `engine`'s role or an operator's mark (`whats`): write
        them for every replica, now and after any etcd outage (the newest value wins)."""
        for what in whats:
            self._put(fact_of(engine, what, self.replica_id))

    def verdict_changed(self, engine: EngineState, kind: str, new: str, reason: str) -> None:
        """Recovery's verdict on `engine` changed on this replica's own evidence
        (`Verdicts.changed`): share an ejection for recovery.health.window_s (its
        readmission, when it comes, ends it early), a quarantine for
        recovery.failure_quarantine_s. Breakers stay each replica's own: they open and
        close within seconds, on the legs each one sees."""
        recovery = self.config.recovery
        value: Hold | bool
        what: What
        if kind == "health" and new == "ejected":
            value, what = Hold(reason, time.time() + recovery.health.window_s), "ejected"
        elif kind == "health" and new == "up":
            value, what = False, "ejected"
        elif kind == "quarantine" and new == "quarantined":
            until = time.time() + recovery.failure_quarantine_s
            value, what = Hold(reason, until), "quarantined"
        else:
            return
        self._put(Fact(engine=engine.id, what=what, value=value, by=self.replica_id))

    def _put(self, fact: Fact) -> None:
        if not self.config.cluster.enabled:
            return
        self._unwritten[fact.engine, fact.what] = fact
        self._write_wanted.set()

    async def _write_facts(self) -> None:
        assert self._etcd is not None
        retry_s = self.config.cluster.lease_ttl_s / 3
        while True:
            await self._write_wanted.wait()
            self._write_wanted = trio.Event()
            while self._unwritten:
                (engine_id, what), fact = next(iter(self._unwritten.items()))
                try:
                    await self._etcd.put(key_of(self._prefix, engine_id, what), encode(fact))
                except EtcdError as exc:
                    log.warning(
                        "engine %s's %s not shared yet: %s",
                        engine_id,
                        what,
                        exc,
                        extra={"event": "cluster_fact_unwritten", "engine": engine_id},
                    )
                    await trio.sleep(retry_s)
                    continue
                # A change made while the write was under way is written next.
                if self._unwritten.get((engine_id, what)) is fact:
                    del self._unwritten[engine_id, what]

    async def _read_facts(self, ctx: ServingContext) -> int:
        """Apply every stored fact; the revision to watch from."""
        assert self._etcd is not None
        kvs, revision = await self._etcd.get_prefix(self._prefix + b"facts/")
        for kv in kvs:
            self._take_fact(ctx, kv.key, kv.value)
        return revision

    async def _watch_facts(self, ctx: ServingContext, revision: int) -> None:
        assert self._etcd is not None
        retry_s = self.config.cluster.lease_ttl_s / 3
        while True:
            try:
                watch = self._etcd.watch_prefix(
                    self._prefix + b"facts/", start_revision=revision + 1
                )
                async with aclosing(watch) as batches:
                    async for batch in batches:
                        for event in batch:
                            revision = max(revision, event.mod_revision)
                            if event.kind == "put":
                                self._take_fact(ctx, event.key, event.value)
            except EtcdError:
                # Past a compaction missed events cannot be replayed, and an outage may
                # have hidden some: read the whole set again once etcd answers.
                await trio.sleep(retry_s)
                try:
                    revision = await self._read_facts(ctx)
                except EtcdError:
                    continue

    def _take_fact(self, ctx: ServingContext, key: bytes, value: bytes) -> None:
        try:
            fact = decode(self._prefix, key, value)
        except ValueError as exc:
            log.warning(
                "ignored a shared fact: %s",
                exc,
                extra={"event": "cluster_fact_invalid", "key": key.decode(errors="replace")},
            )
            return
        self._apply_fact(ctx, fact)

    def _apply_fact(self, ctx: ServingContext, fact: Fact) -> None:
        engine = ctx.fleet.get(fact.engine)
        if engine is None:
            self._waiting[fact.engine, fact.what] = fact
            return
        self._waiting.pop((fact.engine, fact.what), None)
        if (fact.engine, fact.what) in self._unwritten:
            # This replica's own newer change is on its way to etcd and will win.
            return
        if fact.what in VERDICTS:
            self._take_verdict(engine, fact)
            return
        changed = apply(engine, fact)
        if changed is not None:
            log.info(
                "engine %s %s %s -> %s (from replica %s)",
                fact.engine,
                fact.what,
                *changed,
                fact.by,
                extra={
                    "event": "cluster_fact",
                    "engine": fact.engine,
                    "what": fact.what,
                    "old": changed[0],
                    "new": changed[1],
                    "by": fact.by,
                },
            )

    def _take_verdict(self, engine: EngineState, fact: Fact) -> None:
        """Another replica's ejection or quarantine holds the engine out here too, until
        its time, its release, or that replica leaving the cluster. This replica's own
        verdicts (its echo) are recovery's already."""
        if fact.by == self.replica_id:
            return
        held = self.holds.get(engine.id)
        if not isinstance(fact.value, Hold):
            if held is not None and (held.what, held.by) == (fact.what, fact.by):
                self._release(engine, f"{fact.by} readmitted it")
            return
        left_s = fact.value.until - time.time()
        if left_s <= 0:
            return
        self.holds[engine.id] = fact
        reason = f"{fact.what} by replica {fact.by}: {fact.value.reason}"
        engine.cluster_hold(trio.current_time() + left_s, reason)
        log.warning(
            "engine %s held out for %.1f s: %s",
            engine.id,
            left_s,
            reason,
            extra={
                "event": "cluster_hold",
                "engine": engine.id,
                "what": fact.what,
                "by": fact.by,
                "for_s": round(left_s, 3),
                "reason": fact.value.reason,
            },
        )

    def _release(self, engine: EngineState, why: str) -> None:
        fact = self.holds.pop(engine.id, None)
        if fact is None:
            return
        engine.cluster_hold(-math.inf, "")
        log.info(
            "engine %s no longer held out by replica %s: %s",
            engine.id,
            fact.by,
            why,
            extra={"event": "cluster_hold_released", "engine": engine.id, "by": fact.by},
        )

    def take_waiting_facts(self, ctx: ServingContext) -> None:
        """After a reload: facts that named engines this replica did not have yet."""
        for fact in list(self._waiting.values()):
            self._apply_fact(ctx, fact)

    # ------------------------------------------------------------ shared loads

    @property
    def _loads_prefix(self) -> bytes:
        return self._prefix + b"loads/"

    async def _write_loads(self, ctx: ServingContext, membership: Membership) -> None:
        """Publish this replica's word every cluster.load_interval_s when it changed, and
        every `refresh_s` anyway: the others trust a word only that long. A failed write
        is not retried: the next interval's word replaces it."""
        assert self._etcd is not None
        key = self._loads_prefix + self.replica_id.encode()
        last, last_at = b"", -math.inf
        while True:
            interval = self.config.cluster.load_interval_s
            await trio.sleep(interval if interval > 0 else 1.0)
            if interval <= 0:
                continue
            now = trio.current_time()
            value = encode_word(self.word(ctx, now))
            if value == last and now - last_at < refresh_s(interval):
                continue
            try:
                await self._etcd.put(key, value, lease=membership.lease)
            except EtcdError:
                # Membership reports the outage; the others stop trusting the last word.
                continue
            last, last_at = value, now

    def word(self, ctx: ServingContext, now: float) -> Word:
        """This replica's load on each engine it has any on."""
        word: dict[str, EngineWord] = {}
        for engine in ctx.fleet:
            load = engine.load.statistics()
            booked = ctx.backlog.booked_s.get(engine, 0.0)
            if booked or load.prefill_inflight or load.decode_active:
                word[engine.id] = EngineWord(
                    booked_s=booked,
                    backlog_s=ctx.backlog.wait_s(engine, now),
                    prefill=load.prefill_inflight,
                    prefill_tokens=load.prefill_tokens_inflight,
                    decode=load.decode_active,
                    decode_tokens=load.decode_tokens,
                )
        return word

    async def _watch_loads(self, ctx: ServingContext) -> None:
        assert self._etcd is not None
        retry_s = self.config.cluster.lease_ttl_s / 3
        prefix = self._loads_prefix
        while True:
            try:
                kvs, revision = await self._etcd.get_prefix(prefix)
                # Replicas whose keys went while the watch was down are gone.
                for replica in set(self.heard.words) - {self._replica_of(kv.key) for kv in kvs}:
                    self.heard.gone(replica)
                for kv in kvs:
                    self._hear(ctx, kv.key, kv.value)
                self._price_with_loads(ctx)
                watch = self._etcd.watch_prefix(prefix, start_revision=revision + 1)
                async with aclosing(watch) as batches:
                    async for batch in batches:
                        for event in batch:
                            if event.kind == "put":
                                self._hear(ctx, event.key, event.value)
                            else:
                                self.heard.gone(self._replica_of(event.key))
                        self._price_with_loads(ctx)
            except EtcdError:
                await trio.sleep(retry_s)

    def _replica_of(self, key: bytes) -> str:
        return key[len(self._loads_prefix) :].decode(errors="replace")

    def _hear(self, ctx: ServingContext, key: bytes, value: bytes) -> None:
        replica = self._replica_of(key)
        if replica == self.replica_id:
            return
        try:
            word = decode_word(value)
        except ValueError as exc:
            log.warning(
                "ignored replica %s's load: %s",
                replica,
                exc,
                extra={"event": "cluster_load_invalid", "replica": replica},
            )
            return
        now = trio.current_time()
        for engine_id, work_s in self.heard.heard(replica, word, now).items():
            engine = ctx.fleet.get(engine_id)
            if engine is not None:
                ctx.backlog.heard(engine, work_s, now)

    def _price_with_loads(self, ctx: ServingContext) -> None:
        """Give each engine the others' load on it, when every other member's word is
        trusted; otherwise none, and pricing takes the engines' scrape."""
        view = self.view
        if view is None:
            return
        others, until = self._heard_until(view)
        heard = until > trio.current_time()
        for engine in ctx.fleet:
            engine.saw_replica_loads(
                self.heard.others_on(engine.id, others, until) if heard else None
            )
            ctx.backlog.others_say(engine, self.heard.busy_on(engine.id, others))

    # ------------------------------------------------------------ membership

    def _on_view(self, view: View) -> None:
        self.view = view
        self._changed.set()

    async def _follow(self, ctx: ServingContext) -> None:
        """Re-split at every view change, and when the clock crosses the lease while cut
        off (no view change marks that moment)."""
        while True:
            self._changed = trio.Event()
            view = self.view
            deadline = float("inf")
            if (
                view is not None
                and not view.connected
                and trio.current_time() < view.lease_ok_until
            ):
                deadline = view.lease_ok_until
            with trio.move_on_at(deadline):
                await self._changed.wait()
            self._apply_share(ctx)
            self._release_departed(ctx)
            self._price_with_loads(ctx)

    def _release_departed(self, ctx: ServingContext) -> None:
        """A replica's verdicts leave with it: its lease lapsed or it stopped, and this
        replica's own probes judge the engines it held out."""
        view = self.view
        if view is None or not view.connected:
            return
        for engine_id, fact in list(self.holds.items()):
            engine = ctx.fleet.get(engine_id)
            if fact.by not in view.members and engine is not None:
                self._release(engine, "it left the cluster")

    def _apply_share(self, ctx: ServingContext) -> None:
        share = self.share(trio.current_time())
        if share == self._share:
            return
        before, self._share = self._share, share
        ctx.apply_share(share)
        view = self.view
        level = logging.WARNING if share.scale < 1.0 else logging.INFO
        log.log(
            level,
            "capacity share: replica %d of %d at %.2f",
            share.index + 1,
            share.count,
            share.scale,
            extra={
                "event": "cluster_share",
                "replica": self.replica_id,
                "members": list(view.members) if view else [],
                "index": share.index,
                "count": share.count,
                "scale": share.scale,
                "was_count": before.count,
                "max_admitted": share.of(ctx.config.serving.max_connections),
            },
        )

    def state(self, max_connections: int) -> ClusterSection:
        view = self.view
        now = trio.current_time()
        if not self.config.cluster.enabled or view is None:
            return ClusterSection(
                enabled=self.config.cluster.enabled,
                replica_id=self.replica_id if self.config.cluster.enabled else None,
                members=(),
                leader=None,
                leading=False,
                connected=False,
                isolated=False,
                connected_for_s=None,
                max_admitted=max_connections,
            )
        return ClusterSection(
            enabled=True,
            replica_id=self.replica_id,
            members=view.members,
            leader=view.leader,
            leading=self.leads(),
            connected=view.connected,
            isolated=isolated(view.connected, view.lease_ok_until, now),
            connected_for_s=round(now - view.since, 3),
            max_admitted=max(1, self._share.of(max_connections)),
            profiles_source=self.profiles.source,
            profiles_digest=self.profiles.digest_shown,
            holds=self._hold_sections(),
            loads_heard=self._heard_until(view)[1] > now,
        )

    def _heard_until(self, view: View) -> tuple[list[str], float]:
        """The other members, and until when each one's load word is trusted (-inf
        alone: there is nobody else's load to price with)."""
        others = [m for m in view.members if m != self.replica_id]
        if not others:
            return others, -math.inf
        trust = trust_s(self.config.cluster.load_interval_s)
        return others, self.heard.trusted_until(others, trust)

    def _hold_sections(self) -> dict[str, HoldSection]:
        wall = time.time()
        return {
            engine_id: HoldSection(
                what=fact.what,
                by=fact.by,
                reason=fact.value.reason,
                for_s=round(max(0.0, fact.value.until - wall), 3),
            )
            for engine_id, fact in sorted(self.holds.items())
            if isinstance(fact.value, Hold) and fact.value.until > wall
        }

    def gauges(self) -> Iterator[Gauge]:
        """For `Metrics.add_live_gauges`: present for one replica too, at its values."""
        section = self.state(self.config.serving.max_connections)
        single = not section.enabled
        yield (
            "narwhal_cluster_members",
            "Replicas this replica sees in the cluster (1 without a cluster section).",
            [],
            [([], float(1 if single else len(section.members)))],
        )
        yield (
            "narwhal_cluster_connected",
            "1 while this replica reaches etcd (1 without a cluster section).",
            [],
            [([], float(single or section.connected))],
        )
        yield (
            "narwhal_cluster_leader",
            "1 while this replica's role controller may move roles.",
            [],
            [([], float(single or section.leading))],
        )
        yield (
            "narwhal_cluster_isolated",
            "1 while cut off from etcd past the lease: admitting at cluster.isolated_share.",
            [],
            [([], float(section.isolated))],
        )
        yield (
            "narwhal_cluster_loads_heard",
            "1 while every other replica's published load is recent and priced with.",
            [],
            [([], float(section.loads_heard))],
        )
        yield (
            "narwhal_cluster_max_admitted",
            "This replica's part of serving.max_connections.",
            [],
            [([], float(section.max_admitted))],
        )
