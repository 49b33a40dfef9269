"""vLLM-dialect wire behaviour: shapes, SSE framing, errors, auxiliary endpoints."""

from __future__ import annotations

import json

import httpx
import pytest

from narwhal.recovery import parse_load
from narwhal.sim import DEFAULT_MODEL, SimEngineSpec, SimTiming
from narwhal.sim._spec import ENGINE_VERSION

from ..support import StartFleet, post_stream, sse_json, sse_payloads

FAST = {"speed": 50.0}


async def test_completion_non_streaming_shape(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=1, **FAST)
    url = fleet[0].url
    r = await client.post(
        f"{url}/v1/completions",
        json={"model": DEFAULT_MODEL, "prompt": "The capital of France is", "max_tokens": 7},
        headers={"X-Request-Id": "req-1"},
    )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "req-1"
    body = r.json()
    assert body["id"] == "cmpl-req-1"
    assert body["object"] == "text_completion"
    assert body["model"] == DEFAULT_MODEL
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["stop_reason"] is None
    assert len(choice["text"].split()) == 7
    assert body["usage"]["completion_tokens"] == 7
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 7
    assert body["kv_transfer_params"] is None
    # Output text is deterministic for a prompt.
    again = await client.post(
        f"{url}/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 7}
    )
    assert again.json()["choices"][0]["text"] == choice["text"]


async def test_default_max_tokens(start_fleet: StartFleet, client: httpx.AsyncClient) -> None:
    fleet = await start_fleet(engines=1, speed=200.0)
    url = fleet[0].url
    r = await client.post(f"{url}/v1/completions", json={"prompt": "hi"})
    assert r.json()["usage"]["completion_tokens"] == 16
    timing = SimTiming(max_model_len=300)
    fleet2 = await start_fleet(engines=1, speed=200.0, timing=timing)
    r = await client.post(
        f"{fleet2[0].url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "word " * 100}]},
    )
    body = r.json()
    assert body["usage"]["completion_tokens"] == 300 - body["usage"]["prompt_tokens"]


@pytest.mark.parametrize(("vllm_version", "null_completion"), [("0.32.0", 16), ("0.29.0", 256)])
async def test_a_request_without_an_output_bound(
    start_fleet: StartFleet, client: httpx.AsyncClient, vllm_version: str, null_completion: int
) -> None:
    # A chat without max_tokens has no bound: the sim runs it to
    # SimEngineSpec.unbounded_max_tokens (256) within the context, at least to its
    # min_tokens. A completion's absent max_tokens is its default, 16; vLLM 0.32 reads a
    # null one as that default too, 0.29 as no bound.
    timing = SimTiming(max_model_len=400)
    fleet = await start_fleet(engines=2, speed=200.0, timing=timing, vllm_version=vllm_version)
    bounded = fleet[0].url

    async def generated(url: str, path: str, **body: object) -> tuple[int, int]:
        r = await client.post(f"{url}/v1/{path}", json=body)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        return usage["prompt_tokens"], usage["completion_tokens"]

    chat = [{"role": "user", "content": "Hi"}]
    null = await generated(bounded, "completions", prompt="hi", max_tokens=None)
    assert null == (2, null_completion)
    assert await generated(bounded, "completions", prompt="hi") == (2, 16)
    assert (await generated(bounded, "chat/completions", messages=chat))[1] == 256
    assert (await generated(bounded, "chat/completions", messages=chat, max_tokens=None))[1] == 256
    done = await generated(bounded, "chat/completions", messages=chat, min_tokens=300)
    assert done[1] == 300
    # Unset (CLI --unbounded-max-tokens context), they run to the context as vLLM does.
    spec = SimEngineSpec(timing=timing, unbounded_max_tokens=None, vllm_version=vllm_version)
    (engine,) = await start_fleet(engines=1, speed=200.0, spec=spec)
    prompt, output = await generated(engine.url, "chat/completions", messages=chat)
    assert prompt + output == 400
    if null_completion != 16:
        prompt, output = await generated(engine.url, "completions", prompt="hi", max_tokens=None)
        assert prompt + output == 400


