"""The load the router itself has put on one engine, kept as a ledger of claims.

Owns
  `EngineLoad` (one engine's counters: legs queued, running and placed, the KV they hold,
  handoffs waiting), the `Claim`s that change them, and `LoadStatistics`, the frozen
  record readers take.

Invariants
  A counter changes only when a claim is taken (a method of `EngineLoad`) or released.
  A claim gives back exactly what it took, once: by `release()` or by leaving its
  `with` block on any path, an exception or a cancellation included. So a ledger whose
  claims are all released reads zero everywhere.
  Taking and releasing never block or checkpoint: no cancellation can land between a
  count and the `with` that undoes it (`with engine.load.prefill(tokens):`).

Errors
  None: the ledger only counts. Limits (phase slots, admission) are enforced elsewhere.

See
  `EngineState.view` (what placement and pricing read), `narwhal.serving` (the claims'
  takers), tests/fleet/test_load.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import TracebackType
from typing import Literal, Self

import attrs


@attrs.frozen
class LoadStatistics:
    """One engine's load at one instant (`EngineLoad.statistics`)."""

    # Every leg ever started on the engine, of any phase.
    legs_started: int = 0
    # Prefills placed here and waiting for a phase slot.
    prefill_queued: int = 0
    prefill_queued_tokens: int = 0
    # Prefill legs running, and their prompts.
    prefill_inflight: int = 0
    prefill_tokens_inflight: int = 0
    # Prefilled KV on this engine still waiting for its decode leg to be sent.
    handoffs_pending: int = 0
    # Decodes placed here whose prefill has not finished.
    decode_pending: int = 0
    decode_pending_tokens: int = 0
    # Decode legs running, and the KV they hold (prompts plus tokens generated so far).
    decode_active: int = 0
    decode_tokens: int = 0
    # Non-streaming decode legs running; decode legs not yet at their first token.
    unstreamed_legs: int = 0
    awaiting_first_token: int = 0

    def scaled(self, n: int) -> LoadStatistics:
        """The load `n` times over: the fleet's, estimated from one of `n` replicas'
        ledgers (`EngineState.load_scale`). The leg counter stays this ledger's."""
        if n == 1:
            return self
        return LoadStatistics(
            legs_started=self.legs_started,
            prefill_queued=self.prefill_queued * n,
            prefill_queued_tokens=self.prefill_queued_tokens * n,
            prefill_inflight=self.prefill_inflight * n,
            prefill_tokens_inflight=self.prefill_tokens_inflight * n,
            handoffs_pending=self.handoffs_pending * n,
            decode_pending=self.decode_pending * n,
            decode_pending_tokens=self.decode_pending_tokens * n,
            decode_active=self.decode_active * n,
            decode_tokens=self.decode_tokens * n,
            unstreamed_legs=self.unstreamed_legs * n,
            awaiting_first_token=self.awaiting_first_token * n,
        )

    def with_others(self, seen: SeenLoad) -> LoadStatistics:
        """This ledger's load plus the other replicas' legs seen on the engine: the
        fleet's, estimated from the engine's own report rather than from this ledger
        alone (`scaled`)."""
        return attrs.evolve(
            self,
            prefill_inflight=self.prefill_inflight + seen.prefill,
            prefill_tokens_inflight=self.prefill_tokens_inflight
            + round(seen.prefill * seen.prefill_tokens),
            decode_active=self.decode_active + seen.decode,
            decode_tokens=self.decode_tokens + round(seen.decode * seen.decode_tokens),
        )


@attrs.frozen
class SeenLoad:
    """The other replicas' legs on one engine, trusted until `until`: as they published
    them through etcd (`source` "replicas", `EngineState.saw_replica_loads`), or as the
    engine's own /metrics showed them ("scrape", `EngineState.saw_engine_load`): the
    requests it reported running or waiting less this replica's legs on it then, by
    phase, each taken to hold what this replica's legs of that phase held on average."""

    prefill: int
    decode: int
    # Prompt tokens per prefill leg; KV tokens per decode leg.
    prefill_tokens: float
    decode_tokens: float
    until: float
    source: Literal["scrape", "replicas"] = "scrape"


