"""SGLang transfer attribution: whose fault a failed KV transfer is, when it is.

Owns
  `TransferAttribution`: each engine's failed transfers within the breaker window, and
  the rule that counts them against one engine of the pair (`failed`).

Invariants
  A failed transfer counts against neither engine by default: the failure does not say
  which one caused it. It counts against an engine only when that engine fails its
  transfers with whomever it is paired while its peers' succeed; an engine alone in its
  role is never counted (there is nothing to compare it with).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import trio

from .._codes import ErrorCode
from .._errors import EngineFailed
from ..fleet import EngineState
from ._health import Verdict
from ._record import PHASES, EngineRecovery
from ._verdicts import Verdicts

# (record, phase, message, code): counts a failure against the record's engine.
Count = Callable[[EngineRecovery, str, str, str], None]
# (when, leg number, partner id) of one failed transfer (`EngineRecovery.transfer_failures`).
TransferFailure = tuple[float, int, str]


def suspect(
    failures: Sequence[TransferFailure],
    legs_seen: int,
    *,
    threshold: int,
    ratio: float,
    available: Callable[[], int],
) -> tuple[int, int] | None:
    """(failed, legs) when an engine's own transfer failures make it the suspect, or None.

    `failures` are the engine's failed transfers within the breaker window, oldest
    first, as (time, leg number, partner); `legs_seen` numbers its legs so far;
    `available` counts the engines of the other role that could pair with it. A suspect
    failed `threshold` transfers (recovery.breaker.failure_threshold), they are at least
    `ratio` (recovery.breaker.failure_ratio) of its legs since the first of them, and
    they were with at least two partners, or with every one available if fewer. Whether
    its peers' transfers work is the caller's to check (`_transferring_peer`)."""
    if len(failures) < threshold:
        return None
    failed, legs = threshold, legs_seen - failures[-threshold][1] + 1
    if failed < ratio * legs:
        return None
    partners = {partner for _, _, partner in list(failures)[-threshold:]}
    if len(partners) < min(2, available()):
        return None
    return failed, legs


class TransferAttribution:
    """Records failed KV transfers and counts them (`count`) against the engine at fault."""

    def __init__(self, verdicts: Verdicts, count: Count) -> None:
        self.verdicts = verdicts
        self.ctx = verdicts.ctx
        self._count = count

    def failed(self, reporter: EngineState, failure: EngineFailed, partner_id: str) -> None:
        """An SGLang pair's KV transfer failed: count it against the engine of the pair
        that fails its transfers while its peers' succeed, if either does.

        The failure itself does not say which engine caused it (serving `FAILURE_POLICY`),
        so it counts against neither by default. But an engine whose KV path is broken
        while it otherwise answers (a bad NIC, a wedged transfer backend) fails nearly
        every leg it is paired for, and a decode engine failing fast looks idle, so
        placement prefers it: kept in, it would fail most requests for as long as it
        stays broken. So the failure is recorded for both engines and counted against
        one of them when it has failed recovery.breaker.failure_threshold transfers
        within recovery.breaker.window_s, they are at least
        recovery.breaker.failure_ratio of its legs since the first of them (as its
        breaker counts), they were with at least two partners (or the only one available
        of the other role), and another available engine of its role has answered legs
        and failed under half that ratio of its legs within the window: the fleet's
        transfers work, this engine's fail with whomever it is paired. A partner of a
        broken engine fails its transfers with that one engine only (and, since a decode
        engine that fails fast looks idle and draws most pairs, a large share of its
        recent legs), so it is not counted; an engine alone in its role is never
        counted (nothing to compare it with). Once counted, its breaker and
        quarantine judge it as they do any engine's failures."""
        now = trio.current_time()
        window = self.ctx.config.recovery.breaker.window_s
        involved: list[tuple[EngineRecovery, str]] = []
        other = {"prefill": "decode", "decode": "prefill"}
        partner = self.ctx.fleet.get(partner_id)
        for engine, phase, other_id in (
            (reporter, failure.phase, partner_id),
            (partner, other.get(failure.phase, ""), reporter.id),
        ):
            record = None if engine is None else self.verdicts.record_for(engine)
            if record is not None and phase in PHASES:
                record.legs_seen += 1
                record.transfer_failures.append((now, record.legs_seen, other_id))
                while record.transfer_failures and now - record.transfer_failures[0][0] > window:
                    record.transfer_failures.popleft()
                involved.append((record, phase))
        settings = self.ctx.config.recovery.breaker
        ratio, threshold = settings.failure_ratio, settings.failure_threshold
        for record, phase in involved:
            share = suspect(
                record.transfer_failures,
                record.legs_seen,
                threshold=threshold,
                ratio=ratio,
                available=partial(self._partners_available, record.engine),
            )
            if share is None:
                continue
            failed, legs = share
            peer = self._transferring_peer(record, phase, now, ratio / 2)
            if peer is None:
                continue
            message = (
                f"{failure.message}; counted against {record.engine.id}: {failed} of its "
                f"last {legs} legs failed their KV transfer within "
                f"recovery.breaker.window_s={window}, while {peer}"
            )
            self._count(record, phase, message, ErrorCode.KV_TRANSFER_FAILED)

    def _share(self, record: EngineRecovery, phase: str, now: float) -> tuple[int, int]:
        """(failed transfers, legs) of a peer's `phase` within the breaker window: its
        answered legs (the breaker's count, while closed) and its failed transfers."""
        breaker = record.breakers[phase]
        counted, total = breaker.legs_in_window(now)
        window = breaker.settings.window_s
        failed = sum(1 for at, _, _ in record.transfer_failures if now - at <= window)
        return failed, failed + int(total - counted)

    def _partners_available(self, subject: EngineState) -> int:
        """How many engines of the other role could pair with `subject`: those in
        service, or out only for failures (a breaker, quarantine), which is how a
        broken partner leaves, and must not make the one it failed with look alone."""
        other = "decode" if subject.role == "prefill" else "prefill"
        count = 0
        for engine in self.ctx.fleet:
            record = self.verdicts.record_for(engine)
            if (
                record is not None
                and engine.role == other
                and engine.dialect is subject.dialect
                and not (engine.removed or engine.drained or record.hold.active)
                and record.health.verdict is Verdict.UP
                and engine.auth_refused is None
                and engine.model_missing is None
            ):
                count += 1
        return count

    def _transferring_peer(
        self, record: EngineRecovery, phase: str, now: float, below: float
    ) -> str | None:
        """Another available engine of the same role whose transfers mostly work, as
        "ID failed F of its N", or None."""
        subject = record.engine
        for engine in self.ctx.fleet:
            peer = self.verdicts.record_for(engine)
            if (
                peer is None
                or engine is subject
                or engine.role != subject.role
                or engine.dialect is not subject.dialect
                or engine.unavailable_reason(now, "prefill" if phase == "prefill" else "decode")
                is not None
            ):
                continue
            failed, legs = self._share(peer, phase, now)
            if legs > failed and failed < below * legs:
                return f"{engine.id} failed {failed} of its {legs}"
        return None
