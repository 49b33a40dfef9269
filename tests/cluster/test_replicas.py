"""Several Narwhal replicas in front of one simulated fleet, coordinated through a real
three-member etcd: membership, the capacity split, one controller, shared fleet facts,
and what a replica does when etcd goes away (issue 34)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import attrs
import httpx
import pytest
import trio

from narwhal.cluster import ClusterUnavailable
from narwhal.cluster._etcd import Etcd
from narwhal.config import load_config
from narwhal.ctl import CtlRequest
from narwhal.fleet import EngineState
from narwhal.sim import Fleet, serve_fleet
from narwhal.supervisor import Supervisor
from narwhal.supervisor._operations import Operations

from ..admission.test_first_token_wait import Source
from ..admission.test_pricing import Linear
from ..serving.conftest import MODEL, fleet_config
from ..support import FakeFileLimit, InFront, wait_for
from .conftest import EtcdCluster

TTL_S = 2


@attrs.define
class Replica(InFront):
    supervisor: Supervisor
    scope: trio.CancelScope

    @property
    def cluster(self) -> dict[str, Any]:
        section = self.supervisor.cluster
        assert section is not None
        return attrs.asdict(section.state(self.ctx.config.serving.max_connections))

    def stop(self) -> None:
        """Stop it as its service manager would (SIGTERM's path: leases revoked)."""
        self.scope.cancel()


StartReplica = Callable[..., Awaitable[Replica]]


@pytest.fixture
async def fleet(nursery: trio.Nursery) -> Fleet:
    sim: Fleet = await nursery.start(partial(serve_fleet, engines=2, speed=20.0, model=MODEL))
    return sim


@pytest.fixture
def start_replica(nursery: trio.Nursery, fleet: Fleet, etcd_three: EtcdCluster) -> StartReplica:
    async def start(
        name: str, *, cluster: dict[str, Any] | None = None, **sections: dict[str, Any]
    ) -> Replica:
        document = fleet_config(
            fleet,
            ["prefill", "decode"],
            serving={"max_connections": 8, "prefill_concurrency": 3, "decode_concurrency": 4},
            cluster={
                "endpoints": etcd_three.endpoints,
                "replica_id": name,
                "lease_ttl_s": TTL_S,
                "request_timeout_s": 0.5,
                **(cluster or {}),
            },
            **sections,
        )
        config = load_config(document)
        supervisor = Supervisor(config, open_files=FakeFileLimit().limit())
        scope = trio.CancelScope()

        async def run(*, task_status: trio.TaskStatus[Supervisor]) -> None:
            with scope:
                await supervisor.run(task_status=task_status)

        await nursery.start(run)
        return Replica(supervisor, scope)

    return start


def _engine(replica: Replica, engine_id: str) -> EngineState:
    engine = replica.ctx.fleet.get(engine_id)
    assert engine is not None
    return engine


def _members(*replicas: Replica) -> list[list[str]]:
    return [list(r.cluster["members"]) for r in replicas]


async def _complete(replica: Replica) -> httpx.Response:
    async with replica.client() as client:
        return await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "hello there", "max_tokens": 4}
        )


async def test_two_replicas_split_the_capacity_and_one_leads(start_replica: StartReplica) -> None:
    a = await start_replica("a")
    # Alone, a replica has everything.
    assert a.cluster["members"] == ("a",)
    assert a.ctx.gate.statistics().max_admitted == 8
    b = await start_replica("b")
    await wait_for(lambda: _members(a, b) == [["a", "b"], ["a", "b"]], within_s=10)
    assert [r.ctx.gate.statistics().max_admitted for r in (a, b)] == [4, 4]
    # prefill_concurrency 3 on engine 0: the odd slot goes to replica 0 (a).
    prefill = [_engine(r, "p0").prefill_limiter.total_tokens for r in (a, b)]
    decode = [_engine(r, "d1").decode_limiter.total_tokens for r in (a, b)]
    assert prefill == [2, 1]
    assert decode == [2, 2]
    leaders = [r.cluster["leader"] for r in (a, b)]
    assert leaders[0] == leaders[1] in ("a", "b")
    assert [r.cluster["leading"] for r in (a, b)].count(True) == 1
    for replica in (a, b):
        response = await _complete(replica)
        assert response.status_code == 200, response.text
    metrics = await b.metrics()
    assert "narwhal_cluster_members 2.0" in metrics
    assert "narwhal_cluster_max_admitted 4.0" in metrics
    # Each prices with the other's published load (cluster.load_interval_s).
    await wait_for(lambda: a.cluster["loads_heard"] and b.cluster["loads_heard"], within_s=5)
    assert "narwhal_cluster_loads_heard 1.0" in await b.metrics()