class Claim:
    """Load taken from a ledger, given back once: by `release()` (idempotent) or on
    leaving its `with` block."""

    __slots__ = ("_undo",)

    def __init__(self, undo: Callable[[], None]) -> None:
        self._undo: Callable[[], None] | None = undo

    @property
    def held(self) -> bool:
        return self._undo is not None

    def release(self) -> None:
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class _Tally:
    """Legs of one kind on an engine and the tokens they hold, each leg a `Claim`."""

    __slots__ = ("legs", "tokens")

    def __init__(self) -> None:
        self.legs = 0
        self.tokens = 0

    def take(self, tokens: int) -> Claim:
        self.legs += 1
        self.tokens += tokens

        def undo() -> None:
            self.legs -= 1
            self.tokens -= tokens

        return Claim(undo)


class Generated(Claim):
    """A running decode leg's generated tokens, counted into its engine's `decode_tokens`
    as they are seen and given back together on release; a released claim takes no more."""

    __slots__ = ("_decode", "tokens")

    def __init__(self, decode: _Tally) -> None:
        self._decode = decode
        self.tokens = 0

        def undo() -> None:
            decode.tokens -= self.tokens

        super().__init__(undo)

    def add(self, tokens: int) -> None:
        if self.held:
            self.tokens += tokens
            self._decode.tokens += tokens


