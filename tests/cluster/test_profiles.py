"""The cluster's profile store (narwhal.cluster._profiles): replicas in front of one
simulated fleet, on a real one-member etcd, price with the one store in the key; and the
store's decisions, without etcd (issue 34)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from narwhal.cluster import SharedProfiles
from narwhal.cluster._etcd import Etcd
from narwhal.cluster._profiles import MAX_STORE_BYTES
from narwhal.config import load_config
from narwhal.profiles import ProfileStore, StoreDocument, save_profiles, store_to_json
from narwhal.sim import Fleet, serve_fleet
from narwhal.supervisor import Finding, Supervisor, preflight

from ..profiles.helpers import prefill, store_for
from ..profiles.test_check import build_of
from ..serving.conftest import MODEL, fleet_config
from ..support import FakeFileLimit, InFront, wait_for
from .conftest import EtcdCluster

TTL_S = 2
KEY = b"/narwhal/profiles"
# Each store's prefill intercept on every engine: what tells, on a replica, which store
# its serving context prices with.
A, A2, B = 0.006, 0.009, 0.02


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


@attrs.define
class Replica(InFront):
    supervisor: Supervisor
    store: Path  # its profiles.path

    @property
    def cluster(self) -> dict[str, Any]:
        section = self.supervisor.cluster
        assert section is not None
        return attrs.asdict(section.state(self.ctx.config.serving.max_connections))

    def prefill_a_s(self) -> float | None:
        """The prefill intercept the serving context prices engine p0 with: its price of
        an empty prompt."""
        profiles = self.ctx.profiles
        curve = None if profiles is None else profiles.prefill_curve("p0")
        return None if curve is None else curve.prefill_s(0)

    def shared(self) -> SharedProfiles:
        assert self.supervisor.cluster is not None
        return self.supervisor.cluster.profiles


StartReplica = Callable[..., Awaitable[Replica]]
MakeStore = Callable[[float], ProfileStore]


@pytest.fixture
async def fleet(nursery: trio.Nursery) -> Fleet:
    sim: Fleet = await nursery.start(partial(serve_fleet, engines=2, speed=20.0, model=MODEL))
    return sim


@pytest.fixture
async def make_store(fleet: Fleet) -> MakeStore:
    """A store that profiles both engines as they run, each at prefill intercept `a`."""
    build = await build_of(load_config(fleet_config(fleet, ["prefill", "decode"])))
    base = store_for({"p0": fleet[0].url, "d1": fleet[1].url}, build=build)

    def make(a: float) -> ProfileStore:
        engines = {e: attrs.evolve(p, prefill=prefill(a=a)) for e, p in base.engines.items()}
        return attrs.evolve(base, engines=engines)

    return make


@pytest.fixture
def start_replica(
    nursery: trio.Nursery, fleet: Fleet, etcd_one: EtcdCluster, tmp_path: Path
) -> StartReplica:
    async def start(
        name: str, *, store: ProfileStore | None, serving: dict[str, Any] | None = None
    ) -> Replica:
        path = tmp_path / f"{name}-profiles.json"
        if store is not None:
            save_profiles(store, path)
        document = fleet_config(
            fleet,
            ["prefill", "decode"],
            serving={"max_connections": 8, **(serving or {})},
            profiles={"path": str(path)},
            cluster={
                "endpoints": etcd_one.endpoints,
                "replica_id": name,
                "lease_ttl_s": TTL_S,
                "request_timeout_s": 0.5,
            },
        )
        config_path = tmp_path / f"{name}.json"
        config_path.write_text(json.dumps(document))
        supervisor = Supervisor(
            load_config(document), config_path=str(config_path), open_files=FakeFileLimit().limit()
        )
        await nursery.start(supervisor.run)
        return Replica(supervisor, path)

    return start


@pytest.fixture
async def etcd(etcd_one: EtcdCluster) -> AsyncIterator[Etcd]:
    client = Etcd(etcd_one.endpoints, timeout_s=1.0)
    try:
        yield client
    finally:
        await client.aclose()


async def _stored(etcd: Etcd, value: bytes, *, within_s: float = 10.0) -> int:
    """Until the key holds `value`; the revision that wrote it."""
    with trio.fail_after(within_s):
        while True:
            kv = await etcd.get(KEY)
            if kv is not None and kv.value == value:
                return kv.mod_revision
            await trio.sleep(0.02)


def _events(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.__dict__.get("event") == event]


async def test_a_replica_prices_with_the_store_another_published(
    start_replica: StartReplica, make_store: MakeStore, etcd: Etcd, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal")
    a = await start_replica("a", store=make_store(A))
    published = a.store.read_bytes()
    # The key was empty: a wrote its store there, only if still empty.
    await _stored(etcd, published)
    await wait_for(lambda: len(_events(caplog, "cluster_profiles_published")) == 1)
    [record] = _events(caplog, "cluster_profiles_published")
    assert (record.__dict__["replica"], record.__dict__["create"]) == ("a", True)
    assert a.cluster["profiles_source"] == "file"
    assert a.cluster["profiles_digest"] == _sha(published)

    # b's own file says otherwise: from before its first request, it prices with a's.
    b = await start_replica("b", store=make_store(B))
    assert b.prefill_a_s() == A
    assert b.cluster["profiles_source"] == "cluster"
    assert b.cluster["profiles_digest"] == _sha(published)
    state = await b.state()
    assert state["cluster"]["profiles_source"] == "cluster"
    assert state["cluster"]["profiles_digest"] == _sha(published)
    assert state["profiles"]["source"] == "cluster"
    assert state["profiles"]["usable_engines"] == ["d1", "p0"]
    [adopted] = _events(caplog, "cluster_profiles_adopted")
    assert adopted.__dict__["replica"] == "b"
    assert adopted.__dict__["digest"] == _sha(published)

    # A replica without a file of its own starts under predictive admission all the same.
    c = await start_replica("c", store=None, serving={"admission": "predictive"})
    assert not c.store.exists()
    assert c.prefill_a_s() == A
    assert c.cluster["profiles_source"] == "cluster"
    kv = await etcd.get(KEY)
    assert kv is not None
    assert kv.value == published


async def test_a_reload_of_a_changed_file_reaches_every_replica(
    start_replica: StartReplica, make_store: MakeStore, etcd: Etcd
) -> None:
    a = await start_replica("a", store=make_store(A))
    await _stored(etcd, a.store.read_bytes())
    b = await start_replica("b", store=make_store(B))
    assert b.prefill_a_s() == A

    save_profiles(make_store(A2), a.store)
    assert (await a.supervisor.reload(trigger="SIGHUP")).applied
    assert a.prefill_a_s() == A2
    assert a.cluster["profiles_source"] == "file"
    await wait_for(lambda: b.prefill_a_s() == A2, within_s=10)
    changed = a.store.read_bytes()
    await _stored(etcd, changed)
    assert a.cluster["profiles_digest"] == b.cluster["profiles_digest"] == _sha(changed)
    assert b.cluster["profiles_source"] == "cluster"

    # A reload of b's unchanged file keeps the cluster's store.
    assert (await b.supervisor.reload(trigger="SIGHUP")).applied
    assert b.prefill_a_s() == A2
    assert b.cluster["profiles_source"] == "cluster"
    assert b.cluster["profiles_digest"] == _sha(changed)


async def test_a_corrupt_store_in_the_key_is_refused_naming_it(
    start_replica: StartReplica,
    make_store: MakeStore,
    etcd: Etcd,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal")
    await etcd.put(KEY, b"{not json")
    b = await start_replica("b", store=make_store(B))
    assert b.prefill_a_s() == B
    assert b.cluster["profiles_source"] == "file"
    assert b.cluster["profiles_digest"] == _sha(b.store.read_bytes())
    [refused] = _events(caplog, "cluster_profiles_refused")
    assert refused.levelno == logging.WARNING
    message = refused.getMessage()
    assert message.startswith(
        f"profiles: refused the store at etcd key /narwhal/profiles (sha256 {_sha(b'{not json')}"
        "): etcd key /narwhal/profiles: not valid JSON: "
    ), message
    assert message.endswith("; pricing with profiles.path"), message
    # The key holds a value: b's store does not replace it.
    kv = await etcd.get(KEY)
    assert kv is not None
    assert kv.value == b"{not json"

    # Another one arriving while b serves: refused too.
    await etcd.put(KEY, json.dumps({"schema_version": 99}).encode())
    await wait_for(lambda: len(_events(caplog, "cluster_profiles_refused")) == 2, within_s=10)
    assert "schema_version is 99" in _events(caplog, "cluster_profiles_refused")[1].getMessage()
    assert b.prefill_a_s() == B
    assert b.cluster["profiles_source"] == "file"
    # And a good store after them is taken.
    good = json.dumps(store_to_json(make_store(A))).encode()
    await etcd.put(KEY, good)
    await wait_for(lambda: b.prefill_a_s() == A, within_s=10)
    assert b.cluster["profiles_source"] == "cluster"
    assert b.cluster["profiles_digest"] == _sha(good)


async def test_a_replica_never_writes_back_the_store_it_took(
    start_replica: StartReplica,
    make_store: MakeStore,
    etcd: Etcd,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal")
    a = await start_replica("a", store=make_store(A))
    first = await _stored(etcd, a.store.read_bytes())
    b = await start_replica("b", store=make_store(B))
    assert b.prefill_a_s() == A
    assert b.shared().pending() is None
    # A reload of b's own (unchanged) file neither takes it back nor publishes it.
    assert (await b.supervisor.reload(trigger="SIGHUP")).applied
    assert b.shared().pending() is None
    assert b.prefill_a_s() == A

    save_profiles(make_store(A2), a.store)
    assert (await a.supervisor.reload(trigger="SIGHUP")).applied
    await wait_for(lambda: b.prefill_a_s() == A2, within_s=10)
    assert b.shared().pending() is None
    second = await _stored(etcd, a.store.read_bytes())
    # Every write of the key since etcd started: a's two, no other.
    writes = await _history(etcd, until=second)
    assert writes == [first, second]
    await wait_for(lambda: len(_events(caplog, "cluster_profiles_published")) == 2)
    publishers = [r.__dict__["replica"] for r in _events(caplog, "cluster_profiles_published")]
    assert publishers == ["a", "a"]


async def _history(etcd: Etcd, *, until: int) -> list[int]:
    """The revisions of every put of the key, from etcd's first, up to `until`."""
    revisions: list[int] = []
    with trio.fail_after(10):
        async with aclosing(etcd.watch_prefix(KEY, start_revision=1)) as batches:
            async for batch in batches:
                revisions += [e.mod_revision for e in batch if e.key == KEY and e.kind == "put"]
                if revisions and revisions[-1] >= until:
                    return revisions
    raise AssertionError("the watch ended")


