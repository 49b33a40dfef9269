"""A replica's part of the fleet's capacity (narwhal.fleet.Share) and how the engines'
phase limits and placement follow it."""

from __future__ import annotations

import math

import attrs
import pytest

from narwhal.config import Config, EngineSpec, Serving
from narwhal.fleet import EngineState, Fleet, LoadStatistics, SeenLoad, Share
from narwhal.serving import ServingContext

from ..admission.test_first_token_wait import Source


@pytest.mark.parametrize("total", [1, 2, 3, 7, 64, 65])
@pytest.mark.parametrize("count", [1, 2, 3, 5])
@pytest.mark.parametrize("offset", [0, 1, 4])
def test_the_parts_of_a_limit_add_up_to_it_and_differ_by_at_most_one(
    total: int, count: int, offset: int
) -> None:
    parts = [Share(index=i, count=count).of(total, offset) for i in range(count)]
    assert sum(parts) == total
    assert max(parts) - min(parts) <= 1


def test_no_limit_stays_no_limit_and_one_replica_gets_everything() -> None:
    assert Share(index=1, count=3).of(0) == 0
    assert Share().of(17) == 17
    assert Share().whole


def test_limits_below_the_replica_count_spread_over_replicas_by_engine() -> None:
    # Three engines of prefill_concurrency 1, three replicas: each replica has one whole.
    owners = [
        [i for i in range(3) if Share(index=i, count=3).of(1, offset) == 1] for offset in range(3)
    ]
    assert sorted(owner for (owner,) in owners) == [0, 1, 2]


def test_a_scaled_part_rounds_down() -> None:
    assert Share(index=0, count=2, scale=0.5).of(64) == 16
    assert Share(index=0, count=2, scale=0.5).of(3) == 1  # 2 x 0.5
    assert Share(index=1, count=2, scale=0.5).of(3) == 0  # 1 x 0.5
    assert Share(index=0, count=2, scale=0.0).of(64) == 0


def test_describe_names_the_setting_and_this_replicas_part() -> None:
    assert Share().describe("serving.max_connections", 64) == "serving.max_connections=64"
    assert Share(index=0, count=2).describe("serving.max_connections", 64) == (
        "this replica's 32 of serving.max_connections=64 (2 replicas)"
    )
    assert "scaled by 0.5 while cut off from etcd" in Share(0, 2, 0.5).describe("x", 8)


@pytest.mark.parametrize(("index", "count", "scale"), [(2, 2, 1.0), (-1, 2, 1.0), (0, 1, 1.5)])
def test_an_impossible_share_is_refused(index: int, count: int, scale: float) -> None:
    with pytest.raises(ValueError):
        Share(index=index, count=count, scale=scale)


def _fleet(prefill: int, decode: int) -> tuple[Config, Fleet]:
    config = Config(
        engines=(
            EngineSpec(id="p0", url="http://127.0.0.1:9", role="prefill"),
            EngineSpec(id="d0", url="http://127.0.0.1:10", role="decode"),
        ),
        serving=Serving(prefill_concurrency=prefill, decode_concurrency=decode),
    )
    return config, Fleet(config)


def test_the_engines_phase_limiters_take_this_replicas_part() -> None:
    config, fleet = _fleet(prefill=5, decode=8)
    fleet.apply_share(config, Share(index=0, count=2))
    p0, d0 = fleet.get("p0"), fleet.get("d0")
    assert p0 is not None
    assert d0 is not None
    # p0 is engine 0: replica 0 takes 5's odd slot; d0 splits evenly.
    assert p0.prefill_limiter.total_tokens == 3
    assert d0.decode_limiter.total_tokens == 4
    fleet.apply_share(config, Share(index=1, count=2))
    assert p0.prefill_limiter.total_tokens == 2
    fleet.apply_share(config, Share())
    assert p0.prefill_limiter.total_tokens == 5
    assert d0.decode_limiter.total_tokens == 8