class EngineLoad:
    """The ledger of one engine's load, owned by its `EngineState` (`engine.load`).

    Placement sees placed work as load before it runs (queued prefills, pending
    decodes); `EngineState.resident_work` counts it too, so a retired engine closes only
    once nothing placed on it can still start there.
    """

    __slots__ = (
        "_awaiting_first_token",
        "_decode",
        "_decode_pending",
        "_handoffs",
        "_legs_started",
        "_prefill",
        "_prefill_queued",
        "_unstreamed_cap",
        "_unstreamed_legs",
        "_unstreamed_since",
        "_unstreamed_unbounded",
    )

    def __init__(self) -> None:
        self._legs_started = 0
        self._prefill_queued = _Tally()
        self._prefill = _Tally()
        self._handoffs = _Tally()
        self._decode_pending = _Tally()
        self._decode = _Tally()
        # Decode legs sent after their prefill and still waiting for a first token, by
        # start time; insertion order is start order, so the first value is the oldest.
        self._awaiting_first_token: dict[object, float] = {}
        # Non-streaming decode legs: count, sum of start times, sum of bounded
        # max_tokens, count of unbounded ones.
        self._unstreamed_legs = 0
        self._unstreamed_since = 0.0
        self._unstreamed_cap = 0
        self._unstreamed_unbounded = 0

    def __repr__(self) -> str:
        prefill, queued = self._prefill, self._prefill_queued
        decode, pending = self._decode, self._decode_pending
        text = (
            f"<EngineLoad [prefill {prefill.legs} ({prefill.tokens} tokens), "
            f"{queued.legs} queued ({queued.tokens} tokens) | decode {decode.legs} "
            f"({decode.tokens} tokens), {pending.legs} pending ({pending.tokens} tokens)"
            f" | {self._handoffs.legs} handoffs | {self._legs_started} legs started"
        )
        if self._unstreamed_legs:
            text += f" | {self._unstreamed_legs} unstreamed"
        if self._awaiting_first_token:
            text += f" | {len(self._awaiting_first_token)} awaiting first token"
        return text + "]>"

    def statistics(self) -> LoadStatistics:
        return LoadStatistics(
            legs_started=self._legs_started,
            prefill_queued=self._prefill_queued.legs,
            prefill_queued_tokens=self._prefill_queued.tokens,
            prefill_inflight=self._prefill.legs,
            prefill_tokens_inflight=self._prefill.tokens,
            handoffs_pending=self._handoffs.legs,
            decode_pending=self._decode_pending.legs,
            decode_pending_tokens=self._decode_pending.tokens,
            decode_active=self._decode.legs,
            decode_tokens=self._decode.tokens,
            unstreamed_legs=self._unstreamed_legs,
            awaiting_first_token=len(self._awaiting_first_token),
        )

    def mirror(self, decode_active: int, decode_tokens: int, prefill_inflight: int) -> None:
        """Set the counts a worker process reads of its core's ledger (`narwhal.plane`):
        a worker's legs take their claims on the core's, never on this one."""
        self._decode.legs, self._decode.tokens = decode_active, decode_tokens
        self._prefill.legs = prefill_inflight

    # ---------------------------------------------------------------- claims

    def prefill_queue(self, tokens: int) -> Claim:
        """A prefill of `tokens` placed here, waiting for a phase slot."""
        return self._prefill_queued.take(tokens)

    def prefill(self, tokens: int) -> Claim:
        """A prefill leg of `tokens` started here and running."""
        self._legs_started += 1
        return self._prefill.take(tokens)

    def handoff(self) -> Claim:
        """Prefilled KV held here for a decode leg not sent yet."""
        return self._handoffs.take(0)

    def decode_placed(self, tokens: int) -> Claim:
        """A decode of a `tokens` prompt placed here, a whole prefill before its leg
        starts. Without it, every request placed in that window would see the same
        decode load, and the tie-break would send them all to the same engine."""
        return self._decode_pending.take(tokens)

    def decode(self, tokens: int) -> Claim:
        """A decode leg started here and running, its `tokens` prompt resident."""
        self._legs_started += 1
        return self._decode.take(tokens)

    def generated(self) -> Generated:
        """The KV a running streamed decode leg generates, added as its tokens are seen."""
        return Generated(self._decode)

    def awaiting_first_token(self, since: float) -> Claim:
        """A decode leg sent at `since` that has not had its first token: released when
        the token comes or the leg ends."""
        key = object()
        self._awaiting_first_token[key] = since

        def undo() -> None:
            del self._awaiting_first_token[key]

        return Claim(undo)

    def unstreamed_decode(self, max_new_tokens: int | None, since: float) -> Claim:
        """A non-streaming decode leg started at `since`: pricing estimates the KV it
        generates from its age (`EngineView.unstreamed_age_s`), since no token is seen
        until the whole body arrives."""
        self._unstreamed_legs += 1
        self._unstreamed_since += since
        if max_new_tokens is None:
            self._unstreamed_unbounded += 1
        else:
            self._unstreamed_cap += max_new_tokens

        def undo() -> None:
            self._unstreamed_legs -= 1
            # Reset rather than subtract at zero: float sums of clock values drift.
            self._unstreamed_since = (
                self._unstreamed_since - since if self._unstreamed_legs else 0.0
            )
            if max_new_tokens is None:
                self._unstreamed_unbounded -= 1
            else:
                self._unstreamed_cap -= max_new_tokens

        return Claim(undo)

    # ---------------------------------------------------------------- readings

    @property
    def legs_started(self) -> int:
        """A leg that sees this unchanged at its end ran without another leg starting
        beside it (latency residuals need that)."""
        return self._legs_started

    @property
    def prefill_queued(self) -> int:
        return self._prefill_queued.legs

    @property
    def prefill_queued_tokens(self) -> int:
        return self._prefill_queued.tokens

    @property
    def prefill_inflight(self) -> int:
        return self._prefill.legs

    @property
    def prefill_tokens_inflight(self) -> int:
        return self._prefill.tokens

    @property
    def handoffs_pending(self) -> int:
        return self._handoffs.legs

    @property
    def decode_pending(self) -> int:
        return self._decode_pending.legs

    @property
    def decode_pending_tokens(self) -> int:
        return self._decode_pending.tokens

    @property
    def decode_active(self) -> int:
        return self._decode.legs

    @property
    def decode_tokens(self) -> int:
        return self._decode.tokens

    @property
    def unstreamed_legs(self) -> int:
        return self._unstreamed_legs

    @property
    def placed(self) -> int:
        """Legs and handoffs that still need the engine: running, placed or waiting."""
        return (
            self._prefill.legs
            + self._decode.legs
            + self._handoffs.legs
            + self._decode_pending.legs
            + self._prefill_queued.legs
        )

    def first_token_wait_s(self, now: float) -> float:
        """How long the oldest decode leg still waiting for its first token has waited."""
        for since in self._awaiting_first_token.values():
            return max(0.0, now - since)
        return 0.0

    def unstreamed_age_s(self, now: float) -> float:
        """The seconds the non-streaming decode legs have run, summed over the legs."""
        if not self._unstreamed_legs:
            return 0.0
        return max(0.0, self._unstreamed_legs * now - self._unstreamed_since)

    @property
    def unstreamed_cap(self) -> float:
        """The most tokens the non-streaming decode legs may still generate: their
        max_tokens summed; inf when one has no bound."""
        return math.inf if self._unstreamed_unbounded else float(self._unstreamed_cap)