async def test_completion_stream_framing(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    # vLLM 0.32: a chunk has no usage key unless it carries usage, the last one carries
    # the system fingerprint, and `"stream_options": {}` leaves include_usage false.
    fleet = await start_fleet(engines=1, speed=5.0)
    url = fleet[0].url
    status, headers, raw = await post_stream(
        client,
        f"{url}/v1/completions",
        {"prompt": "Hello", "max_tokens": 5, "stream": True, "stream_options": {}},
    )
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["transfer-encoding"] == "chunked"
    tokens = sse_json(raw)
    for chunk in tokens:
        (choice,) = chunk["choices"]
        assert set(choice) == {
            "index",
            "text",
            "logprobs",
            "finish_reason",
            "stop_reason",
            "prompt_token_ids",
            "token_ids",
        }
        assert "usage" not in chunk
    assert [c["choices"][0]["finish_reason"] for c in tokens][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in tokens[:-1])
    assert "".join(c["choices"][0]["text"] for c in tokens).count(" ") == 5
    assert tokens[-1]["system_fingerprint"].startswith("vllm-0.32.0-")
    assert all("system_fingerprint" not in c for c in tokens[:-1])


async def test_completion_stream_framing_on_vllm_029(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=1, speed=5.0, vllm_version="0.29.0")
    url = fleet[0].url
    status, _, raw = await post_stream(
        client,
        f"{url}/v1/completions",
        {"prompt": "Hello", "max_tokens": 5, "stream": True, "stream_options": {}},
    )
    assert status == 200
    chunks = sse_json(raw)
    *tokens, usage = chunks
    for chunk in tokens:
        # exclude_unset=False: every optional key is present, explicitly null (§4.2).
        (choice,) = chunk["choices"]
        assert set(choice) == {
            "index",
            "text",
            "logprobs",
            "finish_reason",
            "stop_reason",
            "prompt_token_ids",
            "token_ids",
        }
        assert chunk["usage"] is None
    assert [c["choices"][0]["finish_reason"] for c in tokens][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in tokens[:-1])
    assert "".join(c["choices"][0]["text"] for c in tokens).count(" ") == 5
    # `"stream_options": {}` means include_usage=True in vLLM 0.29.
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 5


async def test_chat_stream_framing_and_usage_default(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=1, speed=5.0)
    url = fleet[0].url
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    status, _, raw = await post_stream(client, f"{url}/v1/chat/completions", body)
    assert status == 200
    chunks = sse_json(raw)
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    # No stream_options: no usage chunk.
    assert all(c["choices"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "stop_reason" in chunks[-1]["choices"][0]
    assert "stop_reason" not in chunks[1]["choices"][0]  # exclude_unset (§4.3)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert len(text.split()) == 4
    body["stream_options"] = {"include_usage": False}
    _, _, raw = await post_stream(client, f"{url}/v1/chat/completions", body)
    assert all(c["choices"] for c in sse_json(raw))


@pytest.mark.parametrize(
    ("vllm_version", "options", "completion_details", "chat_details"),
    [
        # 0.32: include_usage is false unless set; a completion chunk's usage has the
        # counts only (set fields), a chat chunk's a null completion_tokens_details.
        (
            "0.32.0",
            {"include_usage": True, "continuous_usage_stats": True},
            {},
            {"completion_tokens_details": None},
        ),
        # 0.29: include_usage is true once stream_options is there; a completion chunk
        # is dumped with every field, so its usage has a null prompt_tokens_details.
        ("0.29.0", {"continuous_usage_stats": True}, {"prompt_tokens_details": None}, {}),
    ],
)
async def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(
    start_fleet: StartFleet,
    client: httpx.AsyncClient,
    vllm_version: str,
    options: dict[str, bool],
    completion_details: dict[str, None],
    chat_details: dict[str, None],
) -> None:
    # vLLM: with include_usage, every chunk also carries the usage so far (§4.2-4.4).
    fleet = await start_fleet(engines=1, speed=20.0, vllm_version=vllm_version)
    url = fleet[0].url
    body = {"prompt": "Hello", "max_tokens": 4, "stream": True, "stream_options": options}
    *chunks, final = sse_json((await post_stream(client, f"{url}/v1/completions", body))[2])
    prompt = final["usage"]["prompt_tokens"]
    sent = 0
    for chunk in chunks:
        sent += chunk["choices"][0]["text"].count(" ")
        assert chunk["usage"] == {
            "prompt_tokens": prompt,
            "total_tokens": prompt + sent,
            "completion_tokens": sent,
            **completion_details,
        }
    assert (sent, final["choices"]) == (4, [])
    chat = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": options,
    }
    role, *chunks, final = sse_json(
        (await post_stream(client, f"{url}/v1/chat/completions", chat))[2]
    )
    prompt = final["usage"]["prompt_tokens"]
    assert role["usage"] == {
        "prompt_tokens": prompt,
        "total_tokens": prompt,
        "completion_tokens": 0,
        **chat_details,
    }
    sent = 0
    for chunk in chunks:
        # An event may carry several tokens when the emitter falls behind the steps.
        sent += len(chunk["choices"][0]["delta"]["content"].split())
        assert chunk["usage"] == {
            "prompt_tokens": prompt,
            "total_tokens": prompt + sent,
            "completion_tokens": sent,
            **chat_details,
        }
    assert sent == 3
    # Without include_usage, none at all.
    chat["stream_options"] = {"include_usage": False, "continuous_usage_stats": True}
    raw = (await post_stream(client, f"{url}/v1/chat/completions", chat))[2]
    assert all("usage" not in c for c in sse_json(raw))


async def test_chat_non_streaming_shape(start_fleet: StartFleet, client: httpx.AsyncClient) -> None:
    fleet = await start_fleet(engines=1, **FAST)
    r = await client.post(
        f"{fleet[0].url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 3},
    )
    body = r.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert len(message["content"].split()) == 3
    assert body["usage"]["completion_tokens"] == 3


_VALIDATION_032 = [
    (
        {"prompt": "x", "max_tokens": 2, "min_tokens": 5},
        400,
        None,
        "min_tokens must be less than or equal to max_tokens=2, got 5.",
    ),
    (
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
    ),
    # A text prompt is tokenized only to the context + 1.
    (
        {"prompt": "word " * 9000, "max_tokens": 1},
        400,
        "input_tokens",
        "This model's maximum context length is 8192 tokens. However, your prompt contains "
        "at least 8193 input tokens, which exceeds this limit even without any output tokens.",
    ),
    (
        {"prompt": [7] * 8200, "max_tokens": 1},
        400,
        "input_tokens",
        "This model's maximum context length is 8192 tokens. However, your prompt contains "
        "8200 input tokens,",
    ),
    # A prompt of exactly the context leaves no output.
    (
        {"prompt": [7] * 8192, "max_tokens": 1},
        400,
        "max_tokens",
        "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
    ),
    (
        {"prompt": "x", "max_tokens": 9000},
        400,
        "max_tokens",
        "max_tokens=9000 cannot be greater than max_model_len=8192. Please request fewer "
        "output tokens. (parameter=max_tokens, value=9000)",
    ),
    ({"prompt": "x", "min_tokens": -1}, 400, None, "min_tokens must be greater than or equal to 0"),
    (
        {"model": "nope", "prompt": "x"},
        404,
        "model",
        f"The model `nope` does not exist. Valid aliases: {DEFAULT_MODEL}.",
    ),
    ({"prompt": "x", "n": 0}, 400, None, "n must be at least 1, got 0."),
    (
        {"prompt": "x", "logprobs": 21},
        400,
        "logprobs",
        "Requested sample logprobs of 21, which is greater than max allowed: 20 "
        "(parameter=logprobs, value=21)",
    ),
    ({"prompt": [1, 10**6]}, 400, None, "Token id 1000000 is out of vocabulary"),
    (
        {"prompt": "x", "temperature": -1},
        400,
        "temperature",
        "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)",
    ),
]
_VALIDATION_029 = [
    (
        {"prompt": "x", "max_tokens": 2, "min_tokens": 5},
        400,
        "min_tokens",
        "min_tokens must be less than or equal to max_tokens=2, got 5.",
    ),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "body", "1 validation error"),
    (
        {"prompt": "word " * 9000, "max_tokens": 1},
        400,
        "input_tokens",
        "This model's maximum context length is 8192 tokens. However, your request has",
    ),
    (
        {"prompt": "word " * 8000, "max_tokens": 1000},
        400,
        "max_tokens",
        "'max_tokens' or 'max_completion_tokens' is too large: 1000.",
    ),
    # The context is checked before the sampling parameters are built.
    (
        {"prompt": "word " * 8000, "max_tokens": 1000, "min_tokens": 2000},
        400,
        "max_tokens",
        "'max_tokens' or 'max_completion_tokens' is too large: 1000.",
    ),
    (
        {"prompt": "x", "min_tokens": -1},
        400,
        "min_tokens",
        "min_tokens must be greater than or equal to 0, got -1.",
    ),
    ({"model": "nope", "prompt": "x"}, 404, "model", "The model `nope` does not exist."),
]


@pytest.mark.parametrize(
    ("vllm_version", "body", "status", "param", "message"),
    [("0.32.0", *case) for case in _VALIDATION_032] + [("0.29.0", *c) for c in _VALIDATION_029],
)
async def test_validation_errors_use_the_nested_envelope(
    start_fleet: StartFleet,
    client: httpx.AsyncClient,
    vllm_version: str,
    body: dict[str, object],
    status: int,
    param: str | None,
    message: str,
) -> None:
    fleet = await start_fleet(engines=1, vllm_version=vllm_version, **FAST)
    r = await client.post(f"{fleet[0].url}/v1/completions", json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    assert err["param"] == param
    assert err["message"].startswith(message)
    if status == 404:
        assert err["type"] == "NotFoundError"
    elif param == "body":
        assert err["type"] == "Bad Request"
        assert "Stream options can only be defined when `stream=True`." in err["message"]
    else:
        assert err["type"] == "BadRequestError"
    assert fleet[0].state()["counters"]["rejected_invalid"] == 1


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": [1, 10**6], "max_tokens": 2},
        {"prompt": "x", "max_tokens": 2, "logprobs": 21},
        {"prompt": "x", "max_tokens": 2, "logprobs": -1},
    ],
)
async def test_the_engines_input_checks_answer_a_stream_with_an_error_event(
    start_fleet: StartFleet, client: httpx.AsyncClient, body: dict[str, object]
) -> None:
    # vLLM checks token ids and logprobs in its engine's generator, after a stream's 200:
    # one error event with code 400, then [DONE] (both builds).
    fleet = await start_fleet(engines=1, **FAST)
    status, headers, raw = await post_stream(
        client, f"{fleet[0].url}/v1/completions", {**body, "stream": True}
    )
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    event, done = raw.split(b"\n\n")[:2]
    assert done == b"data: [DONE]"
    assert raw.endswith(b"data: [DONE]\n\n")
    err = json.loads(event.removeprefix(b"data: "))["error"]
    assert (err["code"], err["type"]) == (400, "BadRequestError")


