"""The recovery service and monitor driven by a scripted prober under a MockClock.

Every probe, timer and verification happens at an exact instant, so the tests assert
times, not "eventually".
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import attrs
import pytest
import trio
import trio.testing

from narwhal._records import to_json
from narwhal.config import Config, Secret
from narwhal.ctl import CtlRequest
from narwhal.fleet import EngineState, Role, Share, key_refused, model_refused
from narwhal.recovery import (
    BreakerState,
    ContextReading,
    KeyCheck,
    KeyRefusal,
    LegObservation,
    LoadSample,
    Monitor,
    MonitorPass,
    ProbeResult,
    Recovery,
    ScrapeError,
    VerifyResult,
)
from narwhal.serving import DecodeGaps, ServingContext
from narwhal.serving._lag import LAG_PROBE_S
from narwhal.sim import SimTiming
from narwhal.supervisor import Operations, Supervisor
from narwhal.supervisor._control import MIN_RESIDUAL_GAPS, profile_predictor

from ..serving.test_predictive import LawProfiles
from .fakes import (
    EXHAUSTED,
    HEALTHY,
    KEY_ACCEPTED,
    KEY_REFUSED,
    REFUSED,
    UNHEALTHY,
    WRONG_KEY,
    FakeProber,
    config,
    failure,
    first_token_timeout,
    reload,
    unreachable,
)


@attrs.define
class Rig:
    ctx: ServingContext
    recovery: Recovery
    prober: FakeProber
    t0: float

    def engine(self, engine_id: str) -> EngineState:
        engine = self.ctx.fleet.get(engine_id)
        assert engine is not None
        return engine

    def reason(self, engine_id: str, phase: Any = None) -> str | None:
        return self.engine(engine_id).unavailable_reason(trio.current_time(), phase)

    def degraded(self) -> str | None:
        # A method, so mypy does not narrow the attribute across awaits.
        return self.ctx.degraded_reason

    def breaker(self, engine_id: str, phase: str) -> BreakerState:
        record = self.recovery.record(engine_id)
        assert record is not None
        return record.breakers[phase].state

    async def at(self, offset: float) -> None:
        """Sleep until t0 + offset, then let every woken task finish its step."""
        await trio.sleep_until(self.t0 + offset)
        await trio.testing.wait_all_tasks_blocked()


async def start(
    nursery: trio.Nursery, cfg: Config, prober: FakeProber | None = None, **kw: Any
) -> Rig:
    prober = prober or FakeProber()
    ctx = ServingContext(cfg)
    recovery = Recovery(ctx, prober=prober, **kw)
    ctx.leg_observer = recovery
    await nursery.start(recovery.run)
    return Rig(ctx, recovery, prober, trio.current_time())


def changes(rig: Rig, kind: str) -> list[tuple[str, str | None, str, str]]:
    return [
        (c.engine, c.phase, c.old, c.new) for c in rig.recovery.recent_changes if c.kind == kind
    ]


# ---------------------------------------------------------------- health

# d0's health verdicts from an ejection through a passing readmission verification.
D0_READMITTED = [
    ("d0", None, "up", "ejected"),
    ("d0", None, "ejected", "verifying"),
    ("d0", None, "verifying", "up"),
]


def with_peer(role: str, **sections: Any) -> Config:
    """1P1D plus x1 of `role`: with x1 in placement, d0 is not the last engine to take
    decode work (a `both` engine takes it as aggregate work when there is no pair)."""
    return config(
        engines=[
            {"id": "p0", "url": "http://127.0.0.1:9", "role": "prefill"},
            {"id": "d0", "url": "http://127.0.0.1:10", "role": "decode"},
            {"id": "x1", "url": "http://127.0.0.1:11", "role": role},
        ],
        **sections,
    )


P0 = {"id": "p0", "url": "http://127.0.0.1:9", "role": "prefill"}


def eject_d0(rig: Rig) -> None:
    rig.prober.health_of["d0"] = UNHEALTHY


async def eject_d0_then_answer(rig: Rig) -> None:
    """d0 fails its probes at +1, +2 and +3 (ejected), and answers the ones after."""
    eject_d0(rig)
    await rig.at(3.0)
    rig.prober.health_of["d0"] = HEALTHY


async def test_failed_probes_eject_at_the_threshold_and_readmission_needs_a_verification(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, with_peer("decode"))
    rig.prober.health_of["d0"] = UNHEALTHY
    await rig.at(2.5)  # failed probes at +1 and +2
    assert rig.reason("d0") is None
    await rig.at(3.0)  # the third
    assert rig.reason("d0") == (
        "ejected: 3 consecutive failed health probes (recovery.health.failure_threshold=3): "
        "GET /health returned HTTP 503"
    )
    rig.prober.health_of["d0"] = HEALTHY
    await rig.at(4.0)
    assert rig.reason("d0") is not None  # one good probe is not enough
    await rig.at(5.0)  # second good probe -> verifying -> verification at once
    (verification,) = rig.prober.verifications
    assert attrs.astuple(verification) == ("d0", "decode", "p0", "d0", rig.t0 + 5.0)
    assert rig.reason("d0") is None
    assert changes(rig, "health") == D0_READMITTED


@pytest.mark.parametrize(
    ("role", "still_in"),
    [
        ("decode", "x1 in placement"),
        ("both", "x1 in placement: aggregate work when there is no pair"),
        ("decode", "x1's prefill breaker open: it takes decode work all the same"),
    ],
)
async def test_readmission_takes_readmit_successes_probes_while_another_engine_takes_its_work(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, role: str, still_in: str
) -> None:
    # Open for 100 s: not half-open (and verified) during the test.
    rig = await start(nursery, with_peer(role, recovery={"breaker": {"open_s": 100.0}}))
    x1 = rig.engine("x1")
    if "breaker" in still_in:
        for _ in range(3):
            rig.recovery.leg_failed(x1, "prefill", failure("x1", "prefill"))
        assert rig.breaker("x1", "prefill") is BreakerState.OPEN
    eject_d0(rig)
    await rig.at(3.0)
    rig.prober.health_of["d0"] = HEALTHY
    await rig.at(4.0)
    assert rig.prober.verifications == []  # one good probe is not enough: x1 takes the work
    await rig.at(5.0)
    assert [v.at - rig.t0 for v in rig.prober.verifications] == [5.0]
    assert rig.reason("d0") is None
    # Now x1 goes out too: d0's next readmission needs one good probe.
    x1.operator_drain()
    eject_d0(rig)
    await rig.at(8.0)  # failed probes at +6, +7, +8
    rig.prober.health_of["d0"] = HEALTHY
    await rig.at(9.0)
    assert [v.at - rig.t0 for v in rig.prober.verifications] == [5.0, 9.0]
    assert rig.reason("d0") is None


async def test_readmission_needs_one_good_probe_and_a_verification_when_no_other_engine_takes_its_work(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # 1P1D: while d0 is out every request is refused (no_engine_available), so each
    # further probe of the streak would cost the whole service a probe interval.
    rig = await start(nursery, config())
    eject_d0(rig)
    await rig.at(3.0)
    rig.prober.health_of["d0"] = HEALTHY
    with caplog.at_level(logging.INFO, logger="narwhal.recovery"):
        await rig.at(4.0)  # one good probe, then the verification at once
    (verification,) = rig.prober.verifications
    assert attrs.astuple(verification) == ("d0", "decode", "p0", "d0", rig.t0 + 4.0)
    assert rig.reason("d0") is None
    assert changes(rig, "health") == D0_READMITTED
    reason = (
        "1 good probe of recovery.health.readmit_successes=2, enough while no other engine "
        "in placement takes decode work; verifying before readmission"
    )
    (entry,) = [c for c in rig.recovery.recent_changes if c.new == "verifying"]
    assert entry.reason == reason
    (logged,) = [
        r
        for r in caplog.records
        if getattr(r, "event", None) == "verdict" and r.__dict__["to"] == "verifying"
    ]
    assert logged.getMessage() == f"health d0: ejected -> verifying: {reason}"
    engines: Any = to_json(rig.recovery.state())["engines"]
    assert engines["d0"]["health"]["readmit_shortcuts_total"] == 1
    assert engines["p0"]["health"]["readmit_shortcuts_total"] == 0


async def test_failed_verification_keeps_the_engine_out_until_a_later_one_passes(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, with_peer("decode"))
    await eject_d0_then_answer(rig)
    rig.prober.verify_of["d0"] = VerifyResult("failed", "decode leg on d0 returned HTTP 500")
    await rig.at(5.0)
    assert rig.reason("d0") == "ejected: verification failed: decode leg on d0 returned HTTP 500"
    del rig.prober.verify_of["d0"]
    await rig.at(7.0)  # two more good probes, then a verification that passes
    # The failed pair was sent again at once; both failed, so the second counted.
    assert [v.at - rig.t0 for v in rig.prober.verifications] == [5.0, 5.0, 7.0]
    assert rig.reason("d0") is None


async def test_a_failed_verification_keeps_out_an_engine_readmitted_on_one_good_probe(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # The shortcut leaves out a probe, not the verification pair: a broken engine that
    # answers /health fails it and stays out, and is verified again a probe interval
    # later, each time after one good probe while its role has no other engine.
    rig = await start(nursery, config())
    eject_d0(rig)
    await rig.at(3.0)
    rig.prober.health_of["d0"] = HEALTHY
    rig.prober.verify_of["d0"] = VerifyResult("failed", "decode leg on d0 returned HTTP 500")
    await rig.at(4.0)
    assert [v.at - rig.t0 for v in rig.prober.verifications] == [4.0, 4.0]  # sent again once
    assert rig.reason("d0") == "ejected: verification failed: decode leg on d0 returned HTTP 500"
    await rig.at(4.9)
    assert rig.reason("d0") is not None
    del rig.prober.verify_of["d0"]
    await rig.at(5.0)
    assert [v.at - rig.t0 for v in rig.prober.verifications] == [4.0, 4.0, 5.0]
    assert rig.reason("d0") is None
    assert health_changes(rig, "d0") == [
        ("up", "ejected"),
        ("ejected", "verifying"),
        ("verifying", "ejected"),
        ("ejected", "verifying"),
        ("verifying", "up"),
    ]
    record = rig.recovery.record("d0")
    assert record is not None
    assert record.health.shortcuts_total == 2


BROKEN = VerifyResult("failed", "decode leg on d0 returned HTTP 500")


def pairs_of(rig: Rig, engine_id: str = "d0") -> list[float]:
    """When `engine_id`'s verification pairs went out, a pair sent again included."""
    return [v.at - rig.t0 for v in rig.prober.verifications if v.subject == engine_id]


