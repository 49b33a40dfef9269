"""What admission learns from served requests' projected vs observed TTFT, and where it
applies it: as seconds added, from every request on a path with backlog and from requests
of the same size on one without; under a MockClock with the scripted prober.

Source prices a prefill at 0.1 ms per token and a first decode step at 10 ms, so a
30-token chat projects 13 ms and a 2000-token prompt 210 ms on an idle fleet.
"""

from __future__ import annotations

import json

import pytest
import trio
import trio.testing

from narwhal._errors import Refused
from narwhal.config import Config
from narwhal.serving import state_document
from narwhal.serving._admit import admit_predictively
from narwhal.serving._context import RequestRecord, ServingContext
from narwhal.serving._request import ClientRequest, parse_body

from ..recovery.fakes import config, reload
from .test_reload_admission import D0, P0, ended, rig_with_legs

CHAT_TOKENS = 30
CHAT_PROJECTED_S = 0.013
# A fixed per-request cost the projection does not price (HTTP, tokenizing, the relay):
# 27 ms, twice a short chat's whole projection.
OVERHEAD_S = 0.027
LONG_TOKENS = 2000
LONG_PROJECTED_S = 0.21


def fleet(ttft_s: float = 0.3, percentile: float = 0.8) -> Config:
    return config(
        engines=[P0, D0],
        serving={"admission": "predictive"},
        slo={"ttft_s": ttft_s, "percentile": percentile},
    )


def completion(tokens: int) -> ClientRequest:
    body = {"model": "m", "prompt": [7] * tokens, "max_tokens": 4, "stream": True}
    return parse_body(
        json.dumps(body).encode(),
        kind="completions",
        request_id="r",
        models=("m",),
        arrival=trio.current_time(),
        deadline=trio.current_time() + 10.0,
    )


async def serve_chats(
    ctx: ServingContext, count: int, overrun_s: float = OVERHEAD_S, *, every_s: float = 0.05
) -> None:
    """`count` short chats, one every `every_s`, each `overrun_s` over its projection,
    learnt as the request path learns from them as they finish."""
    for i in range(count):
        now = trio.current_time()
        record = RequestRecord(
            id=f"chat-{i}",
            endpoint="chat",
            arrival=now - CHAT_PROJECTED_S - overrun_s,
            prompt_tokens=CHAT_TOKENS,
            projected_ttft_s=CHAT_PROJECTED_S,
            projected_wait_s=0.0,  # each on an idle fleet
            first_output_at=now,
        )
        ctx.projection_observed(record, now)
        await trio.sleep(every_s)


def admit(ctx: ServingContext, tokens: int) -> None:
    admit_predictively(ctx, completion(tokens), tokens, ctx.config, {})


async def test_short_chats_running_over_do_not_refuse_a_long_prompt_on_an_idle_fleet(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Issue 29: a hundred short chats ran 3x over their projections (a fixed overhead);
    # as a ratio that doubled the long prompt's 210 ms into 420 ms, over the 300 ms
    # budget, and refused it with 429 ttft_budget on a fleet doing nothing.
    async with rig_with_legs(fleet()) as (rig, legs):
        ctx = rig.ctx
        await serve_chats(ctx, 100)
        assert rig.ctx.backlog.finish == {}
        admit(ctx, LONG_TOKENS)  # no Refused: nothing learnt at its size with no backlog
        # Behind other work the overrun counts, as seconds, for every size: a chat behind
        # 270 ms of prefill projects 283 ms, and 283 + 27 > 300.
        admit(ctx, CHAT_TOKENS)
        backlog = await legs.open(rig.engine("p0"), "prefill", 2700)
        with pytest.raises(Refused, match=r"\(0\.310s allowing for the 0\.027s by which") as info:
            admit(ctx, CHAT_TOKENS)
        assert info.value.code == "ttft_budget"
        await ended(backlog)
        backlog = await legs.open(rig.engine("p0"), "prefill", 700)  # 210 + 70 + 27 > 300
        with pytest.raises(Refused, match=r"recent first tokens ran over their projections"):
            admit(ctx, LONG_TOKENS)
        await ended(backlog)
        admit(ctx, LONG_TOKENS)


async def test_state_reports_the_allowances_and_reload_reconfigures_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with rig_with_legs(fleet()) as (rig, _):
        ctx = rig.ctx
        await serve_chats(ctx, 90, overrun_s=0.01)
        await serve_chats(ctx, 10, overrun_s=0.2, every_s=0.0)

        def shown() -> object:
            admission = state_document(rig.ctx)["admission"]
            assert isinstance(admission, dict)
            return admission["projection_errors"]

        def both(quantile: float, samples: int, overrun_s: float) -> object:
            window = {"samples": samples, "overrun_s": overrun_s}
            return {
                "quantile": quantile,
                "backlog": window,
                "idle_by_prompt_tokens": {"0-127": window},
            }

        # slo.percentile 0.8: the 0.9 quantile, under the 200 ms overruns.
        assert shown() == both(0.9, 100, 0.01)
        # slo.percentile 0.9: the 0.95 quantile reaches them; an overrun is capped at
        # half the budget, which slo.ttft_s sets.
        await reload(rig.ctx, rig.recovery, fleet(ttft_s=0.3, percentile=0.9))
        assert shown() == both(0.95, 100, 0.15)
        await reload(rig.ctx, rig.recovery, fleet(ttft_s=1.0, percentile=0.9))
        assert shown() == both(0.95, 100, 0.2)
        # A quiet minute later the burst is forgotten.
        await trio.sleep(61.0)
        assert shown() == {
            "quantile": 0.95,
            "backlog": {"samples": 0, "overrun_s": 0.0},
            "idle_by_prompt_tokens": {},
        }
