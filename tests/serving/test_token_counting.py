"""Prompt lengths from /tokenize: the count the router prices a request at is the one the
engine charges it (`usage.prompt_tokens`), and an estimate says why it is one.

The simulator renders tool schemas and the generation prompt into a chat prompt as a real
template does, and its SGLang /tokenize takes `messages` or refuses them as a newer or an
older SGLang build does, so a body that drops or adds what shapes the prompt shows up here
as a count that differs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from narwhal.sim import EngineHandle, SimEngineSpec, SimTiming

from ..support import wait_for
from .conftest import MODEL, Stack, StartStack
from .test_sglang import sglang_stack

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather at a place, in the unit the user prefers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string", "description": "City and country"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["location"],
            },
        },
    }
]
QUESTION = [{"role": "user", "content": "Is it raining in Tromso right now?"}]


def tokenize_bodies(handle: EngineHandle) -> list[dict[str, Any]]:
    """Record the /tokenize bodies this engine receives (it still answers them)."""
    bodies: list[dict[str, Any]] = []
    route = handle.engine._routes[("POST", "/tokenize")]

    async def recording(req: Any, resp: Any) -> None:
        bodies.append(json.loads(req.body))
        await route(req, resp)

    handle.engine._routes[("POST", "/tokenize")] = recording
    return bodies


async def priced_and_charged(stack: Stack, path: str, body: dict[str, Any]) -> tuple[int, int]:
    """(the prompt length Narwhal priced the request at, the engine's usage.prompt_tokens)."""
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.post(f"{stack.url}{path}", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    charged = response.json()["usage"]["prompt_tokens"]
    return stack.ctx.demand_events[-1].prompt_tokens, charged


async def test_a_chat_with_tools_is_counted_with_its_tool_schemas(
    start_stack: StartStack,
) -> None:
    stack = await start_stack(["prefill", "decode"])
    await tools_are_counted(stack, {"tool_choice": "auto"})
    assert (await stack.state())["requests"]["token_counts"] == {"exact": 2}


async def tools_are_counted(stack: Stack, fields: dict[str, Any]) -> None:
    """A chat is priced at what the engine charges, with and without tool schemas
    (`fields` go with the tools)."""
    plain = await priced_and_charged(
        stack, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2}
    )
    with_tools = await priced_and_charged(
        stack,
        "/v1/chat/completions",
        {"messages": QUESTION, "tools": TOOLS, **fields, "max_tokens": 2},
    )
    assert plain[0] == plain[1]
    assert with_tools[0] == with_tools[1]
    # The schemas outweigh the question: a count without them would be far off.
    assert with_tools[0] > 3 * plain[0]


async def test_a_chat_continuing_its_last_message_is_counted_as_rendered(
    start_stack: StartStack,
) -> None:
    stack = await start_stack(["prefill", "decode"])
    bodies = tokenize_bodies(stack.fleet[0])
    bodies += tokenize_bodies(stack.fleet[1])
    messages = [*QUESTION, {"role": "assistant", "content": "Let me check: it is"}]
    priced, charged = await priced_and_charged(
        stack,
        "/v1/chat/completions",
        {
            "messages": messages,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "chat_template_kwargs": {"enable_thinking": False},
            "max_tokens": 2,
        },
    )
    assert priced == charged
    assert bodies == [
        {
            "model": MODEL,
            "messages": messages,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "chat_template_kwargs": {"enable_thinking": False},
        }
    ]


PROSE = "tokenisation of ordinary english prose " * 10
# An SGLang build before /tokenize took chat messages (0.5.23's does).
OLDER_SGLANG = SimEngineSpec(dialect="sglang", tokenize_messages=False)


async def pd_stack(start_stack: StartStack, nursery: trio.Nursery, dialect: str) -> Stack:
    """A 1P1D fleet of `dialect` behind Narwhal."""
    if dialect == "sglang":
        return await sglang_stack(nursery)
    return await start_stack(["prefill", "decode"])


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_a_one_prompt_list_is_counted_exactly(
    start_stack: StartStack, nursery: trio.Nursery, dialect: str
) -> None:
    stack = await pd_stack(start_stack, nursery, dialect)
    priced, charged = await priced_and_charged(
        stack, "/v1/completions", {"prompt": [PROSE], "max_tokens": 2}
    )
    assert priced == charged
    assert (await stack.state())["requests"]["token_counts"] == {"exact": 1}


async def test_a_long_prompt_is_counted_exactly(start_stack: StartStack) -> None:
    # /tokenize lists every token id: 20,000 of them are some 140 KB of answer, which was
    # refused as too large and estimated (`bad_answer`): the prompts that cost most were
    # the ones priced by a ratio.
    stack = await start_stack(sim={"timing": SimTiming(max_model_len=32768)}, speed=200.0)
    words = " ".join(f"w{i}" for i in range(7_000))  # some 20,000 tokens
    priced, charged = await priced_and_charged(
        stack, "/v1/completions", {"prompt": words, "max_tokens": 2}
    )
    assert priced == charged > 15_000
    assert (await stack.state())["requests"]["token_counts"] == {"exact": 1}


async def chat(stack: Stack, **extra: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.post(
            f"{stack.url}/v1/chat/completions",
            json={"model": MODEL, "messages": QUESTION, "max_tokens": 2, **extra},
        )


def chat_asks(stack: Stack) -> list[int]:
    """The engines asked to count a chat from now on, in order (their index in the fleet);
    the list grows as they are asked."""
    asked: list[int] = []
    for index, handle in enumerate(stack.fleet):
        route = handle.engine._routes[("POST", "/tokenize")]

        async def recording(req: Any, resp: Any, index: int = index, route: Any = route) -> None:
            if "messages" in json.loads(req.body):
                asked.append(index)
            await route(req, resp)

        handle.engine._routes[("POST", "/tokenize")] = recording
    return asked


async def test_an_older_sglang_build_is_asked_about_chat_once(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    stack = await sglang_stack(nursery, OLDER_SGLANG)
    bodies = [tokenize_bodies(handle) for handle in stack.fleet]
    asked = chat_asks(stack)
    for _ in range(4):
        assert (await chat(stack)).status_code == 200
    async with httpx.AsyncClient(timeout=10) as client:
        await client.post(
            f"{stack.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
        )
        metrics = (await client.get(f"{stack.admin_url}/metrics")).text
    # Its /tokenize answers messages with 400 (`prompt` is required): each engine is asked
    # once, and once both have refused, chat requests are estimated without a round trip.
    assert asked == [0, 1]
    assert [b for per_engine in bodies for b in per_engine if "prompt" in b] == [
        {"model": MODEL, "prompt": "hi"}
    ]
    requests = (await stack.state())["requests"]
    assert requests["token_counts"] == {"exact": 1, "fallback": 4}
    assert requests["token_count_fallbacks"] == {"unsupported": 4}
    assert set(requests["tokenize_chat_refused"]) == {"p0", "d1"}  # seconds since learnt
    assert 'narwhal_token_count_fallbacks_total{reason="unsupported"} 4.0' in metrics
    refusals = [r for r in caplog.records if getattr(r, "event", "") == "tokenize_chat_refused"]
    assert [getattr(r, "engine", "") for r in refusals] == ["p0", "d1"]
    assert (
        refusals[0]
        .getMessage()
        .startswith("engine p0 counts no chat messages: its /tokenize refused them (HTTP 400)")
    )


async def test_an_sglang_chat_refusal_is_forgotten_when_the_engine_may_have_changed(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    path = tmp_path / "narwhal.json"
    stack = await sglang_stack(nursery, OLDER_SGLANG, config_path=path)
    asked = chat_asks(stack)
    for _ in range(3):
        await chat(stack)
    assert asked == [0, 1]
    # Out of placement (drained, ejected, held after a restart) and back: asked again.
    p0 = stack.ctx.fleet.get("p0")
    assert p0 is not None
    p0.operator_drain()
    await chat(stack)  # no prefill engine; counted (estimated) before that fails
    p0.operator_undrain()
    await chat(stack)
    assert asked == [0, 1, 0]
    # A reload forgets every refusal.
    assert (await stack.supervisor.reload()).applied
    assert (await stack.state())["requests"]["tokenize_chat_refused"] == {}
    for _ in range(3):
        await chat(stack)
    assert asked == [0, 1, 0, 0, 1]


async def test_a_newer_sglang_build_counts_chat_exactly(nursery: trio.Nursery) -> None:
    stack = await sglang_stack(nursery)
    bodies = [tokenize_bodies(handle) for handle in stack.fleet]
    await tools_are_counted(stack, {"reasoning_effort": "low"})
    assert [b for per_engine in bodies for b in per_engine] == [
        {"model": MODEL, "messages": QUESTION},
        {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "reasoning_effort": "low"},
    ]
    requests = (await stack.state())["requests"]
    assert requests["token_counts"] == {"exact": 2}
    assert requests["token_count_fallbacks"] == {}


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_a_prompt_without_special_tokens_is_counted_as_charged(
    start_stack: StartStack, nursery: trio.Nursery, dialect: str
) -> None:
    stack = await pd_stack(start_stack, nursery, dialect)
    bare = await priced_and_charged(
        stack,
        "/v1/completions",
        {"prompt": PROSE, "add_special_tokens": False, "max_tokens": 2},
    )
    usual = await priced_and_charged(stack, "/v1/completions", {"prompt": PROSE, "max_tokens": 2})
    assert bare[0] == bare[1]
    assert usual[0] == usual[1]
    # vLLM leaves the BOS out when asked to; SGLang's completions always add it.
    assert usual[1] - bare[1] == (1 if dialect == "vllm" else 0)


async def test_a_fallback_names_a_failed_tokenize(start_stack: StartStack) -> None:
    stack = await start_stack(["prefill", "decode"], engine={"tokenize_timeout_s": 0.2})
    held = trio.Event()

    async def failing(req: Any, resp: Any) -> None:
        await resp.send_json(500, {"error": {"message": "boom", "code": 500}})

    async def hanging(req: Any, resp: Any) -> None:
        await held.wait()

    async def ask() -> float:
        started = trio.current_time()
        async with httpx.AsyncClient(timeout=10) as client:
            response = await client.post(
                f"{stack.url}/v1/completions",
                json={"model": MODEL, "prompt": "x" * 38, "max_tokens": 1},
            )
        assert response.status_code == 200
        return trio.current_time() - started

    elapsed = {}
    for route in (failing, hanging):
        for handle in stack.fleet:
            handle.engine._routes[("POST", "/tokenize")] = route
        elapsed[route] = await ask()
    held.set()
    # engine.tokenize_timeout_s bounds the wait for a hanging /tokenize.
    assert 0.2 <= elapsed[hanging] < 2.0
    requests = (await stack.state())["requests"]
    assert requests["token_counts"] == {"fallback": 2}
    assert requests["token_count_fallbacks"] == {"engine_error": 1, "timeout": 1}
    assert stack.ctx.demand_events[-1].prompt_tokens == 10  # 38 chars at 3.8 a token


async def test_an_estimate_in_flight_shows_its_reason(nursery: trio.Nursery) -> None:
    stack = await sglang_stack(nursery, OLDER_SGLANG)
    for handle in stack.fleet:
        handle.set_faults(stall_before_first_token_s=30)

    async def ask() -> None:
        async with httpx.AsyncClient(timeout=10) as client:
            await client.post(
                f"{stack.url}/v1/chat/completions",
                json={"model": MODEL, "messages": QUESTION, "max_tokens": 2},
            )

    async with trio.open_nursery() as inner:
        inner.start_soon(ask)
        await wait_for(
            lambda: any(
                r.stage not in ("reading", "tokenizing") for r in stack.ctx.records.values()
            )
        )
        (listed,) = (await stack.state())["requests"]["in_flight"]
        inner.cancel_scope.cancel()
    assert listed["token_count_method"] == "fallback"
    assert listed["token_count_fallback"] == "unsupported"


async def test_an_sglang_chat_estimate_includes_its_tool_schemas(nursery: trio.Nursery) -> None:
    stack = await sglang_stack(nursery, OLDER_SGLANG)
    plain = await priced_and_charged(
        stack, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2}
    )
    with_tools = await priced_and_charged(
        stack, "/v1/chat/completions", {"messages": QUESTION, "tools": TOOLS, "max_tokens": 2}
    )
    assert (await stack.state())["requests"]["token_count_fallbacks"] == {"unsupported": 2}
    chars = len(QUESTION[0]["content"])
    assert plain[0] == math.ceil(chars / 3.8)
    # Still an estimate at engine.chars_per_token, but of the schemas too, which are
    # most of this prompt (JSON is denser in tokens than prose, so it stays low).
    assert with_tools[0] == math.ceil((chars + len(json.dumps(TOOLS))) / 3.8)
    assert with_tools[0] > 5 * plain[0]
    assert with_tools[1] > with_tools[0]