async def test_failed_readmission_verifications_back_off_until_one_passes_or_a_restart(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # An engine that answers /health but fails its pair (a dead GPU behind a live HTTP
    # server) while x1 takes decode work: verified after each readmit_successes good
    # probes, it would take a pair (sent twice) every two probe intervals for as long as
    # it stays broken. From the second failure in a row the wait doubles: 1, 2, 4, 8, 8
    # intervals (the first two come after the probe streak).
    rig = await start(nursery, with_peer("decode", recovery={"restart_hold_s": 1.0}))
    await eject_d0_then_answer(rig)
    rig.prober.verify_of["d0"] = BROKEN
    await rig.at(30.0)
    assert pairs_of(rig) == [t for t in (5.0, 7.0, 9.0, 13.0, 21.0, 29.0) for _ in range(2)]
    assert rig.reason("d0") == (
        "ejected: verification failed: decode leg on d0 returned HTTP 500; 6 failed in a row, "
        "so the next waits 8 s (doubling from recovery.health.interval_s=1.0, up to 8 of them)"
    )
    await rig.at(31.0)
    assert rig.reason("d0") == (
        "ejected: 2 good probes (recovery.health.readmit_successes=2); 6 verifications failed "
        "in a row, so it waits until 8 s after the last; verifying before readmission"
    )
    health = state_of(rig, "d0")["health"]
    assert (health["failed_verifications"], health["verify_in_s"]) == (6, 6.0)
    # A restart is a new instance (how such an engine is mostly fixed): verified after
    # its hold (seen at +32, recovery.restart_hold_s=1), not the backoff.
    rig.prober.health_of["d0"] = attrs.evolve(HEALTHY, identity=(("instance_id", "b"),))
    await rig.at(33.0)
    assert pairs_of(rig)[12:] == [33.0, 33.0]
    assert state_of(rig, "d0")["health"]["failed_verifications"] == 1
    del rig.prober.verify_of["d0"]
    await rig.at(35.0)
    assert pairs_of(rig)[14:] == [35.0]
    assert rig.reason("d0") is None
    health = state_of(rig, "d0")["health"]
    assert (health["failed_verifications"], health["verify_in_s"]) == (0, None)
    # A pass starts the count over: the next ejection's first failures come quickly.
    rig.prober.verify_of["d0"] = BROKEN
    eject_d0(rig)
    await rig.at(38.0)
    # Instance b, as before the ejection: no restart this time.
    rig.prober.health_of["d0"] = attrs.evolve(HEALTHY, identity=(("instance_id", "b"),))
    await rig.at(42.0)
    assert pairs_of(rig)[15:] == [40.0, 40.0, 42.0, 42.0]


async def test_the_verification_backoff_is_cut_to_a_probe_interval_while_the_role_is_empty(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # While x1 takes decode work the backoff holds d0's verifications (above): the pair
    # at +13 failed, so the next waits until +21. Once x1 is drained (+16.5) every
    # decode request is refused, and d0, fixed without a restart, would be refused too
    # until +21, or up to 8 probe intervals after its last pair in general: it is
    # verified at once, then every probe interval, while its role stays empty.
    rig = await start(nursery, with_peer("decode"))
    await eject_d0_then_answer(rig)
    rig.prober.verify_of["d0"] = BROKEN
    await rig.at(16.5)
    assert pairs_of(rig) == [t for t in (5.0, 7.0, 9.0, 13.0) for _ in range(2)]
    assert state_of(rig, "d0")["health"]["verify_in_s"] == 4.5
    rig.engine("x1").operator_drain()
    await rig.at(16.5)
    assert pairs_of(rig)[8:] == [16.5, 16.5]
    await rig.at(19.9)
    # One verification a probe interval at most (a good probe at +17, +18, +19 makes it
    # verifying, the last pair +16.5, +17.5, +18.5 decides when).
    assert pairs_of(rig)[8:] == [t for t in (16.5, 17.5, 18.5, 19.5) for _ in range(2)]
    assert rig.reason("d0") == (
        "ejected: verification failed: decode leg on d0 returned HTTP 500; 8 failed in a row, "
        "so the next waits 8 s (doubling from recovery.health.interval_s=1.0, up to 8 of "
        "them), or 1 s while no other engine in placement takes decode work"
    )
    health = state_of(rig, "d0")["health"]
    assert (health["failed_verifications"], health["verify_in_s"]) == (8, 0.6)
    verifying = [c.reason for c in rig.recovery.recent_changes if c.new == "verifying"]
    assert verifying[-1] == (
        "1 good probe of recovery.health.readmit_successes=2, enough while no other engine "
        "in placement takes decode work; 7 verifications failed in a row, so it would wait "
        "until 8 s after the last, but waits 1 s while its role has no other engine; "
        "verifying before readmission"
    )
    # x1 back in service: the backoff holds again, from d0's last pair (+19.5).
    rig.engine("x1").operator_undrain()
    await rig.at(27.4)
    assert pairs_of(rig)[16:] == []
    assert state_of(rig, "d0")["health"]["verify_in_s"] == 0.1
    # Fixed: the next pair passes.
    del rig.prober.verify_of["d0"]
    await rig.at(27.5)
    assert pairs_of(rig)[16:] == [27.5]
    assert rig.reason("d0") is None


async def test_control_pool_exhaustion_leaves_the_verdict_and_streak_unchanged(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, config())
    rig.prober.health_of["d0"] = UNHEALTHY
    await rig.at(2.0)
    rig.prober.health_of["d0"] = EXHAUSTED
    await rig.at(6.0)  # four inconclusive probes: no evidence either way
    assert rig.reason("d0") is None
    rig.prober.health_of["d0"] = UNHEALTHY
    await rig.at(7.0)  # the streak continues from two
    assert rig.reason("d0") is not None
    rig.prober.health_of["d0"] = EXHAUSTED
    await rig.at(12.0)
    assert rig.prober.verifications == []  # inconclusive probes are not good probes
    assert rig.reason("d0") is not None


async def test_a_verification_that_fails_once_is_sent_again_and_the_second_pair_decides(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # One transient fault on a verification leg (an engine's one 5xx) must not keep a
    # sound engine out for another round of probes.
    rig = await start(nursery, with_peer("decode"))
    await eject_d0_then_answer(rig)
    rig.prober.verify_next["d0"] = [VerifyResult("failed", "decode leg on d0 returned HTTP 503")]
    await rig.at(5.0)
    assert [v.at - rig.t0 for v in rig.prober.verifications] == [5.0, 5.0]
    assert rig.reason("d0") is None
    assert changes(rig, "health") == D0_READMITTED
    record = rig.recovery.record("d0")
    assert record is not None
    assert record.last_verification is not None
    assert record.last_verification.outcome == "ok"
    registry = rig.ctx.metrics.registry
    counts = {
        outcome: registry.get_sample_value(
            "narwhal_verifications_total",
            {"engine": "d0", "purpose": "readmission", "outcome": outcome},
        )
        for outcome in ("retried", "ok", "failed")
    }
    assert counts == {"retried": 1.0, "ok": 1.0, "failed": None}


async def test_a_verification_that_ran_out_its_deadline_is_not_sent_again(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # It has waited engine.first_token_timeout_s already; a stalled engine would hold
    # its loop twice as long.
    rig = await start(nursery, with_peer("decode"))
    await eject_d0_then_answer(rig)
    rig.prober.hung_legs.add("d0")
    await rig.at(7.5)  # verification at +5 runs out engine.first_token_timeout_s=2.5
    assert [v.at - rig.t0 for v in rig.prober.verifications] == [5.0]
    assert rig.reason("d0") == (
        "ejected: verification failed: decode leg on d0: no answer within "
        "engine.first_token_timeout_s=2.5"
    )


async def test_an_engine_down_at_startup_is_kept_probed_held_and_readmitted(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    prober = FakeProber()
    prober.health_of["d0"] = REFUSED
    rig = await start(nursery, with_peer("decode"), prober)  # x1 takes decode work
    assert rig.reason("d0") == (
        "ejected: failed its first probe (startup): GET /health: connect failed: connection refused"
    )
    await rig.at(3.0)
    assert [p for p in rig.prober.probes if p[0] == "d0"] == [
        ("d0", rig.t0 + t) for t in (0.0, 1.0, 2.0, 3.0)
    ]
    prober.health_of["d0"] = HEALTHY
    await rig.at(4.0)  # answers again: a restart hold of recovery.restart_hold_s=5
    assert rig.engine("d0").held_until == math.inf
    await rig.at(8.9)  # good probes long enough, but the hold runs until +9
    assert rig.prober.verifications == []
    await rig.at(9.0)
    (verification,) = rig.prober.verifications
    assert verification.at == rig.t0 + 9.0
    assert rig.reason("d0") is None
    assert changes(rig, "hold") == [
        ("d0", None, "released", "held"),
        ("d0", None, "held", "released"),
    ]


def state_of(rig: Rig, engine_id: str) -> Any:
    engines: Any = to_json(rig.recovery.state())["engines"]
    return engines[engine_id]


CUT_1P1D = (
    "cut short 5.0 s before recovery.restart_hold_s=5.0 ran out, at a good probe, while no "
    "other engine in placement takes decode work"
)


async def test_a_restart_hold_ends_at_the_first_good_probe_when_no_other_engine_takes_its_work(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # 1P1D: while d0 is held every request is refused (no_engine_available), so waiting
    # for its warm-up costs the whole service. What the hold does besides waiting stays:
    # the context length is read again, the verification pair has to pass and the build
    # is compared (before_release) before placement sees it.
    prober = FakeProber()
    prober.health_of["d0"] = REFUSED
    rig = await start(nursery, config(), prober)
    released: list[tuple[str | None, float]] = []

    async def before_release(engine: EngineState) -> None:
        released.append((rig.reason(engine.id), trio.current_time() - rig.t0))

    rig.recovery.before_release = before_release
    await rig.at(3.0)
    prober.health_of["d0"] = HEALTHY
    prober.verify_of["d0"] = VerifyResult("failed", "decode leg on d0 returned HTTP 500")
    with caplog.at_level(logging.INFO, logger="narwhal.recovery"):
        await rig.at(4.0)  # answers again: held, and verified at once
    assert [v.at - rig.t0 for v in prober.verifications] == [4.0, 4.0]
    assert [at - rig.t0 for e, at in prober.context_reads if e == "d0"] == [4.0]
    # The failed pair keeps it out, held.
    assert rig.reason("d0") == "ejected: verification failed: decode leg on d0 returned HTTP 500"
    assert rig.engine("d0").held_until == math.inf
    assert released == []
    hold = state_of(rig, "d0")["hold"]
    assert (hold["active"], hold["verify_in_s"], hold["cut_short"]) == (True, 0.0, CUT_1P1D)
    (logged,) = [r for r in caplog.records if getattr(r, "event", "") == "restart_hold_cut"]
    assert logged.levelname == "WARNING"
    assert logged.getMessage() == f"restart hold of d0 {CUT_1P1D}: verifying before placement"
    del prober.verify_of["d0"]
    await rig.at(5.0)  # the next good probe, the next pair
    assert [v.at - rig.t0 for v in prober.verifications] == [4.0, 4.0, 5.0]
    assert released == [("restart hold", 5.0)]
    assert rig.reason("d0") is None
    (release,) = [c for c in rig.recovery.recent_changes if c.new == "released"]
    assert release.reason == f"verification passed; the hold was {CUT_1P1D}"
    hold = state_of(rig, "d0")["hold"]
    assert (hold["holds_total"], hold["cut_short_total"], hold["cut_short"]) == (1, 1, None)


async def test_a_restart_hold_is_cut_short_at_once_when_its_role_empties_during_it(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # x1 takes decode work while d0 is held; when x1 goes out (its decode breaker opens
    # at +3.5) d0 is probed at once, not at +4, and verified at that probe.
    rig = await start(nursery, with_peer("decode", recovery={"breaker": {"open_s": 100.0}}))
    await rig.at(1.5)
    rig.prober.health_of["d0"] = attrs.evolve(HEALTHY, identity=(("instance_id", "b"),))
    await rig.at(3.5)
    assert rig.reason("d0") == "restart hold"
    assert rig.prober.verifications == []
    x1 = rig.engine("x1")
    for _ in range(3):
        rig.recovery.leg_failed(x1, "decode", failure("x1", "decode"))
    await rig.at(3.5)
    assert [v.at - rig.t0 for v in rig.prober.verifications] == [3.5]
    assert [at - rig.t0 for e, at in rig.prober.probes if e == "d0"][-2:] == [3.0, 3.5]
    assert rig.reason("d0") is None
    (release,) = [c for c in rig.recovery.recent_changes if c.new == "released"]
    assert release.reason == (
        "verification passed; the hold was cut short 3.5 s before recovery.restart_hold_s=5.0 "
        "ran out, at a good probe, while no other engine in placement takes decode work"
    )


# ------------------------------------------------- roles emptied by any path

# d0 ejected at +3, answering from +4, waiting for readmission while x1 (`with_peer`)
# takes decode work: one good probe is not enough then, so without anything else d0 is
# verifying at +5 and readmitted after that probe's pair.


def ctl(rig: Rig) -> Operations:
    """narwhalctl's commands on the rig's fleet, as the control socket runs them."""
    return Operations(cast("Supervisor", _CtlHost(rig.ctx)))


@attrs.define
class _CtlHost:
    """What `Operations` reads of the supervisor for the engine commands."""

    ctx: ServingContext
    deferred_roles: dict[str, Role] = attrs.Factory(dict)
    cluster: None = None  # one replica: nothing to share


async def drain_x1(rig: Rig) -> None:
    await ctl(rig)(CtlRequest("drain", "x1"))


async def pin_x1_prefill(rig: Rig) -> None:
    await ctl(rig)(CtlRequest("pin", "x1", "prefill"))


async def reload_without_x1(rig: Rig) -> None:
    await reload(rig.ctx, rig.recovery, config(engines=[P0, D0]))


async def reload_replacing_x1(rig: Rig) -> None:
    # The new instance fails its first probe, so it joins ejected.
    rig.prober.health_of["x1"] = REFUSED
    x1 = {"id": "x1", "url": "http://127.0.0.1:21", "role": "decode"}
    await reload(rig.ctx, rig.recovery, config(engines=[P0, D0, x1]))


async def reload_x1_as_prefill(rig: Rig) -> None:
    x1 = {"id": "x1", "url": "http://127.0.0.1:11", "role": "prefill"}
    await reload(rig.ctx, rig.recovery, config(engines=[P0, D0, x1]))


async def x1_refuses_the_key(rig: Rig) -> None:
    # As the request path does when a leg meets HTTP 401 (serving's _flow).
    key_refused(rig.engine("x1"), 401, "Unauthorized", rig.ctx.config)


async def x1_refuses_the_model(rig: Rig) -> None:
    # As the request path does when a leg meets vLLM's 404 for the model (serving's _flow).
    model_refused(rig.engine("x1"), "The model `m` does not exist.", rig.ctx.config)


D0 = {"id": "d0", "url": "http://127.0.0.1:10", "role": "decode"}


@pytest.mark.parametrize(
    "empty",
    [
        drain_x1,
        pin_x1_prefill,
        reload_without_x1,
        reload_replacing_x1,
        reload_x1_as_prefill,
        x1_refuses_the_key,
        x1_refuses_the_model,
    ],
)
async def test_a_waiting_engine_is_probed_at_once_when_its_role_empties_by_any_path(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
    empty: Callable[[Rig], Awaitable[None]],
) -> None:
    # x1, d0's only peer of its role, leaves placement at +4.5 by narwhalctl, a reload
    # or a refused key or model: every decode request is refused from then on, so d0 is probed
    # at once and, as the last of its role, verified at that one good probe. It waited
    # for its next probe (+5) and a second good one before.
    rig = await start(nursery, with_peer("decode"))
    await eject_d0_then_answer(rig)
    await rig.at(4.5)
    assert rig.reason("d0") is not None
    assert rig.prober.verifications == []
    await empty(rig)
    await rig.at(4.5)
    assert [at - rig.t0 for e, at in rig.prober.probes if e == "d0"][-2:] == [4.0, 4.5]
    assert pairs_of(rig) == [4.5]
    assert rig.reason("d0") is None


async def test_an_undrained_waiting_engine_is_probed_at_once_when_its_role_is_empty(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # 1P1D, d0 ejected and drained by the operator: a drained engine gets no shortcut
    # (it would stay out anyway), so its good probe at +4 counts as one of two. Undrained
    # at +4.5 it is the last decode engine: probed and verified then, not at +5.
    rig = await start(nursery, config())
    await eject_d0_then_answer(rig)
    await ctl(rig)(CtlRequest("drain", "d0"))
    await rig.at(4.5)
    assert rig.prober.verifications == []
    await ctl(rig)(CtlRequest("undrain", "d0"))
    await rig.at(4.5)
    assert [at - rig.t0 for e, at in rig.prober.probes if e == "d0"][-2:] == [4.0, 4.5]
    assert pairs_of(rig) == [4.5]
    assert rig.reason("d0") is None


async def test_two_waiting_engines_of_one_role_do_not_wake_each_other(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # d0 and d1 both ejected, both answering, both failing their pairs, p0 in service:
    # the decode role is empty, and each is verified once a probe interval (its pair
    # sent again once), on its own probes: a failed verification takes nothing out of
    # placement, so neither wakes the other.
    d1 = {"id": "d1", "url": "http://127.0.0.1:11", "role": "decode"}
    rig = await start(nursery, config(engines=[P0, D0, d1]))
    for engine_id in ("d0", "d1"):
        rig.prober.health_of[engine_id] = UNHEALTHY
        rig.prober.verify_of[engine_id] = VerifyResult(
            "failed", f"decode leg on {engine_id} returned HTTP 500"
        )
    await rig.at(3.0)
    rig.prober.health_of.clear()
    await rig.at(10.0)
    for engine_id in ("d0", "d1"):
        probes = [at - rig.t0 for e, at in rig.prober.probes if e == engine_id]
        assert probes == [float(t) for t in range(11)]
        twice = [float(t) for t in range(4, 11) for _ in range(2)]
        assert pairs_of(rig, engine_id) == twice


async def test_identity_change_is_a_restart_held_until_verified(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, with_peer("decode"))
    await rig.at(1.5)
    rig.prober.health_of["d0"] = attrs.evolve(HEALTHY, identity=(("instance_id", "b"),))
    await rig.at(2.0)
    assert rig.reason("d0") == "restart hold"
    record = rig.recovery.record("d0")
    assert record is not None
    assert record.hold.reason == "identity changed (instance_id a -> b)"
    await rig.at(6.9)
    assert rig.reason("d0") == "restart hold"
    await rig.at(7.0)
    assert rig.reason("d0") is None
    assert [v.at - rig.t0 for v in rig.prober.verifications] == [7.0]


async def test_the_context_length_is_read_at_the_first_good_probe_and_after_a_restart(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # It changes only with a new instance: read once, not at every probe, and again after
    # a failed probe (the engine may come back launched with another --max-model-len) or
    # a restart seen any other way.
    prober = FakeProber()
    prober.context_of["d0"] = ContextReading(None, "GET /v1/models returned HTTP 500", final=False)
    with caplog.at_level(logging.INFO, logger="narwhal"):
        rig = await start(nursery, config(), prober)
        assert (rig.engine("p0").context_length, rig.engine("d0").context_length) == (8192, None)
        await rig.at(3.5)
        # A failed read is asked again at each good probe; a settled one is not.
        assert [at - rig.t0 for e, at in prober.context_reads if e == "d0"] == [0, 1, 2, 3]
        assert [e for e, _ in prober.context_reads].count("p0") == 1
        prober.context_of["d0"] = ContextReading(4096, "GET /v1/models max_model_len")
        await rig.at(4.0)
        assert rig.engine("d0").context_length == 4096
        await rig.at(6.0)
        assert [e for e, _ in prober.context_reads].count("d0") == 5
        prober.health_of["d0"] = UNHEALTHY
        await rig.at(7.0)
        prober.health_of["d0"] = HEALTHY
        prober.context_of["d0"] = ContextReading(8192, "GET /v1/models max_model_len")
        await rig.at(8.0)
        assert rig.engine("d0").context_length == 8192
        prober.health_of["p0"] = attrs.evolve(HEALTHY, identity=(("instance_id", "b"),))
        prober.context_of["p0"] = ContextReading(None, "its /v1/models answer lists no model 'm'")
        await rig.at(9.0)
        assert rig.engine("p0").context_length is None
        assert rig.engine("p0").context_note == "its /v1/models answer lists no model 'm'"
    logged = [
        (r.levelname, r.getMessage())
        for r in caplog.records
        if r.__dict__.get("event") == "engine_context"
    ]
    # The first probes run side by side, in either order.
    assert sorted(logged[:2]) == [
        ("INFO", "engine p0: context length 8192 (GET /v1/models max_model_len)"),
        (
            "WARNING",
            "engine d0: context length unknown (GET /v1/models returned HTTP 500); requests "
            "are not checked against it, and one past it is refused by the engine itself",
        ),
    ]
    assert logged[2:] == [
        ("INFO", "engine d0: context length 4096 (GET /v1/models max_model_len)"),
        ("INFO", "engine d0: context length 8192 (GET /v1/models max_model_len)"),
        (
            "WARNING",
            "engine p0: context length unknown (its /v1/models answer lists no model 'm'); "
            "requests are not checked against it, and one past it is refused by the engine "
            "itself",
        ),
    ]


class ModelRefusingProber(FakeProber):
    """Its engines can refuse the model while their /v1/models is being read."""

    refuse_during_context = False

    async def context(self, engine: EngineState, config: Config) -> ContextReading:
        if self.refuse_during_context:
            model_refused(engine, "The model `m` does not exist.", config)
        return await super().context(engine, config)


async def test_an_engine_refusing_its_model_is_read_at_each_probe_until_it_lists_it(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    prober = ModelRefusingProber()
    rig = await start(nursery, config(), prober)
    await rig.at(0.5)
    d0 = rig.engine("d0")
    absent = "its /v1/models answer lists no model 'm' (it lists 'x')"
    prober.context_of["d0"] = ContextReading(None, absent, listed=False)
    model_refused(d0, "The model `m` does not exist.", rig.ctx.config)
    refused = "model not served: HTTP 404: The model `m` does not exist."
    await rig.at(3.5)
    assert rig.reason("d0") == refused
    # Read at every good probe while it is out (the context alone would be read once).
    assert [at - rig.t0 for e, at in prober.context_reads if e == "d0"] == [0, 1, 2, 3]

    # A refusal that arrives while /v1/models is read wins over that reading.
    prober.context_of["d0"] = ContextReading(8192, "GET /v1/models max_model_len", listed=True)
    prober.refuse_during_context = True
    await rig.at(4.5)
    assert rig.reason("d0") == refused
    prober.refuse_during_context = False
    await rig.at(5.5)
    assert rig.reason("d0") is None
    assert d0.context_length == 8192
    await rig.at(8.5)
    assert [e for e, _ in prober.context_reads].count("d0") == 6  # settled: not read again


async def test_an_engine_that_does_not_list_its_model_is_named_once_and_kept_in_placement(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # A LoRA resolver's adapter is listed only once loaded, and SGLang serves whatever a
    # request names: only a refused request takes the engine out.
    prober = FakeProber()
    absent = "its /v1/models answer lists no model 'm' (it lists 'x')"
    prober.context_of["d0"] = ContextReading(None, absent, listed=False)
    with caplog.at_level(logging.INFO, logger="narwhal"):
        rig = await start(nursery, config(), prober)
        await rig.at(5.5)
    assert rig.reason("d0") is None
    unlisted = [
        r.getMessage() for r in caplog.records if r.__dict__.get("event") == "engine_model_unlisted"
    ]
    model = rig.engine("d0").spec.model
    assert unlisted == [
        f"engine d0 does not list model {model!r} (engines[].model) in /v1/models; if it refuses "
        "requests for it (vLLM answers 404), the first refused one takes it out of "
        "placement: check the engine's --served-model-name"
    ]


async def test_a_reload_forgets_a_key_refusal_only_when_it_changes_the_key() -> None:
    # An unchanged key would be refused again: one more failed leg and ERROR per reload.
    cfg = config()
    engine = ServingContext(cfg).fleet.get("p0")
    assert engine is not None
    key_refused(engine, 401, "Unauthorized", cfg)
    engine.reconfigure(cfg.engines[0], cfg)
    assert str(engine.unavailable_reason(0.0)).startswith("auth refused: ")
    engine.reconfigure(attrs.evolve(cfg.engines[0], api_key=Secret("sk-new")), cfg)
    assert engine.unavailable_reason(0.0) is None


async def test_a_reload_forgets_a_model_refusal_only_when_it_changes_the_model() -> None:
    cfg = config()
    engine = ServingContext(cfg).fleet.get("p0")
    assert engine is not None
    model_refused(engine, "The model `m` does not exist.", cfg)
    engine.reconfigure(cfg.engines[0], cfg)
    assert (
        engine.unavailable_reason(0.0)
        == "model not served: HTTP 404: The model `m` does not exist."
    )
    engine.reconfigure(attrs.evolve(cfg.engines[0], model="m2"), cfg)
    assert engine.unavailable_reason(0.0) is None
    assert engine.context_due


async def test_a_restarted_engine_is_released_only_after_the_before_release_hook(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # A restart may be an upgrade: the supervisor's hook compares builds (a stale profile
    # is dropped) while the engine is still held, so nothing is priced with it meanwhile;
    # also when the hold was cut short because no other engine takes its role's work.
    rig = await start(nursery, with_peer("decode"))
    seen: list[tuple[str, str | None, float]] = []

    async def before_release(engine: EngineState) -> None:
        seen.append((engine.id, rig.reason(engine.id), trio.current_time() - rig.t0))
        await trio.sleep(0.5)  # asking the engine its build takes a while

    rig.recovery.before_release = before_release
    await rig.at(1.5)
    rig.prober.health_of["d0"] = attrs.evolve(HEALTHY, identity=(("instance_id", "b"),))
    await rig.at(7.0)
    assert seen == [("d0", "restart hold", 7.0)]
    assert rig.reason("d0") == "restart hold"
    await rig.at(7.5)
    assert rig.reason("d0") is None
    # Alone in its role, its hold is cut short at the probe that sees the restart.
    rig.engine("x1").operator_drain()
    rig.prober.health_of["d0"] = attrs.evolve(HEALTHY, identity=(("instance_id", "c"),))
    await rig.at(8.0)
    assert seen[1:] == [("d0", "restart hold", 8.0)]
    assert rig.reason("d0") == "restart hold"
    await rig.at(8.5)
    assert rig.reason("d0") is None
    await rig.at(20.0)
    assert len(seen) == 2  # not for an engine that was not held


async def test_a_leg_that_cannot_connect_takes_the_engine_out_until_a_probe_answers(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # An engine refusing connections fails every leg at once and looks idle, so it would
    # draw most new requests until its probes had failed failure_threshold times.
    rig = await start(nursery, config(recovery={"breaker": {"failure_threshold": 5}}))
    d0 = rig.engine("d0")
    await rig.at(0.5)
    rig.prober.health_of["d0"] = REFUSED
    rig.recovery.leg_failed(d0, "decode", unreachable("d0", "decode"))
    assert rig.reason("d0") == (
        "unreachable: decode leg could not connect (decode engine d0: connect to "
        "127.0.0.1:10 failed: connection refused); until a probe answers"
    )
    await trio.testing.wait_all_tasks_blocked()
    assert ("d0", rig.t0 + 0.5) in rig.prober.probes  # at once, not at +1
    await rig.at(1.5)  # probes at +0.5 and +1.5 refused too: still out
    assert (rig.reason("d0") or "").startswith("unreachable: ")
    rig.prober.health_of["d0"] = HEALTHY
    await rig.at(2.5)  # the next probe answers: back, with no restart hold
    assert rig.reason("d0") is None
    assert changes(rig, "reachability") == [
        ("d0", None, "reachable", "unreachable"),
        ("d0", None, "unreachable", "reachable"),
    ]
    assert changes(rig, "health") == []  # two refused probes, under failure_threshold=3
    # A blip: the probe sent at once answers, so the engine was out for no time at all.
    await rig.at(3.2)
    rig.recovery.leg_failed(d0, "decode", unreachable("d0", "decode"))
    assert rig.reason("d0") is not None
    await trio.testing.wait_all_tasks_blocked()
    assert rig.reason("d0") is None
    assert trio.current_time() == rig.t0 + 3.2
    # Other failures leave it in placement (the breaker and quarantine judge those).
    rig.recovery.leg_failed(d0, "decode", failure("d0", "decode"))
    assert rig.reason("d0") is None


async def test_only_a_probe_sent_after_the_failed_connect_returns_the_engine(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, config())
    d0 = rig.engine("d0")
    rig.prober.health_delay["d0"] = 0.5
    await rig.at(1.2)  # the probe sent at +1 is under way
    rig.recovery.leg_failed(d0, "decode", unreachable("d0", "decode"))
    await rig.at(1.5)  # its answer predates the refusal: another probe at once
    assert (rig.reason("d0") or "").startswith("unreachable: ")
    assert [t - rig.t0 for e, t in rig.prober.probes if e == "d0"] == [0.0, 1.0, 1.5]
    await rig.at(2.0)
    assert rig.reason("d0") is None


# ---------------------------------------------------------------- breakers


async def test_decode_failures_open_only_that_engines_decode_breaker(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, config())
    d0 = rig.engine("d0")
    for _ in range(3):
        rig.recovery.leg_failed(d0, "decode", failure("d0", "decode"))
    assert rig.breaker("d0", "decode") is BreakerState.OPEN
    assert rig.breaker("d0", "prefill") is BreakerState.CLOSED
    assert rig.breaker("p0", "prefill") is BreakerState.CLOSED
    assert rig.breaker("p0", "decode") is BreakerState.CLOSED
    assert rig.reason("d0", "decode") == "decode breaker open"
    assert rig.reason("d0", "prefill") is None
    await rig.at(3.9)
    assert rig.prober.verifications == []
    await rig.at(4.0)  # recovery.breaker.open_s=4: half-open, verified with p0 as producer
    (verification,) = rig.prober.verifications
    assert attrs.astuple(verification)[:4] == ("d0", "decode", "p0", "d0")
    assert rig.breaker("d0", "decode") is BreakerState.CLOSED
    assert changes(rig, "breaker") == [
        ("d0", "decode", "closed", "open"),
        ("d0", "decode", "open", "half_open"),
        ("d0", "decode", "half_open", "closed"),
    ]


async def test_a_prefill_failure_never_touches_the_decode_engines_breaker(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, config())
    p0, d0 = rig.engine("p0"), rig.engine("d0")
    for _ in range(5):
        # The pair's request failed in its prefill leg: recovery is told about p0 only,
        # and even if a caller passed the other engine, failure.phase decides the breaker.
        rig.recovery.leg_failed(p0, "prefill", failure("p0", "prefill"))
    assert rig.breaker("p0", "prefill") is BreakerState.OPEN
    assert rig.breaker("d0", "decode") is BreakerState.CLOSED
    assert rig.breaker("d0", "prefill") is BreakerState.CLOSED
    assert rig.reason("d0") is None
    assert d0.quarantined_until == -math.inf


async def test_client_errors_and_busy_engines_never_count(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, config(recovery={"failure_quarantine_s": 5.0}))
    d0 = rig.engine("d0")
    for status in (400, 404, 422, 429) * 5:
        rig.recovery.leg_failed(d0, "decode", failure("d0", "decode", status=status, counts=False))
    assert rig.breaker("d0", "decode") is BreakerState.CLOSED
    assert rig.reason("d0") is None


async def test_a_failed_verification_reopens_for_another_open_s(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, config())
    d0 = rig.engine("d0")
    rig.prober.verify_of["d0"] = VerifyResult("failed", "decode leg on d0 returned HTTP 500")
    for _ in range(3):
        rig.recovery.leg_failed(d0, "decode", failure("d0", "decode"))
    await rig.at(4.0)
    assert rig.breaker("d0", "decode") is BreakerState.OPEN
    del rig.prober.verify_of["d0"]
    await rig.at(8.0)
    assert [v.at - rig.t0 for v in rig.prober.verifications] == [4.0, 4.0, 8.0]
    assert rig.breaker("d0", "decode") is BreakerState.CLOSED


async def test_inconclusive_verification_retries_after_a_probe_interval(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, config())
    d0 = rig.engine("d0")
    rig.prober.verify_of["d0"] = VerifyResult("inconclusive", "control pool of d0 exhausted")
    for _ in range(3):
        rig.recovery.leg_failed(d0, "decode", failure("d0", "decode"))
    await rig.at(6.5)
    assert [v.at - rig.t0 for v in rig.prober.verifications] == [4.0, 5.0, 6.0]
    assert rig.breaker("d0", "decode") is BreakerState.HALF_OPEN


async def test_aggregate_failures_count_on_both_breakers_and_verify_locally(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    cfg = config(engines=[{"id": "a0", "url": "http://127.0.0.1:9", "role": "both"}])
    rig = await start(nursery, cfg)
    a0 = rig.engine("a0")
    for _ in range(3):
        rig.recovery.leg_failed(a0, "aggregate", failure("a0", "aggregate"))
    assert rig.breaker("a0", "prefill") is BreakerState.OPEN
    assert rig.breaker("a0", "decode") is BreakerState.OPEN
    await rig.at(4.0)
    assert [attrs.astuple(v)[:4] for v in rig.prober.verifications] == [
        ("a0", "prefill", "a0", "a0"),
        ("a0", "decode", "a0", "a0"),
    ]
    assert rig.reason("a0") is None


# ---------------------------------------------------------------- standby partners


def sglang_pd() -> Config:
    """1P1D SGLang: each engine's only partner is the other, so when both are out each
    is verified with the other on standby."""
    return config(
        engines=[
            {"id": "p0", "url": "http://127.0.0.1:9", "role": "prefill", "dialect": "sglang"},
            {"id": "d0", "url": "http://127.0.0.1:10", "role": "decode", "dialect": "sglang"},
        ]
    )


def verified(rig: Rig, engine_id: str) -> tuple[list[float], dict[str, object]]:
    """When `engine_id` was verified, and its last verification as the state shows it."""
    record = rig.recovery.record(engine_id)
    assert record is not None
    assert record.last_verification is not None
    times = [v.at - rig.t0 for v in rig.prober.verifications if v.subject == engine_id]
    return times, to_json(record.last_verification)


def health_changes(rig: Rig, engine_id: str) -> list[tuple[str, str]]:
    return [(old, new) for engine, _, old, new in changes(rig, "health") if engine == engine_id]


async def test_a_standby_partner_failure_is_not_counted_against_the_subject(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    rig = await start(nursery, sglang_pd())
    for engine_id in ("p0", "d0"):
        rig.prober.health_of[engine_id] = UNHEALTHY
    await rig.at(3.0)  # both ejected
    rig.prober.health_of.clear()
    # Each is the only engine of its role: one good probe (+4) and each is verifying.
    # Whether one's pair at +4 finds the other answering depends on which probe ran
    # first, so those pairs are inconclusive; from +5 each is verified with the other
    # on standby.
    exhausted = VerifyResult("inconclusive", "control pool exhausted")
    rig.prober.verify_of.update(p0=exhausted, d0=exhausted)
    await rig.at(4.0)
    assert health_changes(rig, "p0") == [("up", "ejected"), ("ejected", "verifying")]
    assert health_changes(rig, "d0") == [("up", "ejected"), ("ejected", "verifying")]
    rig.prober.verifications.clear()
    # The decode leg's 500 may be the prefill's doing (a KV transfer that failed), so it
    # proves nothing about p0; the dropped connection is d0's own.
    rig.prober.verify_of["p0"] = VerifyResult("failed", "decode leg on d0 returned HTTP 500")
    rig.prober.verify_of["d0"] = VerifyResult(
        "failed", "decode leg on d0: server disconnected", culprit="d0"
    )
    with caplog.at_level(logging.INFO, logger="narwhal"):
        await rig.at(5.0)
    times, last = verified(rig, "p0")
    assert (times, last["partner"], last["standby"], last["outcome"]) == (
        [5.0],
        "d0",
        True,
        "inconclusive",
    )
    assert last["detail"] == (
        "decode leg on d0 returned HTTP 500; not counted against p0: either engine may have "
        "caused it, and d0 is unverified itself"
    )
    # Not a failed verification: no ejection, no new readmission streak, still verifying.
    assert health_changes(rig, "p0") == [("up", "ejected"), ("ejected", "verifying")]
    assert rig.reason("p0") == (
        "ejected: 1 good probe of recovery.health.readmit_successes=2, enough while no other "
        "engine in placement takes prefill work; verifying before readmission"
    )
    registry = rig.ctx.metrics.registry
    counted = {
        outcome: registry.get_sample_value(
            "narwhal_verifications_total",
            {"engine": "p0", "purpose": "readmission", "outcome": outcome},
        )
        for outcome in ("failed", "inconclusive")
    }
    assert counted == {"failed": None, "inconclusive": 2.0}  # +4 and +5
    (logged,) = [
        r
        for r in caplog.records
        if getattr(r, "event", None) == "verification"
        and r.__dict__["engine"] == "p0"
        and r.__dict__["detail"].startswith("decode leg on d0 returned HTTP 500")
    ]
    assert (logged.__dict__["partner"], logged.__dict__["standby"]) == ("d0", True)
    # d0's own failure still counts against it.
    assert verified(rig, "d0")[1]["outcome"] == "failed"
    assert health_changes(rig, "d0")[-1] == ("verifying", "ejected")
    assert rig.reason("d0") == "ejected: verification failed: decode leg on d0: server disconnected"

    # p0 is tried again a probe interval later, not after a new streak of good probes.
    # d0 is verifying again after one good probe (+6); its pair then may or may not find
    # p0 readmitted, so it is inconclusive.
    del rig.prober.verify_of["p0"]
    rig.prober.verify_of["d0"] = exhausted
    await rig.at(6.0)
    times, last = verified(rig, "p0")
    assert (times, last["standby"], last["outcome"]) == ([5.0, 6.0], True, "ok")
    assert rig.reason("p0") is None
    # p0's pair passing readmits p0 alone: d0 waits for a verification of its own.
    assert (rig.reason("d0") or "").startswith("ejected: 1 good probe")

    # With p0 in service, d0's partner is no longer on standby: any failure counts.
    rig.prober.verify_of["d0"] = VerifyResult("failed", "decode leg on d0 returned HTTP 500")
    await rig.at(7.0)
    times, last = verified(rig, "d0")
    assert (times, last["partner"], last["standby"], last["outcome"]) == (
        [5.0, 5.0, 6.0, 7.0, 7.0],  # each failed pair was sent again once
        "p0",
        False,
        "failed",
    )
    assert rig.reason("d0") == (
        "ejected: verification failed: decode leg on d0 returned HTTP 500; 2 failed in a "
        "row, so the next waits 2 s (doubling from recovery.health.interval_s=1.0, up to 8 "
        "of them), or 1 s while no other engine in placement takes decode work"
    )
    # But not a failure that is certainly the in-service partner's own: its serving traffic
    # and breakers judge p0.
    rig.prober.verify_of["d0"] = VerifyResult(
        "failed", "prefill leg on p0: connection refused", culprit="p0"
    )
    await rig.at(8.0)  # a good probe at +8, and d0 is the only decode engine: verified then
    times, last = verified(rig, "d0")
    assert (times[-1], last["standby"], last["outcome"]) == (8.0, False, "inconclusive")
    assert last["detail"] == (
        "prefill leg on p0: connection refused; not counted against d0: the failure is p0's own"
    )
    assert health_changes(rig, "d0")[-1] == ("ejected", "verifying")


async def test_a_half_open_breaker_is_not_reopened_by_its_standby_partner(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, sglang_pd())
    for engine_id, phase in (("p0", "prefill"), ("d0", "decode")):
        for _ in range(3):
            rig.recovery.leg_failed(rig.engine(engine_id), phase, failure(engine_id, phase))
    # At +4 both breakers are half-open: each engine's partner is out, on standby.
    refused = VerifyResult("failed", "decode leg on d0: connection refused", culprit="d0")
    rig.prober.verify_of.update(p0=refused, d0=refused)
    await rig.at(4.0)
    _, last = verified(rig, "p0")
    assert last["detail"] == (
        "decode leg on d0: connection refused; not counted against p0: the failure is d0's own"
    )
    assert rig.breaker("p0", "prefill") is BreakerState.HALF_OPEN
    assert rig.breaker("d0", "decode") is BreakerState.OPEN
    record = rig.recovery.record("p0")
    assert record is not None
    assert record.breakers["prefill"].opened_total == 1
    del rig.prober.verify_of["p0"]
    await rig.at(5.0)  # p0 again a probe interval later; d0 reopened for open_s=4
    assert verified(rig, "p0")[0] == [4.0, 5.0]
    assert rig.breaker("p0", "prefill") is BreakerState.CLOSED
    assert rig.breaker("d0", "decode") is BreakerState.OPEN
    assert [c for c in changes(rig, "breaker") if c[0] == "p0"] == [
        ("p0", "prefill", "closed", "open"),
        ("p0", "prefill", "open", "half_open"),
        ("p0", "prefill", "half_open", "closed"),
    ]


def sglang_ppd() -> Config:
    """2P1D SGLang: d0 has two prefill servers to pair with."""
    return config(
        engines=[
            {"id": "p0", "url": "http://127.0.0.1:9", "role": "prefill", "dialect": "sglang"},
            {"id": "p1", "url": "http://127.0.0.1:11", "role": "prefill", "dialect": "sglang"},
            {"id": "d0", "url": "http://127.0.0.1:10", "role": "decode", "dialect": "sglang"},
        ]
    )


@pytest.mark.parametrize("refuses", ["key", "model"])
async def test_a_standby_partner_refusing_the_key_or_the_model_is_skipped(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, refuses: str
) -> None:
    rig = await start(nursery, sglang_ppd())
    for engine_id in ("p0", "p1", "d0"):
        rig.prober.health_of[engine_id] = UNHEALTHY
    await rig.at(3.0)  # all ejected
    del rig.prober.health_of["p0"], rig.prober.health_of["p1"]
    # p0 answers its health probe but refuses the key (or the model): its leg of d0's
    # pair would be refused, naming p0, and d0's readmission would wait a probe interval
    # for nothing.
    if refuses == "key":
        rig.engine("p0").note_key_refused(AUTH_REFUSED)
        rig.prober.key_of["p0"] = KEY_REFUSED
    else:
        model_refused(rig.engine("p0"), "The model `m` does not exist.", rig.ctx.config)
    # p1 stays out of service (verifying), on standby for d0.
    rig.prober.verify_of["p1"] = VerifyResult("inconclusive", "control pool of p1 exhausted")
    await rig.at(4.0)  # p1 answers; d0 does from +5, when p1 has answered a probe already
    del rig.prober.health_of["d0"]
    await rig.at(5.0)  # one good probe (the only decode engine), then d0 is verified
    times, last = verified(rig, "d0")
    assert (times, last["partner"], last["standby"], last["outcome"]) == ([5.0], "p1", True, "ok")
    assert rig.reason("d0") is None


async def test_a_subject_whose_only_standby_partners_refuse_the_key_is_skipped_saying_so(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, sglang_pd())
    for engine_id in ("p0", "d0"):
        rig.prober.health_of[engine_id] = UNHEALTHY
    await rig.at(3.0)  # both ejected
    rig.prober.health_of.clear()
    rig.engine("p0").note_key_refused(AUTH_REFUSED)
    rig.prober.key_of["p0"] = KEY_REFUSED
    await rig.at(5.0)  # verifying, but the only prefill server refuses the key
    assert rig.prober.verifications == []
    _, last = verified(rig, "d0")
    assert (last["partner"], last["standby"], last["outcome"]) == (None, False, "inconclusive")
    assert str(last["detail"]).startswith(
        "skipped: no prefill engine that answers its health probe takes narwhal's API key and "
        f"serves the model to pair with d0 (p0 {AUTH_REFUSED}; an sglang server's role is "
        "fixed when it is launched"
    )
    rig.prober.key_of["p0"] = KEY_ACCEPTED
    # p0 takes the key again at its next probe (+6); d0 is paired with it then, or a
    # probe interval later if d0's own turn at +6 came first.
    await rig.at(7.0)
    times, last = verified(rig, "d0")
    assert (len(times), last["partner"], last["outcome"]) == (1, "p0", "ok")
    assert rig.reason("d0") is None


# ---------------------------------------------------------------- quarantine


async def test_quarantine_excludes_then_expires_on_time(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, config(recovery={"failure_quarantine_s": 2.0}))
    p0 = rig.engine("p0")
    rig.recovery.leg_failed(p0, "prefill", failure("p0", "prefill"))
    assert rig.reason("p0") == "quarantined"
    await rig.at(1.0)
    rig.recovery.leg_failed(p0, "prefill", failure("p0", "prefill"))  # extends to +3
    await rig.at(2.9)
    assert rig.reason("p0") == "quarantined"
    await rig.at(3.0)
    assert rig.reason("p0") is None
    assert changes(rig, "quarantine") == [
        ("p0", None, "released", "quarantined"),
        ("p0", None, "quarantined", "released"),
    ]


async def test_quarantine_zero_disables_it(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, config())
    rig.recovery.leg_failed(rig.engine("p0"), "prefill", failure("p0", "prefill"))
    assert rig.reason("p0") is None


# ---------------------------------------------------------------- API key

AUTH_REFUSED = "refused narwhal's API key (HTTP 401)"


def key_checks(rig: Rig, engine_id: str, outcome: str) -> float | None:
    return rig.ctx.metrics.registry.get_sample_value(
        "narwhal_auth_checks_total", {"engine": engine_id, "outcome": outcome}
    )


async def test_a_refused_key_is_checked_with_each_good_probe_until_it_is_accepted(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    rig = await start(nursery, config())
    rig.engine("d0").note_key_refused(AUTH_REFUSED)  # as the request path sets it
    rig.prober.key_of["d0"] = KEY_REFUSED
    await rig.at(2.5)
    # Only the refused engine is checked, right after each probe (recovery.health.interval_s).
    assert rig.prober.key_checks == [("d0", rig.t0 + 1.0), ("d0", rig.t0 + 2.0)]
    assert rig.reason("d0") == f"auth refused: {AUTH_REFUSED}"
    record = rig.recovery.record("d0")
    assert record is not None
    assert to_json(record.snapshot(trio.current_time()))["auth"] == {
        "refused": AUTH_REFUSED,
        "last_check": {"outcome": "refused", "detail": KEY_REFUSED.detail, "age_s": 0.5},
    }
    rig.prober.key_of["d0"] = KEY_ACCEPTED  # the engine was relaunched with narwhal's key
    with caplog.at_level(logging.INFO, logger="narwhal"):
        await rig.at(3.0)
        assert rig.reason("d0") is None
        await rig.at(5.0)
    assert len(rig.prober.key_checks) == 3  # not checked once it takes the key
    (logged,) = [r for r in caplog.records if r.__dict__.get("event") == "engine_auth_recovered"]
    assert logged.getMessage() == (
        "engine d0 accepts narwhal's requests again (GET /v1/models returned HTTP 200) and "
        f"takes new work; it was out with auth refused: {AUTH_REFUSED}"
    )
    assert (key_checks(rig, "d0", "refused"), key_checks(rig, "d0", "accepted")) == (2.0, 1.0)
    assert key_checks(rig, "p0", "refused") is None


async def test_a_key_check_waits_for_a_good_probe_and_only_200_clears_the_refusal(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, config())
    rig.engine("d0").note_key_refused(AUTH_REFUSED)
    rig.prober.health_of["d0"] = UNHEALTHY
    await rig.at(2.0)
    assert rig.prober.key_checks == []  # the health probes judge an engine that is down
    rig.prober.health_of["d0"] = HEALTHY
    rig.prober.key_of["d0"] = KeyCheck("failed", "GET /v1/models returned HTTP 503")
    await rig.at(3.0)
    assert rig.reason("d0") == f"auth refused: {AUTH_REFUSED}"
    rig.prober.key_of["d0"] = KeyCheck("inconclusive", EXHAUSTED.detail)
    await rig.at(4.0)
    assert rig.reason("d0") == f"auth refused: {AUTH_REFUSED}"
    assert [at - rig.t0 for _, at in rig.prober.key_checks] == [3.0, 4.0]
    assert key_checks(rig, "d0", "failed") == key_checks(rig, "d0", "inconclusive") == 1.0


class SlowKeyCheck(FakeProber):
    """Key checks take half a second to answer (recorded when sent)."""

    async def check_key(self, engine: EngineState, config: Config) -> KeyCheck:
        result = await super().check_key(engine, config)
        await trio.sleep(0.5)
        return result


async def test_a_key_check_does_not_clear_a_refusal_recorded_while_it_was_under_way(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, config(), SlowKeyCheck())
    d0 = rig.engine("d0")
    key_refused(d0, 401, "Unauthorized", rig.ctx.config)  # a request met the refusal
    await rig.at(1.25)  # the key check sent at +1 has not answered yet
    key_refused(d0, 401, "Unauthorized", rig.ctx.config)  # another request meets it
    await rig.at(1.5)  # the check answers 200, but the refusal came after it was sent
    assert rig.reason("d0") == "auth refused: requires an API key and narwhal sends none (HTTP 401)"
    record = rig.recovery.record("d0")
    assert record is not None
    assert record.last_key_check == KeyCheck(
        "accepted",
        "GET /v1/models returned HTTP 200; sent before the engine's latest refusal, which "
        "it does not clear",
    )
    await rig.at(3.0)  # the next check, after the next probe (+2.5), clears it
    assert [at - rig.t0 for _, at in rig.prober.key_checks] == [1.0, 2.5]
    assert rig.reason("d0") is None


@pytest.fixture
async def keyed(nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> Rig:
    """The test fleet configured with an API key (engine.api_key_file), logs captured.
    (pytest-trio takes the clock from the test's own arguments.)"""
    caplog.set_level(logging.INFO, logger="narwhal")
    path = tmp_path / "engine-api-key"
    path.write_text("sk-narwhal\n")
    return await start(nursery, config(engine={"api_key_file": str(path)}))


def refused_leg(engine: EngineState, leg: str = "decode") -> VerifyResult:
    """The prober's report of a verification pair whose `leg` on `engine` got HTTP 401."""
    return VerifyResult(
        "refused",
        f"{leg} leg on {engine.id}: {WRONG_KEY}",
        refusal=KeyRefusal(engine, 401, "Unauthorized"),
    )


async def test_a_readmission_verification_refused_for_the_key_waits_for_the_key_check(
    keyed: Rig, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    rig = keyed
    d0 = rig.engine("d0")
    rig.prober.verify_of["d0"] = refused_leg(d0)
    rig.prober.key_of["d0"] = KEY_REFUSED
    await rig.at(1.5)
    # Relaunched with another key: a new instance, held, then verified (at once: no other
    # engine takes decode work, so the hold is cut short).
    rig.prober.health_of["d0"] = attrs.evolve(HEALTHY, identity=(("instance_id", "b"),))
    await rig.at(2.0)
    assert [v.at - rig.t0 for v in rig.prober.verifications] == [2.0]
    # Out for the key, as a refused request would put it, not for a failed verification.
    assert rig.reason("d0") == f"auth refused: {AUTH_REFUSED}"
    assert changes(rig, "health") == []
    record = rig.recovery.record("d0")
    assert record is not None
    assert record.hold.active
    assert record.last_verification is not None
    assert record.last_verification.outcome == "refused"
    await rig.at(4.5)
    # Not verified again while the key is refused; its key is checked instead.
    assert len(rig.prober.verifications) == 1
    assert [at - rig.t0 for _, at in rig.prober.key_checks] == [3.0, 4.0]
    rig.prober.key_of["d0"] = KEY_ACCEPTED
    del rig.prober.verify_of["d0"]
    await rig.at(5.0)  # the key is accepted, and the verification follows at once
    assert [v.at - rig.t0 for v in rig.prober.verifications] == [2.0, 5.0]
    assert rig.reason("d0") is None
    assert changes(rig, "hold") == [
        ("d0", None, "released", "held"),
        ("d0", None, "held", "released"),
    ]
    logged = [
        (r.levelname, r.getMessage())
        for r in caplog.records
        if r.__dict__.get("event") in ("engine_auth_refused", "engine_auth_recovered")
    ]
    assert logged == [
        (
            "ERROR",
            "engine d0 refused narwhal's API key (HTTP 401: Unauthorized); check "
            "engine.api_key_file against the engine's --api-key; it takes no new work until "
            "it accepts the key again (checked with each health probe, "
            "recovery.health.interval_s=1.0) or a reload",
        ),
        (
            "INFO",
            "engine d0 accepts narwhal's requests again (GET /v1/models returned HTTP 200); "
            f"it was out with auth refused: {AUTH_REFUSED}; still out: restart hold",
        ),
    ]


async def test_a_breaker_verification_refused_for_the_key_stays_half_open(
    keyed: Rig, autojump_clock: trio.testing.MockClock
) -> None:
    rig = keyed
    d0 = rig.engine("d0")
    rig.prober.verify_of["d0"] = refused_leg(d0)
    rig.prober.key_of["d0"] = KEY_REFUSED
    for _ in range(3):
        rig.recovery.leg_failed(d0, "decode", failure("d0", "decode"))
    await rig.at(6.5)  # half-open at +4 (recovery.breaker.open_s=4), and refused there
    assert [v.at - rig.t0 for v in rig.prober.verifications] == [4.0]
    assert rig.breaker("d0", "decode") is BreakerState.HALF_OPEN  # not reopened
    assert rig.reason("d0") == f"auth refused: {AUTH_REFUSED}"
    rig.prober.key_of["d0"] = KEY_ACCEPTED
    del rig.prober.verify_of["d0"]
    await rig.at(7.0)
    assert [v.at - rig.t0 for v in rig.prober.verifications] == [4.0, 7.0]
    assert changes(rig, "breaker") == [
        ("d0", "decode", "closed", "open"),
        ("d0", "decode", "open", "half_open"),
        ("d0", "decode", "half_open", "closed"),
    ]


async def test_a_partner_refusing_the_key_leaves_placement_and_the_subject_is_not_failed(
    keyed: Rig, autojump_clock: trio.testing.MockClock
) -> None:
    rig = keyed
    await eject_d0_then_answer(rig)
    rig.prober.verify_of["d0"] = refused_leg(rig.engine("p0"), "prefill")
    # Verifying after one good probe (d0 is the only decode engine): p0 refuses the key
    # on its leg of d0's pair.
    await rig.at(4.0)
    assert rig.reason("p0") == f"auth refused: {AUTH_REFUSED}"
    del rig.prober.verify_of["d0"]
    await rig.at(5.0)  # a probe interval later, without p0
    assert [attrs.astuple(v)[:4] for v in rig.prober.verifications] == [
        ("d0", "decode", "p0", "d0"),
        ("d0", "decode", "d0", "d0"),
    ]
    assert rig.reason("d0") is None
    assert changes(rig, "health") == D0_READMITTED


async def test_a_refused_identity_check_takes_the_engine_out_unless_the_key_check_passes(
    keyed: Rig, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    rig = keyed
    d0 = rig.engine("d0")
    detail = "GET /health returned HTTP 200; GET /version returned HTTP 401: refused"
    refused = ProbeResult("ok", detail, True, None, KeyRefusal(d0, 401, "Unauthorized"))

    def logged(event: str) -> list[str]:
        return [r.levelname for r in caplog.records if r.__dict__.get("event") == event]

    rig.prober.health_of["d0"] = refused
    rig.prober.key_of["d0"] = KEY_REFUSED
    await rig.at(3.0)
    # Out as a refused request would put it, from the first refused probe on: a key check
    # confirmed the refusal at once, and one follows each good probe after that.
    assert rig.reason("d0") == f"auth refused: {AUTH_REFUSED}"
    assert [at - rig.t0 for _, at in rig.prober.key_checks] == [1.0, 2.0, 3.0]
    record = rig.recovery.record("d0")
    assert record is not None
    health = to_json(record.snapshot(trio.current_time()))["health"]
    assert isinstance(health, dict)
    assert health["last_probe"]["detail"] == detail
    assert record.identity.identity == HEALTHY.identity  # the last one seen
    assert logged("identity_refused") == ["WARNING"]  # three refused probes, one warning
    assert logged("engine_auth_refused") == ["ERROR"]
    rig.prober.health_of["d0"] = HEALTHY
    rig.prober.key_of["d0"] = KEY_ACCEPTED
    await rig.at(4.0)
    assert rig.reason("d0") is None
    rig.prober.health_of["d0"] = refused
    await rig.at(5.0)  # refused again after /version answered: said again
    assert logged("identity_refused") == ["WARNING", "WARNING"]
    # But the key check accepts the key: only /version is guarded more (an admin-only
    # route, a proxy), so the engine stays in, rather than leave at every probe and come
    # back at every key check.
    assert rig.reason("d0") is None
    assert logged("engine_auth_refused") == ["ERROR"]
    warning = [r for r in caplog.records if r.__dict__.get("event") == "identity_refused"][-1]
    assert "only /version refuses the key" in warning.getMessage()
    await rig.at(8.0)  # and it does not flap: no refusal recorded at each probe
    assert rig.reason("d0") is None
    assert logged("identity_refused") == ["WARNING", "WARNING"]
    assert logged("engine_auth_refused") == ["ERROR"]


# ---------------------------------------------------------------- KV transfers


def sglang_2p2d() -> Config:
    return config(
        engines=[
            {"id": engine_id, "url": f"http://127.0.0.1:{port}", "role": role, "dialect": "sglang"}
            for engine_id, port, role in (
                ("p0", 9, "prefill"),
                ("p1", 10, "prefill"),
                ("d0", 11, "decode"),
                ("d1", 12, "decode"),
            )
        ],
        recovery={
            "failure_quarantine_s": 2.0,
            "breaker": {"failure_threshold": 3, "window_s": 30.0, "failure_ratio": 0.5},
        },
    )


def transfer_failed(rig: Rig, prefill: str, decode: str, reporter: str) -> None:
    """What the request path reports when an SGLang pair's KV transfer failed: a failure
    of the reporting leg that counts against neither engine, naming the other."""
    phase = "decode" if reporter == decode else "prefill"
    failed = failure(reporter, phase, status=500, counts=False)
    failed.code = "kv_transfer_failed"
    failed.partner_id = prefill if reporter == decode else decode
    rig.recovery.leg_failed(rig.engine(reporter), phase, failed)


def served(rig: Rig, prefill: str, decode: str) -> None:
    rig.recovery.leg_ok(rig.engine(prefill), "prefill", 0.05)
    rig.recovery.leg_ok(rig.engine(decode), "decode", 0.5)


async def test_a_decode_engine_whose_transfers_fail_while_its_peers_work_is_counted(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # d1's KV pulls fail (a bad NIC) while it answers its probes. Each failure names no
    # culprit, but d1 fails every pair while d0 fails none, with the same prefill servers.
    rig = await start(nursery, sglang_2p2d())
    for n in range(4):  # few good legs before the fault: the breaker's ratio is over the window
        served(rig, f"p{n % 2}", f"d{n % 2}")
    for n in range(2):
        transfer_failed(rig, f"p{n % 2}", "d1", reporter="d1")
        served(rig, f"p{n % 2}", "d0")
    assert rig.breaker("d1", "decode") is BreakerState.CLOSED
    assert rig.reason("d1") is None  # two failures could be anything's
    transfer_failed(rig, "p0", "d1", reporter="p0")  # either side may report it
    assert rig.reason("d1") == "quarantined"
    transfer_failed(rig, "p1", "d1", reporter="d1")
    transfer_failed(rig, "p0", "d1", reporter="d1")
    assert rig.breaker("d1", "decode") is BreakerState.OPEN
    (counted, *_) = [c for c in rig.recovery.recent_changes if c.kind == "quarantine"]
    assert counted.engine == "d1"
    # The prefill servers failed only the pairs with d1, as much as each other: neither
    # is counted, nor is d0.
    for engine_id in ("p0", "p1", "d0"):
        assert rig.reason(engine_id) is None
        assert rig.breaker(engine_id, "prefill") is BreakerState.CLOSED
        assert rig.breaker(engine_id, "decode") is BreakerState.CLOSED
    assert (
        rig.ctx.metrics.registry.get_sample_value(
            "narwhal_counted_failures_total", {"engine": "d1", "phase": "decode"}
        )
        == 3
    )


async def test_transfer_failures_name_the_engine_in_the_log(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    rig = await start(nursery, sglang_2p2d())
    for n in range(10):
        served(rig, f"p{n % 2}", "d0")
    with caplog.at_level(logging.INFO, logger="narwhal"):
        for n in range(3):
            transfer_failed(rig, f"p{n % 2}", "d1", reporter="d1")
    (line,) = [r for r in caplog.records if r.__dict__.get("counted") is True]
    assert line.getMessage().endswith(
        "; counted against d1: 3 of its last 3 legs failed their KV transfer within "
        "recovery.breaker.window_s=30.0, while d0 failed 0 of its 10"
    )


async def test_a_prefill_engine_whose_transfers_fail_is_counted_not_its_decoders(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, sglang_2p2d())
    for n in range(20):
        served(rig, "p0", f"d{n % 2}")
    for n in range(6):
        # The decode servers report p1's failed transfers; they also serve p0's pairs.
        transfer_failed(rig, "p1", f"d{n % 2}", reporter=f"d{n % 2}")
        served(rig, "p0", f"d{n % 2}")
    assert rig.breaker("p1", "prefill") is BreakerState.OPEN
    for engine_id in ("d0", "d1"):
        assert rig.breaker(engine_id, "decode") is BreakerState.CLOSED
        assert rig.reason(engine_id) is None


async def test_with_one_prefill_server_a_decode_engine_failing_its_transfers_is_counted(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    cfg = sglang_2p2d()
    rig = await start(nursery, attrs.evolve(cfg, engines=cfg.engines[:1] + cfg.engines[2:]))
    for _ in range(10):
        served(rig, "p0", "d0")
    for _ in range(3):
        transfer_failed(rig, "p0", "d1", reporter="d1")
    assert rig.reason("d1") == "quarantined"  # p0 transfers to d0; d1 fails with it
    assert rig.reason("p0") is None


async def test_rare_transfer_failures_and_a_lone_role_count_against_nobody(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, sglang_2p2d())
    for n in range(200):  # one pair in twenty fails, spread over the fleet
        if n % 20 == 19:
            transfer_failed(rig, f"p{n % 2}", f"d{(n // 2) % 2}", reporter=f"d{(n // 2) % 2}")
        else:
            served(rig, f"p{n % 2}", f"d{(n // 2) % 2}")
    assert all(rig.reason(e) is None for e in ("p0", "p1", "d0", "d1"))
    # 1P1D: every transfer fails, but with nothing to compare, neither is blamed.
    pd = await start(nursery, sglang_pd())
    for _ in range(10):
        transfer_failed(pd, "p0", "d0", reporter="d0")
    assert pd.reason("p0") is None
    assert pd.reason("d0") is None


# ---------------------------------------------------------------- residuals


def residual_config(*, engines: int = 2) -> Config:
    """`engines` of each role (another of its role must be available for a slow engine
    to be ejected), 3 residuals over 30 s at a ratio of 3 eject."""
    return config(
        engines=[
            {
                "id": f"{role[0]}{i}",
                "url": f"http://127.0.0.1:{20 + 2 * i + (role == 'decode')}",
                "role": role,
            }
            for i in range(engines)
            for role in ("prefill", "decode")
        ],
        recovery={"health": {"min_samples": 3, "window_s": 30.0, "eject_ratio": 3.0}},
    )


async def test_latency_residuals_eject_after_min_samples_one_per_pass(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    predictions: list[tuple[str, str, LegObservation]] = []

    def predictor(engine: EngineState, phase: str, observation: LegObservation) -> float | None:
        predictions.append((engine.id, phase, observation))
        return 0.1 if engine.id == "d0" else None

    rig = await start(nursery, residual_config(), predictor=predictor)
    d0 = rig.engine("d0")
    for pass_number in range(3):
        for _ in range(5):  # five legs between passes still make one residual
            rig.recovery.leg_ok(d0, "decode", 0.5)
        rig.recovery.leg_ok(rig.engine("p0"), "prefill", 0.5)
        residuals = rig.recovery.residual_pass(trio.current_time())
        assert residuals == {"d0": pytest.approx(5.0)}
        if pass_number < 2:
            assert rig.reason("d0") is None
    assert rig.reason("d0") == (
        "ejected: latency: median observed/predicted ratio 5.00 over 3 residuals in "
        "recovery.health.window_s=30.0 >= recovery.health.eject_ratio=3.0; readmission "
        "starts after recovery.health.window_s=30.0"
    )
    assert len(predictions) == 6
    # Ejected engines contribute nothing; readmission goes through probes and verification.
    rig.recovery.leg_ok(d0, "decode", 0.5)
    assert rig.recovery.residual_pass(trio.current_time()) == {}
    # A slow engine answers its probes at once, and a verification pair is not timed
    # against the profile: readmitted at once, it would be back on its residuals' cycle.
    # Its good probes count only after the window its residuals covered.
    await rig.at(29.9)
    assert rig.reason("d0") is not None
    assert rig.prober.verifications == []
    await rig.at(30.0)  # recovery.health.readmit_successes=2 good probes: 30, 31
    assert rig.reason("d0") is not None
    await rig.at(31.0)
    assert rig.reason("d0") is None
    assert [v.at - rig.t0 for v in rig.prober.verifications] == [31.0]


async def test_a_busy_slow_engine_gets_a_residual_every_pass_and_is_ejected(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # A prefill engine four times slower than its profile (thermal throttling) and busy:
    # the profile predicts only its uncontended legs, and the last leg of a pass is most
    # often a contended one. Each pass must still find the pass's predictable leg.
    def predictor(engine: EngineState, phase: str, observation: LegObservation) -> float | None:
        return None if observation.contended else 0.05

    rig = await start(nursery, residual_config(), predictor=predictor)
    p0 = rig.engine("p0")
    for pass_number in range(3):
        rig.recovery.leg_ok(p0, "prefill", 0.2, prompt_tokens=100)
        for _ in range(4):
            rig.recovery.leg_ok(p0, "prefill", 0.5, prompt_tokens=100, contended=True)
        assert rig.recovery.residual_pass(trio.current_time()) == {"p0": pytest.approx(4.0)}
        if pass_number < 2:
            assert rig.reason("p0") is None
    assert rig.reason("p0") == (
        "ejected: latency: median observed/predicted ratio 4.00 over 3 residuals in "
        "recovery.health.window_s=30.0 >= recovery.health.eject_ratio=3.0; readmission "
        "starts after recovery.health.window_s=30.0"
    )


async def test_the_last_available_engine_of_its_role_is_not_ejected_for_latency(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog: Any
) -> None:
    # 1P1D: ejecting the one decode engine would stop every request for at least the
    # window, where a slow one still serves them.
    def predictor(engine: EngineState, phase: str, observation: LegObservation) -> float | None:
        return 0.1

    rig = await start(nursery, residual_config(engines=1), predictor=predictor)
    d0 = rig.engine("d0")
    with caplog.at_level(logging.WARNING, logger="narwhal.recovery"):
        for _ in range(6):
            rig.recovery.leg_ok(d0, "decode", 0.5)
            assert rig.recovery.residual_pass(trio.current_time()) == {"d0": pytest.approx(5.0)}
            await trio.sleep(1.0)
    assert rig.reason("d0") is None
    withheld = [r for r in caplog.records if getattr(r, "event", "") == "latency_ejection_withheld"]
    assert len(withheld) == 2  # each time 3 residuals say eject; they start over after it
    assert (
        withheld[0]
        .getMessage()
        .startswith(
            "engine d0 is slower than its profile (latency: median observed/predicted ratio 5.00"
        )
    )
    assert (
        withheld[0]
        .getMessage()
        .endswith("but is the last available decode engine: not ejected for latency")
    )


async def test_a_slow_engine_is_ejected_once_another_of_its_role_is_available(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    def predictor(engine: EngineState, phase: str, observation: LegObservation) -> float | None:
        return 0.1

    rig = await start(nursery, residual_config(), predictor=predictor)
    d0, d1 = rig.engine("d0"), rig.engine("d1")
    d1.operator_drain()  # the other decode engine takes no new work: d0 is the last one
    for _ in range(3):
        rig.recovery.leg_ok(d0, "decode", 0.5)
        rig.recovery.residual_pass(trio.current_time())
    assert rig.reason("d0") is None
    d1.operator_undrain()
    for _ in range(3):
        rig.recovery.leg_ok(d0, "decode", 0.5)
        rig.recovery.residual_pass(trio.current_time())
    assert (rig.reason("d0") or "").startswith("ejected: latency: median observed/predicted")


async def test_a_slow_engine_is_ejected_when_an_aggregate_engine_takes_its_work(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # With d0 out, placement sends every request to x1 (role both) as aggregate work:
    # d0 is not the last engine to take decode work, so slow, it is ejected.
    def predictor(engine: EngineState, phase: str, observation: LegObservation) -> float | None:
        return 0.1

    residuals = {"health": {"min_samples": 3, "window_s": 30.0, "eject_ratio": 3.0}}
    rig = await start(nursery, with_peer("both", recovery=residuals), predictor=predictor)
    d0 = rig.engine("d0")
    for _ in range(3):
        rig.recovery.leg_ok(d0, "decode", 0.5)
        rig.recovery.residual_pass(trio.current_time())
    assert (rig.reason("d0") or "").startswith("ejected: latency: median observed/predicted")


async def eject_d0_for_latency(nursery: trio.Nursery) -> Rig:
    """2P2D with d0 ejected for latency at +0 (`residual_config`): its good probes count
    from +30, when recovery.health.window_s has passed."""

    def predictor(engine: EngineState, phase: str, observation: LegObservation) -> float | None:
        return 0.1

    rig = await start(nursery, residual_config(), predictor=predictor)
    d0 = rig.engine("d0")
    for _ in range(3):
        rig.recovery.leg_ok(d0, "decode", 0.5)
        rig.recovery.residual_pass(trio.current_time())
    assert (rig.reason("d0") or "").startswith("ejected: latency: median observed/predicted")
    return rig


async def test_a_latency_ejected_engine_s_good_probes_count_once_its_role_is_empty(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # It was slow, not down: once d1 takes no decode work (drained at +1.5), d0 serving
    # slowly beats refusing every request until recovery.health.window_s has passed. The
    # drain gets d0 a probe at once, not at +2, and that good probe is enough on its own.
    rig = await eject_d0_for_latency(nursery)
    await rig.at(1.5)
    assert rig.prober.verifications == []
    rig.engine("d1").operator_drain()
    await rig.at(1.5)
    assert [at - rig.t0 for e, at in rig.prober.probes if e == "d0"][-2:] == [1.0, 1.5]
    assert [v.at - rig.t0 for v in rig.prober.verifications] == [1.5]
    assert rig.reason("d0") is None
    (entry,) = [c for c in rig.recovery.recent_changes if c.new == "verifying"]
    assert entry.reason == (
        "1 good probe of recovery.health.readmit_successes=2, enough while no other engine in "
        "placement takes decode work; counted 28.5 s before its latency ejection's "
        "recovery.health.window_s=30.0 ran out: slow beats refusing all decode work; "
        "verifying before readmission"
    )
    health = state_of(rig, "d0")["health"]
    assert (health["latency_cut_short_total"], health["readmission_in_s"]) == (1, None)
    assert health["readmit_shortcuts_total"] == 1


async def test_a_latency_ejected_engine_is_probed_at_once_when_its_last_peer_goes_out(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # d1's decode breaker opens at +2.5, between d0's probes: d0 is probed then, not at +3.
    rig = await eject_d0_for_latency(nursery)
    await rig.at(2.5)
    d1 = rig.engine("d1")
    for _ in range(3):
        rig.recovery.leg_failed(d1, "decode", failure("d1", "decode"))
    await rig.at(2.5)
    assert [at - rig.t0 for e, at in rig.prober.probes if e == "d0"][-2:] == [2.0, 2.5]
    assert [v.at - rig.t0 for v in rig.prober.verifications] == [2.5]
    assert rig.reason("d0") is None


async def test_a_latency_ejected_engine_waits_the_window_while_a_peer_takes_its_work(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # A peer going out is no reason to probe d0 early while another still takes the work,
    # nor is d0's ejection ever cut short then.
    rig = await eject_d0_for_latency(nursery)
    p1 = rig.engine("p1")
    for _ in range(3):
        rig.recovery.leg_failed(p1, "prefill", failure("p1", "prefill"))
    await rig.at(29.9)
    assert [at - rig.t0 for e, at in rig.prober.probes if e == "d0"] == [
        float(t) for t in range(30)
    ]
    assert [v for v in rig.prober.verifications if v.subject == "d0"] == []
    assert state_of(rig, "d0")["health"]["latency_cut_short_total"] == 0


# A decode profile where load dominates: 10 ms a step, and 5 ms more per request decoding.
LOAD_BOUND = SimTiming(step_base_s=0.01, decode_kv_token_s=0.0, decode_seq_s=0.005)


def decode_gaps(
    median_s: float, *, active: float = 20, kv_tokens: float = 0, count: int = 32
) -> DecodeGaps:
    """A stream's gaps, all positive, at a mean load of `active` requests and
    `kv_tokens` resident."""
    return DecodeGaps(
        count=count,
        median_s=median_s,
        positive=count,
        positive_median_s=median_s,
        mean_active=active,
        mean_kv_tokens=kv_tokens,
        max_active=round(active) + 4,
        max_kv_tokens=round(kv_tokens),
    )


async def profiled(nursery: trio.Nursery, cfg: Config) -> Rig:
    """A rig whose residuals come from the daemon's own predictor over LOAD_BOUND."""
    rig = await start(nursery, cfg, predictor=lambda engine, phase, observation: None)
    rig.ctx.profiles = LawProfiles(timing=LOAD_BOUND, speed=1.0)
    rig.recovery.predictor = profile_predictor(rig.ctx)
    return rig


async def test_a_decode_engine_is_judged_by_its_token_interval_at_its_load(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # Both decode engines ran streams among 20 others: the profile says 110 ms a token
    # there. d0 decoded at that pace, d1 three times slower (a gray failure: it answers
    # every probe). Each stream ended with the engine idle, as the last of a batch does:
    # predicted at that load (15 ms), d0 would look seven times too slow.
    rig = await profiled(nursery, residual_config())
    d0, d1 = rig.engine("d0"), rig.engine("d1")
    assert d0.load.decode_active == d1.load.decode_active == 0
    for pass_number in range(3):
        rig.recovery.leg_ok(d0, "decode", 4.0, gaps=decode_gaps(0.11))
        rig.recovery.leg_ok(d1, "decode", 12.0, gaps=decode_gaps(0.33))
        residuals = rig.recovery.residual_pass(trio.current_time())
        assert residuals == {"d0": pytest.approx(1.0), "d1": pytest.approx(3.0)}
        if pass_number < 2:
            assert rig.reason("d1") is None
        await trio.sleep(1.0)
    assert rig.reason("d0") is None
    assert rig.reason("d1") == (
        "ejected: latency: median observed/predicted ratio 3.00 over 3 residuals in "
        "recovery.health.window_s=30.0 >= recovery.health.eject_ratio=3.0; readmission "
        "starts after recovery.health.window_s=30.0"
    )


async def test_a_decode_leg_is_predicted_at_its_mean_load_unrounded(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # 20.4 requests decoding on average: 112 ms a token on the profile. Rounded to 20
    # (110 ms), an engine on its profile was 2 % slow to the residual, while the decode
    # correction judged the same stream at 20.4.
    rig = await profiled(nursery, residual_config())
    d0 = rig.engine("d0")
    rig.recovery.leg_ok(d0, "decode", 4.0, gaps=decode_gaps(0.112, active=20.4))
    assert rig.recovery.residual_pass(trio.current_time()) == {"d0": pytest.approx(1.0)}


async def test_decode_legs_without_enough_clean_gaps_in_the_domain_are_not_judged(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await profiled(nursery, residual_config())
    d0 = rig.engine("d0")
    unjudged = [
        ("decode", decode_gaps(0.5, count=MIN_RESIDUAL_GAPS - 1)),  # too few gaps
        ("decode", decode_gaps(0.5, active=300)),  # beyond the profile's 256 requests
        ("decode", None),  # a client stall or a prefill among its gaps (or no stream)
        ("aggregate", decode_gaps(0.5)),  # its own and others' prompts share the steps
    ]
    for phase, gaps in unjudged:
        rig.recovery.leg_ok(d0, phase, 10.0, gaps=gaps)
        assert rig.recovery.residual_pass(trio.current_time()) == {}, (phase, gaps)
    rig.recovery.leg_ok(d0, "decode", 10.0, gaps=decode_gaps(0.5, count=MIN_RESIDUAL_GAPS))
    assert rig.recovery.residual_pass(trio.current_time()) == {"d0": pytest.approx(0.5 / 0.11)}


# ---------------------------------------------------------------- router overload


async def starved_loop(rig: Rig, lag_s: float, until: float) -> None:
    """What the loop-lag probe reports while a client flood starves the router's event
    loop: every probe waited `lag_s` for the loop, until t0 + until."""
    while trio.current_time() < rig.t0 + until:
        await trio.sleep(LAG_PROBE_S)
        rig.ctx.loop_lag.observe(lag_s, at=trio.current_time())


def excused(rig: Rig, engine_id: str, evidence: str) -> float:
    value = rig.ctx.metrics.registry.get_sample_value(
        "narwhal_router_lag_excused_total", {"engine": engine_id, "evidence": evidence}
    )
    return value or 0.0


async def test_probes_timing_out_while_the_router_is_starved_do_not_eject(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, config(engine={"health_timeout_s": 2.0}))
    rig.prober.hung.add("d0")
    # Each probe waits 0.5 s for the loop: a tenth of the 2 s deadline is 0.2 s.
    nursery.start_soon(starved_loop, rig, 0.5, 9.5)
    await rig.at(9.5)  # probes at +1, +4 and +7 ran out their 2 s
    assert [t - rig.t0 for e, t in rig.prober.probes if e == "d0" and t > rig.t0] == [1, 4, 7]
    assert rig.reason("d0") is None
    record = rig.recovery.record("d0")
    assert record is not None
    assert record.last_probe is not None
    assert record.last_probe.outcome == "inconclusive"
    assert record.last_probe.detail == (
        "GET /health: no answer within engine.health_timeout_s=2.0; the router's own event "
        "loop lagged 0.5 s meanwhile (at least 10% of 2 s): router overload, not held "
        "against the engine"
    )
    assert excused(rig, "d0", "health_probe") == 3
    assert record.health.consecutive_failures == 0
    # The loop is quick again, the engine is still silent: the ordinary streak ejects it.
    await rig.at(17.9)  # timeouts at +12 and +15
    assert rig.reason("d0") is None
    await rig.at(18.0)
    assert rig.reason("d0") == (
        "ejected: 3 consecutive failed health probes (recovery.health.failure_threshold=3): "
        "GET /health: no answer within engine.health_timeout_s=2.0"
    )
    assert excused(rig, "d0", "health_probe") == 3


async def test_lag_short_of_a_tenth_of_the_deadline_excuses_nothing(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, config(engine={"health_timeout_s": 2.0}))
    rig.prober.hung.add("d0")
    nursery.start_soon(starved_loop, rig, 0.19, 20.0)
    await rig.at(9.0)
    assert rig.reason("d0") is not None
    assert excused(rig, "d0", "health_probe") == 0


async def test_leg_timeouts_while_the_router_is_starved_do_not_open_breakers(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, config())
    d0, p0 = rig.engine("d0"), rig.engine("p0")
    nursery.start_soon(starved_loop, rig, 0.3, 5.0)
    await rig.at(3.0)
    for _ in range(5):  # a tenth of 2.5 s is 0.25 s
        rig.recovery.leg_failed(d0, "decode", first_token_timeout("d0", "decode", 2.5))
    assert rig.breaker("d0", "decode") is BreakerState.CLOSED
    assert excused(rig, "d0", "leg_failure") == 5
    # An error status is the engine's answer, not a deadline: the lag excuses nothing.
    for _ in range(3):
        rig.recovery.leg_failed(p0, "prefill", failure("p0", "prefill"))
    assert rig.breaker("p0", "prefill") is BreakerState.OPEN
    # A deadline long enough that the lag is under a tenth of it counts too.
    rig.recovery.leg_failed(d0, "decode", first_token_timeout("d0", "decode", 3.5))
    assert excused(rig, "d0", "leg_failure") == 5
    await rig.at(8.0)  # the last lag seen was at +5, before these 2.5 s deadlines began
    for _ in range(2):
        rig.recovery.leg_failed(d0, "decode", first_token_timeout("d0", "decode", 2.5))
    assert rig.breaker("d0", "decode") is BreakerState.OPEN


async def test_a_connect_timing_out_while_the_router_is_starved_takes_nothing_out(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # A connect deadline is a deadline: under a client flood the handshake's answer waits
    # unread, and the engine was marked unreachable (out of placement) and charged.
    rig = await start(nursery, config())
    d0 = rig.engine("d0")
    nursery.start_soon(starved_loop, rig, 0.3, 5.0)
    await rig.at(3.0)
    for _ in range(3):  # a tenth of 1 s is 0.1 s
        rig.recovery.leg_failed(d0, "decode", unreachable("d0", "decode", timeout_s=1.0))
    assert rig.reason("d0") is None
    assert rig.breaker("d0", "decode") is BreakerState.CLOSED
    assert excused(rig, "d0", "leg_failure") == 3
    # Refused outright, it is the engine's doing whatever the loop does.
    rig.recovery.leg_failed(d0, "decode", unreachable("d0", "decode"))
    assert (rig.reason("d0") or "").startswith("unreachable: ")


async def test_a_verification_timing_out_while_the_router_is_starved_is_inconclusive(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, config())
    await eject_d0_then_answer(rig)  # good probes at +4 and +5 start its verification
    rig.prober.hung_legs.add("d0")
    nursery.start_soon(starved_loop, rig, 0.5, 9.0)
    await rig.at(9.0)
    record = rig.recovery.record("d0")
    assert record is not None
    assert record.last_verification is not None
    assert record.last_verification.outcome == "inconclusive"
    assert "router overload, not held against the engine" in str(record.last_verification.detail)
    assert changes(rig, "health") == [
        ("d0", None, "up", "ejected"),
        ("d0", None, "ejected", "verifying"),
    ]
    assert excused(rig, "d0", "verification") >= 1
    await rig.at(20.0)  # the next one, on a quick loop, fails as the engine is silent
    assert ("d0", None, "verifying", "ejected") in changes(rig, "health")


async def test_a_leg_slowed_by_router_lag_makes_no_latency_residual(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, config(), predictor=lambda engine, phase, obs: 0.1)
    d0 = rig.engine("d0")
    rig.recovery.leg_ok(d0, "decode", 0.5)  # before the lag: a residual of 5
    rig.ctx.loop_lag.observe(0.08, at=trio.current_time())  # over a tenth of 0.7 s
    rig.recovery.leg_ok(d0, "decode", 0.7)
    assert rig.recovery.residual_pass(trio.current_time()) == {"d0": pytest.approx(5.0)}
    assert excused(rig, "d0", "residual") == 1
    await trio.sleep(1.0)
    rig.recovery.leg_ok(d0, "decode", 0.7)
    assert rig.recovery.residual_pass(trio.current_time()) == {"d0": pytest.approx(7.0)}


# ---------------------------------------------------------------- monitor


async def start_monitor(nursery: trio.Nursery, rig: Rig, **kw: Any) -> Monitor:
    monitor = Monitor(rig.ctx, rig.recovery, rig.prober, **kw)
    await nursery.start(monitor.run)
    return monitor


async def test_consecutive_failed_passes_degrade_and_a_good_pass_recovers(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    cfg = config(controller={"monitor_interval_s": 1.0, "monitor_failure_limit": 3})
    rig = await start(nursery, cfg)
    for engine_id in ("p0", "d0"):
        rig.prober.load_of[engine_id] = ScrapeError(f"GET /metrics returned HTTP 500 ({engine_id})")
    seen: list[str | None] = []
    monitor = await start_monitor(nursery, rig, on_degraded=seen.append)
    await rig.at(1.5)  # passes at +0 and +1 failed
    assert rig.degraded() is None
    await rig.at(2.0)
    reason = rig.degraded()
    assert reason == (
        "3 consecutive monitor passes failed (controller.monitor_failure_limit=3); last: no "
        "engine could be observed (p0: GET /metrics returned HTTP 500 (p0); "
        "d0: GET /metrics returned HTTP 500 (d0))"
    )
    rig.prober.load_of.pop("p0")  # one engine observable again: the pass succeeds
    await rig.at(3.0)
    assert rig.degraded() is None
    assert monitor.consecutive_failures == 0
    assert seen == [reason, None]


async def test_a_pass_failing_while_the_router_is_starved_says_so(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    cfg = config(
        controller={"monitor_interval_s": 1.0, "monitor_failure_limit": 1},
        engine={"health_timeout_s": 2.0},
    )
    rig = await start(nursery, cfg)
    rig.prober.hung.update(("p0", "d0"))
    nursery.start_soon(starved_loop, rig, 0.5, 5.0)
    monitor = await start_monitor(nursery, rig)
    passes = recorded_passes(monitor)
    await rig.at(3.5)  # the scrapes started at +0 ran out their 2 s
    # Still a failure, with no load to decide on, but the reason names the router.
    timeout = "no answer within engine.health_timeout_s=2.0"
    assert rig.degraded() == (
        "1 consecutive monitor passes failed (controller.monitor_failure_limit=1); last: "
        f"no engine could be observed (p0: GET /metrics: {timeout}; d0: GET /metrics: "
        f"{timeout}); the router's own event loop lagged 0.5 s while the scrapes ran "
        "(router overload)"
    )
    await rig.at(12.0)  # scrapes since the loop is quick: the engines are silent, nothing more
    (*_, last) = (p.failures for p in passes if p.failures)
    assert last[0].endswith(f"d0: GET /metrics: {timeout})")


async def test_one_engine_down_is_not_a_monitor_failure(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    cfg = config(controller={"monitor_interval_s": 1.0, "monitor_failure_limit": 1})
    rig = await start(nursery, cfg)
    rig.prober.load_of["d0"] = ScrapeError("GET /metrics: connect failed: connection refused")
    rig.prober.load_of["p0"] = LoadSample(3.0, 2.0, 0.25)
    passes: list[MonitorPass] = []

    async def handler(result: MonitorPass) -> None:
        passes.append(result)

    monitor = await start_monitor(nursery, rig)
    monitor.add_handler("controller", handler)
    await rig.at(2.0)
    assert rig.degraded() is None
    last = passes[-1]
    assert last.failures == ()
    assert [(e.id, e.load, e.load_error) for e in last.engines] == [
        ("p0", LoadSample(3.0, 2.0, 0.25), None),
        ("d0", None, "GET /metrics: connect failed: connection refused"),
    ]
    assert [e.id for e in last.observed] == ["p0"]


def recorded_passes(monitor: Monitor) -> list[MonitorPass]:
    passes: list[MonitorPass] = []

    async def handler(result: MonitorPass) -> None:
        passes.append(result)

    monitor.add_handler("controller", handler)
    return passes


def seen(rig: Rig, result: MonitorPass, engine_id: str) -> tuple[object, ...]:
    """When `result` ran, relative to t0, and what it reported of `engine_id`'s load."""
    (engine,) = [e for e in result.engines if e.id == engine_id]
    return (
        result.started_at - rig.t0,
        result.finished_at - rig.t0,
        engine.load,
        engine.load_error,
        engine.load_pending_s,
    )


async def test_a_hung_metrics_scrape_costs_only_its_own_engine_s_observations(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # d0's /metrics accepts the scrape and never answers (its /health is fine). Every pass
    # waited for it until engine.health_timeout_s (5 s), and the residual stage and the
    # role controller, which run after the scrapes, ran every 5 s instead of every 1 s.
    rig = await start(nursery, config(controller={"monitor_interval_s": 1.0}))
    rig.prober.scrape_delay_of["d0"] = math.inf
    p0_load = LoadSample(3.0, 2.0, 0.25)
    rig.prober.load_of["p0"] = p0_load
    with caplog.at_level(logging.INFO, logger="narwhal"):
        monitor = await start_monitor(nursery, rig)
        passes = recorded_passes(monitor)
        await rig.at(4.5)
        # The first pass waits half an interval for d0's new scrape; later ones do not
        # wait again for the scrape an earlier pass started.
        assert [seen(rig, p, "d0") for p in passes] == [
            (0.0, 0.5, None, None, 0.5),
            (1.0, 1.0, None, None, 1.0),
            (2.0, 2.0, None, None, 2.0),
            (3.0, 3.0, None, None, 3.0),
            (4.0, 4.0, None, None, 4.0),
        ]
        assert [seen(rig, p, "p0")[2:] for p in passes] == [(p0_load, None, None)] * 5
        assert all(p.failures == () for p in passes)
        assert [at for engine_id, at in rig.prober.scrapes if engine_id == "d0"] == [0.0]
        await rig.at(7.5)  # d0's scrape ran out its 5 s at +5: reported, then d0 re-scraped
    timeout = "GET /metrics: no answer within engine.health_timeout_s=5.0"
    assert seen(rig, passes[-1], "d0")[:4] == (7.0, 7.0, None, timeout)
    assert [at for engine_id, at in rig.prober.scrapes if engine_id == "d0"] in ([0, 5], [0, 6])
    assert len(passes) == 8
    assert monitor.consecutive_failures == 0
    assert rig.degraded() is None
    warnings = [r for r in caplog.records if r.__dict__.get("event") == "scrape"]
    assert [(r.__dict__["engine"], r.__dict__["outcome"]) for r in warnings] == [("d0", "failed")]


async def test_a_slow_metrics_answer_is_taken_by_the_next_pass(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, config(controller={"monitor_interval_s": 1.0}))
    rig.prober.scrape_delay_of["d0"] = 0.7  # past the half interval a pass waits
    d0_load = LoadSample(4.0, 1.0, 0.5)
    rig.prober.load_of["d0"] = d0_load
    monitor = await start_monitor(nursery, rig)
    passes = recorded_passes(monitor)
    await rig.at(3.5)
    # Each pass takes the answer to the scrape the pass before started, and starts one.
    assert [seen(rig, p, "d0") for p in passes] == [
        (0.0, 0.5, None, None, 0.5),
        (1.0, 1.0, d0_load, None, None),
        (2.0, 2.0, d0_load, None, None),
        (3.0, 3.0, d0_load, None, None),
    ]
    assert [at for engine_id, at in rig.prober.scrapes if engine_id == "d0"] == [0, 1, 2, 3]


async def test_a_load_stage_that_raises_late_fails_the_pass_that_takes_it(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, config(controller={"monitor_interval_s": 1.0}))
    rig.prober.scrape_delay_of["d0"] = 0.7
    rig.prober.load_of["d0"] = ValueError("bad gauge")
    monitor = await start_monitor(nursery, rig)
    passes = recorded_passes(monitor)
    await rig.at(1.5)
    assert [p.failures for p in passes] == [(), ("load stage raised ValueError for d0: bad gauge",)]
    assert seen(rig, passes[1], "d0")[2:] == (None, "internal error: ValueError('bad gauge')", None)
    assert monitor.consecutive_failures == 1


async def test_passes_that_take_no_scrape_failure_are_inconclusive(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    cfg = config(
        controller={"monitor_interval_s": 1.0, "monitor_failure_limit": 3},
        engine={"health_timeout_s": 2.5},
    )
    rig = await start(nursery, cfg)
    rig.prober.scrape_delay_of.update(p0=math.inf, d0=math.inf)
    monitor = await start_monitor(nursery, rig)
    passes = recorded_passes(monitor)

    def counted(result: str) -> float:
        value = rig.ctx.metrics.registry.get_sample_value(
            "narwhal_monitor_passes_total", {"result": result}
        )
        return value or 0.0

    await rig.at(2.9)  # passes at +0..+2: the scrapes may still answer
    assert [counted(r) for r in ("ok", "failed", "inconclusive")] == [0, 0, 3]
    assert monitor.consecutive_failures == 0
    await rig.at(4.5)  # they ran out at +2.5: the pass at +3 took that and scraped again
    assert [counted(r) for r in ("ok", "failed", "inconclusive")] == [0, 1, 4]
    timeout = "GET /metrics: no answer within engine.health_timeout_s=2.5"
    # The pass at +4 reports the failure again, but counted it once: failures are not
    # multiplied by the passes that run while a hung engine's next scrape is out.
    assert seen(rig, passes[-1], "d0") == (4.0, 4.0, None, timeout, 1.0)
    assert passes[-1].failures == ()
    assert monitor.consecutive_failures == 1
    await rig.at(8.9)
    assert [counted(r) for r in ("ok", "failed", "inconclusive")] == [0, 2, 7]
    assert rig.degraded() is None
    await rig.at(9.0)  # the third round of timeouts (+8.5), taken by the pass at +9
    assert rig.degraded() == (
        "3 consecutive monitor passes failed (controller.monitor_failure_limit=3); last: no "
        f"engine could be observed (p0: {timeout}; d0: {timeout})"
    )
    assert [at for engine_id, at in rig.prober.scrapes if engine_id == "d0"] == [0, 3, 6, 9]
    await rig.at(10.5)
    # An inconclusive pass since: the state still says which failures degraded it (its
    # last pass's own list is empty, and that alone read as no failure at all).
    state = to_json(monitor.state())
    assert state["last_pass"]["result"] == "inconclusive"  # type: ignore[index]
    assert state["last_pass"]["failures"] == []  # type: ignore[index]
    assert state["last_failed_pass"] == {
        "number": 10,  # the pass at +9
        "failures": [f"no engine could be observed (p0: {timeout}; d0: {timeout})"],
    }
    assert rig.degraded() is not None


async def test_a_removed_engine_s_scrape_in_flight_is_forgotten(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    rig = await start(nursery, config(controller={"monitor_interval_s": 1.0}))
    rig.prober.scrape_delay_of["d0"] = math.inf
    with caplog.at_level(logging.INFO, logger="narwhal"):
        monitor = await start_monitor(nursery, rig)
        passes = recorded_passes(monitor)
        await rig.at(1.5)
        rig.ctx.fleet.retire("d0")
        await rig.at(6.5)  # its scrape ran out at +5, unseen
    assert [e.id for e in passes[-1].engines] == ["p0"]
    assert to_json(monitor.state())["last_pass"]["failures"] == []  # type: ignore[index]
    assert "d0" not in monitor.unscraped
    assert not [r for r in caplog.records if r.__dict__.get("event") == "scrape"]
    assert [at for engine_id, at in rig.prober.scrapes if engine_id == "d0"] == [0]


async def test_a_metrics_scrape_that_fails_is_logged_once_and_again_when_it_answers(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    rig = await start(nursery, config(controller={"monitor_interval_s": 1.0}))
    rig.prober.load_of["d0"] = ScrapeError("GET /metrics: no answer within 5.0")
    rig.prober.load_of["p0"] = LoadSample(3.0, 2.0, 0.25)
    with caplog.at_level(logging.INFO, logger="narwhal"):
        await start_monitor(nursery, rig)
        await rig.at(3.5)  # four passes, one line
        rig.prober.load_of["d0"] = LoadSample(1.0, 0.0, 0.1)
        await rig.at(5.5)
    lines = [
        (r.levelname, r.__dict__["engine"], r.__dict__["outcome"])
        for r in caplog.records
        if r.__dict__.get("event") == "scrape"
    ]
    assert lines == [("WARNING", "d0", "failed"), ("INFO", "d0", "ok")]
    warning = next(r for r in caplog.records if r.__dict__.get("event") == "scrape")
    assert warning.getMessage() == (
        "monitor cannot read the /metrics of d0: GET /metrics: no answer within 5.0; its "
        "load is missing from role control and a restart shows only on /version or when "
        "it stops answering"
    )


async def start_scraped(nursery: trio.Nursery, peer: str | None = "decode") -> Rig:
    """A rig with a monitor passing every second; d0's /metrics reports a start time.
    With a `peer`, x1 of that role (`with_peer`) takes decode work beside d0."""
    monitor = {"monitor_interval_s": 1.0}
    cfg = config(controller=monitor) if peer is None else with_peer(peer, controller=monitor)
    rig = await start(nursery, cfg)
    rig.prober.load_of["d0"] = LoadSample(1.0, 0.0, 0.1, started_at=1000.0)
    await start_monitor(nursery, rig)
    return rig


async def test_a_new_process_start_time_on_metrics_is_a_restart_held_until_verified(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # Stock vLLM's /version names no instance, so only /metrics shows a quick restart.
    rig = await start_scraped(nursery)
    await rig.at(2.5)
    assert rig.reason("d0") is None
    rig.prober.load_of["d0"] = LoadSample(0.0, 0.0, 0.0, started_at=1003.0)
    await rig.at(3.0)
    assert rig.reason("d0") == "restart hold"
    record = rig.recovery.record("d0")
    assert record is not None
    assert record.hold.reason == "process_start_time_seconds changed (1000.0 -> 1003.0)"
    await rig.at(7.9)  # the same start time every pass since: one hold, not one per pass
    assert record.hold.holds_total == 1
    assert rig.reason("d0") == "restart hold"
    await rig.at(8.0)  # recovery.restart_hold_s=5 after +3, then the verification
    assert rig.reason("d0") is None
    assert [v.at - rig.t0 for v in rig.prober.verifications] == [8.0]
    assert changes(rig, "hold") == [
        ("d0", None, "released", "held"),
        ("d0", None, "held", "released"),
    ]


async def test_a_restart_seen_on_metrics_is_probed_at_once_when_no_other_engine_takes_its_work(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # Probes 10 s apart: d0's hold would be cut short only at +10 (after its 5 s ran out),
    # but the probe goes out when the monitor's scrape sees the restart.
    cfg = config(controller={"monitor_interval_s": 1.0}, recovery={"health": {"interval_s": 10.0}})
    rig = await start(nursery, cfg)
    rig.prober.load_of["d0"] = LoadSample(1.0, 0.0, 0.1, started_at=1000.0)
    await start_monitor(nursery, rig)
    await rig.at(2.5)
    rig.prober.load_of["d0"] = LoadSample(0.0, 0.0, 0.0, started_at=1003.0)
    await rig.at(3.5)
    record = rig.recovery.record("d0")
    assert record is not None
    assert record.hold.holds_total == 1
    assert [at - rig.t0 for e, at in rig.prober.probes if e == "d0"] == [0.0, 3.0]
    assert [v.at - rig.t0 for v in rig.prober.verifications] == [3.0]
    assert rig.reason("d0") is None


async def test_a_restart_seen_by_the_probe_is_not_seen_again_on_metrics(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start_scraped(nursery)
    await rig.at(1.5)
    rig.prober.health_of["d0"] = REFUSED
    rig.prober.load_of["d0"] = ScrapeError("GET /metrics: connect failed: connection refused")
    await rig.at(2.5)
    rig.prober.health_of["d0"] = attrs.evolve(HEALTHY, identity=(("instance_id", "b"),))
    await rig.at(3.0)  # the probe at +3 sees it answer again and starts the hold
    record = rig.recovery.record("d0")
    assert record is not None
    assert record.hold.reason == "answered again after being unreachable"
    rig.prober.load_of["d0"] = LoadSample(0.0, 0.0, 0.0, started_at=1002.0)
    await rig.at(7.9)  # passes at +4..+7 saw the new start time
    assert record.identity.start_time == 1002.0
    assert record.hold.reason == "answered again after being unreachable"
    await rig.at(8.0)  # the hold's clock was never restarted by the new value
    assert rig.reason("d0") is None
    assert record.hold.holds_total == 1


async def test_a_raising_or_hanging_pass_handler_is_a_monitoring_stage_failure(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config(controller={"monitor_interval_s": 1.0, "monitor_failure_limit": 2})
    rig = await start(nursery, cfg)
    behaviour = {"mode": "raise"}

    async def controller(result: MonitorPass) -> None:
        if behaviour["mode"] == "raise":
            raise ValueError("no profile for d0")
        if behaviour["mode"] == "hang":
            await trio.sleep_forever()

    monitor = await start_monitor(nursery, rig)
    monitor.add_handler("controller", controller)
    with caplog.at_level(logging.WARNING, logger="narwhal"):
        await rig.at(1.0)
    degraded = rig.degraded()
    assert degraded is not None
    assert degraded.endswith("last: pass handler 'controller' raised ValueError: no profile for d0")
    assert any(getattr(r, "event", None) == "degraded" for r in caplog.records)
    behaviour["mode"] = "ok"
    await rig.at(2.0)
    assert rig.degraded() is None
    behaviour["mode"] = "hang"
    await rig.at(13.0)  # each hanging pass is cut at max(interval, health_timeout_s)=5s
    assert monitor.last_failures == ("pass handler 'controller' did not finish within 5.0s",)
    assert rig.degraded() is not None


async def test_verdict_changes_are_logged_as_json_events(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    rig = await start(nursery, config())
    d0 = rig.engine("d0")
    with caplog.at_level(logging.INFO, logger="narwhal"):
        for _ in range(3):
            rig.recovery.leg_failed(d0, "decode", failure("d0", "decode"))
    (record,) = [r for r in caplog.records if getattr(r, "event", None) == "verdict"]
    assert record.levelno == logging.WARNING
    fields = {k: getattr(record, k) for k in ("engine", "phase", "kind", "from", "to")}
    assert fields == {
        "engine": "d0",
        "phase": "decode",
        "kind": "breaker",
        "from": "closed",
        "to": "open",
    }
    assert "recovery.breaker.window_s=10.0" in record.__dict__["reason"]
    legs = [r for r in caplog.records if getattr(r, "event", None) == "leg_failed"]
    assert [r.__dict__["counted"] for r in legs] == [True, True, True]


# ---------------------------------------------------------------- reload


async def test_a_replaced_engine_is_probed_as_one_engine_not_two(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # The new instance is adopted (and probed) before the old one leaves placement; its
    # record took the old one's place, so retiring the old instance found nothing to stop
    # and the old instance's loop probed the old url alongside, for good.
    rig = await start(nursery, config())
    await rig.at(0.5)
    old = rig.engine("d0")
    document = {"id": "d0", "url": "http://127.0.0.1:20", "role": "decode"}
    assert await reload(rig.ctx, rig.recovery, config(engines=[P0, document])) == [old]
    new = rig.engine("d0")
    assert new is not old
    await rig.at(4.5)
    assert [at for engine_id, at in rig.prober.probes if engine_id == "d0"] == [
        0,  # startup
        0.5,  # the new instance, before it joins
        1.5,
        2.5,
        3.5,
        4.5,
    ]
    record = rig.recovery.record("d0")
    assert record is not None
    assert record.engine is new


@pytest.mark.parametrize(("index", "count", "first_s"), [(0, 1, 1.0), (1, 2, 1.5), (2, 4, 1.5)])
async def test_a_replica_starts_its_probe_loops_by_its_place_among_the_members(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
    index: int,
    count: int,
    first_s: float,
) -> None:
    # Replicas restarted together would otherwise probe every engine at the same instants
    # for as long as they run (the interval here is 1 s).
    prober = FakeProber()
    ctx = ServingContext(with_peer("decode"))
    ctx.fleet.apply_share(ctx.config, Share(index=index, count=count))
    recovery = Recovery(ctx, prober=prober)
    t0 = trio.current_time()
    await nursery.start(recovery.run)
    await trio.sleep_until(t0 + first_s + 1.2)
    d0 = [round(at - t0, 6) for engine, at in prober.probes if engine == "d0"]
    assert d0 == [0.0, first_s, first_s + 1.0]  # the startup probe, then the loop's