# ---------------------------------------------------------------------- without etcd

FILE = StoreDocument("runs/profiles.json", b'{"schema_version": 1}')
OTHER = StoreDocument("runs/profiles.json", b'{"schema_version": 1, "tool": "x"}')


def _shared(*, joined: bool = True, file: StoreDocument | None = FILE) -> SharedProfiles:
    """A replica's shared store that priced with `file` at start and joined (`joined`) a key
    that held the same store (as after the create it made)."""
    shared = SharedProfiles(b"/narwhal/", replica_id="a", retry_s=1.0)

    async def adopt(document: StoreDocument) -> None:
        shared.adopted(document)

    shared.adopt = adopt
    if file is not None:
        shared.checked(file, file, installed=True)
    if joined:
        assert shared.take(FILE.data, 1) is None
    return shared


def test_a_replica_joining_an_empty_key_creates_it_with_its_files_store() -> None:
    shared = _shared(joined=False)
    assert (shared.source, shared.digest) == ("file", FILE.digest)
    assert shared.pending() is None  # nothing before the key was read
    assert shared.take(None, 0) is None
    assert shared.pending() == (FILE, True)
    # A store there meanwhile comes first: the create is dropped, the store adopted.
    value = shared.take(OTHER.data, 7)
    assert value is not None
    assert value.source == "etcd key /narwhal/profiles"
    assert shared.pending() is None
    # Without a store of its own, a replica writes nothing.
    bare = _shared(joined=False, file=None)
    assert bare.take(None, 0) is None
    assert bare.pending() is None