async def test_a_stopped_replicas_part_and_leadership_return_to_the_others(
    start_replica: StartReplica,
) -> None:
    a = await start_replica("a")
    b = await start_replica("b")
    await wait_for(lambda: _members(a, b) == [["a", "b"], ["a", "b"]], within_s=10)
    leader, other = (a, b) if a.cluster["leading"] else (b, a)
    started = trio.current_time()
    leader.stop()
    await wait_for(lambda: other.cluster["leading"], within_s=TTL_S + 5)
    # A stop revokes the lease: the others know at once, not after the TTL.
    assert trio.current_time() - started < TTL_S
    await wait_for(lambda: other.ctx.gate.statistics().max_admitted == 8, within_s=5)
    assert len(other.cluster["members"]) == 1
    assert other.cluster["loads_heard"] is False  # alone: nobody else's to hear


async def test_narwhalctl_on_one_replica_acts_on_every_replica(
    start_replica: StartReplica,
) -> None:
    a = await start_replica("a")
    b = await start_replica("b")
    await wait_for(lambda: _members(a, b) == [["a", "b"], ["a", "b"]], within_s=10)
    result = await Operations(a.supervisor)(CtlRequest("drain", engine="d1"))
    assert isinstance(result, dict)
    assert result["replicas"] == "all"
    b_d1 = b.ctx.fleet.get("d1")
    assert b_d1 is not None
    await wait_for(lambda: b_d1.drained, within_s=5)
    await Operations(b.supervisor)(CtlRequest("undrain", engine="d1"))
    a_d1 = a.ctx.fleet.get("d1")
    assert a_d1 is not None
    await wait_for(lambda: not a_d1.drained, within_s=5)
    await Operations(b.supervisor)(CtlRequest("pin", engine="p0", role="decode"))
    a_p0 = a.ctx.fleet.get("p0")
    assert a_p0 is not None
    await wait_for(lambda: a_p0.pinned and a_p0.role == "decode", within_s=5)
    # A replica that joins later starts with the facts.
    c = await start_replica("c")
    c_p0 = c.ctx.fleet.get("p0")
    assert c_p0 is not None
    assert (c_p0.pinned, c_p0.role) == (True, "decode")


async def test_cut_off_from_etcd_a_replica_keeps_serving_then_admits_a_safe_share(
    start_replica: StartReplica, etcd_three: EtcdCluster
) -> None:
    a = await start_replica("a", cluster={"isolated_share": 0.5})
    b = await start_replica("b")
    await wait_for(lambda: _members(a, b) == [["a", "b"], ["a", "b"]], within_s=10)
    etcd_three.pause_all()
    try:
        await wait_for(lambda: not a.cluster["connected"], within_s=TTL_S + 5)
        # Roles freeze: nobody leads while cut off.
        assert not a.cluster["leading"]
        assert not b.cluster["leading"]
        response = await _complete(a)
        assert response.status_code == 200, response.text
        await wait_for(lambda: a.cluster["isolated"], within_s=TTL_S + 5)
        assert a.ctx.gate.statistics().max_admitted == 2  # half of its 4
        state = await a.state()
        assert state["cluster"]["isolated"] is True
        assert "narwhal_cluster_isolated 1.0" in await a.metrics()
        response = await _complete(a)
        assert response.status_code == 200, response.text
    finally:
        etcd_three.resume_all()
    await wait_for(lambda: a.cluster["connected"] and not a.cluster["isolated"], within_s=15)
    await wait_for(lambda: _members(a, b) == [["a", "b"], ["a", "b"]], within_s=15)
    # Each re-registered after etcd expired its lease: the split follows the members.
    await wait_for(lambda: a.ctx.gate.statistics().max_admitted == 4, within_s=5)
    await wait_for(
        lambda: [a.cluster["leading"], b.cluster["leading"]].count(True) == 1, within_s=15
    )


