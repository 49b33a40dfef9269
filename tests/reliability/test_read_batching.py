"""Token intervals when the router reads several events at once.

A router that falls behind (a busy event loop) finds several events waiting in one read.
They arrived over the time since the previous read, so they share it; timing each by
its read alone gave the first the whole wait and the others zero, which the decode
correction (positive gaps only) saw as an engine several times slower than it is.
"""

from __future__ import annotations

import trio

from ..support import GapRecorder
from . import hostile
from .campaign import StartCampaign, start_beside_hostile

PACE_S = 0.03
PER_READ = 3
READS = 6


async def batched_tokens(leg: hostile.Leg, wire: hostile.Wire) -> None:
    """One token, then PER_READ tokens in one write every PACE_S, then the usage chunk."""
    await wire.send(hostile.SSE_HEAD + hostile.chunk(hostile.token_event()))
    for _ in range(READS):
        await trio.sleep(PACE_S)
        await wire.send(hostile.chunk(hostile.token_event() * PER_READ))
    usage = b'data: {"choices":[],"usage":{"completion_tokens":%d}}\n\n' % (1 + READS * PER_READ)
    await wire.send(hostile.chunk(usage + b"data: [DONE]\n\n") + hostile.LAST_CHUNK)


async def test_events_of_one_read_share_its_interval(
    start: StartCampaign, nursery: trio.Nursery
) -> None:
    c, engine = await start_beside_hostile(start, nursery, "batched", "decode", batched_tokens)
    recorder = GapRecorder()
    assert c.stack.supervisor.ctx is not None
    c.stack.supervisor.ctx.signals = recorder
    ex = await c.send(0, c.body(stream=True, max_tokens=1 + READS * PER_READ))
    assert ex.status == 200
    assert b'"usage"' not in ex.body  # the router asked for it; the client did not
    # PER_READ tokens per PACE_S: 10 ms each, not one 30 ms gap and two unseen ones.
    (gaps,) = recorder.summaries
    assert gaps.count == READS * PER_READ
    assert 0.8 * PACE_S / PER_READ < gaps.median_s < 2.0 * PACE_S / PER_READ
    (leg,) = [leg for leg in engine.legs if leg.leg == "decode"]
    assert leg.body["stream_options"] == {"include_usage": True}