def test_an_engine_with_no_part_here_takes_no_work_of_that_phase_here() -> None:
    config, fleet = _fleet(prefill=1, decode=0)
    seen: list[str] = []
    fleet.watch(lambda engine: seen.append(engine.id))
    p0 = fleet.get("p0")
    assert p0 is not None
    fleet.apply_share(config, Share(index=1, count=2))  # replica 0 has p0's one slot
    assert p0.unavailable_reason(0.0, "prefill") == "no prefill share on this replica"
    assert p0.unavailable_reason(0.0, "decode") is None  # no decode limit: no split
    assert seen == ["p0"]  # recovery hears of it, as of a drain
    fleet.apply_share(config, Share(index=0, count=2))
    assert p0.unavailable_reason(0.0, "prefill") is None
    assert p0.prefill_limiter.total_tokens == 1


def test_a_reload_keeps_the_part() -> None:
    config, fleet = _fleet(prefill=4, decode=0)
    fleet.apply_share(config, Share(index=0, count=2))
    p0 = fleet.get("p0")
    assert p0 is not None
    bigger = attrs.evolve(config, serving=Serving(prefill_concurrency=10))
    p0.reconfigure(bigger.engines[0], bigger)
    assert p0.prefill_limiter.total_tokens == 5
    assert p0.decode_limiter.total_tokens == math.inf


async def test_the_booked_prefill_backlog_is_priced_as_the_fleets() -> None:
    # Each replica books only its own prefills; behind an even balancer every member
    # sends about as many, so the engine's queue is the book times the member count.
    config, _ = _fleet(prefill=0, decode=0)
    ctx = ServingContext(config)
    p0 = ctx.fleet.get("p0")
    assert p0 is not None
    ctx.backlog.commit(p0, 0.25, now=10.0)
    assert ctx.load_signals(10.0).backlog_s == {"p0": 0.25, "d0": 0.0}
    ctx.apply_share(Share(index=1, count=3))
    assert ctx.load_signals(10.0).backlog_s == {"p0": 0.75, "d0": 0.0}
    assert ctx.load_signals(10.1).backlog_s["p0"] == pytest.approx(0.45)
    ctx.apply_share(Share())
    assert ctx.load_signals(10.0).backlog_s["p0"] == 0.25


def test_a_replicas_load_statistics_scale_to_the_fleets_but_its_leg_counter() -> None:
    load = LoadStatistics(legs_started=7, prefill_inflight=1, decode_active=2, decode_tokens=300)
    assert load.scaled(1) is load
    assert load.scaled(3) == LoadStatistics(
        legs_started=7, prefill_inflight=3, decode_active=6, decode_tokens=900
    )


def test_the_other_replicas_legs_are_what_the_engine_reports_beyond_this_ones() -> None:
    config, fleet = _fleet(prefill=0, decode=0)
    p0, d0 = fleet.get("p0"), fleet.get("d0")
    assert p0 is not None
    assert d0 is not None
    fleet.apply_share(config, Share(index=0, count=2))
    with p0.load.prefill(400), p0.load.prefill(600), d0.load.decode(1000):
        # No scrape yet: this ledger times the members stands for the fleet's load.
        assert p0.view(1.0).prefill_inflight == 4
        # p0 runs 5 requests, 2 of them this replica's: 3 are the other's, each the
        # size of this replica's on average; d0 runs only this replica's leg.
        p0.saw_engine_load(5, 1.0, 0.5)
        d0.saw_engine_load(1, 1.0, 0.5)
        view = p0.view(1.2)
        assert (view.prefill_inflight, view.prefill_tokens_inflight) == (5, 2500)
        assert (d0.view(1.2).decode_active, d0.view(1.2).decode_tokens) == (1, 1000)
        assert p0.fleet_load(1.2).prefill_inflight == 5
        # Trusted for valid_s: an engine not scraped since is priced as before.
        assert p0.seen_load(1.6) is None
        assert p0.view(1.6).prefill_inflight == 4
    # With none of this replica's legs on it, the other's keep the size last seen.
    p0.saw_engine_load(2, 2.0, 0.5)
    assert (p0.view(2.0).prefill_inflight, p0.view(2.0).prefill_tokens_inflight) == (2, 1000)
    # One replica: its ledger is the engine's whole load, whatever the engine reports.
    fleet.apply_share(config, Share())
    p0.saw_engine_load(9, 3.0, 0.5)
    assert p0.seen_load(3.0) is None
    assert p0.view(3.0).prefill_inflight == 0