async def test_a_replica_restarted_after_a_crash_waits_out_its_old_lease(
    start_replica: StartReplica, etcd_three: EtcdCluster
) -> None:
    # What a kill -9 leaves: the member key under a lease nobody renews any more.
    etcd = Etcd(etcd_three.endpoints, timeout_s=1.0)
    try:
        lease = await etcd.grant(TTL_S)
        await etcd.put(b"/narwhal/members/a", b'{"id": "a"}', lease=lease)
        started = trio.current_time()
        a = await start_replica("a")
        waited = trio.current_time() - started
    finally:
        await etcd.aclose()
    assert a.cluster["members"] == ("a",)
    assert waited >= 1.0  # it did wait for the lapse (etcd may round the TTL up)


async def test_a_second_live_replica_with_a_name_in_use_is_refused_naming_it(
    start_replica: StartReplica,
) -> None:
    await start_replica("a")
    with pytest.raises(ExceptionGroup) as refused:
        await start_replica("a")
    # After waiting out a lease TTL in case it was its own previous process's key.
    assert refused.group_contains(ClusterUnavailable, match="replica id 'a' is in use")


def _why_out(replica: Replica, engine_id: str) -> str | None:
    return _engine(replica, engine_id).unavailable_reason(trio.current_time())


async def test_a_quarantine_on_one_replica_holds_the_engine_out_on_every_replica(
    start_replica: StartReplica, fleet: Fleet
) -> None:
    recovery = {"failure_quarantine_s": 30.0}
    a = await start_replica("a", recovery=recovery)
    b = await start_replica("b", recovery=recovery)
    await wait_for(lambda: _members(a, b) == [["a", "b"], ["a", "b"]], within_s=10)
    fleet[0].set_faults(error_status=503, leg="prefill", count=1)
    await _complete(a)  # its prefill leg fails on p0, and a quarantines p0
    assert _why_out(a, "p0") == "quarantined"
    await wait_for(lambda: _why_out(b, "p0") is not None, within_s=5)
    assert _why_out(b, "p0") == "quarantined by replica a: counted prefill failure " + (
        "(engine_http_503); excluded from placement for recovery.failure_quarantine_s=30.0"
    )
    assert b.supervisor.recovery is not None
    # b's own verdicts are untouched: the hold is a's, and b's probes go on.
    assert b.supervisor.recovery.state().engines["p0"].quarantine.active is False
    # A replica joining later takes it from etcd before it serves.
    c = await start_replica("c", recovery=recovery)
    assert (_why_out(c, "p0") or "").startswith("quarantined by replica a")
    # A replica's verdicts leave with it.
    a.stop()
    await wait_for(lambda: _why_out(b, "p0") is None and _why_out(c, "p0") is None, within_s=5)


async def test_an_ejection_is_shared_and_its_readmission_releases_every_replica(
    start_replica: StartReplica, fleet: Fleet
) -> None:
    # a probes often; b so rarely that it sees p0 fail only through a.
    fast = {"health": {"interval_s": 0.1, "failure_threshold": 1, "readmit_successes": 1}}
    a = await start_replica("a", recovery=fast)
    b = await start_replica("b", recovery={"health": {"interval_s": 600.0}})
    await wait_for(lambda: _members(a, b) == [["a", "b"], ["a", "b"]], within_s=10)
    fleet[0].set_faults(unhealthy=True)
    await wait_for(lambda: (_why_out(a, "p0") or "").startswith("ejected"), within_s=5)
    await wait_for(lambda: _why_out(b, "p0") is not None, within_s=5)
    assert (_why_out(b, "p0") or "").startswith("ejected by replica a: ")
    assert b.supervisor.recovery is not None
    assert b.supervisor.recovery.state().engines["p0"].health.verdict.verdict.value == "up"
    with pytest.raises(trio.TooSlowError):  # nothing else lets it go early
        await wait_for(lambda: _why_out(b, "p0") is None, within_s=1)
    fleet[0].clear_faults()
    # a verifies p0 and readmits it; b follows without a probe or verification of its own.
    await wait_for(lambda: _why_out(a, "p0") is None, within_s=10)
    await wait_for(lambda: _why_out(b, "p0") is None, within_s=5)
    assert b.supervisor.recovery.state().engines["p0"].last_verification is None


