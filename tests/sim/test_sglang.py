"""SGLang dialect: bootstrap pairing, P failure -> D 500, launch roles, flat errors,
endpoints."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import httpx
import pytest
import trio

from narwhal.sim import EngineHandle, SimEngineSpec

from ..support import StartFleet, open_sse, post_stream, sse_json, sse_payloads, wait_for

# Engine 0 launched with --disaggregation-mode prefill, engine 1 with decode.
PD = ("prefill", "decode")


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
    fleet = await start_fleet(engines=2, dialect="sglang", speed=20.0, disaggregation_modes=PD)
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
    fleet = await start_fleet(engines=2, dialect="sglang", speed=20.0, disaggregation_modes=PD)
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
    fleet = await start_fleet(engines=2, dialect="sglang", speed=20.0, disaggregation_modes=PD)
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
    # An abort's error event: the status's name as type, json.dumps' spacing.
    assert (err["object"], err["type"], err["code"]) == ("error", "INTERNAL_SERVER_ERROR", 500)
    assert b'{"error": {"object": "error", ' in raw
    assert "decode_req.req.bootstrap_room=99 with exception " in err["message"]
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
    # Raised as an HTTPException, whose status SGLang's handler names as the type.
    assert err_body["type"] == "500"


async def long_prompt_pair(
    start_fleet: StartFleet, room: int
) -> tuple[EngineHandle, EngineHandle, dict[str, Any]]:
    """A prefill and a decode server at speed 1, and a body for the pair whose prompt is
    long enough for a test to act while the prefill runs."""
    fleet = await start_fleet(engines=2, dialect="sglang", speed=1.0, disaggregation_modes=PD)
    p = fleet[0]
    body = pd_body(p, room, messages=[{"role": "user", "content": "word " * 7000}], max_tokens=4)
    return p, fleet[1], body


async def post_leg(
    client: httpx.AsyncClient,
    engine: EngineHandle,
    body: dict[str, Any],
    results: dict[str, httpx.Response],
    name: str,
) -> None:
    results[name] = await client.post(f"{engine.url}/v1/chat/completions", json=body)


async def test_prefill_abort_fails_the_decode(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    p, d, body = await long_prompt_pair(start_fleet, 5)
    results: dict[str, httpx.Response] = {}
    async with trio.open_nursery() as nursery, trio.open_nursery() as p_nursery:
        nursery.start_soon(post_leg, client, d, body, results, "d")
        p_nursery.start_soon(post_leg, client, p, body, results, "p")
        await wait_for(lambda: p.state()["running"] == 1)
        p_nursery.cancel_scope.cancel()
    assert results["d"].status_code == 500
    assert "Aborted by AbortReq." in results["d"].json()["message"]
    assert p.state()["counters"]["aborted"]["prefill"] == 1


async def test_a_decoder_that_leaves_before_the_transfer_frees_the_prefill_kv(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    # SGLang's prefill server pushes the KV to its decoder and frees it when the push
    # ends; it held it for the whole bootstrap timeout when the decoder had left.
    p, d, body = await long_prompt_pair(start_fleet, 6)
    results: dict[str, httpx.Response] = {}
    async with trio.open_nursery() as nursery, trio.open_nursery() as d_nursery:
        d_nursery.start_soon(post_leg, client, d, body, results, "d")
        await wait_for(lambda: 6 in p.engine.rooms and p.engine.rooms[6].d_present)
        nursery.start_soon(post_leg, client, p, body, results, "p")
        await wait_for(lambda: p.state()["running"] == 1)
        d_nursery.cancel_scope.cancel()
    assert results["p"].status_code == 200
    state = p.state()
    assert state["leases"]["held"] == 0
    assert state["kv"]["used_blocks"] == 0
    assert state["counters"]["kv_receiver_gone"] == 1
    assert state["counters"]["kv_expired"] == 0


async def test_missing_room_and_flat_errors(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(
        engines=3, dialect="sglang", speed=20.0, disaggregation_modes=("prefill", "decode", "null")
    )
    refusal = {
        "object": "error",
        "message": "Invalid request: Disaggregated request received without boostrap room id",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    plain = {"prompt": "x", "max_tokens": 3}
    for engine in (fleet[0], fleet[1]):
        # A disaggregated server refuses a plain request, streamed or not, and one that
        # names a bootstrap server but no room; nothing is scheduled.
        body = {**pd_body(fleet[0], 1), "prompt": "x"}
        del body["bootstrap_room"]
        for request in (body, plain, {**plain, "stream": True}):
            r = await client.post(f"{engine.url}/v1/completions", json=request)
            assert (r.status_code, r.json()) == (400, refusal)
        assert engine.state()["counters"]["requests"] == {"prefill": 0, "decode": 0, "aggregate": 0}
    # An aggregate server (no --disaggregation-mode) runs plain requests; stream_options
    # default to no usage.
    aggregate = fleet[2]
    status, _, raw = await post_stream(
        client,
        f"{aggregate.url}/v1/completions",
        {**plain, "stream": True, "stream_options": {}},
    )
    assert status == 200
    assert all(c["choices"] for c in sse_json(raw))
    assert aggregate.state()["counters"]["requests"]["aggregate"] == 1


async def test_a_request_past_the_context_is_refused_by_both_servers_before_a_stream(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    # SGLang's tokenizer manager checks the request as sent, on a prefill server too
    # (max_new_tokens becomes 1 later, in its bootstrap queue). 0.5.23's handler starts
    # the response generator before it answers, so a stream is refused with a 400 too.
    fleet = await start_fleet(engines=2, dialect="sglang", speed=20.0, disaggregation_modes=PD)
    p, d = fleet[0], fleet[1]

    def ids(room: int, count: int, max_tokens: int) -> dict[str, Any]:
        room_fields = {k: v for k, v in pd_body(p, room).items() if k.startswith("bootstrap")}
        return {"prompt": [5] * count, "max_tokens": max_tokens, **room_fields}

    refusal = {
        "object": "error",
        "message": (
            "Requested token count exceeds the model's maximum context length of 8192 "
            "tokens. You requested a total of 8193 tokens: 8000 tokens from the input "
            "messages and 193 tokens for the completion. Please reduce the number of "
            "tokens in the input messages or the completion to fit within the limit."
        ),
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    for engine, room in ((p, 21), (d, 22)):
        r = await client.post(f"{engine.url}/v1/completions", json=ids(room, 8000, 193))
        assert (r.status_code, r.json()) == (400, refusal)
        status, _, raw = await post_stream(
            client, f"{engine.url}/v1/completions", {**ids(room, 8000, 193), "stream": True}
        )
        assert (status, json.loads(raw)) == (400, refusal)
    r = await client.post(f"{d.url}/v1/completions", json=ids(23, 8192, 1))
    assert r.json()["message"] == (
        "The input (8192 tokens) is longer than the model's context length (8192 tokens)."
    )
    for engine in (p, d):
        assert engine.state()["counters"]["requests"] == {"prefill": 0, "decode": 0, "aggregate": 0}
    # Newer builds let a total equal to the context through.
    async with trio.open_nursery() as nursery:
        for engine in (p, d):
            nursery.start_soon(
                partial(client.post, f"{engine.url}/v1/completions", json=ids(24, 8000, 192))
            )
    assert d.state()["counters"]["completed"]["decode"] == 1


async def test_the_scheduler_refuses_a_prompt_near_the_context_a_stream_after_its_200(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    # Past the tokenizer manager, SGLang's scheduler refuses a prompt of its longest
    # request (context - 1) less 5 tokens or more: it aborts the request, which a stream
    # reports after its 200 (the status's name as type, json.dumps' spacing).
    (engine,) = await start_fleet(engines=1, dialect="sglang", speed=20.0)
    url = f"{engine.url}/v1/completions"
    message = (
        "Input length (8186 tokens) exceeds the maximum allowed length (8186 tokens). Use a "
        "shorter input or enable --allow-auto-truncate."
    )
    body = {"prompt": [5] * 8186, "max_tokens": 6}
    r = await client.post(url, json=body)
    assert (r.status_code, r.json()) == (400, flat(message))
    status, _, raw = await post_stream(client, url, {**body, "stream": True})
    assert status == 200
    assert raw == (
        b'data: {"error": {"object": "error", "message": "' + message.encode() + b'", '
        b'"type": "BAD_REQUEST", "param": null, "code": 400}}\n\ndata: [DONE]\n\n'
    )
    r = await client.post(url, json={**body, "prompt": [5] * 8185})
    assert r.json()["usage"]["completion_tokens"] == 6


async def test_an_engine_serves_only_the_leg_it_was_launched_for(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(
        engines=3, dialect="sglang", speed=20.0, disaggregation_modes=("decode", "decode", "null")
    )
    d0, d1, aggregate = fleet[0], fleet[1], fleet[2]
    # Naming a decode server as the bootstrap server does not make it a prefill server:
    # it has no bootstrap server, so the pull fails as against a dead prefill instance.
    r = await client.post(f"{d1.url}/v1/chat/completions", json=pd_body(d0, 11))
    assert r.status_code == 500
    assert "KVTransferError(bootstrap_room=11)" in r.json()["message"]
    assert d0.state()["counters"]["requests"]["prefill"] == 0
    # An aggregate server ignores bootstrap fields and answers the whole request.
    r = await client.post(f"{aggregate.url}/v1/chat/completions", json=pd_body(aggregate, 12))
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 6
    assert aggregate.state()["counters"]["requests"]["aggregate"] == 1
    info = (await client.get(f"{d0.url}/get_server_info")).json()
    assert info["disaggregation_mode"] == "decode"
    assert d0.state()["disaggregation_mode"] == "decode"
    # A restart relaunches the engine in the mode it had.
    await d0.restart()
    assert d0.state()["disaggregation_mode"] == "decode"


def test_only_sglang_engines_have_a_launch_mode() -> None:
    with pytest.raises(ValueError, match=r"^disaggregation_mode is 'prefill'; only sglang"):
        SimEngineSpec(dialect="vllm", disaggregation_mode="prefill")
    assert SimEngineSpec(dialect="sglang", disaggregation_mode="decode").disaggregation_mode == (
        "decode"
    )


async def test_modes_are_one_per_engine(start_fleet: StartFleet) -> None:
    with pytest.raises(ValueError, match=r"^1 disaggregation modes for 2 engines"):
        await start_fleet(engines=2, dialect="sglang", disaggregation_modes=("prefill",))


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
    assert tok == {"tokens": tok["tokens"], "count": 3, "max_model_len": 8192}
    assert (await client.post(f"{url}/flush_cache")).text.startswith("Cache flushed.")
    assert (await client.get(f"{url}/version")).status_code == 404


async def test_an_older_sglang_tokenize_takes_prompts_only(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    spec = SimEngineSpec(dialect="sglang", tokenize_messages=False, tokenizer_max_length=131072)
    fleet = await start_fleet(engines=1, spec=spec, speed=20.0)
    url = fleet[0].url
    messages = [{"role": "user", "content": "Hello world"}]
    refused = await client.post(f"{url}/tokenize", json={"messages": messages})
    # Its TokenizeRequest requires `prompt`: FastAPI's validation error, through SGLang's
    # RequestValidationError handler (400, the flat envelope, type "Bad Request").
    assert refused.status_code == 400
    error = refused.json()
    assert error == {
        "object": "error",
        "message": error["message"],
        "type": "Bad Request",
        "param": None,
        "code": 400,
    }
    assert "'loc': ('body', 'prompt'), 'msg': 'Field required'" in error["message"]
    # A list gets a list of counts, one per prompt; special tokens are added to each.
    many = (await client.post(f"{url}/tokenize", json={"prompt": ["Hello world", "Hi"]})).json()
    assert many["count"] == [3, 2]
    # A Llama-3.1 tokenizer's limit, whatever the server's context.
    assert many["max_model_len"] == 131072
    assert [len(ids) for ids in many["tokens"]] == [3, 2]
    bare = {"prompt": ["Hello world"], "add_special_tokens": False}
    assert (await client.post(f"{url}/tokenize", json=bare)).json()["count"] == [2]


async def test_sglang_tokenize_renders_chat_as_its_completions_do(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=1, dialect="sglang", speed=20.0)
    url = fleet[0].url
    messages = [{"role": "user", "content": "Is it raining in Tromso?"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]

    async def counted(**extra: object) -> int:
        body = {"messages": messages, **extra}
        tok = await client.post(f"{url}/tokenize", json=body)
        assert tok.status_code == 200, tok.text
        assert set(tok.json()) == {"tokens", "count", "max_model_len"}
        chat = await client.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 1})
        assert chat.json()["usage"]["prompt_tokens"] == tok.json()["count"]
        return int(tok.json()["count"])

    plain = await counted()
    assert await counted(tools=tools) > plain + 10
    # Neither form takes these: SGLang's chat request has no such fields (the tokenize
    # request drops add_special_tokens before building it).
    assert await counted(add_special_tokens=True) == plain
    assert await counted(add_generation_prompt=False) == plain
    # The last message left open: its header and text ("It"), no <|eot_id|>, and no
    # generation prompt after it.
    continued = [*messages, {"role": "assistant", "content": "It"}]
    assert await counted(messages=continued, continue_final_message=True) == plain + 1
    for body in ({"prompt": "x", "messages": messages}, {}):
        both = await client.post(f"{url}/tokenize", json=body)
        assert both.status_code == 400
        assert "Exactly one of 'prompt' or 'messages' must be provided." in both.json()["message"]
    # Pydantic reports the field's value as the input, not the body.
    text = await client.post(f"{url}/tokenize", json={"messages": "Hi"})
    assert "'msg': 'Input should be a valid list', 'input': 'Hi'}" in text.json()["message"]
    # Prompts are counted as before.
    assert (await client.post(f"{url}/tokenize", json={"prompt": "Hello world"})).json()[
        "count"
    ] == 3


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_only_vllm_completions_honour_add_special_tokens(
    start_fleet: StartFleet, client: httpx.AsyncClient, dialect: str
) -> None:
    fleet = await start_fleet(engines=1, dialect=dialect, speed=20.0)
    url = fleet[0].url

    async def charged(**extra: object) -> int:
        body = {"prompt": "Hello world", "max_tokens": 1, **extra}
        answer = await client.post(f"{url}/v1/completions", json=body)
        return int(answer.json()["usage"]["prompt_tokens"])

    # vLLM's CompletionRequest takes add_special_tokens; SGLang's has no such field and
    # always adds the BOS.
    assert await charged(add_special_tokens=False) == await charged() - (dialect == "vllm")


def flat(message: str, type_: str = "BadRequestError") -> dict[str, Any]:
    return {"object": "error", "message": message, "type": type_, "param": None, "code": 400}


async def test_a_completion_max_tokens_is_an_integer(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    (engine,) = await start_fleet(engines=1, dialect="sglang", speed=20.0)
    url = f"{engine.url}/v1/completions"
    # CompletionRequest.max_tokens is `int = 16` with a positive validator: FastAPI refuses
    # null (which vLLM reads as no bound) and 0, streamed or not, through SGLang's
    # validation handler.
    for value, error in (
        (
            None,
            "{'type': 'int_type', 'loc': ('body', 'max_tokens'), 'msg': 'Input should be a "
            "valid integer', 'input': None}",
        ),
        (
            0,
            "{'type': 'value_error', 'loc': ('body', 'max_tokens'), 'msg': 'Value error, "
            "max_tokens must be positive', 'input': 0, 'ctx': {'error': ValueError('max_tokens "
            "must be positive')}}",
        ),
    ):
        for stream in (False, True):
            r = await client.post(url, json={"prompt": "x", "max_tokens": value, "stream": stream})
            message = f"1 validation error:\n  {error} [{error}]"
            assert (r.status_code, r.json()) == (400, flat(message, "Bad Request"))
    # A chat's max_tokens is optional: null is no bound (256 tokens in the sim).
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": None}
    r = await client.post(f"{engine.url}/v1/chat/completions", json=chat)
    assert r.json()["usage"]["completion_tokens"] == 256
    assert engine.state()["counters"]["rejected_invalid"] == 4


async def test_any_model_name_is_served_and_an_adapter_is_refused(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    # SGLang's OpenAI routes do not check `model` (vLLM answers 404) and answer in its
    # name; newer builds read `base:adapter` as a LoRA adapter, refused by a server
    # launched without --enable-lora (as its tokenizer manager refuses it: 400, streamed
    # or not).
    (engine,) = await start_fleet(engines=1, dialect="sglang", speed=20.0)
    url = engine.url
    for name in ("nope", "sim-llama:", "sim-llama: "):
        for path, body in (
            ("completions", {"model": name, "prompt": "x", "max_tokens": 2}),
            ("chat/completions", {"model": name, "messages": [{"role": "user", "content": "x"}]}),
        ):
            r = await client.post(f"{url}/v1/{path}", json=body)
            assert r.status_code == 200, (name, path, r.text)
            assert r.json()["model"] == name
    tok = await client.post(f"{url}/tokenize", json={"model": "nope", "prompt": "Hello world"})
    assert tok.json()["count"] == 3
    refusal = flat(
        "LoRA adapter 'sql-expert' was requested, but LoRA is not enabled. Please launch the "
        "server with --enable-lora flag and preload adapters using --lora-paths or "
        "/load_lora_adapter endpoint."
    )
    adapters: tuple[dict[str, Any], ...] = (
        {"model": "nope:sql-expert", "prompt": "x"},
        {"model": "nope: sql-expert ", "prompt": "x", "lora_path": "other"},
        {"model": "nope", "prompt": "x", "lora_path": "sql-expert"},
        {"prompt": "x", "lora_path": [None, "sql-expert"]},
    )
    for selected in adapters:
        r = await client.post(f"{url}/v1/completions", json=selected)
        assert (r.status_code, r.json()) == (400, refusal), selected
        status, _, raw = await post_stream(
            client, f"{url}/v1/completions", {**selected, "stream": True}
        )
        assert (status, json.loads(raw)) == (400, refusal)
    unnamed = await client.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert unnamed.json()["model"] == "default"
    assert engine.state()["counters"]["requests"] == {"prefill": 0, "decode": 0, "aggregate": 7}


async def test_min_tokens_is_checked_against_the_request_in_sglang_words(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    # SamplingParams.verify in its tokenizer manager: against the request's max_tokens,
    # also on a prefill server, which forces max_new_tokens to 1 only afterwards.
    fleet = await start_fleet(engines=2, dialect="sglang", speed=20.0, disaggregation_modes=PD)
    p, d = fleet[0], fleet[1]
    body = pd_body(p, 31, min_tokens=7)
    results: dict[str, httpx.Response] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(post_leg, client, d, body, results, "d")
        nursery.start_soon(post_leg, client, p, body, results, "p")
    message = "min_new_tokens must be in [0, max_new_tokens(6)], got 7."
    for leg in ("p", "d"):
        assert (results[leg].status_code, results[leg].json()) == (400, flat(message))
    negative = {"prompt": "x", "min_tokens": -1}
    r = await client.post(f"{p.url}/v1/completions", json={**negative, "bootstrap_room": 33})
    message = "min_new_tokens must be in [0, max_new_tokens], got -1."
    assert (r.status_code, r.json()) == (400, flat(message))
    body = pd_body(p, 32, min_tokens=4)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(post_leg, client, d, body, results, "d")
        nursery.start_soon(post_leg, client, p, body, results, "p")
    assert results["p"].status_code == 200, results["p"].text
    assert results["d"].json()["usage"]["completion_tokens"] == 6


async def test_a_completion_prompt_is_required_and_not_empty(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    # CompletionRequest requires `prompt`; `_validate_request` refuses an empty one, both
    # before a stream starts.
    (engine,) = await start_fleet(engines=1, dialect="sglang", speed=20.0)
    url = f"{engine.url}/v1/completions"
    empty: tuple[object, ...] = ("", [], [""], [[]])
    for prompt in empty:
        for stream in (False, True):
            r = await client.post(url, json={"prompt": prompt, "stream": stream})
            assert (r.status_code, r.json()) == (400, flat("Prompt cannot be empty"))
    r = await client.post(url, json={"max_tokens": 2})
    assert (r.status_code, r.json()["type"]) == (400, "Bad Request")
    assert "'loc': ('body', 'prompt'), 'msg': 'Field required'" in r.json()["message"]


async def test_a_null_stream_or_n_is_refused(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    # SGLang's request models declare `stream: bool = False` and `n: int = 1`: FastAPI
    # refuses a null (which vLLM's chat takes as the default).
    (engine,) = await start_fleet(engines=1, dialect="sglang", speed=20.0)
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for key, error in (
        ("stream", "'type': 'bool_type', 'loc': ('body', 'stream'), 'msg': 'Input should be a"),
        ("n", "'type': 'int_type', 'loc': ('body', 'n'), 'msg': 'Input should be a valid"),
    ):
        r = await client.post(f"{engine.url}/v1/chat/completions", json={**chat, key: None})
        assert (r.status_code, r.json()["type"]) == (400, "Bad Request")
        assert error in r.json()["message"]
    r = await client.post(f"{engine.url}/v1/chat/completions", json={**chat, "n": 1})
    assert r.status_code == 200


async def test_an_aggregate_server_serves_n_choices_and_a_pair_never_answers_them(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(
        engines=3, dialect="sglang", speed=20.0, disaggregation_modes=("prefill", "decode", "null")
    )
    p, d, aggregate = fleet[0], fleet[1], fleet[2]
    url = f"{aggregate.url}/v1/completions"
    body = {"prompt": "x", "max_tokens": 3, "n": 2}
    r = await client.post(url, json=body)
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert r.json()["usage"]["completion_tokens"] == 6
    assert "x-request-id" not in r.headers  # SGLang sends none
    status, _, raw = await post_stream(client, url, {**body, "stream": True})
    assert status == 200
    chunks = sse_json(raw)
    # Each streamed choice carries an id of its own.
    ids = {c["choices"][0]["index"]: c["id"] for c in chunks}
    assert len(set(ids.values())) == 2
    # n=0: its usage processor divides by it once the request has run; a stream has no
    # usage to count and serves one choice.
    r = await client.post(url, json={**body, "n": 0})
    assert (r.status_code, r.json()) == (400, flat("range() arg 3 must not be zero", "BadRequest"))
    status, _, raw = await post_stream(client, url, {**body, "n": 0, "stream": True})
    assert {c["choices"][0]["index"] for c in sse_json(raw)} == {0}
    # A bootstrap pair given n > 1 answers neither leg (SGLang 0.5.23: nothing within 60 s),
    # until the client leaves.
    pair = pd_body(p, 41, n=2)
    async with trio.open_nursery() as nursery:
        for engine in (p, d):
            nursery.start_soon(partial(client.post, f"{engine.url}/v1/chat/completions", json=pair))
        await wait_for(lambda: p.state()["waiting"] == 1 and d.state()["waiting"] == 1)
        nursery.cancel_scope.cancel()
    await wait_for(lambda: p.state()["waiting"] == d.state()["waiting"] == 0)
    assert p.state()["counters"]["aborted"]["prefill"] == 1
    assert d.state()["counters"]["aborted"]["decode"] == 1


async def test_sampling_parameters_are_refused_before_a_stream(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    # SamplingParams.verify, in its order, in its tokenizer manager: a 400, streamed or not.
    (engine,) = await start_fleet(engines=1, dialect="sglang", speed=20.0)
    url = f"{engine.url}/v1/chat/completions"
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for extra, message in (
        ({"temperature": -1}, "temperature must be a non-negative finite number, got -1.0."),
        (
            {"temperature": -0.5, "top_p": 0},
            "temperature must be a non-negative finite number, got -0.5.",
        ),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0.0."),
        ({"min_p": 2}, "min_p must be in [0, 1], got 2.0."),
        ({"top_k": -5}, "top_k must be -1 (disable) or at least 1, got -5."),
        ({"frequency_penalty": 3}, "frequency_penalty must be in [-2, 2], got 3.0."),
        ({"presence_penalty": -3}, "presence_penalty must be in [-2, 2], got -3.0."),
        (
            {"repetition_penalty": 0},
            "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 0.0.",
        ),
    ):
        for stream in (False, True):
            r = await client.post(url, json={**chat, **extra, "stream": stream})
            assert (r.status_code, r.json()) == (400, flat(message)), extra
    # Only a negative temperature is refused (vLLM also refuses one above 2); -1 and null
    # are top_k's "whole vocabulary".
    served: tuple[dict[str, Any], ...] = (
        {"temperature": 3},
        {"top_k": -1},
        {"top_k": None, "temperature": None},
    )
    for extra in served:
        r = await client.post(url, json={**chat, **extra})
        assert r.status_code == 200, (extra, r.text)


async def test_a_stream_answers_its_200_with_its_first_chunk(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    # SGLang 0.5.23's handler waits for the response generator's first chunk (which
    # is how a refusal there becomes a 400) before it sends the status and headers.
    (engine,) = await start_fleet(engines=1, dialect="sglang", speed=20.0)
    stall = {"X-Sim-Fault": json.dumps({"stall_before_first_token_s": 0.3})}
    started = trio.current_time()
    async with open_sse(engine.url, "/v1/completions", {"prompt": "x", "stream": True}, stall):
        assert trio.current_time() - started >= 0.3


async def test_a_fresh_server_publishes_its_load_gauges_once_its_scheduler_reports(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    gauges = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage")
    # Decode steps of 30 ms: the 40th comes well after the stream's first tokens.
    fleet = await start_fleet(
        engines=3, dialect="sglang", speed=0.2, disaggregation_modes=("null", "prefill", "decode")
    )
    aggregate, p, d = fleet[0], fleet[1], fleet[2]

    async def page(engine: EngineHandle) -> str:
        return (await client.get(f"{engine.url}/metrics")).text

    for engine in fleet:
        fresh = await page(engine)
        assert "sglang:max_total_num_tokens{" in fresh
        assert not [name for name in gauges if name in fresh]
        assert "sglang:prompt_tokens_total{" not in fresh  # a labelled counter, unused yet
    # An aggregate (or prefill) server reports at its first batch.
    r = await client.post(f"{aggregate.url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 200
    served = await page(aggregate)
    assert all(name in served for name in gauges)
    assert (
        'sglang:prompt_tokens_total{engine_type="unified",is_streaming="false",'
        f'model_name="{aggregate.engine.spec.model}"}}'
    ) in served
    # A decode server at its 40th decode step, or at its first idle tick after serving.
    body = pd_body(p, 51, max_tokens=60, stream=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(client.post, f"{p.url}/v1/chat/completions", json=body))
        async with open_sse(d.url, "/v1/chat/completions", body) as reader:
            await reader.event()
            await reader.event()
            assert not [name for name in gauges if name in await page(d)]
            while await reader.event() is not None:
                pass
    served = await page(d)
    assert all(name in served for name in gauges)
    assert 'sglang:num_running_reqs{engine_type="decode",' in served
