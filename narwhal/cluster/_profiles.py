"""The cluster's profile store: one etcd key, so that every replica prices with one store.

Owns
  `SharedProfiles`: the key `prefix + b"profiles"` (the store's JSON document, byte for
  byte as profiles.path holds it); where the store this replica prices with came from
  (`source`: "file" or "cluster", and its `digest`); reading the key as the replica
  joins, watching it, and publishing the store an operator gave this replica.
  `MAX_STORE_BYTES`, what one etcd request carries.

Invariants
  A replica publishes only a store it priced with from its own file: as it joins, if the
  key is absent, with create-if-absent (of replicas starting together the first wins, the
  others adopt its store); after a reload that found the file changed, with a put (the
  last writer wins, in etcd's order, on every replica alike). A store received from etcd
  is never published back, and a value whose digest is the store in use is not applied
  again. While its own put waits for etcd, a replica applies no value (its put follows it
  and wins). Checking a value as a file is checked, and pricing with it, are the
  supervisor's `adopt`, serialised with its reloads: a value that gives no usable profile
  is refused, naming the key, and the replica keeps the store it has.

Errors
  None from `run`: an etcd failure is retried every `retry_s` (the key is read again);
  a store etcd refuses, or one over `MAX_STORE_BYTES`, is not shared, and said.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Literal

import trio

from ..profiles import StoreDocument
from ._etcd import Etcd, EtcdError, EtcdUnavailable

log = logging.getLogger("narwhal.cluster")

Source = Literal["file", "cluster"]
# etcd's default --max-request-bytes (1.5 MiB) bounds a put, its key and framing included:
# a store is published only with a KiB to spare.
ETCD_MAX_REQUEST_BYTES = 1536 * 1024
MAX_STORE_BYTES = ETCD_MAX_REQUEST_BYTES - 1024


def profiles_key(prefix: bytes) -> bytes:
    return prefix + b"profiles"


class SharedProfiles:
    def __init__(self, prefix: bytes, *, replica_id: str, retry_s: float) -> None:
        self.key = profiles_key(prefix)
        self.replica_id = replica_id
        self.retry_s = retry_s
        # The store this replica prices with, and where it came from (None: none yet, or
        # one that is not shared: injected, or not read since start).
        self.source: Source | None = None
        self.in_use: StoreDocument | None = None
        # The key's value as last read or watched (None: absent, or not read yet), and
        # the revision that wrote it.
        self.value: StoreDocument | None = None
        self._value_revision = 0
        # The supervisor's: check a value of the key as a store file is checked and, if it
        # gives a usable profile, price with it (`adopted`), else `refused`. None: this
        # replica shares no profiles (they were injected).
        self.adopt: Callable[[StoreDocument], Awaitable[None]] | None = None
        self._joined = False
        # profiles.path's digest at its last read: a reload that finds another has the
        # operator's change to publish.
        self._file_digest: str | None = None
        # The store to write, and whether only if the key is absent.
        self._unpublished: tuple[StoreDocument, bool] | None = None
        self._publish_wanted = trio.Event()

    def __repr__(self) -> str:
        key = self.key.decode(errors="replace")
        return f"<SharedProfiles {key} [{self.source}: {self.digest_shown}]>"

    def pending(self) -> tuple[StoreDocument, bool] | None:
        """The store waiting to be written to the key, and whether only if it is absent."""
        return self._unpublished

    @property
    def where(self) -> str:
        """The key, as the messages about its value name it."""
        return f"etcd key {self.key.decode(errors='replace')}"

    @property
    def digest(self) -> str | None:
        """The sha256 of the store in use (hex)."""
        return None if self.in_use is None else self.in_use.digest

    @property
    def digest_shown(self) -> str | None:
        """`digest` as /narwhal/state and the log show it."""
        return _short(self.digest)

    # ------------------------------------------------------------ decisions (no I/O)

    def to_check(self, file: StoreDocument) -> StoreDocument:
        """What a reload that read `file` checks again and prices with: the cluster's store
        in use, unless the operator changed the file since it was last read."""
        if self.source == "cluster" and self.in_use is not None and not self._changed(file):
            return self.in_use
        return file

    def checked(self, file: StoreDocument, document: StoreDocument, *, installed: bool) -> None:
        """profiles.path was read (`file`) at start or at a reload, and `document` (the file,
        or the cluster's store: `to_check`) was priced with (`installed`) or kept out.

        A store installed from a changed file is published; at start the join decides
        (the key's store, if any, comes first)."""
        changed = self._changed(file)
        self._file_digest = file.digest
        if not installed:
            return
        self.in_use = document
        if document is not file:
            return
        self.source = "file"
        if (
            self._joined
            and changed
            and file.data is not None
            and (self.value is None or self.value.digest != file.digest)
        ):
            self._publish(file, create=False)

    def _changed(self, file: StoreDocument) -> bool:
        return file.digest != self._file_digest

    def take(self, data: bytes | None, revision: int) -> StoreDocument | None:
        """The key's value as read or watched at `revision` (None: absent, or deleted): the
        store to adopt, if any. The first read is the replica joining: a key it finds empty
        gets the store of its file, if it prices with one (create-if-absent)."""
        joining, self._joined = not self._joined, True
        if data is None:
            self.value = None
            if joining and self.source == "file" and self.in_use is not None:
                self._publish(self.in_use, create=True)
            return None
        document = StoreDocument(self.where, data)
        self.value, self._value_revision = document, revision
        if self._unpublished is not None and self._unpublished[1]:
            # A create would find the key taken: the store there comes first.
            self._unpublished = None
        # While this replica's own put is on its way, `wants` says no: that put comes
        # after this value and wins (unless it landed first: `_write` compares revisions).
        return document if self.adopt is not None and self.wants(document) else None

    def wants(self, document: StoreDocument) -> bool:
        """Whether `document`, read from the key, should be adopted now: it is the key's
        latest value, another store than the one in use, and no put of this replica's own
        is on its way to etcd (it would replace the value, and win)."""
        putting = self._unpublished is not None and not self._unpublished[1]
        return document is self.value and document.digest != self.digest and not putting

    def adopted(self, document: StoreDocument) -> None:
        """The supervisor prices with the key's `document` from now on."""
        before = self.digest
        self.source = "cluster"
        self.in_use = document
        log.info(
            "profiles: pricing with the cluster's store from %s (sha256 %s)",
            self.where,
            _short(document.digest),
            extra={
                "event": "cluster_profiles_adopted",
                "replica": self.replica_id,
                "key": self.key.decode(errors="replace"),
                "digest": _short(document.digest),
                "was": _short(before),
                "bytes": len(document.data or b""),
            },
        )

    def refused(self, document: StoreDocument, problems: Sequence[str]) -> None:
        """The key's `document` gives no usable profile here: the store in use stays."""
        detail = "; ".join(problems) or "no engine has a usable profile"
        kept = {"file": "profiles.path", "cluster": "the cluster's previous store"}
        log.warning(
            "profiles: refused the store at %s (sha256 %s): %s; pricing with %s",
            self.where,
            _short(document.digest),
            detail,
            kept[self.source] if self.source else "no profiles",
            extra={
                "event": "cluster_profiles_refused",
                "replica": self.replica_id,
                "key": self.key.decode(errors="replace"),
                "digest": _short(document.digest),
                "problems": list(problems),
                "source": self.source,
            },
        )

    def _publish(self, document: StoreDocument, *, create: bool) -> None:
        assert document.data is not None
        size = len(document.data)
        if size > MAX_STORE_BYTES:
            log.warning(
                "profiles: the store from %s is %d bytes, over the %d etcd takes in one "
                "request (its default --max-request-bytes, 1.5 MiB, less the key): not "
                "shared; the other replicas keep theirs",
                document.source,
                size,
                MAX_STORE_BYTES,
                extra={
                    "event": "cluster_profiles_too_large",
                    "replica": self.replica_id,
                    "key": self.key.decode(errors="replace"),
                    "bytes": size,
                    "limit": MAX_STORE_BYTES,
                },
            )
            return
        self._unpublished = (document, create)
        self._publish_wanted.set()

    # ------------------------------------------------------------ etcd

    async def run(self, etcd: Etcd, *, task_status: trio.TaskStatus[None]) -> None:
        """Read the key (adopting its store, or publishing this replica's), report
        started, then watch it and publish what `checked` asks for."""
        revision: int | None = None
        try:
            revision = await self._read(etcd)
        except EtcdError as exc:
            # Joined a moment ago, so etcd answers again soon: serve with the file's store
            # meanwhile, and read the key then.
            log.warning(
                "profiles: %s not read yet (%s); pricing with profiles.path until it is",
                self.where,
                exc,
                extra={
                    "event": "cluster_profiles_unread",
                    "replica": self.replica_id,
                    "problem": str(exc),
                },
            )
        task_status.started()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._write, etcd)
            await self._watch(etcd, revision)

    async def _read(self, etcd: Etcd) -> int:
        """Take the key's value (the first read joins); the revision to watch from."""
        kvs, revision = await etcd.get_prefix(self.key)
        found = next((kv for kv in kvs if kv.key == self.key), None)
        if found is None:
            self.take(None, revision)
        else:
            await self._adopt(self.take(found.value, found.mod_revision))
        return revision

    async def _adopt(self, document: StoreDocument | None) -> None:
        if document is not None and self.adopt is not None:
            await self.adopt(document)

    async def _watch(self, etcd: Etcd, revision: int | None) -> None:
        while True:
            try:
                if revision is None:
                    revision = await self._read(etcd)
                watch = etcd.watch_prefix(self.key, start_revision=revision + 1)
                async with aclosing(watch) as batches:
                    async for batch in batches:
                        for event in batch:
                            revision = max(revision, event.mod_revision)
                            if event.key != self.key:
                                continue
                            if event.kind == "put":
                                await self._adopt(self.take(event.value, event.mod_revision))
                            else:
                                # Whoever deleted it: every replica keeps what it has.
                                self.take(None, event.mod_revision)
            except EtcdError:
                # Past a compaction missed values cannot be replayed, and an outage may
                # have hidden some: read the key again once etcd answers.
                await trio.sleep(self.retry_s)
                revision = None

    async def _write(self, etcd: Etcd) -> None:
        while True:
            await self._publish_wanted.wait()
            self._publish_wanted = trio.Event()
            while self._unpublished is not None:
                pending = self._unpublished
                document, create = pending
                assert document.data is not None
                revision = 0
                try:
                    if create:
                        written = await etcd.create(self.key, document.data, lease=0)
                    else:
                        revision = await etcd.put(self.key, document.data)
                        written = True
                except EtcdError as exc:
                    # Unavailable: tried again. Anything else is etcd's no (a smaller
                    # --max-request-bytes, say), which the same write would get again.
                    retry = isinstance(exc, EtcdUnavailable)
                    log.warning(
                        "profiles: the store from %s not published to %s%s: %s",
                        document.source,
                        self.where,
                        " yet" if retry else "",
                        exc,
                        extra={
                            "event": "cluster_profiles_unpublished",
                            "replica": self.replica_id,
                            "key": self.key.decode(errors="replace"),
                            "digest": _short(document.digest),
                            "problem": str(exc),
                            "retry": retry,
                        },
                    )
                    if not retry and self._unpublished is pending:
                        self._unpublished = None
                    elif retry:
                        await trio.sleep(self.retry_s)
                    continue
                if self._unpublished is pending:
                    self._unpublished = None
                # A create that found the key taken published nothing: the watch brings
                # the store there.
                if written:
                    log.info(
                        "profiles: published the store from %s to %s (sha256 %s, %d bytes)",
                        document.source,
                        self.where,
                        _short(document.digest),
                        len(document.data),
                        extra={
                            "event": "cluster_profiles_published",
                            "replica": self.replica_id,
                            "key": self.key.decode(errors="replace"),
                            "digest": _short(document.digest),
                            "bytes": len(document.data),
                            "create": create,
                        },
                    )
                # A value written after this put, seen (and passed over) while it was on
                # its way, is the key's store now.
                value = self.value
                if (
                    revision
                    and value is not None
                    and self._value_revision > revision
                    and self.wants(value)
                ):
                    await self._adopt(value)


def _short(digest: str | None) -> str | None:
    """A digest as /narwhal/state and the log show it: its first 12 hex digits."""
    return None if digest is None else digest[:12]
