"""What recovery shows: its section of /narwhal/state, its counters and live gauges.

Owns
  `RecoveryMetrics` (every recovery counter, registered once on the router's registry),
  the state document's `recovery` section as frozen records (`RecoverySection` and its
  parts, with `RecentChange` and `VerificationReport`, which the verdicts and verifications
  keep), built by `engine_snapshot` and `state_document`, and `live_gauges` (breaker
  states and availability flags, read at each scrape).

Invariants
  Reads only: nothing here changes a record or a verdict. Every verdict change is one
  increment of `transitions` and one entry of `recent_changes`, so they never disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

import attrs
from prometheus_client import CollectorRegistry, Counter

from .._records import SPLICED, key
from ._breaker import BreakerSnapshot, BreakerState
from ._health import HealthSnapshot, HoldSnapshot, IdentitySnapshot, ResidualSnapshot

if TYPE_CHECKING:
    from ._evidence import KeyCheck, ProbeResult
    from ._record import EngineRecovery


@attrs.frozen
class RecoveryMetrics:
    """Recovery's counters, by what they count."""

    transitions: Counter
    probes: Counter
    verifications: Counter
    key_checks: Counter
    excused: Counter
    counted: Counter

    @classmethod
    def register(cls, registry: CollectorRegistry) -> RecoveryMetrics:
        return cls(
            transitions=Counter(
                "narwhal_recovery_transitions",
                "Recovery verdict changes by engine, kind (breaker, health, hold, quarantine, "
                "reachability), phase and states.",
                ["engine", "kind", "phase", "from", "to"],
                registry=registry,
            ),
            probes=Counter(
                "narwhal_health_probes",
                "Health probes by engine and outcome (ok, failed, inconclusive).",
                ["engine", "outcome"],
                registry=registry,
            ),
            verifications=Counter(
                "narwhal_verifications",
                "Verification leg pairs by engine, purpose (breaker, readmission) and outcome "
                "(ok, failed, inconclusive, refused: a leg refused narwhal's API key; retried: "
                "failed at once and sent again, only the second pair counts).",
                ["engine", "purpose", "outcome"],
                registry=registry,
            ),
            key_checks=Counter(
                "narwhal_auth_checks",
                "API key checks of engines that refused narwhal's key, or whose /version did, "
                "by engine and outcome (accepted, refused, failed, inconclusive).",
                ["engine", "outcome"],
                registry=registry,
            ),
            excused=Counter(
                "narwhal_router_lag_excused",
                "Evidence against an engine set aside because the router's own event loop "
                "lagged at least a tenth of the deadline or duration meanwhile, by engine and "
                "evidence (health_probe, verification, leg_failure, residual).",
                ["engine", "evidence"],
                registry=registry,
            ),
            counted=Counter(
                "narwhal_counted_failures",
                "Engine leg failures counted against the engine (breakers, quarantine).",
                ["engine", "phase"],
                registry=registry,
            ),
        )


@attrs.frozen(kw_only=True)
class LastCheck:
    """The last health probe or API key check: its outcome, and how long ago."""

    outcome: str
    detail: str
    age_s: float


@attrs.frozen(kw_only=True)
class HealthSection:
    verdict: HealthSnapshot = attrs.field(metadata=SPLICED)
    readmission_in_s: float | None  # while the latency readmission waits
    latency_cut_short_total: int
    failed_verifications: int
    verify_in_s: float | None  # until the next verification may run
    last_probe: LastCheck | None


@attrs.frozen(kw_only=True)
class AuthSection:
    refused: str | None  # why the engine refuses narwhal's API key
    last_check: LastCheck | None


@attrs.frozen(kw_only=True)
class QuarantineSection:
    active: bool
    remaining_s: float | None


@attrs.frozen(kw_only=True)
class VerificationReport:
    """The last verification pair of an engine (also logged, event `verification`)."""

    request_id: str
    purpose: str
    phase: str
    partner: str | None
    standby: bool
    outcome: str
    detail: str
    duration_s: float


@attrs.frozen(kw_only=True)
class RecentChange:
    """One verdict change (also logged, event `verdict`); `at` counts from the start."""

    at: float
    engine: str
    kind: str
    phase: str | None
    old: str = attrs.field(metadata=key("from"))
    new: str = attrs.field(metadata=key("to"))
    reason: str