def test_the_same_store_is_not_taken_again() -> None:
    shared = _shared()
    shared.take(None, 2)
    assert shared.pending() is None  # an empty key after the join is not filled again
    # This replica's own store, written again.
    assert shared.take(FILE.data, 3) is None
    other = shared.take(OTHER.data, 4)
    assert other is not None
    shared.adopted(other)
    assert (shared.source, shared.digest) == ("cluster", OTHER.digest)
    assert shared.take(OTHER.data, 5) is None


def test_only_a_changed_file_is_published_and_never_the_clusters_store() -> None:
    shared = _shared()
    value = shared.take(OTHER.data, 4)
    assert value is not None
    shared.adopted(value)
    # A reload of the unchanged file checks the cluster's store again, and writes nothing.
    same = StoreDocument(FILE.source, FILE.data)
    assert shared.to_check(same) is value
    shared.checked(same, value, installed=True)
    assert (shared.source, shared.pending()) == ("cluster", None)
    # The operator changed the file: it is priced with, and put.
    changed = StoreDocument(FILE.source, b'{"schema_version": 1, "tool": "new"}')
    assert shared.to_check(changed) is changed
    shared.checked(changed, changed, installed=True)
    assert (shared.source, shared.digest) == ("file", changed.digest)
    assert shared.pending() == (changed, False)
    # While that put is on its way, no value is taken: the put comes after it, and wins.
    assert shared.take(OTHER.data, 9) is None
    assert shared.digest == changed.digest


