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
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

from ..support import sse_payloads
from .engines import MODEL_NAME, Engine, sample
from .pacer import send_signal as _signal

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


class Pacer:
    """Model processes let run `on_s` and stopped (SIGSTOP) `off_s` in turn by a child
    process at real-time priority (`pacer.py`), from `start` until `halt`, which leaves
    them stopped.

    Not by the test process: while a real engine generates, this box leaves other
    processes of its priority unscheduled for up to half a second, and in CI a pacer in
    the test process let a 1500-token stream be made in one "2 ms" step."""

    def __init__(self, pids: list[int], *, on_s: float, off_s: float) -> None:
        self.pids = pids
        self._argv = [sys.executable, str(_PACER), str(on_s), str(off_s), *map(str, pids)]
        self._child: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        _signal(self.pids, signal.SIGSTOP)  # stopped until the child takes over
        self._child = subprocess.Popen(self._argv)

    def halt(self) -> None:
        """Stop pacing, the processes stopped; blocks until the child has exited (at
        most one `on_s` slice after the SIGTERM)."""
        child, self._child = self._child, None
        if child is None:
            return
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        _signal(self.pids, signal.SIGSTOP)  # whatever the child did last


_PACER = Path(__file__).with_name("pacer.py")


@asynccontextmanager
async def stepping(
    pids: list[int], *, step_s: float = 0.002, rest_s: float = 0.05
) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """Model processes stopped (SIGSTOP) and let run `step_s` at a time, every `rest_s`
    (`Pacer`), so a stream advances by the few tokens a step makes (0-30 here for 2 ms)
    however slowly the client reads. Yields `halt`: stop stepping and leave them
    stopped. All are continued at the end.

    `Throttle`'s share of each period bounds nothing on this box: the tiny model makes a
    1500-token stream in well under a second of CPU, and with vLLM's core paced at 1 %
    the whole stream was made by the client's third event."""
    pacer = Pacer(pids, on_s=step_s, off_s=rest_s)

    async def halt() -> None:
        await trio.to_thread.run_sync(pacer.halt)

    pacer.start()
    try:
        yield halt
    finally:
        await trio.to_thread.run_sync(pacer.halt)
        _signal(pids, signal.SIGCONT)


class Throttle:
    """Model processes (vLLM's EngineCore, SGLang's scheduler) let run for `share` of each
    `period_s` and stopped (SIGSTOP) for the rest (`Pacer`).

    The tiny model makes a whole 1500-token stream in a few seconds, and a test staged at
    a stream's third event must find it still in progress. Neither a lower CPU priority
    nor retries were enough: in CI every attempt finished before the client read three
    events. Throttled, the box's CPU goes to Narwhal and the client; but a share of each
    period bounds the tokens made less than it seems (vLLM's model runs in a worker the
    core feeds, and a few ms make dozens of tokens), so a test that must catch a stream
    unfinished steps the model instead (`stepping`). While stopped, the API servers still answer (metrics,
    aborts); the cores take what arrived first when continued."""

    def __init__(self, pids: list[int], *, share: float = 0.2, period_s: float = 0.1) -> None:
        self._pids = pids
        self._pacer = Pacer(pids, on_s=period_s * share, off_s=period_s * (1 - share))

    def __enter__(self) -> Throttle:
        self._pacer.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._pacer.halt()
        _signal(self._pids, signal.SIGCONT)

    @contextmanager
    def stopped(self, *others: int) -> Iterator[None]:
        """Stopped for the block, with `others` too, then running at full speed: pacing
        does not resume. Stop an engine's API server with its core to hold a stream
        where it is: on this box vLLM's API server, not its core, sets a tiny model's
        pace, and it streams out what the core made before the stop (1000 tokens took
        1.7 s with the core paced at a fifth and free alike, 900 of them in one burst)."""
        self._pacer.halt()
        _signal(list(others), signal.SIGSTOP)
        try:
            yield
        finally:
            _signal([*self._pids, *others], signal.SIGCONT)
