"""engine.tokenizer_path: the router counts prompts with the model's own tokenizer, without
the engines' /tokenize, and leaves to /tokenize, counted by reason, what it cannot count as
the engine does.

The simulator has a tokenizer of its own, so counts here are held to the `tokenizers`
library's encoding of the text the engine tokenises; tests/real/test_vllm_local_tokens.py
holds them to a real vLLM engine's usage.prompt_tokens.
"""

from __future__ import annotations

import json
import re
import threading
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from tokenizers import Tokenizer

from narwhal.config import load_config_file
from narwhal.serving._tokens import LOCAL_COUNT_INLINE_CHARS
from narwhal.sim import Fleet, serve_fleet
from narwhal.supervisor import Supervisor
from narwhal.tokenizer import LocalTokenizer

from ..support import FakeFileLimit
from ..tokenizer.model import write_model
from .conftest import MODEL, Stack, StartStack, fleet_config
from .test_failures import settled
from .test_token_counting import QUESTION, TOOLS, priced_and_charged, tokenize_bodies

CHATML_QUESTION = "<|im_start|>user\nIs it raining in Tromso right now?<|im_end|>\n"
PROMPT = "def count(prompt):\n    return len(tokenizer.encode(prompt))\n"


def encoded(folder: Path, text: str, *, special: bool) -> int:
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return len(tokenizer.encode(text, add_special_tokens=special).ids)


async def priced(stack: Stack, path: str, body: dict[str, Any]) -> int:
    return (await priced_and_charged(stack, path, body))[0]


async def test_prompts_are_counted_in_the_router_without_asking_the_engines(
    start_stack: StartStack, tmp_path: Path
) -> None:
    model = write_model(tmp_path / "model")
    stack = await start_stack(engine={"tokenizer_path": str(model)})
    asked = tokenize_bodies(stack.fleet[0])
    asked += tokenize_bodies(stack.fleet[1])
    completion = {"prompt": PROMPT, "max_tokens": 2}
    assert await priced(stack, "/v1/completions", completion) == encoded(
        model, PROMPT, special=True
    )
    chat = {"messages": QUESTION, "max_tokens": 2}
    assert await priced(stack, "/v1/chat/completions", chat) == encoded(
        model, CHATML_QUESTION + "<|im_start|>assistant\n", special=False
    )
    assert asked == []
    state = await settled(stack)
    assert state["requests"]["token_counts"] == {"local": 2}
    assert state["requests"]["token_count_local_misses"] == {}
    assert state["requests"]["context_checks"] == {"passed": 2}
    assert 'narwhal_token_counts_total{method="local"} 2.0' in await stack.metrics()


async def test_a_chat_it_cannot_render_as_vllm_does_is_counted_by_tokenize(
    start_stack: StartStack, tmp_path: Path
) -> None:
    stack = await start_stack(engine={"tokenizer_path": str(write_model(tmp_path / "model"))})
    asked = tokenize_bodies(stack.fleet[0])
    asked += tokenize_bodies(stack.fleet[1])
    body = {"messages": QUESTION, "tools": TOOLS, "max_tokens": 2}
    priced_at, charged = await priced_and_charged(stack, "/v1/chat/completions", body)
    # The engine's own count, as without a tokenizer in the router.
    assert priced_at == charged
    assert [b["tools"] for b in asked] == [TOOLS]
    state = await settled(stack)
    assert state["requests"]["token_counts"] == {"exact": 1}
    assert state["requests"]["token_count_local_misses"] == {"fields": 1}
    assert 'narwhal_token_count_local_misses_total{reason="fields"} 1.0' in await stack.metrics()


async def test_the_context_check_and_truncation_take_the_local_count(
    start_stack: StartStack, tmp_path: Path
) -> None:
    model = write_model(tmp_path / "model")
    stack = await start_stack(engine={"tokenizer_path": str(model)})
    long = "The router counts every prompt before it admits the request. " * 1500
    assert encoded(model, long, special=True) > 8192
    async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
        refused = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": long, "max_tokens": 1}
        )
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "input_tokens")
    assert f"{encoded(model, long, special=True)} input tokens" in error["message"]
    kept = {"prompt": long, "truncate_prompt_tokens": 1000, "max_tokens": 2}
    assert await priced_and_charged(stack, "/v1/completions", kept) == (1000, 1000)
    state = await settled(stack)
    assert state["requests"]["token_counts"] == {"local": 2}
    assert state["requests"]["context_checks"] == {"passed": 1, "refused": 1}


async def test_a_reload_reads_the_tokenizer_again_and_refuses_a_broken_one(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    fleet: Fleet = await nursery.start(partial(serve_fleet, engines=2, speed=20.0, model=MODEL))
    model = write_model(tmp_path / "model", template=None)
    path = tmp_path / "narwhal.json"
    # Relative to the configuration file's folder, as every path setting is.
    document = fleet_config(fleet, ["prefill", "decode"], engine={"tokenizer_path": "model"})
    path.write_text(json.dumps(document))
    config = load_config_file(path)
    supervisor: Supervisor = await nursery.start(
        Supervisor(config, config_path=str(path), open_files=FakeFileLimit().limit()).run
    )
    stack = Stack(fleet, supervisor, config)
    chat = {"messages": QUESTION, "max_tokens": 2}
    await priced(stack, "/v1/chat/completions", chat)
    assert (await stack.state())["requests"]["token_count_local_misses"] == {"no_template": 1}

    # A template beside it now: the reload loads it, and says the files changed.
    (model / "chat_template.jinja").write_text(
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    )
    result = await supervisor.reload()
    assert result.applied
    assert result.plan is not None
    [change] = result.plan.summary()
    assert re.fullmatch(
        r'engine\.tokenizer_path: "sha256:[0-9a-f]{12}" -> "sha256:[0-9a-f]{12}"', change
    )
    chatml = encoded(model, CHATML_QUESTION, special=False)
    assert (
        await priced(stack, "/v1/chat/completions", {**chat, "add_generation_prompt": False})
        == chatml
    )

    # A broken file: refused with the setting named, and the running tokenizer counts on.
    (model / "tokenizer.json").write_text("{}")
    refused = await supervisor.reload()
    assert not refused.applied
    [error] = refused.errors
    assert error.startswith(
        f'engine.tokenizer_path: "{model}/tokenizer.json": not a tokenizer the tokenizers '
        "library reads: "
    )
    assert (
        await priced(stack, "/v1/chat/completions", {**chat, "add_generation_prompt": False})
        == chatml
    )
    state = await settled(stack)
    assert state["requests"]["token_counts"] == {"exact": 1, "local": 2}


async def test_a_long_prompt_is_counted_off_the_event_loop(
    start_stack: StartStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = write_model(tmp_path / "model")
    stack = await start_stack(engine={"tokenizer_path": str(model)})
    threads: list[int] = []
    ids = LocalTokenizer.ids

    def spied(self: LocalTokenizer, *args: Any) -> list[int] | str:
        threads.append(threading.get_ident())
        return ids(self, *args)

    monkeypatch.setattr(LocalTokenizer, "ids", spied)
    short = PROMPT
    long = PROMPT * (LOCAL_COUNT_INLINE_CHARS // len(PROMPT) + 1)
    for prompt in (short, long):
        body = {"prompt": prompt, "max_tokens": 2}
        assert await priced(stack, "/v1/completions", body) == encoded(model, prompt, special=True)
    loop = threading.get_ident()
    assert threads[0] == loop  # a short prompt costs less than the hand-off
    assert threads[1] != loop
