"""SGLang dialect: bootstrap pairing, P failure -> D 500, flat errors, endpoints."""

from __future__ import annotations

from typing import Any

import httpx
import trio

from narwhal.sim import EngineHandle

from ..support import StartFleet, post_stream, sse_json, sse_payloads, wait_for


def pd_body(p: EngineHandle, room: int, **extra: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "Tell me about narwhals."}],
        "max_tokens": 6,
        "bootstrap_host": p.host,
        "bootstrap_port": p.port,
        "bootstrap_room": room,
        **extra,
    }


async def test_pairing_by_room(start_fleet: StartFleet, client: httpx.AsyncClient) -> None:
    fleet = await start_fleet(engines=2, dialect="sglang", speed=20.0)
    p, d = fleet[0], fleet[1]
    body = pd_body(p, 4611686018427387904, stream=True)
    results: dict[str, Any] = {}

    async def leg(name: str, engine: EngineHandle) -> None:
        results[name] = await post_stream(client, f"{engine.url}/v1/chat/completions", body)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(leg, "d", d)
        nursery.start_soon(leg, "p", p)
    status, _, raw = results["d"]
    assert status == 200
    chunks = sse_json(raw)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert len(text.split()) == 6
    # include_usage defaults to False in SGLang; no stream_options means no usage anyway.
    assert all(c["choices"] for c in chunks)
    p_status, _, p_raw = results["p"]
    assert p_status == 200
    p_text = "".join(c["choices"][0]["delta"].get("content") or "" for c in sse_json(p_raw))
    assert len(p_text.split()) == 1  # SGLang's prefill server forces max_new_tokens=1
    assert p.state()["counters"]["requests"]["prefill"] == 1
    assert p.state()["counters"]["kv_served"] == 1
    assert p.state()["kv"]["used_blocks"] == 0
    assert d.state()["counters"]["requests"]["decode"] == 1
    assert d.state()["counters"]["kv_pulled"] == 1
    assert not p.engine.rooms


async def test_decoder_first_then_prefill(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=2, dialect="sglang", speed=20.0)
    p, d = fleet[0], fleet[1]
    body = pd_body(p, 7)
    results: dict[str, httpx.Response] = {}

    async def leg(name: str, engine: EngineHandle) -> None:
        results[name] = await client.post(f"{engine.url}/v1/chat/completions", json=body)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(leg, "d", d)
        await wait_for(lambda: 7 in p.engine.rooms)
        nursery.start_soon(leg, "p", p)
    assert results["d"].status_code == 200
    assert results["d"].json()["usage"]["completion_tokens"] == 6
    assert results["p"].status_code == 200


