"""Client disconnects at every stage of a request: reading the body, tokenising,
queued for admission, during prefill, waiting for the KV handoff, and during decode
(streaming and not).

Each round holds one request at its stage (the engine side is slowed or stalled, or
the only slot is taken by a stalled stream; the router itself is never touched), hangs
up there, and the campaign then checks every invariant: the leg that was running
ended `aborted` at the engine, nothing that had not started reached an engine, and
nothing is left held (a handoff's KV lease included: it must expire).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest
import trio

from narwhal.sim import EngineHandle

from .campaign import Campaign, StartCampaign
from .client import Exchange, HangUp, after_events

PREFILL, DECODE = 0, 1
STAGES = ("reading", "tokenizing", "queued", "prefill", "handoff", "decode", "decode-json")


def scale(ci: int, long: int) -> list[Any]:
    return [pytest.param(ci, id="ci"), pytest.param(long, id="long", marks=pytest.mark.slow)]


def hold_tokenize(handle: EngineHandle) -> set[str]:
    """Make this engine's /tokenize hang (a slow tokenizer); returns the set of request
    ids that reached it. The router closing its connection ends the handler."""
    seen: set[str] = set()

    async def slow(req: Any, resp: Any) -> None:
        seen.add(req.headers.get("x-request-id", ""))
        await trio.sleep_forever()

    handle.engine._routes[("POST", "/tokenize")] = slow
    return seen


@asynccontextmanager
async def blocker(c: Campaign, nursery: trio.Nursery) -> AsyncIterator[None]:
    """A stream stalled after its first token holds the only admission and decode slot
    until the block ends; then its client hangs up (its decode leg must be aborted)."""
    release = trio.Event()
    c.fleet[DECODE].set_faults(stall_after_tokens=1, leg="decode", count=1)

    async def hang_up(ex: Exchange) -> str:
        await release.wait()
        return "blocker done"

    body = c.body(stream=True, max_tokens=50)
    nursery.start_soon(partial(c.send, -1, body, label="blocker abort:decode", hang_up=hang_up))
    await trio.testing.wait_all_tasks_blocked()
    (blocking,) = [e for e in c.exchanges if e.label.startswith("blocker")]
    with trio.fail_after(10):
        while not blocking.events():
            await blocking.wait_changed()
    try:
        yield
    finally:
        release.set()


def arrived(c: Campaign, index: int, phase: str) -> Callable[[], bool]:
    """The current round's leg has reached the engine (rounds run one at a time)."""

    def check() -> bool:
        requests = c.fleet[index].state(outcomes=0)["counters"]["requests"][phase]
        return bool(requests >= c.sent)

    return check


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("rounds", scale(3, 40))
async def test_disconnect_at_every_stage(
    start: StartCampaign, nursery: trio.Nursery, stage: str, rounds: int
) -> None:
    sections: dict[str, Any] = {}
    # The blocker's stream is stalled on purpose: only its client may end it.
    patient = {"request_timeout_s": 60.0}
    if stage == "queued":
        sections = {
            "engine": {"decode_read_timeout_s": 0},
            "serving": {
                **patient,
                "max_connections": 1,
                "queue_capacity": 4,
                "queue_timeout_s": 3,
                "prefill_concurrency": 1,
                "decode_concurrency": 1,
            },
        }
    elif stage == "handoff":
        sections = {
            "engine": {"decode_read_timeout_s": 0},
            "serving": {**patient, "decode_concurrency": 1, "handoff_timeout_s": 30.0},
        }
    c = await start(f"gone-{stage}", ["prefill", "decode"], seed=11, **sections)
    ctx = c.stack.ctx
    send_kw: dict[str, Any] = {}
    label = stage
    hang_up: HangUp
    if stage == "reading":
        # A slow uploader that gives up half-way through its body.
        send_kw = {"body_pieces": 8, "body_pause_s": 0.05}
        hang_up = c.at_stage("reading")
    elif stage == "tokenizing":
        seen = [hold_tokenize(handle) for handle in c.fleet]
        hang_up = c.at_stage(
            "tokenizing", lambda: any(c.exchanges[-1].request_id in ids for ids in seen)
        )
    elif stage == "queued":
        hang_up = c.at_stage("queued", lambda: ctx.gate.statistics().waiting == 1)
    elif stage == "prefill":
        c.fleet[PREFILL].set_faults(stall_before_first_token_s=30, leg="prefill")
        label = "prefill abort:prefill"
        hang_up = c.at_stage("prefill", arrived(c, PREFILL, "prefill"))
    elif stage == "handoff":
        hang_up = c.at_stage("handoff")
    elif stage == "decode":
        c.fleet[DECODE].set_faults(stall_after_tokens=2, leg="decode")
        label = "decode abort:decode"
        hang_up = after_events(1)  # one event may carry both tokens
    else:  # a non-streaming request, gone while its decode leg runs
        c.fleet[DECODE].set_faults(stall_before_first_token_s=30, leg="decode")
        label = "decode abort:decode"
        hang_up = c.at_stage("decode", arrived(c, DECODE, "decode"))

    async def plan(i: int) -> None:
        body = c.body(stream=stage != "decode-json", max_tokens=20)
        await c.send(i, body, label=label, hang_up=hang_up, **send_kw)

    if stage in ("queued", "handoff"):
        async with blocker(c, nursery):
            await c.run(rounds, plan, concurrency=1, within_s=60)
    else:
        await c.run(rounds, plan, concurrency=1, within_s=60)
    report = await c.check()
    report.assert_ok()
    mine = [ex for ex in c.exchanges if not ex.label.startswith("blocker")]
    assert len(mine) == rounds
    assert [c.label_of(ex) for ex in mine] == ["hung_up"] * rounds
    outcomes = report.checks["accounted"].notes["router_outcomes"]
    assert outcomes == {"client_disconnected": len(c.exchanges)}, outcomes
    legs: dict[str, list[dict[str, Any]]] = {}
    for state in c.engine_states():
        for entry in state["outcomes"]:
            legs.setdefault(entry["request_id"], []).append(entry)
    for ex in mine:
        mine_legs = [(leg["phase"], leg["outcome"]) for leg in legs.get(ex.request_id, [])]
        if stage in ("reading", "tokenizing", "queued"):
            assert mine_legs == [], stage  # nothing reached an engine
        elif stage == "prefill":
            assert mine_legs == [("prefill", "aborted")]
        elif stage == "handoff":
            assert mine_legs == [("prefill", "ok")]  # its KV lease expired (checked)
        else:
            assert mine_legs == [("prefill", "ok"), ("decode", "aborted")]