def test_the_other_replicas_legs_on_an_engine_of_both_roles_split_as_this_ones() -> None:
    spec = EngineSpec(id="a0", url="http://127.0.0.1:9", role="both")
    config = Config(engines=(spec,))
    fleet = Fleet(config)
    fleet.apply_share(config, Share(index=1, count=2))
    a0 = fleet.get("a0")
    assert a0 is not None
    a0.saw_engine_load(4, 0.0, 1.0)  # none of this replica's: decodes, by most of their life
    assert (a0.fleet_load(0.0).prefill_inflight, a0.fleet_load(0.0).decode_active) == (0, 4)
    with a0.load.prefill(100), a0.load.decode(300), a0.load.decode(300), a0.load.decode(300):
        a0.saw_engine_load(12, 0.0, 1.0)  # 8 others, a quarter of them prefills
        load = a0.fleet_load(0.5)
        assert (load.prefill_inflight, load.decode_active) == (3, 9)
        assert (load.prefill_tokens_inflight, load.decode_tokens) == (300, 2700)
    # A report below this replica's own legs (they reached the engine after its
    # gauges were read) leaves no others, not a negative count.
    with a0.load.decode(300), a0.load.decode(300):
        a0.saw_engine_load(1, 1.0, 1.0)
        assert a0.fleet_load(1.0).decode_active == 2


def _two_replicas_with_a_booking() -> tuple[ServingContext, EngineState]:
    """One of two replicas, with profiles, that booked 0.25 s on p0 at t=10."""
    config, _ = _fleet(prefill=0, decode=0)
    ctx = ServingContext(config)
    ctx.profiles = Source()  # prefill_s = 0.0001 s per token
    p0 = ctx.fleet.get("p0")
    assert p0 is not None
    ctx.apply_share(Share(index=0, count=2))
    ctx.backlog.commit(p0, 0.25, now=10.0)
    return ctx, p0


async def test_the_other_replicas_prefills_seen_on_an_engine_are_priced_by_its_curve() -> None:
    ctx, p0 = _two_replicas_with_a_booking()
    # No scrape: the book times the members.
    assert ctx.load_signals(10.0).backlog_s["p0"] == pytest.approx(0.5)
    with p0.load.prefill(2000):
        p0.saw_engine_load(4, 10.0, 1.0)  # 3 of the other's, of 2,000 tokens each
    assert ctx.load_signals(10.0).backlog_s["p0"] == pytest.approx(0.25 + 3 * 0.2)
    p0.saw_engine_load(0, 10.0, 1.0)  # the engine runs none but this replica's
    assert ctx.load_signals(10.0).backlog_s["p0"] == pytest.approx(0.25)


async def test_the_other_replicas_published_load_stands_before_the_scrape_while_trusted() -> None:
    ctx, p0 = _two_replicas_with_a_booking()
    ctx.backlog.heard(p0, 0.5, now=10.0)  # the other booked 0.5 s on p0
    p0.saw_engine_load(3, 10.0, 5.0)  # the scrape: 3 of the other's, sized as none
    published = SeenLoad(
        prefill=2, decode=0, prefill_tokens=500.0, decode_tokens=0.0, until=11.0, source="replicas"
    )
    p0.saw_replica_loads(published)
    assert p0.seen_load(10.5) is published
    # One queue of both replicas' work, drained since: not the legs by the curve.
    assert ctx.load_signals(10.1).backlog_s["p0"] == pytest.approx(0.75 - 0.1)
    assert p0.view(10.1).prefill_inflight == 2
    assert p0.view(10.1).prefill_tokens_inflight == 1000
    # Past its trust, the scrape again (3 legs of no tokens: nothing to price).
    scraped = p0.seen_load(11.5)
    assert scraped is not None
    assert scraped.source == "scrape"
    assert p0.view(11.5).prefill_inflight == 3
    # This replica's own leg, overdue by 1.25 s, and the other's 3 legs of no tokens.
    assert ctx.load_signals(11.5).backlog_s["p0"] == pytest.approx(1.25)
    p0.saw_replica_loads(None)
    assert p0.seen_load(10.5) is scraped
    # One replica: nobody else's, whatever was published.
    p0.saw_replica_loads(published)
    ctx.apply_share(Share())
    assert p0.seen_load(10.5) is None
