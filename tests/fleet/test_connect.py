"""The fleet's connect function reaches every pool of its engines: the ones it starts with
and, through `Fleet.connect`, those a reload adds (`supervisor._reload` builds them so)."""

from __future__ import annotations

import trio

from narwhal.config import Config, EngineSpec
from narwhal.fleet import Fleet


async def _nowhere(host: str, port: int) -> trio.abc.Stream:
    raise OSError(f"no network here: {host}:{port}")


def test_every_pool_of_the_fleet_connects_through_its_connect_function() -> None:
    config = Config(
        engines=(
            EngineSpec(id="p0", url="http://127.0.0.1:9", role="prefill"),
            EngineSpec(id="d0", url="http://127.0.0.1:10", role="decode"),
        )
    )
    fleet = Fleet(config, connect=_nowhere)
    assert fleet.connect is _nowhere
    pools = [pool for e in fleet for pool in (e.serving_pool, e.control_pool)]
    assert len(pools) == 4
    assert all(pool.connect is _nowhere for pool in pools)
    # By default, TCP.
    assert all(e.serving_pool.connect is trio.open_tcp_stream for e in Fleet(config))
