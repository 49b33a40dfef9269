"""What pricing keeps per engine across a reload that replaces or removes an engine.

A replaced engine (same id, another url) is a new EngineState instance. Legs that were
placed on the old instance still run on it after the reload and end later: what they
committed and observed must stay with the old instance, and the replacement starts with
nothing committed and nothing learnt. Under a MockClock with the scripted prober.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

import pytest
import trio
import trio.testing

from narwhal.config import Config
from narwhal.fleet import EngineState
from narwhal.profiles import (
    DecodeCorrection,
    DecodeModel,
    FleetProfiles,
    load_profiles,
    save_profiles,
)
from narwhal.serving import state_document
from narwhal.serving._admit import priced as priced_fleet
from narwhal.serving._context import DemandEvent, ServingContext
from narwhal.serving._legs import phase_slot
from narwhal.supervisor._control import ControlLink

from ..admission.test_first_token_wait import Source
from ..profiles.helpers import config_for, store_for
from ..recovery.fakes import config, reload
from ..recovery.test_service import Rig, decode_gaps, start

# Source prices a prefill at 0.1 ms per token.
P0 = {"id": "p0", "url": "http://127.0.0.1:9", "role": "prefill"}
P1 = {"id": "p1", "url": "http://127.0.0.1:11", "role": "prefill"}
D0 = {"id": "d0", "url": "http://127.0.0.1:10", "role": "decode"}


def fleet(*engines: dict[str, Any]) -> Config:
    return config(engines=list(engines), serving={"admission": "predictive"})


class Legs:
    """Engine legs held open in the phase slots (so committed and accounted) until
    their `end` event is set."""

    def __init__(self, nursery: trio.Nursery, ctx: ServingContext) -> None:
        self.nursery = nursery
        self.ctx = ctx

    async def open(
        self, engine: EngineState, phase: Literal["prefill", "decode"], tokens: int
    ) -> trio.Event:
        end = trio.Event()

        async def run(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            async with phase_slot(self.ctx, engine, phase, tokens):
                task_status.started()
                await end.wait()

        await self.nursery.start(run)
        return end


@asynccontextmanager
async def rig_with_legs(cfg: Config) -> AsyncIterator[tuple[Rig, Legs]]:
    async with trio.open_nursery() as nursery:
        rig = await start(nursery, cfg)
        rig.ctx.profiles = Source()
        yield rig, Legs(nursery, rig.ctx)
        nursery.cancel_scope.cancel()


async def ended(event: trio.Event) -> None:
    event.set()
    await trio.testing.wait_all_tasks_blocked()


def backlog_s(rig: Rig) -> dict[str, float]:
    admission = state_document(rig.ctx)["admission"]
    assert isinstance(admission, dict)
    shown = admission["prefill_backlog_s"]
    assert isinstance(shown, dict)
    return shown


async def test_a_leg_on_a_replaced_engine_leaves_the_replacements_backlog_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with rig_with_legs(fleet(P0, D0)) as (rig, legs):
        old = rig.engine("p0")
        stuck = await legs.open(old, "prefill", 1000)  # 0.1 s of work that never ends
        await rig.at(1.0)
        # Overdue by 0.9 s: the old p0 is priced as stalled (the reason to replace it).
        assert backlog_s(rig)["p0"] == pytest.approx(0.9)

        await reload(rig.ctx, rig.recovery, fleet({**P0, "url": "http://127.0.0.1:19"}, D0))
        new = rig.engine("p0")
        assert new is not old
        # The replacement has nothing committed: it inherited the old instance's
        # overdue work (priced 0.9 s, and growing by the second) before.
        assert backlog_s(rig)["p0"] == 0.0
        done = await legs.open(new, "prefill", 2000)
        now = trio.current_time()
        assert rig.ctx.backlog.wait_s(new, now) == pytest.approx(0.2)

        await ended(stuck)  # the old leg ends after the reload
        assert trio.current_time() == now
        assert rig.ctx.backlog.wait_s(new, now) == pytest.approx(0.2)
        assert rig.ctx.backlog.committed == {new: 1}
        assert priced_fleet(rig.ctx, Source(), {})["p0"].backlog_s == pytest.approx(0.2)
        await ended(done)
        assert rig.ctx.backlog.committed == rig.ctx.backlog.finish == {}


async def test_a_removed_engine_leaves_the_books_when_its_last_leg_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with rig_with_legs(fleet(P0, P1, D0)) as (rig, legs):
        p1 = rig.engine("p1")
        leg = await legs.open(p1, "prefill", 1000)
        assert set(backlog_s(rig)) == {"p0", "p1", "d0"}

        assert await reload(rig.ctx, rig.recovery, fleet(P0, D0)) == [p1]
        assert set(backlog_s(rig)) == {"p0", "d0"}  # only engines in the fleet are shown
        assert rig.ctx.backlog.committed == {p1: 1}  # its leg still runs, on it
        await ended(leg)
        assert rig.ctx.backlog.committed == rig.ctx.backlog.finish == {}


async def test_a_replaced_decode_engine_starts_with_no_lag_or_kv_turnover(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with rig_with_legs(fleet(P0, D0)) as (rig, legs):
        ctx = rig.ctx
        old = rig.engine("d0")
        ctx.first_token_lags.observe(old, 0.5, trio.current_time())
        await ended(await legs.open(old, "decode", 4000))  # frees 4000 tokens of KV
        resident = await legs.open(old, "decode", 1000)
        priced = priced_fleet(ctx, Source(), {})["d0"]
        assert priced.first_token_lag_s == pytest.approx(0.5)
        assert priced.kv_release_per_s > 0

        await reload(rig.ctx, rig.recovery, fleet(P0, {**D0, "url": "http://127.0.0.1:20"}))
        new = rig.engine("d0")
        await ended(resident)  # its KV is freed on the old instance, after the reload
        assert ctx.kv_turnover.current(old, trio.current_time()) == pytest.approx(4000)
        priced = priced_fleet(ctx, Source(), {})["d0"]
        assert (priced.first_token_lag_s, priced.kv_release_per_s) == (0.0, 0.0)
        signals = ctx.load_signals(trio.current_time())
        assert "d0" not in signals.first_token_lag_s
        assert "d0" not in signals.kv_release_per_s

        # What it learnt before the reload goes once its resident requests are done.
        assert old in ctx.kv_turnover.value
        ctx.engine_retired(old)
        assert new not in ctx.kv_turnover.value
        assert ctx.first_token_lags.value == ctx.kv_turnover.value == {}


async def test_a_leg_that_outlives_its_engines_retirement_leaves_nothing_in_the_books(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The supervisor retires a removed instance once its resident requests are done, or
    # once serving.request_timeout_s (the reloaded one: it may have been shortened) and
    # a cleanup bound have passed; a leg started under the old timeout can outlive that.
    async with rig_with_legs(fleet(P0, D0)) as (rig, legs):
        ctx = rig.ctx
        old = rig.engine("d0")
        late = await legs.open(old, "decode", 1000)
        prefill = await legs.open(rig.engine("p0"), "prefill", 1000)
        replaced = fleet(P0, {**D0, "url": "http://127.0.0.1:20"})
        assert await reload(rig.ctx, rig.recovery, replaced) == [old]
        ctx.engine_retired(old)  # the wait ran out

        ctx.first_token_lag(old, 0.5, trio.current_time())  # its first token, late
        await ended(late)  # frees its 1000 tokens of KV on the retired instance
        assert old.load.decode_active == old.load.decode_tokens == 0
        assert ctx.first_token_lags.value == ctx.kv_turnover.value == {}
        assert ctx.first_token_lags.at == ctx.kv_turnover.at == {}
        assert ctx.backlog.committed == {rig.engine("p0"): 1}  # the live engine's own
        await ended(prefill)
        assert ctx.backlog.committed == ctx.backlog.finish == {}


def decode_profiles(tmp_path: Path) -> tuple[FleetProfiles, DecodeModel]:
    """Profiles of P0 and D0 whose decode correction moves half way to each window's
    ratio from two gaps on; and D0's decode model."""
    urls = {"p0": P0["url"], "d0": D0["url"]}
    path = tmp_path / "profiles.json"
    save_profiles(store_for(urls), path)
    profiles = FleetProfiles(
        load_profiles(path, config_for(urls)),
        correction=DecodeCorrection(alpha=0.5, min_samples=2),
    )
    curve = profiles.decode_curve("d0")
    assert curve is not None
    return profiles, curve


