"""Applying a decision to the live fleet, and the bounded flip history.

A role change is one assignment to `EngineState.role`. Placement reads the role for
every new request, so the change steers new work at once; nothing here touches resident
work (docs/design.md#placement): a decode engine turned prefill keeps streaming the requests it
holds until they finish or are cancelled, it simply stops receiving new decode legs. A prefill
engine turned decode finishes its in-flight prefills and keeps serving the KV handoffs already
waiting on it.

No trio import: the live engine is anything with the `RoleTarget` members.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Literal, Protocol

import attrs

from ._decide import Caller, Decision, Move, Reason, Split


class DecodeLoad(Protocol):
    """The members of `narwhal.fleet.EngineLoad` a role change reads."""

    @property
    def decode_active(self) -> int: ...
    @property
    def decode_pending(self) -> int: ...


class RoleTarget(Protocol):
    """The members of `narwhal.fleet.EngineState` that a role change reads or writes."""

    id: str
    role: Literal["prefill", "decode", "both"]

    @property
    def pinned(self) -> bool: ...
    @property
    def drained(self) -> bool: ...
    @property
    def removed(self) -> bool: ...

    @property
    def load(self) -> DecodeLoad: ...

    @property
    def fixed_role(self) -> str | None: ...

    def unavailable_reason(
        self, now: float, phase: Literal["prefill", "decode", "aggregate"] | None = None
    ) -> str | None: ...


class MoveRejected(Exception):
    """The live engine no longer allows the move the decision named."""


@attrs.frozen(kw_only=True)
class FlipRecord:
    """One role change (or, in advisory mode, one proposed role change)."""

    time: float
    engine: str
    from_role: str
    to_role: str
    caller: Caller
    reason: Reason
    detail: str
    before: Split
    after: Split
    # Decode streams left to finish on the engine where they are: open ones and those
    # placed on it that have not started (`resident_streams`).
    resident_streams: int
    applied: bool


def check_move(engine: RoleTarget, move: Move, now: float) -> None:
    """Raise MoveRejected unless the engine may change role now: it has the role the
    move starts from, its dialect lets its role change, and it is not pinned, drained,
    removed, ejected, held or quarantined (any availability reason, breakers included)."""
    if engine.id != move.engine:
        raise MoveRejected(f"move names engine {move.engine!r}, got {engine.id!r}")
    if engine.role != move.from_role:
        raise MoveRejected(
            f"engine {engine.id!r} has role {engine.role!r}; the move starts from "
            f"{move.from_role!r}"
        )
    if engine.fixed_role is not None:
        raise MoveRejected(f"engine {engine.id!r} cannot change role: {engine.fixed_role}")
    if engine.pinned:
        raise MoveRejected(f"engine {engine.id!r} is pinned")
    reason = engine.unavailable_reason(now)
    if reason is not None:
        raise MoveRejected(f"engine {engine.id!r} is unavailable: {reason}")


def apply_move(engine: RoleTarget, decision: Decision) -> FlipRecord:
    """Change the role of the engine `decision.move` names and return the flip record.

    Resident work stays where it is; only new placement sees the new role.
    """
    move = decision.move
    if move is None:
        raise MoveRejected("the decision names no move")
    if decision.result != "move":
        raise MoveRejected(f"the decision's result is {decision.result!r}, not 'move'")
    check_move(engine, move, decision.now)
    engine.role = move.to_role
    return flip_record(decision, resident_streams=resident_streams(engine), applied=True)


def resident_streams(engine: RoleTarget) -> int:
    """The decode streams a role change leaves on the engine: the open ones and the legs
    placed on it whose prefill is still running or whose KV waits for a slot
    (docs/design.md#placement: placed requests keep their engine, so they start here after a
    move to prefill)."""
    return engine.load.decode_active + engine.load.decode_pending


def flip_record(decision: Decision, *, resident_streams: int, applied: bool) -> FlipRecord:
    move = decision.move
    assert move is not None
    return FlipRecord(
        time=decision.now,
        engine=move.engine,
        from_role=move.from_role,
        to_role=move.to_role,
        caller=decision.caller,
        reason=decision.reason,
        detail=decision.detail,
        before=decision.current,
        after=decision.proposed,
        resident_streams=resident_streams,
        applied=applied,
    )


class FlipHistory:
    """The newest `controller.flip_history` records, ordinary and recovery alike."""

    def __init__(self, limit: int) -> None:
        self._records: deque[FlipRecord] = deque(maxlen=limit)
        self.total = 0

    @property
    def limit(self) -> int:
        maxlen = self._records.maxlen
        assert maxlen is not None
        return maxlen

    def resize(self, limit: int) -> None:
        """A reload changed `controller.flip_history`: keep the newest records."""
        if limit != self.limit:
            self._records = deque(self._records, maxlen=limit)

    def append(self, record: FlipRecord) -> None:
        self._records.append(record)
        self.total += 1

    @property
    def last(self) -> FlipRecord | None:
        return self._records[-1] if self._records else None

    def __iter__(self) -> Iterator[FlipRecord]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)
