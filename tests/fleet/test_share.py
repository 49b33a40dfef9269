"""A replica's part of the fleet's capacity (narwhal.fleet.Share) and how the engines'
phase limits and placement follow it."""

from __future__ import annotations

import math

import attrs
import pytest

from narwhal.config import Config, EngineSpec, Serving
from narwhal.fleet import Fleet, LoadStatistics, Share
from narwhal.serving import ServingContext


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