@attrs.frozen(kw_only=True)
class RecoveryEngine:
    """One engine's part of the `recovery` section."""

    breakers: Mapping[str, BreakerSnapshot]
    health: HealthSection
    auth: AuthSection
    ejected: str | None
    unreachable: str | None
    hold: HoldSnapshot
    quarantine: QuarantineSection
    identity: IdentitySnapshot
    residuals: ResidualSnapshot
    last_verification: VerificationReport | None
    drained: bool
    pinned: bool


@attrs.frozen(kw_only=True)
class RecoverySection:
    engines: Mapping[str, RecoveryEngine]
    recent_changes: tuple[RecentChange, ...]  # the last 50


def engine_snapshot(
    record: EngineRecovery, now: float, *, backoff_cut: bool = False
) -> RecoveryEngine:
    """One engine's section of the state document."""
    engine = record.engine
    # With the backoff cut, the next verification waits only for a probe interval
    # after the last (`next_verify_at`).
    verify_at = record.next_verify_at if backoff_cut else record.readmit_after
    return RecoveryEngine(
        breakers={phase: b.snapshot(now) for phase, b in record.breakers.items()},
        health=HealthSection(
            verdict=record.health.snapshot(),
            readmission_in_s=round(record.latency_until - now, 3)
            if now < record.latency_until
            else None,
            latency_cut_short_total=record.latency_cuts_total,
            failed_verifications=record.failed_verifications,
            verify_in_s=round(verify_at - now, 3) if now < verify_at else None,
            last_probe=_last(record.last_probe, record.last_probe_at, now),
        ),
        auth=AuthSection(
            refused=engine.auth_refused,
            last_check=_last(record.last_key_check, record.last_key_check_at, now),
        ),
        ejected=engine.ejected,
        unreachable=engine.unreachable,
        hold=record.hold.snapshot(now),
        quarantine=QuarantineSection(
            active=now < engine.quarantined_until,
            remaining_s=round(max(0.0, engine.quarantined_until - now), 3)
            if now < engine.quarantined_until
            else None,
        ),
        identity=record.identity.snapshot(),
        residuals=record.residuals.snapshot(),
        last_verification=record.last_verification,
        drained=engine.drained,
        pinned=engine.pinned,
    )


def _last(result: ProbeResult | KeyCheck | None, at: float | None, now: float) -> LastCheck | None:
    if result is None:
        return None
    return LastCheck(
        outcome=result.outcome, detail=result.detail, age_s=round(now - (at or now), 3)
    )


def state_document(
    records: Mapping[str, EngineRecovery],
    recent_changes: Iterable[RecentChange],
    backoff_cut: Callable[[EngineRecovery, float], bool],
    now: float,
) -> RecoverySection:
    """Recovery's section of /narwhal/state."""
    return RecoverySection(
        engines={
            engine_id: record.snapshot(now, backoff_cut=backoff_cut(record, now))
            for engine_id, record in records.items()
        },
        recent_changes=tuple(recent_changes)[-50:],
    )


def live_gauges(
    records: list[EngineRecovery], now: float
) -> Iterator[tuple[str, str, list[str], list[tuple[list[str], float]]]]:
    """The gauges read at each scrape of /metrics."""
    codes = {BreakerState.CLOSED: 0.0, BreakerState.OPEN: 1.0, BreakerState.HALF_OPEN: 2.0}
    yield (
        "narwhal_breaker_state",
        "Circuit breaker per engine and phase: 0 closed, 1 open, 2 half-open.",
        ["engine", "phase"],
        [
            ([r.engine.id, phase], codes[b.state])
            for r in records
            for phase, b in r.breakers.items()
        ],
    )
    flags: list[tuple[str, str, Callable[[EngineRecovery], bool]]] = [
        ("ejected", "1 while health-ejected.", lambda r: r.engine.ejected is not None),
        ("held", "1 while under a restart hold.", lambda r: r.hold.active),
        (
            "unreachable",
            "1 while out after a leg could not connect, until a probe answers.",
            lambda r: r.engine.unreachable is not None,
        ),
        (
            "quarantined",
            "1 while quarantined after a failure.",
            lambda r: now < r.engine.quarantined_until,
        ),
        ("drained", "1 while drained by the operator.", lambda r: r.engine.drained),
        ("pinned", "1 while pinned by the operator.", lambda r: r.engine.pinned),
    ]
    for name, help_text, test in flags:
        yield (
            f"narwhal_engine_{name}",
            help_text,
            ["engine"],
            [([r.engine.id], float(test(r))) for r in records],
        )
