"""The official `openai` client parses everything the simulator sends."""

from __future__ import annotations

from typing import Any

import openai
import trio

from narwhal.sim import DEFAULT_MODEL

from ..support import StartFleet


def _exercise(base_url: str) -> dict[str, Any]:
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=10)
    try:
        out: dict[str, Any] = {}
        comp = client.completions.create(
            model=DEFAULT_MODEL, prompt="Once upon a time", max_tokens=5
        )
        out["completion"] = (
            comp.choices[0].text,
            comp.choices[0].finish_reason,
            comp.usage.completion_tokens if comp.usage else None,
        )
        chat = client.chat.completions.create(
            model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        out["chat"] = (
            chat.choices[0].message.content,
            chat.choices[0].finish_reason,
            chat.usage.completion_tokens if chat.usage else None,
        )
        texts = []
        usage = None
        for chunk in client.completions.create(
            model=DEFAULT_MODEL,
            prompt="Once",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        ):
            if chunk.choices:
                texts.append(chunk.choices[0].text)
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        out["completion_stream"] = ("".join(texts), usage)
        deltas = []
        roles = []
        finish = None
        for c in client.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=6,
            stream=True,
        ):
            choice = c.choices[0]
            roles.append(choice.delta.role)
            deltas.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
        out["chat_stream"] = ("".join(deltas), roles[0], finish)
        try:
            client.completions.create(model="nope", prompt="x")
        except openai.NotFoundError as exc:
            out["not_found"] = exc.status_code
        return out
    finally:
        client.close()


async def test_openai_client_parses_sim_responses(start_fleet: StartFleet) -> None:
    fleet = await start_fleet(engines=1, speed=20.0)
    out = await trio.to_thread.run_sync(_exercise, f"{fleet[0].url}/v1")
    text, finish, used = out["completion"]
    assert len(text.split()) == 5
    assert (finish, used) == ("length", 5)
    content, finish, used = out["chat"]
    assert len(content.split()) == 4
    assert (finish, used) == ("length", 4)
    text, usage = out["completion_stream"]
    assert len(text.split()) == 6
    assert usage == 6
    text, role, finish = out["chat_stream"]
    assert len(text.split()) == 6
    assert (role, finish) == ("assistant", "length")
    assert out["not_found"] == 404