async def test_prefill_failure_fails_the_decode(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=2, dialect="sglang", speed=20.0)
    p, d = fleet[0], fleet[1]
    p.set_faults(error_status=500, leg="prefill")
    results: dict[str, tuple[int, dict[str, str], bytes]] = {}

    async def leg(name: str, engine: EngineHandle, body: dict[str, Any]) -> None:
        results[name] = await post_stream(client, f"{engine.url}/v1/chat/completions", body)

    body = pd_body(p, 99, stream=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(leg, "d", d, body)
        await wait_for(lambda: d.state()["pulling"] == 1)
        nursery.start_soon(leg, "p", p, body)
    p_status, _, p_raw = results["p"]
    assert p_status == 500
    assert b'"object": "error"' in p_raw
    status, _, raw = results["d"]
    assert status == 200
    payloads = sse_payloads(raw)
    assert payloads[-1] == "[DONE]"
    err = sse_json(raw)[-1]["error"]
    assert err["object"] == "error"
    assert err["code"] == 500
    assert "KVTransferError(bootstrap_room=99)" in err["message"]
    assert d.state()["outcomes"][-1]["outcome"] == "error"

    # Non-streaming decode gets the flat envelope with status 500.
    body = pd_body(p, 100)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(leg, "d", d, body)
        await wait_for(lambda: d.state()["pulling"] == 1)
        nursery.start_soon(leg, "p", p, body)
    status, _, raw = results["d"]
    assert status == 500
    err_body = httpx.Response(500, content=raw).json()
    assert set(err_body) == {"object", "message", "type", "param", "code"}
    assert "Decode transfer failed" in err_body["message"]


async def test_prefill_abort_fails_the_decode(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=2, dialect="sglang", speed=1.0)
    p, d = fleet[0], fleet[1]
    body = pd_body(p, 5, messages=[{"role": "user", "content": "word " * 7000}], max_tokens=4)
    results: dict[str, httpx.Response] = {}

    async def decode() -> None:
        results["d"] = await client.post(f"{d.url}/v1/chat/completions", json=body)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(decode)
        async with trio.open_nursery() as p_nursery:

            async def prefill() -> None:
                await client.post(f"{p.url}/v1/chat/completions", json=body)

            p_nursery.start_soon(prefill)
            await wait_for(lambda: p.state()["running"] == 1)
            p_nursery.cancel_scope.cancel()
    assert results["d"].status_code == 500
    assert "Aborted by AbortReq." in results["d"].json()["message"]
    assert p.state()["counters"]["aborted"]["prefill"] == 1


async def test_missing_room_and_flat_errors(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=1, dialect="sglang", speed=20.0)
    e = fleet[0]
    body = pd_body(e, 1)
    del body["bootstrap_room"]
    r = await client.post(f"{e.url}/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert r.json() == {
        "object": "error",
        "message": "Invalid request: Disaggregated request received without boostrap room id",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    r = await client.post(f"{e.url}/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404
    assert r.json()["object"] == "error"
    # Plain requests (no bootstrap fields) run aggregated; stream_options default no usage.
    status, _, raw = await post_stream(
        client,
        f"{e.url}/v1/completions",
        {"prompt": "x", "max_tokens": 3, "stream": True, "stream_options": {}},
    )
    assert status == 200
    assert all(c["choices"] for c in sse_json(raw))


async def test_sglang_endpoints(start_fleet: StartFleet, client: httpx.AsyncClient) -> None:
    fleet = await start_fleet(engines=1, dialect="sglang", speed=20.0)
    url = fleet[0].url
    for path in ("/health", "/health_generate"):
        assert (await client.get(url + path)).status_code == 200
    info = (await client.get(f"{url}/get_server_info")).json()
    assert info["disaggregation_bootstrap_port"] == fleet[0].port
    assert "version" in info
    model = (await client.get(f"{url}/get_model_info")).json()
    assert model["is_generation"] is True
    models = (await client.get(f"{url}/v1/models")).json()
    assert models["data"][0]["owned_by"] == "sglang"
    tok = (await client.post(f"{url}/tokenize", json={"prompt": "Hello world"})).json()
    assert set(tok) == {"tokens", "count", "max_model_len"}
    assert tok["count"] == 3
    metrics = (await client.get(f"{url}/metrics")).text
    assert "sglang:num_running_reqs" in metrics
    assert (await client.post(f"{url}/flush_cache")).text.startswith("Cache flushed.")


async def test_sglang_tokenize_takes_prompts_only(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=1, dialect="sglang", speed=20.0)
    url = fleet[0].url
    messages = [{"role": "user", "content": "Hello world"}]
    refused = await client.post(f"{url}/tokenize", json={"messages": messages})
    assert refused.status_code == 400
    assert refused.json() == {
        "object": "error",
        "message": "Invalid prompt type: <class 'NoneType'>. Expected str or List[str].",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    # A list gets a list of counts, one per prompt; special tokens are added to each.
    many = (await client.post(f"{url}/tokenize", json={"prompt": ["Hello world", "Hi"]})).json()
    assert many["count"] == [3, 2]
    assert [len(ids) for ids in many["tokens"]] == [3, 2]
    bare = {"prompt": ["Hello world"], "add_special_tokens": False}
    assert (await client.post(f"{url}/tokenize", json=bare)).json()["count"] == [2]
