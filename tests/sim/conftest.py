from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import httpx
import pytest
import trio

from narwhal.sim import Fleet, serve_fleet

StartFleet = Callable[..., Awaitable[Fleet]]


@pytest.fixture
def start_fleet(nursery: trio.Nursery) -> StartFleet:
    async def start(**kwargs: Any) -> Fleet:
        fleet: Fleet = await nursery.start(partial(serve_fleet, **kwargs))
        return fleet

    return start


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0) as c:
        yield c


async def wait_for(predicate: Callable[[], bool], *, timeout: float = 5.0) -> None:
    """Bounded polling of the simulator's own state, for the few waits no event covers."""
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.005)


def sse_payloads(raw: bytes) -> list[str]:
    """Split an SSE body into its `data:` payloads, asserting vLLM's exact framing."""
    text = raw.decode()
    assert text.endswith("\n\n"), text[-80:]
    events = text[:-2].split("\n\n")
    out = []
    for event in events:
        assert event.startswith("data: "), event
        assert "\n" not in event, event
        out.append(event[len("data: ") :])
    return out


def sse_json(raw: bytes) -> list[Any]:
    payloads = sse_payloads(raw)
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


async def post_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], **kw: Any
) -> tuple[int, dict[str, str], bytes]:
    async with client.stream("POST", url, json=body, **kw) as resp:
        data = b"".join([chunk async for chunk in resp.aiter_raw()])
        return resp.status_code, dict(resp.headers), data