@pytest.mark.parametrize(
    ("interval_s", "source"), [(0.05, "replicas"), (0.0, "scrape")], ids=["published", "scraped"]
)
async def test_a_replica_prices_the_legs_it_sees_of_another_on_an_engine(
    start_replica: StartReplica, fleet: Fleet, interval_s: float, source: str
) -> None:
    # Published, a's word says what it runs on d1; with publishing off, b's scrape of d1.
    a = await start_replica("a", cluster={"load_interval_s": interval_s})
    b = await start_replica("b", cluster={"load_interval_s": interval_s})
    await wait_for(lambda: _members(a, b) == [["a", "b"], ["a", "b"]], within_s=10)
    fleet[1].set_faults(decode_slowdown=1000.0)  # a's decode stays on d1 for seconds
    d1_on_a, d1_on_b = _engine(a, "d1"), _engine(b, "d1")

    async def long_request() -> None:
        async with a.client() as client:
            body = {"model": MODEL, "prompt": "hello there", "max_tokens": 200}
            await client.post("/v1/completions", json=body)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(long_request)
        await wait_for(lambda: d1_on_a.load.decode_active == 1, within_s=10)
        # b sent nothing to d1, yet prices the decode a runs there.
        await wait_for(lambda: d1_on_b.view(trio.current_time()).decode_active == 1, within_s=10)
        assert d1_on_b.load.decode_active == 0
        entry = next(e for e in (await b.state())["engines"] if e["id"] == "d1")
        assert entry["other_replicas"] == {"source": source, "prefill": 0, "decode": 1}
        # a sees its own leg on d1 and nobody else's.
        assert d1_on_a.view(trio.current_time()).decode_active == 1
        nursery.cancel_scope.cancel()


class _SlowPrefills(Source):
    def prefill_curve(self, engine_id: str) -> Linear:
        return Linear(1.0)  # a second a token: a's booking shows on b for seconds


async def test_a_replica_prices_the_prefill_work_another_booked(
    start_replica: StartReplica, fleet: Fleet
) -> None:
    a = await start_replica("a")
    b = await start_replica("b")
    await wait_for(lambda: _members(a, b) == [["a", "b"], ["a", "b"]], within_s=10)
    fleet[0].set_faults(leg="prefill", stall_before_first_token_s=30.0)  # p0 holds a's prefill
    p0_on_a, p0_on_b = _engine(a, "p0"), _engine(b, "p0")
    a.ctx.profiles = _SlowPrefills()  # a books its prefills; b has no profile to book with

    async def long_request() -> None:
        async with a.client() as client:
            body = {"model": MODEL, "prompt": "hello there", "max_tokens": 2}
            await client.post("/v1/completions", json=body)

    def backlog_on_b() -> float:
        return b.ctx.load_signals(trio.current_time()).backlog_s["p0"]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(long_request)
        await wait_for(lambda: p0_on_a.load.prefill_inflight == 1, within_s=10)
        booked = a.ctx.backlog.booked_s[p0_on_a]
        assert booked >= 3.0  # "hello there" is 3 tokens or more
        # b booked nothing on p0, yet its wait there is a's booking, less the time since.
        await wait_for(lambda: backlog_on_b() > 0, within_s=5)
        assert b.ctx.backlog.wait_s(p0_on_b, trio.current_time()) == 0.0
        assert booked - 1.0 < backlog_on_b() <= booked
        entry = next(e for e in (await b.state())["engines"] if e["id"] == "p0")
        assert entry["other_replicas"] == {"source": "replicas", "prefill": 1, "decode": 0}
        nursery.cancel_scope.cancel()


async def test_a_silent_replicas_load_gives_way_to_the_engines_scrape(
    start_replica: StartReplica,
) -> None:
    a = await start_replica("a")
    b = await start_replica("b")
    await wait_for(lambda: b.cluster["loads_heard"], within_s=10)
    d1_on_b = _engine(b, "d1")
    seen = d1_on_b.seen_load(trio.current_time())
    assert seen is not None
    assert seen.source == "replicas"
    # A reload turns a's publishing off: still a member, but silent. Within 2.5 s b stops
    # trusting its last word and says so.
    silent = attrs.evolve(
        a.supervisor.config,
        cluster=attrs.evolve(a.supervisor.config.cluster, load_interval_s=0.0),
    )
    assert a.supervisor.cluster is not None
    a.supervisor.cluster.reconfigure(silent)
    await wait_for(lambda: not b.cluster["loads_heard"], within_s=5)
    assert "narwhal_cluster_loads_heard 0.0" in await b.metrics()
    assert b.cluster["members"] == ("a", "b")
    await wait_for(
        lambda: (d1_on_b.seen_load(trio.current_time()) or seen).source == "scrape", within_s=5
    )
