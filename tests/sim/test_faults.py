"""Every fault type, engine-wide and per request, and its count in /_sim/state."""

from __future__ import annotations

import json

import h11
import httpx
import pytest
import trio

from narwhal.sim import FaultSpecError, SimTiming, parse_faults

from ..support import StartFleet, open_sse, post_stream, sse_json, wait_for

P_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}


def fault(**kw: object) -> dict[str, str]:
    return {"X-Sim-Fault": json.dumps(kw)}


async def test_error_status_on_a_leg_for_the_first_n(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=1, speed=50.0)
    e = fleet[0]
    e.set_faults(error_status=503, leg="prefill", count=2)
    url = f"{e.url}/v1/completions"
    p_body = {"prompt": "x", "max_tokens": 1, "kv_transfer_params": P_PARAMS}
    # Aggregate requests do not match the leg and do not use up the count.
    assert (await client.post(url, json={"prompt": "x", "max_tokens": 1})).status_code == 200
    statuses = [(await client.post(url, json=p_body)).status_code for _ in range(3)]
    assert statuses == [503, 503, 200]
    state = e.state()
    assert state["counters"]["errors_injected"] == 2
    assert state["faults"]["remaining"] == 0
    assert [o["outcome"] for o in state["outcomes"]] == ["ok", "error", "error", "ok"]
    # Runtime control over HTTP, with the vLLM 5xx envelope.
    r = await client.post(f"{e.url}/_sim/faults", json={"error_status": 500})
    assert r.status_code == 200
    r = await client.post(url, json={"prompt": "x"})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "InternalServerError"
    await client.post(f"{e.url}/_sim/faults", json={"error_status": 429})
    r = await client.post(url, json={"prompt": "x"})
    assert r.status_code == 429
    assert r.json()["error"]["type"] == "Too Many Requests"
    assert (await client.delete(f"{e.url}/_sim/faults")).status_code == 200
    assert (await client.post(url, json={"prompt": "x"})).status_code == 200
    assert e.state()["faults"] is None