def test_a_changed_file_it_cannot_use_is_not_published() -> None:
    shared = _shared()
    broken = StoreDocument(FILE.source, b"{")
    shared.checked(broken, broken, installed=False)
    assert (shared.source, shared.digest, shared.pending()) == ("file", FILE.digest, None)
    # Nor one the key holds already.
    shared.take(OTHER.data, 4)
    again = StoreDocument(FILE.source, OTHER.data)
    shared.checked(again, again, installed=True)
    assert shared.pending() is None


def test_a_store_over_etcds_request_limit_is_not_published(
    caplog: pytest.LogCaptureFixture,
) -> None:
    shared = _shared()
    large = StoreDocument(FILE.source, b" " * (MAX_STORE_BYTES + 1))
    shared.checked(large, large, installed=True)
    assert shared.pending() is None
    assert shared.source == "file"
    [warning] = [
        r for r in caplog.records if r.__dict__.get("event") == "cluster_profiles_too_large"
    ]
    assert warning.getMessage() == (
        f"profiles: the store from runs/profiles.json is {MAX_STORE_BYTES + 1} bytes, over the "
        f"{MAX_STORE_BYTES} etcd takes in one request (its default --max-request-bytes, "
        "1.5 MiB, less the key): not shared; the other replicas keep theirs"
    )
    fits = StoreDocument(FILE.source, b" " * MAX_STORE_BYTES)
    shared.checked(fits, fits, installed=True)
    assert shared.pending() == (fits, False)


def test_validate_says_a_replica_without_a_store_of_its_own_needs_the_clusters(
    tmp_path: Path,
) -> None:
    store = tmp_path / "profiles.json"
    document: dict[str, Any] = {
        "engines": [{"id": "a", "url": "http://127.0.0.1:9"}],
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"host": "127.0.0.1", "port": 0},
        "ctl": {"socket": str(tmp_path / "ctl.sock")},
        "serving": {"admission": "predictive"},
        "profiles": {"path": str(store)},
    }
    alone = preflight(load_config(document), open_files=FakeFileLimit().limit())
    refusal = (
        f"serving.admission is predictive but profiles.path='{store}' gives no usable "
        f"profile ({store}: profile store is missing; run narwhal-profile --config FILE); "
        "run narwhal-profile, or set serving.admission to open"
    )
    assert alone.refusals == [Finding(refusal, refuses=True)]
    # A replica takes the cluster's store as it joins: serve may well start.
    document["cluster"] = {"endpoints": ["http://127.0.0.1:9"], "prefix": "/fleet-a/"}
    replica = preflight(load_config(document), open_files=FakeFileLimit().limit())
    assert replica.refusals == []
    assert replica.degraded == [
        Finding(
            f"{refusal} (serve starts all the same if etcd key /fleet-a/profiles holds a "
            "usable store)",
            refuses=False,
        )
    ]
