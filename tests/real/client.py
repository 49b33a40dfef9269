"""What the real-engine tests ask the engines directly: token counts, exact-length prompts,
counters from /metrics, and SSE bodies read with their framing checked.

Every call is async (httpx) so that it never blocks the in-process Narwhal sharing the
test's event loop, and bounded by its client's timeout.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from ..support import sse_payloads
from .engines import MODEL_NAME, Engine, sample

MODEL = MODEL_NAME
TIMEOUT_S = 120.0
_serial = itertools.count()

# Words of the tokenizer's own training text (Python sources): they tokenize densely and
# deterministically. A serial and the pid lead every prompt, so no two prompts of a run
# share a first KV block and prefix caching never serves one from another.
_WORDS = [
    "def",
    "return",
    "import",
    "class",
    "self",
    "value",
    "result",
    "raise",
    "except",
    "finally",
    "while",
    "yield",
    "lambda",
    "assert",
    "global",
    "with",
    "open",
    "read",
    "write",
    "path",
    "name",
    "items",
    "append",
    "format",
    "string",
    "number",
    "list",
    "dict",
    "tuple",
    "error",
    "module",
    "object",
    "function",
    "method",
    "default",
]


def unique_text(words: int) -> str:
    serial = next(_serial)
    body = " ".join(_WORDS[(serial * 7 + i * 13) % len(_WORDS)] for i in range(words))
    return f"# request {os.getpid()}-{serial}\n{body}\n"


async def post_json(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = await client.post(url, json=body)
    assert answer.status_code == 200, f"{url}: HTTP {answer.status_code}: {answer.text}"
    document: dict[str, Any] = answer.json()
    return document


async def token_count(engine: Engine, **body: Any) -> int:
    """The engine's own count of a prompt (`prompt=`) or a chat (`messages=`)."""
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
        answer = await post_json(client, f"{engine.url}/tokenize", {"model": MODEL, **body})
    return int(answer["count"])


async def prompt_of(engine: Engine, tokens: int) -> str:
    """A fresh text prompt that the engine counts as exactly `tokens` tokens."""
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
        text = unique_text(tokens)
        ids = (await post_json(client, f"{engine.url}/tokenize", {"model": MODEL, "prompt": text}))[
            "tokens"
        ]
        assert len(ids) >= tokens, f"{len(ids)} tokens in a text meant to have more"
        take = tokens
        # Decoding a prefix and encoding it again can merge tokens at the cut: adjust.
        for _ in range(8):
            detok = f"{engine.url}/detokenize"
            cut = (await post_json(client, detok, {"model": MODEL, "tokens": ids[:take]}))["prompt"]
            count = (
                await post_json(client, f"{engine.url}/tokenize", {"model": MODEL, "prompt": cut})
            )["count"]
            if count == tokens:
                return str(cut)
            take += tokens - count
    raise AssertionError(f"no prompt of exactly {tokens} tokens in 8 tries")


async def chat_of(engine: Engine, tokens: int) -> list[dict[str, str]]:
    """Fresh chat messages that the engine counts, template included, as `tokens`."""
    empty = await token_count(engine, messages=[{"role": "user", "content": ""}])
    content_tokens = tokens - empty
    for _ in range(8):
        messages = [{"role": "user", "content": await prompt_of(engine, content_tokens)}]
        count = await token_count(engine, messages=messages)
        if count == tokens:
            return messages
        content_tokens += tokens - count
    raise AssertionError(f"no chat of exactly {tokens} tokens in 8 tries")


async def scrape(engine: Engine) -> str:
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
        answer = await client.get(f"{engine.url}/metrics")
    answer.raise_for_status()
    return answer.text


async def counter(engine: Engine, name: str, **labels: str) -> float:
    return sample(await scrape(engine), name, **labels)


def sse_events(raw: bytes) -> list[dict[str, Any]]:
    """An SSE body's JSON events, asserting vLLM's framing (`data: X` + blank line, one
    line each) and that the body ends with exactly one `data: [DONE]`."""
    payloads = sse_payloads(raw)
    assert payloads[-1] == "[DONE]", payloads[-3:]
    assert payloads.count("[DONE]") == 1, payloads
    return [json.loads(p) for p in payloads[:-1]]


def streamed_text(events: list[dict[str, Any]], *, chat: bool = False) -> str:
    parts = []
    for event in events:
        for choice in event["choices"]:
            if chat:
                parts.append(choice["delta"].get("content") or "")
            else:
                parts.append(choice["text"])
    return "".join(parts)


def finish_reasons(events: list[dict[str, Any]]) -> list[str]:
    return [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]


@contextmanager
def stopped_cores(engines: list[Engine]) -> Iterator[None]:
    """The engines' cores stopped (SIGSTOP) for the block: their API servers still answer
    and take aborts, which their cores then process first when continued (SIGCONT)."""
    cores = [engine.engine_core_pid() for engine in engines]
    try:
        for core in cores:
            os.kill(core, signal.SIGSTOP)
        yield
    finally:
        for core in cores:
            try:
                os.kill(core, signal.SIGCONT)
            except ProcessLookupError:
                pass  # killed meanwhile


@contextmanager
def yielding_cores(engines: list[Engine]) -> Iterator[None]:
    """The engines' cores at the lowest CPU priority for the block (nice 19).

    The tiny model makes a whole 1500-token stream in a second or two; on a two-core box
    whose other core the rest of the fleet keeps busy, the test process and Narwhal could
    wait that long for a turn, and the client then read its first events only after the
    engine had finished (a fault test staged at the third event had nothing to stop). A
    core that yields the CPU to them keeps the stream in progress while they read."""
    cores = [engine.engine_core_pid() for engine in engines]
    before = {}
    try:
        for core in cores:
            before[core] = os.getpriority(os.PRIO_PROCESS, core)
            os.setpriority(os.PRIO_PROCESS, core, 19)
        yield
    finally:
        for core, niceness in before.items():
            try:
                os.setpriority(os.PRIO_PROCESS, core, niceness)
            except ProcessLookupError:
                pass  # killed meanwhile