async def test_decode_gaps_from_a_replaced_engine_leave_the_replacements_correction_alone(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    profiles, curve = decode_profiles(tmp_path)
    slow = decode_gaps(1.2 * curve.interval_s(1, 0), active=1, count=2)  # 20 % slow
    async with rig_with_legs(fleet(P0, D0)) as (rig, _):
        rig.ctx.profiles = profiles
        link = ControlLink(rig.ctx)
        old = rig.engine("d0")
        link.decode_gaps(old, slow)
        assert profiles.decode_correction("d0") == pytest.approx(1.1)

        await reload(rig.ctx, rig.recovery, fleet(P0, {**D0, "url": "http://127.0.0.1:20"}))
        link.decode_gaps(old, slow)  # a stream on the old instance ends after the reload
        assert profiles.decode_correction("d0") == pytest.approx(1.1)
        link.decode_gaps(rig.engine("d0"), slow)  # the replacement's own stream counts
        assert profiles.decode_correction("d0") == pytest.approx(1.15)


async def test_first_token_timeouts_of_a_replaced_engine_leave_the_controller_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A first-token timeout resets the controller's D->P evidence window (manual 7.6): an
    # instance the reload took out of the fleet serves no role, so its timeouts do not count.
    async with rig_with_legs(fleet(P0, D0)) as (rig, _):
        link = ControlLink(rig.ctx)
        assert link.controller is not None
        old = rig.engine("d0")
        await reload(rig.ctx, rig.recovery, fleet(P0, {**D0, "url": "http://127.0.0.1:20"}))
        link.first_token_timeout(old)  # a leg placed on it before the reload
        assert link.controller.snapshot(trio.current_time()).first_token_timeouts == 0
        link.first_token_timeout(rig.engine("d0"))
        assert link.controller.snapshot(trio.current_time()).first_token_timeouts == 1


async def test_the_decode_correction_is_judged_at_the_load_the_gaps_were_measured_under(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    # The prediction was read at the engine's load as the stream ended, lighter than
    # during it (the last stream of a batch ends alone): a busy engine's correction
    # leaned upward.
    profiles, curve = decode_profiles(tmp_path)
    busy = (47.6, 47.6 * 2000)
    on_profile = decode_gaps(curve.interval_s(*busy), active=busy[0], kv_tokens=busy[1])
    async with rig_with_legs(fleet(P0, D0)) as (rig, _):
        rig.ctx.profiles = profiles
        link = ControlLink(rig.ctx)
        d0 = rig.engine("d0")
        assert (d0.load.decode_active, d0.load.decode_tokens) == (0, 0)  # as the stream ended
        link.decode_gaps(d0, on_profile)
        assert profiles.decode_correction("d0") == pytest.approx(1.0)


async def test_a_replica_weights_its_arrivals_by_the_members_and_moves_roles_only_leading(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # narwhal.cluster: each of N replicas sees about 1/N of the fleet's arrivals, and only
    # the leader's controller moves roles (its moves are then shared).
    async with rig_with_legs(fleet(P0, D0)) as (rig, _):
        link = ControlLink(rig.ctx)
        controller = link.controller
        assert controller is not None
        leading = False
        moved: list[EngineState] = []
        link.leads = lambda: leading
        link.moved = moved.append
        link.arrival_weight = lambda: 3
        calls: list[float] = []

        async def on_pass() -> None:
            calls.append(trio.current_time())
            rig.engine("d0").role = "prefill"

        controller.on_pass = on_pass  # type: ignore[method-assign,assignment]
        rig.ctx.demand_events.append(DemandEvent(trio.current_time(), 100, 10, True))
        await link.on_pass(None)  # type: ignore[arg-type]
        # Three arrivals in the demand, one sample for the evidence gate.
        short, _ = controller.demand.estimates(trio.current_time())
        assert (short.arrivals, short.samples, controller.demand.total) == (3, 1, 1)
        assert calls == []
        assert moved == []
        leading = True
        await link.on_pass(None)  # type: ignore[arg-type]
        assert len(calls) == 1
        assert moved == [rig.engine("d0")]