async def test_prompt_and_output_over_the_context_is_served_capped_on_vllm_032(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=1, timing=SimTiming(max_model_len=300), speed=200.0)
    url = fleet[0].url
    r = await client.post(f"{url}/v1/completions", json={"prompt": [7] * 290, "max_tokens": 100})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"] == {
        "prompt_tokens": 290,
        "total_tokens": 300,
        "completion_tokens": 10,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    assert body["choices"][0]["finish_reason"] == "length"
    chat = {"messages": [{"role": "user", "content": "word " * 250}], "max_tokens": 100}
    r = await client.post(f"{url}/v1/chat/completions", json=chat)
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 300


async def test_queue_limit_answers_503(start_fleet: StartFleet, client: httpx.AsyncClient) -> None:
    fleet = await start_fleet(engines=1, speed=1.0, max_num_queued=1)
    url = fleet[0].url
    async with client.stream(
        "POST", f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 500, "stream": True}
    ) as first:
        assert first.status_code == 200
        r = await client.post(f"{url}/v1/completions", json={"prompt": "b", "max_tokens": 1})
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["type"] == "Service Unavailable"
        assert err["code"] == 503
        assert err["param"] is None
    assert fleet[0].state()["counters"]["rejected_queue_full"] == 1


async def test_tokenize_counts_differ_from_chars_estimate(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=1, **FAST)
    url = fleet[0].url
    prose = (
        "Narwhals are medium-sized toothed whales that live year-round in the Arctic waters "
        "around Greenland, Canada and Russia. Their most conspicuous characteristic is a long, "
        "straight, helical tusk extending from the upper left jaw."
    )
    r = await client.post(f"{url}/tokenize", json={"model": DEFAULT_MODEL, "prompt": prose})
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["max_model_len"] == 8192
    assert body["token_strs"] is None
    assert body["count"] == len(body["tokens"])
    estimate = len(prose) / 3.8
    assert abs(body["count"] - estimate) / estimate > 0.08
    # The count is what a generation request is charged.
    gen = await client.post(f"{url}/v1/completions", json={"prompt": prose, "max_tokens": 1})
    assert gen.json()["usage"]["prompt_tokens"] == body["count"]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prose}]
    chat_tok = (await client.post(f"{url}/tokenize", json={"messages": msgs})).json()
    chat = await client.post(f"{url}/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == chat_tok["count"]
    # Template overhead: a few tokens per message beyond the contents.
    assert chat_tok["count"] > body["count"] - 1 + 3 + 2 * 4
    strs = (
        await client.post(f"{url}/tokenize", json={"prompt": "Hi there", "return_token_strs": True})
    ).json()
    assert strs["token_strs"] == ["<|begin_of_text|>", "Hi", " there"]


async def test_chat_tokenize_renders_what_the_completion_renders(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=1, **FAST)
    url = fleet[0].url
    msgs = [{"role": "user", "content": "Is it raining in Tromso?"}]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]

    async def counted(**extra: object) -> int:
        body = {"messages": msgs, **extra}
        tok = (await client.post(f"{url}/tokenize", json=body)).json()["count"]
        chat = await client.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 1})
        assert chat.json()["usage"]["prompt_tokens"] == tok
        return int(tok)

    plain = await counted()
    # The tool schemas go into the prompt, as a real template puts them.
    assert await counted(tools=tools) > plain + 20
    # The assistant header is 5 tokens; continuing the last message also drops its <|eot_id|>.
    assert await counted(add_generation_prompt=False) == plain - 5
    assert await counted(add_generation_prompt=False, continue_final_message=True) == plain - 6
    assert await counted(add_special_tokens=True) == plain + 1
    both = await client.post(
        f"{url}/tokenize", json={"messages": msgs, "continue_final_message": True}
    )
    assert both.status_code == 400
    assert both.json()["error"]["message"] == (
        "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
    )


