"""vLLM-style P/D handoff: producer params, lease, heartbeats, pulls and their failures."""

from __future__ import annotations

import json
from typing import Any

import httpx
import trio

from narwhal.sim import Fleet, SimTiming

from ..support import StartFleet, post_stream, sse_json, wait_for

PROMPT = "Explain the difference between prefill and decode in two sentences."
P_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


async def prefill(
    client: httpx.AsyncClient, fleet: Fleet, rid: str, *, engine: int = 0, **extra: Any
) -> dict[str, Any]:
    r = await client.post(
        f"{fleet[engine].url}/v1/completions",
        json={
            "prompt": PROMPT,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": P_PARAMS,
            **extra,
        },
        headers={"X-Request-Id": rid},
    )
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def decode_body(kv: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": 8, "kv_transfer_params": kv, **extra}


async def test_an_engine_without_a_kv_connector_serves_legs_as_plain_requests(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    # vLLM without --kv-transfer-config: a prefill leg generates its max_tokens and answers
    # kv_transfer_params null, keeping no KV; a decode leg computes the prompt itself.
    fleet = await start_fleet(engines=2, speed=20.0, kv_connectors=[False, True])
    plain, nixl = fleet[0], fleet[1]
    body = await prefill(client, fleet, "plain-1", max_tokens=3)
    assert body["kv_transfer_params"] is None
    assert body["usage"]["completion_tokens"] == 3
    assert plain.state()["leases"]["held"] == 0
    kv = (await prefill(client, fleet, "nixl-1", engine=1))["kv_transfer_params"]
    r = await client.post(f"{plain.url}/v1/completions", json=decode_body(kv))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    counters = plain.state()["counters"]
    assert (counters["kv_pulled"], counters["requests"]["aggregate"]) == (0, 2)
    # The producer's lease is left to run out, as a real one's would be.
    assert nixl.state()["leases"]["held"] == 1
    metrics = (await client.get(f"{plain.url}/metrics")).text
    assert "vllm:nixl_" not in metrics
    assert "vllm:nixl_num_kv_expired_reqs_total" in (await client.get(f"{nixl.url}/metrics")).text


async def test_handoff_end_to_end(start_fleet: StartFleet, client: httpx.AsyncClient) -> None:
    fleet = await start_fleet(engines=2, speed=20.0)
    p, d = fleet[0], fleet[1]
    body = await prefill(client, fleet, "pd-1")
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 1
    kv = body["kv_transfer_params"]
    assert list(kv) == [
        "do_remote_prefill",
        "do_remote_decode",
        "remote_block_ids",
        "remote_engine_id",
        "remote_request_id",
        "remote_host",
        "remote_port",
        "tp_size",
        "dcp_size",
        "pp_size",
        "remote_num_tokens",
        "remote_blocks_expiry_time",
        "transfer_mode",
        "remote_prefill_cached_tokens",
    ]
    assert kv["do_remote_prefill"] is True
    assert kv["do_remote_decode"] is False
    prompt_tokens = body["usage"]["prompt_tokens"]
    (blocks,) = kv["remote_block_ids"]
    assert len(blocks) == -(-prompt_tokens // 16)
    assert all(isinstance(b, int) for b in blocks)
    assert kv["remote_engine_id"] == p.instance_id
    assert kv["remote_request_id"].startswith("cmpl-pd-1-")
    assert (kv["remote_host"], kv["remote_port"]) == (p.host, p.port)
    assert (kv["tp_size"], kv["dcp_size"], kv["pp_size"]) == (1, 1, 1)
    assert kv["remote_num_tokens"] == prompt_tokens
    assert kv["remote_blocks_expiry_time"] is None
    assert kv["transfer_mode"] == "pull"
    assert kv["remote_prefill_cached_tokens"] == 0
    p_state = p.state()
    assert p_state["leases"]["held"] == 1
    assert p_state["kv"]["used_blocks"] == len(blocks)

    status, _, raw = await post_stream(
        client,
        f"{d.url}/v1/completions",
        decode_body(kv, stream=True, stream_options={"include_usage": True}),
        headers={"X-Request-Id": "pd-1"},
    )
    assert status == 200
    *tokens, usage = sse_json(raw)
    assert "".join(c["choices"][0]["text"] for c in tokens).count(" ") == 8
    assert usage["usage"] == {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + 8,
        "completion_tokens": 8,
    }
    assert "kv_transfer_params" not in tokens[0]
    # The pull freed the producer's blocks; the decoder freed its own when done.
    p_state, d_state = p.state(), d.state()
    assert p_state["leases"]["held"] == 0
    assert p_state["kv"]["used_blocks"] == 0
    assert p_state["counters"]["kv_served"] == 1
    assert d_state["counters"]["kv_pulled"] == 1
    assert d_state["counters"]["requests"]["decode"] == 1
    assert d_state["kv"]["used_blocks"] == 0
    assert [o["phase"] for o in p_state["outcomes"]] == ["prefill"]
    assert d_state["outcomes"][-1]["outcome"] == "ok"
    assert d_state["outcomes"][-1]["request_id"] == "pd-1"
    # Pulling the same blocks twice fails: they are gone.
    r = await client.post(f"{d.url}/v1/completions", json=decode_body(kv))
    assert r.status_code == 500


async def test_decode_ttft_includes_the_transfer(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=2, speed=1.0)
    kv = (await prefill(client, fleet, "ttft"))["kv_transfer_params"]
    t0 = trio.current_time()
    r = await client.post(f"{fleet[1].url}/v1/completions", json=decode_body(kv, max_tokens=1))
    elapsed = trio.current_time() - t0
    assert r.status_code == 200
    timing = fleet.spec.timing
    floor = timing.kv_transfer_s(kv["remote_num_tokens"]) + timing.step_base_s
    assert elapsed > 0.8 * floor


async def test_lease_expiry_fails_the_decode(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=2, speed=20.0)
    p, d = fleet[0], fleet[1]
    p.set_faults(lease_s=0.05)
    kv = (await prefill(client, fleet, "late"))["kv_transfer_params"]
    await wait_for(lambda: p.state()["counters"]["kv_expired"] == 1)
    assert p.state()["leases"]["held"] == 0
    assert p.state()["kv"]["used_blocks"] == 0

    r = await client.post(f"{d.url}/v1/completions", json=decode_body(kv))
    assert r.status_code == 500
    assert r.json() == {
        "error": {
            "message": "Internal server error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    state = d.state()
    assert state["counters"]["kv_pull_failed"] == 1
    assert state["outcomes"][-1]["outcome"] == "expired_kv"
    assert state["outcomes"][-1]["status"] == 500
    assert state["kv"]["used_blocks"] == 0
    metrics = (await client.get(f"{p.url}/metrics")).text
    assert 'vllm:nixl_num_kv_expired_reqs_total{engine="0"' in metrics
    assert any(
        line.startswith("vllm:nixl_num_kv_expired_reqs_total") and line.endswith(" 1.0")
        for line in metrics.splitlines()
    )

    # Streaming: the 200 is already out, so the failure is an SSE error event then [DONE].
    kv2 = (await prefill(client, fleet, "late2"))["kv_transfer_params"]
    await wait_for(lambda: p.state()["counters"]["kv_expired"] == 2)
    status, _, raw = await post_stream(
        client,
        f"{d.url}/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "stream": True, "kv_transfer_params": kv2},
    )
    assert status == 200
    events = sse_json(raw)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1] == {
        "error": {
            "message": "Internal server error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }


async def test_heartbeats_keep_a_queued_decode_alive(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    # Lease 30 s at speed 50 = 0.6 s wall; heartbeats every 0.1 s extend it by 0.4 s.
    fleet = await start_fleet(engines=2, speed=50.0)
    p, d = fleet[0], fleet[1]
    kv = (await prefill(client, fleet, "hb"))["kv_transfer_params"]
    # The decoder holds the request 1.5 s (2.5 leases) before scheduling it.
    r = await client.post(
        f"{d.url}/v1/completions",
        json=decode_body(kv),
        headers={"X-Sim-Fault": json.dumps({"slow_first_token_s": 1.5})},
    )
    assert r.status_code == 200
    assert p.state()["counters"]["heartbeats_received"] >= 3
    assert d.state()["counters"]["heartbeats_sent"] >= 3
    assert p.state()["counters"]["kv_expired"] == 0


async def test_decode_abort_before_pull_releases_the_producer(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=2, speed=20.0)
    p, d = fleet[0], fleet[1]
    kv = (await prefill(client, fleet, "gone"))["kv_transfer_params"]
    async with trio.open_nursery() as nursery:

        async def doomed() -> None:
            await client.post(
                f"{d.url}/v1/completions",
                json=decode_body(kv),
                headers={"X-Sim-Fault": json.dumps({"slow_first_token_s": 30})},
            )

        nursery.start_soon(doomed)
        await wait_for(lambda: d.state()["waiting"] == 1)
        nursery.cancel_scope.cancel()
    await wait_for(lambda: p.state()["leases"]["held"] == 0)
    assert p.state()["counters"]["leases_released"] == 1
    assert p.state()["counters"]["kv_expired"] == 0
    await wait_for(lambda: d.state()["counters"]["aborted"]["decode"] == 1)
    assert d.state()["outcomes"][-1]["outcome"] == "aborted"


async def test_invalid_params_compute_locally(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=2, speed=50.0)
    kv = (await prefill(client, fleet, "bad"))["kv_transfer_params"]
    broken = {k: v for k, v in kv.items() if k != "remote_request_id"}
    r = await client.post(f"{fleet[1].url}/v1/completions", json=decode_body(broken))
    assert r.status_code == 200
    assert fleet[1].state()["counters"]["kv_pulled"] == 0
    assert fleet[1].state()["counters"]["requests"]["decode"] == 1
    assert fleet[0].state()["leases"]["held"] == 1  # nobody pulled it


async def test_producer_restart_loses_the_blocks(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=2, speed=50.0)
    p = fleet[0]
    kv = (await prefill(client, fleet, "rs"))["kv_transfer_params"]
    old_id = p.instance_id
    await p.restart()
    assert p.instance_id != old_id
    assert p.state()["leases"]["held"] == 0
    assert p.state()["generation"] == 1
    r = await client.post(f"{fleet[1].url}/v1/completions", json=decode_body(kv))
    assert r.status_code == 500
    assert fleet[1].state()["outcomes"][-1]["outcome"] == "error"
    # The restarted engine serves on the same port.
    ok = await client.post(f"{p.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


async def test_same_engine_can_serve_both_phases(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=1, speed=50.0)
    kv = (await prefill(client, fleet, "self"))["kv_transfer_params"]
    r = await client.post(f"{fleet[0].url}/v1/completions", json=decode_body(kv))
    assert r.status_code == 200
    assert fleet[0].state()["kv"]["used_blocks"] == 0


async def test_many_concurrent_handoffs_leak_nothing(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    # Small KV so decoders queue for space and preempt; every lease must still be settled.
    timing = SimTiming(kv_capacity_tokens=6000)
    fleet = await start_fleet(engines=4, speed=5.0, timing=timing)
    outcomes: list[bool] = []

    async def pair(i: int) -> None:
        p, d = fleet[i % 2], fleet[2 + i % 2]
        prompt = "word " * (20 + 37 * i)
        r = await client.post(
            f"{p.url}/v1/completions",
            json={"prompt": prompt, "max_tokens": 1, "kv_transfer_params": P_PARAMS},
        )
        kv = r.json()["kv_transfer_params"]
        status, _, raw = await post_stream(
            client,
            f"{d.url}/v1/completions",
            {"prompt": prompt, "max_tokens": 5 + i, "stream": True, "kv_transfer_params": kv},
        )
        outcomes.append(status == 200 and "error" not in sse_json(raw)[-1])

    async with trio.open_nursery() as nursery:
        for i in range(40):
            nursery.start_soon(pair, i)
    assert outcomes == [True] * 40
    for handle in fleet:
        state = handle.state(outcomes=0)
        assert state["kv"]["used_blocks"] == 0
        assert state["leases"]["held"] == 0
        assert state["running"] == state["waiting"] == state["pulling"] == 0
    assert sum(h.state()["counters"]["kv_served"] for h in fleet) == 40