async def test_outcomes_mark_the_legs_that_ran_with_an_armed_fault(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    # The reliability soak counts whose legs its armed faults hit (serving traffic or
    # the router's verification legs) from this mark; a header fault is the request's own.
    fleet = await start_fleet(engines=1, speed=50.0)
    e = fleet[0]
    url = f"{e.url}/v1/completions"
    e.set_faults(error_status=503, count=1)
    assert (await client.post(url, json={"prompt": "x"})).status_code == 503
    e.set_faults(sse_error_after_tokens=1, count=1)
    assert (await client.post(url, json={"prompt": "x", "max_tokens": 2})).status_code == 500
    assert (await client.post(url, json={"prompt": "x", "max_tokens": 1})).status_code == 200
    r = await client.post(url, json={"prompt": "x"}, headers=fault(error_status=502))
    assert r.status_code == 502
    outcomes = e.state()["outcomes"]
    assert [(o["status"], o["armed_fault"]) for o in outcomes] == [
        (503, True),
        (500, True),
        (200, False),
        (502, False),
    ]


async def test_per_request_header_fault(start_fleet: StartFleet, client: httpx.AsyncClient) -> None:
    fleet = await start_fleet(engines=1, speed=50.0)
    url = f"{fleet[0].url}/v1/completions"
    r = await client.post(url, json={"prompt": "x"}, headers=fault(error_status=400))
    assert r.status_code == 400
    # The leg filter applies to headers too: a decode-only fault spares an aggregate request.
    r = await client.post(url, json={"prompt": "x"}, headers=fault(error_status=400, leg="decode"))
    assert r.status_code == 200
    r = await client.post(url, json={"prompt": "x"}, headers={"X-Sim-Fault": "{nope"})
    assert r.status_code == 400
    assert "X-Sim-Fault" in r.json()["error"]["message"]
    r = await client.post(url, json={"prompt": "x"}, headers=fault(down_s=1))
    assert r.status_code == 400


def test_fault_spec_validation() -> None:
    assert parse_faults({"crash_after_tokens": 3}).crash_after_tokens == 3
    bad: object
    for bad in (
        {"nope": 1},
        {"error_status": 200},
        {"stall_s": -1},
        {"leg": "both"},
        {"kv_pull_fail": 1},
        [],
    ):
        with pytest.raises(FaultSpecError):
            parse_faults(bad)


async def test_stall_before_first_token(start_fleet: StartFleet, client: httpx.AsyncClient) -> None:
    fleet = await start_fleet(engines=1, speed=50.0)
    body = {"prompt": "x", "max_tokens": 3, "stream": True}
    async with open_sse(
        fleet[0].url, "/v1/completions", body, fault(stall_before_first_token_s=0.3)
    ) as sse:
        # Headers come first, as on vLLM; the first token is what stalls.
        assert sse.status == 200
        t0 = trio.current_time()
        first = await sse.event()
        assert first is not None
        assert json.loads(first)["choices"][0]["text"]
        assert trio.current_time() - t0 >= 0.25
    assert fleet[0].state()["counters"]["stalls_injected"] == 1


async def test_slow_first_token(start_fleet: StartFleet, client: httpx.AsyncClient) -> None:
    fleet = await start_fleet(engines=1, speed=50.0)
    t0 = trio.current_time()
    r = await client.post(
        f"{fleet[0].url}/v1/completions",
        json={"prompt": "x", "max_tokens": 1},
        headers=fault(slow_first_token_s=0.3),
    )
    assert r.status_code == 200
    assert trio.current_time() - t0 >= 0.3
    assert fleet[0].state()["counters"]["slow_first_tokens_injected"] == 1


async def test_stall_after_tokens_then_client_gives_up(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=1, speed=50.0)
    body = {"prompt": "x", "max_tokens": 50, "stream": True}
    received: list[str] = []
    async with open_sse(fleet[0].url, "/v1/completions", body, fault(stall_after_tokens=3)) as sse:
        with trio.move_on_after(0.3):
            while (payload := await sse.event()) is not None:
                received.append(payload)
    texts = "".join(json.loads(x)["choices"][0]["text"] for x in received)
    assert texts.count(" ") == 3
    await wait_for(lambda: fleet[0].state()["counters"]["aborted"]["aggregate"] == 1)
    state = fleet[0].state()
    assert state["counters"]["stalls_injected"] == 1
    assert state["outcomes"][-1]["outcome"] == "aborted"
    assert state["outcomes"][-1]["tokens"] == 3


async def test_stall_after_tokens_for_a_while(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=1, speed=50.0)
    t0 = trio.current_time()
    status, _, raw = await post_stream(
        client,
        f"{fleet[0].url}/v1/completions",
        {"prompt": "x", "max_tokens": 6, "stream": True},
        headers=fault(stall_after_tokens=2, stall_s=0.3),
    )
    assert status == 200
    assert trio.current_time() - t0 >= 0.3
    assert "".join(c["choices"][0]["text"] for c in sse_json(raw)).count(" ") == 6


async def test_crash_mid_stream(start_fleet: StartFleet, client: httpx.AsyncClient) -> None:
    fleet = await start_fleet(engines=1, speed=50.0)
    e = fleet[0]
    body = {"prompt": "x", "max_tokens": 20, "stream": True}
    data = bytearray()

    async def read_all() -> None:
        async with client.stream(
            "POST", f"{e.url}/v1/completions", json=body, headers=fault(crash_after_tokens=4)
        ) as resp:
            async for chunk in resp.aiter_raw():
                data.extend(chunk)

    with pytest.raises(httpx.RemoteProtocolError):
        await read_all()
    assert b"[DONE]" not in data
    text = "".join(
        json.loads(p[6:])["choices"][0]["text"]
        for p in data.decode().split("\n\n")
        if p.startswith("data: ")
    )
    assert text.count(" ") == 4
    await wait_for(lambda: e.state()["counters"]["crashes_injected"] == 1)
    assert e.state()["outcomes"][-1]["outcome"] == "error"
    # Non-streaming: the connection drops before any response.
    with pytest.raises(httpx.RemoteProtocolError):
        await client.post(
            f"{e.url}/v1/completions",
            json={"prompt": "x", "max_tokens": 5},
            headers=fault(crash_after_tokens=2),
        )


async def test_sse_error_mid_stream(start_fleet: StartFleet, client: httpx.AsyncClient) -> None:
    fleet = await start_fleet(engines=1, speed=50.0)
    e = fleet[0]
    status, _, raw = await post_stream(
        client,
        f"{e.url}/v1/completions",
        {"prompt": "x", "max_tokens": 20, "stream": True},
        headers=fault(sse_error_after_tokens=3),
    )
    assert status == 200
    *tokens, error = sse_json(raw)
    assert "".join(c["choices"][0]["text"] for c in tokens).count(" ") == 3
    assert error == {
        "error": {
            "message": "Internal server error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    r = await client.post(
        f"{e.url}/v1/completions",
        json={"prompt": "x", "max_tokens": 9},
        headers=fault(sse_error_after_tokens=3),
    )
    assert r.status_code == 500
    assert e.state()["counters"]["sse_errors_injected"] == 2


async def test_connection_refused_while_down(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=2, speed=50.0)
    e = fleet[1]
    # Below the kernel's ephemeral range: no outgoing connection can take the port as its
    # source port while the engine is down, so it can always bind it again.
    low = (await trio.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()).split()[0]
    assert e.port < int(low)
    port = e.port
    await e.go_down()
    with pytest.raises(httpx.ConnectError):
        await client.get(f"{e.url}/health")
    assert e.state()["up"] is False
    await e.come_up()
    assert e.port == port
    assert (await client.get(f"{e.url}/health")).status_code == 200
    # The timed form, set over HTTP: refuse for a while, then come back by itself.
    r = await client.post(f"{e.url}/_sim/faults", json={"down_s": 0.2})
    assert r.status_code == 200
    await wait_for(lambda: not e.state()["up"])
    with pytest.raises(httpx.ConnectError):
        await client.get(f"{e.url}/health")
    await wait_for(lambda: e.state()["up"])
    assert (await client.get(f"{e.url}/health")).status_code == 200
    assert e.state()["counters"]["downs_injected"] == 1


async def test_health_flapping_and_unhealthy(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=1, speed=50.0)
    e = fleet[0]
    e.set_faults(unhealthy=True)
    assert (await client.get(f"{e.url}/health")).status_code == 503
    # Unhealthy is about /health only; requests still run.
    assert (await client.post(f"{e.url}/v1/completions", json={"prompt": "x"})).status_code == 200
    e.set_faults(health_flap_period_s=0.1)
    seen: set[int] = set()
    with trio.fail_after(3):
        while len(seen) < 2:
            seen.add((await client.get(f"{e.url}/health")).status_code)
            await trio.sleep(0.02)
    assert seen == {200, 503}
    assert e.state()["counters"]["health_failures_served"] >= 2
    e.clear_faults()
    assert (await client.get(f"{e.url}/health")).status_code == 200


async def test_metrics_stall_holds_only_metrics(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=1, speed=50.0)
    e = fleet[0]
    e.set_faults(metrics_stall_s=60.0)
    # The connection is accepted and the request read; no answer comes.
    with pytest.raises(httpx.ReadTimeout):
        await client.get(f"{e.url}/metrics", timeout=0.2)
    assert (await client.get(f"{e.url}/health")).status_code == 200
    assert (await client.post(f"{e.url}/v1/completions", json={"prompt": "x"})).status_code == 200
    e.set_faults(metrics_stall_s=0.2)
    start = trio.current_time()
    r = await client.get(f"{e.url}/metrics")
    assert r.status_code == 200
    assert "vllm:num_requests_running" in r.text
    assert trio.current_time() - start >= 0.2
    assert e.state()["counters"]["metrics_stalls_injected"] == 2
    with pytest.raises(FaultSpecError, match="applies to an engine"):
        parse_faults({"metrics_stall_s": 1}, per_request=True)


async def test_decode_slowdown_stretches_decode_steps_only(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    # A gray failure: the engine answers every probe and request, but each decode step
    # takes three times the law (what a latency residual against its profile must see).
    fleet = await start_fleet(engines=1, speed=2.0, timing=SimTiming(noise_sigma=0.0))
    e = fleet[0]
    url = f"{e.url}/v1/completions"
    body = {"prompt": "x", "max_tokens": 41}

    async def decode_s() -> float:
        started = trio.current_time()
        assert (await client.post(url, json=body)).status_code == 200
        return trio.current_time() - started

    # The faster of two: a stall of the box only ever adds time (one CI run's 50 ms
    # stall made a healthy run look 1.4 times too slow).
    healthy = min(await decode_s(), await decode_s())
    e.set_faults(decode_slowdown=3.0)
    assert (await client.get(f"{e.url}/health")).status_code == 200
    slowed = min(await decode_s(), await decode_s())
    # 40 decode steps of 3 ms (6 ms at speed 2), then 9 ms each.
    assert 0.11 < healthy < slowed / 2.2
    assert slowed > 0.33
    assert e.state()["faults"] == {"decode_slowdown": 3.0}
    with pytest.raises(FaultSpecError, match="applies to an engine"):
        parse_faults({"decode_slowdown": 2}, per_request=True)
    with pytest.raises(FaultSpecError, match=r"^decode_slowdown is 0.5; must be >= 1$"):
        parse_faults({"decode_slowdown": 0.5})


async def test_kv_pull_failure(start_fleet: StartFleet, client: httpx.AsyncClient) -> None:
    fleet = await start_fleet(engines=2, speed=50.0)
    p = await client.post(
        f"{fleet[0].url}/v1/completions",
        json={"prompt": "x", "max_tokens": 1, "kv_transfer_params": P_PARAMS},
    )
    kv = p.json()["kv_transfer_params"]
    fleet[1].set_faults(kv_pull_fail=True, leg="decode")
    r = await client.post(
        f"{fleet[1].url}/v1/completions", json={"prompt": "x", "kv_transfer_params": kv}
    )
    assert r.status_code == 500
    state = fleet[1].state()
    assert state["counters"]["kv_pull_failed"] == 1
    assert state["counters"]["kv_pull_failures_injected"] == 1
    assert state["outcomes"][-1]["outcome"] == "error"


async def test_restart_drops_in_flight_work(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=1, speed=5.0)
    e = fleet[0]
    old = e.instance_id
    body = {"prompt": "x", "max_tokens": 1000, "stream": True}
    async with open_sse(e.url, "/v1/completions", body) as sse:
        assert await sse.event() is not None
        await e.restart()

        async def drain() -> None:
            while await sse.event() is not None:
                pass

        with pytest.raises((h11.RemoteProtocolError, trio.BrokenResourceError)):
            await drain()
    assert e.instance_id != old
    state = e.state()
    assert state["running"] == 0
    assert state["kv"]["used_blocks"] == 0
    assert (await client.post(f"{e.url}/v1/completions", json={"prompt": "x"})).status_code == 200
