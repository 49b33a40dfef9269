"""A hostile client beside honest ones (issue 29, item 4): one address keeps more slow
POSTs open than the router retains, each a body that never ends, and opens another as
soon as one is answered, while other clients (another loopback address) send ordinary
requests. The others are all served, the hostile client gets well-formed refusals and
timeouts, and nothing stays held."""

from __future__ import annotations

from functools import partial

import trio

from ..support import wait_for
from .campaign import StartCampaign

OTHER = "127.0.0.2"
CEILING = 16
# An eighth of the ceiling, at least 8: serving.max_pending_bodies_per_client's default.
PENDING_PER_CLIENT = 8
HOSTILE = {"error:body_timeout", "error:pending_bodies_per_client"}


async def test_a_slowloris_that_reconnects_does_not_lock_out_the_other_clients(
    start: StartCampaign,
) -> None:
    c = await start(
        "slowloris",
        ["prefill", "decode"],
        serving={"max_connections": CEILING, "body_timeout_s": 1.0},
    )
    ctx = c.stack.ctx

    async def hostile(i: int) -> None:
        ex = await c.send(i, c.body(stream=False), label="hostile", stall_body=True)
        if ex.status == 429:
            # Back at the Retry-After it was given: what a well-behaved retrying client
            # does too, and enough to keep the bodies it may have at its limit.
            await trio.sleep(float(ex.headers["retry-after"]))

    async def other(i: int) -> None:
        await c.send(i, c.body(stream=i % 2 == 0), label="other", local_address=OTHER)

    async with trio.open_nursery() as nursery:
        # Half again as many slow POSTs as the router retains at once, for three
        # body timeouts.
        nursery.start_soon(partial(c.run, 1000, hostile, concurrency=CEILING * 3 // 2, within_s=3))
        await wait_for(lambda: ctx.retained >= PENDING_PER_CLIENT)
        await c.run(40, other, concurrency=4, within_s=20)
    report = await c.check()
    report.assert_ok()
    labels: dict[str, dict[str, int]] = {"hostile": {}, "other": {}}
    for ex in c.exchanges:
        seen = labels[ex.label]
        seen[c.label_of(ex)] = seen.get(c.label_of(ex), 0) + 1
    assert labels["other"] == {"ok": 40}
    assert set(labels["hostile"]) == HOSTILE, labels
    refused = ctx.pending_bodies.statistics().refused
    assert refused == labels["hostile"]["error:pending_bodies_per_client"]