async def test_health_models_version_metrics(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=2, build="build-42", **FAST)
    url = fleet[1].url
    r = await client.get(f"{url}/health")
    assert r.status_code == 200
    assert r.content == b""
    models = (await client.get(f"{url}/v1/models")).json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == DEFAULT_MODEL
    assert card["owned_by"] == "vllm"
    assert card["max_model_len"] == 8192
    assert card["permission"][0]["object"] == "model_permission"
    version = (await client.get(f"{url}/version")).json()
    assert version["build"] == "build-42"
    assert version["instance_id"] == fleet[1].instance_id
    await client.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 3})
    metrics = (await client.get(f"{url}/metrics")).text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:request_success_total",
        "vllm:nixl_num_kv_expired_reqs_total",
    ):
        assert name in metrics, name
    assert f'model_name="{DEFAULT_MODEL}"' in metrics
    assert 'engine="1"' in metrics
    assert 'vllm:request_success_total{engine="1",finished_reason="length"' in metrics
    assert "vllm:time_to_first_token_seconds_count" in metrics
    # Real vLLM's cache config gauge: capacity = num_gpu_blocks x block_size.
    assert (
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="False",'
        'engine="1",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="28125"} 1.0'
    ) in metrics
    assert json.loads((await client.get(f"{url}/_sim/state")).text)["engine"] == "1"
    # prometheus_client's process collector, as vLLM's default registry serves it.
    assert parse_load(metrics.encode(), "vllm").started_at == fleet[1].engine.started_at


