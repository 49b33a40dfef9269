"""Over HTTP: decode steps slow down as the batch grows (continuous batching)."""

from __future__ import annotations

from functools import partial

import httpx
import trio

from narwhal.sim import SimTiming

from ..support import StartFleet


async def _mean_itl(start_fleet: StartFleet, streams: int) -> float:
    # 40 us per sequence makes the batch term dominate; noise off so means compare cleanly.
    timing = SimTiming(noise_sigma=0.0, decode_seq_s=4e-5)
    fleet = await start_fleet(engines=1, speed=1.0, timing=timing)
    url = fleet[0].url
    body = {"prompt": "x", "max_tokens": 30}
    limits = httpx.Limits(max_connections=streams)
    async with httpx.AsyncClient(timeout=30, limits=limits) as c, trio.open_nursery() as nursery:
        for _ in range(streams):
            nursery.start_soon(partial(c.post, f"{url}/v1/completions", json=body))
    itl = fleet[0].engine.metrics.itl
    assert itl.count == streams * 29
    return itl.sum / itl.count


async def test_step_time_grows_with_the_batch(start_fleet: StartFleet) -> None:
    one = await _mean_itl(start_fleet, 1)
    many = await _mean_itl(start_fleet, 64)
    timing = SimTiming(decode_seq_s=4e-5)
    assert one >= timing.decode_step_s(0, 1) * 0.95
    # 64 x 40 us = 2.5 ms more per step on a ~6 ms base.
    assert many > one * 1.25
