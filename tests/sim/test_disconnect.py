"""A client that closes its connection aborts the request at once, on every leg."""

from __future__ import annotations

import json

import httpx
import trio

from ..support import StartFleet, open_sse, wait_for


async def test_stream_disconnect_is_an_abort(start_fleet: StartFleet) -> None:
    fleet = await start_fleet(engines=1, speed=5.0)
    e = fleet[0]
    body = {"prompt": "x", "max_tokens": 8000, "stream": True}
    async with open_sse(e.url, "/v1/completions", body, {"X-Request-Id": "bye"}) as sse:
        for _ in range(3):
            assert await sse.event() is not None
        assert e.state()["running"] == 1
    await wait_for(lambda: e.state()["counters"]["aborted"]["aggregate"] == 1)
    state = e.state()
    assert state["running"] == 0
    assert state["kv"]["used_blocks"] == 0
    (outcome,) = state["outcomes"]
    assert outcome["request_id"] == "bye"
    assert outcome["phase"] == "aggregate"
    assert outcome["outcome"] == "aborted"
    assert 3 <= outcome["tokens"] < 8000
    metrics = e.engine.metrics
    assert metrics.success.get("abort") == 1


async def test_prefill_leg_disconnect_frees_kv_and_holds_no_lease(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=1, speed=1.0)
    e = fleet[0]
    body = {
        "prompt": "word " * 7000,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    async with trio.open_nursery() as nursery:

        async def leg() -> None:
            await client.post(
                f"{e.url}/v1/completions", json=body, headers={"X-Request-Id": "p-leg"}
            )

        nursery.start_soon(leg)
        await wait_for(lambda: e.state()["running"] == 1)
        nursery.cancel_scope.cancel()
    await wait_for(lambda: e.state()["counters"]["aborted"]["prefill"] == 1)
    state = e.state()
    assert state["kv"]["used_blocks"] == 0
    assert state["leases"]["held"] == 0
    assert state["outcomes"][-1] == {
        **state["outcomes"][-1],
        "request_id": "p-leg",
        "phase": "prefill",
        "outcome": "aborted",
    }


async def test_decode_leg_disconnect(start_fleet: StartFleet, client: httpx.AsyncClient) -> None:
    fleet = await start_fleet(engines=2, speed=5.0)
    p, d = fleet[0], fleet[1]
    r = await client.post(
        f"{p.url}/v1/completions",
        json={"prompt": "hello", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    kv = r.json()["kv_transfer_params"]
    body = {"prompt": "hello", "max_tokens": 5000, "stream": True, "kv_transfer_params": kv}
    async with open_sse(d.url, "/v1/completions", body, {"X-Request-Id": "d-leg"}) as sse:
        payload = await sse.event()
        assert payload is not None
        assert json.loads(payload)["choices"][0]["text"]
    await wait_for(lambda: d.state()["counters"]["aborted"]["decode"] == 1)
    assert d.state()["outcomes"][-1]["request_id"] == "d-leg"
    assert d.state()["kv"]["used_blocks"] == 0
    assert p.state()["leases"]["held"] == 0  # pulled before the abort


async def test_keep_alive_connection_serves_several_requests(start_fleet: StartFleet) -> None:
    fleet = await start_fleet(engines=1, speed=50.0)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=1)) as c:
        for _ in range(5):
            r = await c.post(f"{fleet[0].url}/v1/completions", json={"prompt": "x"})
            assert r.status_code == 200
    http = fleet[0].state()["http"]
    assert http["requests"] == 5
    assert http["connections"] == 1