async def test_stock_version_names_no_instance_and_sglang_has_no_process_metrics(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    for dialect in ("vllm", "sglang"):
        spec = SimEngineSpec(dialect=dialect, stock_version=True)
        fleet = await start_fleet(engines=1, spec=spec, **FAST)
        url = fleet[0].url
        version = await client.get(f"{url}/version")
        if dialect == "vllm":
            assert version.json() == {"version": ENGINE_VERSION[dialect]}
        else:
            # SGLang 0.5.23 has no /version: /get_server_info says it (below).
            assert (version.status_code, version.json()) == (404, {"detail": "Not Found"})
        metrics = (await client.get(f"{url}/metrics")).content
        started = parse_load(metrics, dialect).started_at
        # SGLang serves prometheus multiprocess mode: no process collector.
        assert started == (fleet[0].engine.started_at if dialect == "vllm" else None)
    info = (await client.get(f"{url}/get_server_info")).json()
    assert info["version"] == ENGINE_VERSION["sglang"]
    assert "instance_id" not in info
    assert "build" not in info


async def test_unknown_path_and_method(start_fleet: StartFleet, client: httpx.AsyncClient) -> None:
    fleet = await start_fleet(engines=1, **FAST)
    assert (await client.get(f"{fleet[0].url}/nope")).status_code == 404
    assert (await client.get(f"{fleet[0].url}/v1/completions")).status_code == 405


async def test_sse_payloads_helper_rejects_bad_framing() -> None:
    with pytest.raises(AssertionError):
        sse_payloads(b"data: x\n")


async def test_stream_interval_packs_tokens_into_events(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    # SGLang --stream-interval, and vLLM when its API server falls behind: one event
    # carries several tokens. The first token still goes out on its own.
    fleet = await start_fleet(engines=1, spec=SimEngineSpec(stream_interval=3), speed=5.0)
    options = {"include_usage": True}
    _, _, raw = await post_stream(
        client,
        f"{fleet[0].url}/v1/completions",
        {"prompt": "Hello", "max_tokens": 10, "stream": True, "stream_options": options},
    )
    *tokens, usage = sse_json(raw)
    first, *middle, last = [c["choices"][0]["text"].count(" ") for c in tokens]
    # At least 3 per event between the first and the last; more when the emitter itself
    # falls behind the steps (then the first may carry two).
    assert middle
    assert min(middle) >= 3
    assert first + sum(middle) + last == 10
    assert len(tokens) <= 4
    assert usage["usage"]["completion_tokens"] == 10
    with pytest.raises(ValueError, match="stream_interval"):
        SimEngineSpec(stream_interval=0)
