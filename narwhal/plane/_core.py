"""The decision core's answers to its workers (docs/architecture.md#workers).

Owns
  `DecisionCore`: the handlers of every worker's channel, over the one `ServingContext`
  the core keeps. Each request a worker retains is a session here: a `Decisions` of the
  core's own, which takes what the worker's `RemoteDecisions` asks for on the same
  objects a single process uses (the retained count, the admission gate and its queue,
  the engines' phase limiters and load ledgers, the retry budget, the books pricing
  reads), and the ledger claims the worker's legs reported.

Invariants
  A session lives as long as its `retained` hold. It ends when the worker releases it,
  or when the worker dies (its channel's handlers are cancelled): then every hold of the
  request is released by its own `async with`, and every claim it still has is given
  back. So the counts here are exact, but for the requests of a worker that has just
  died, released in the core's next scheduler pass. A note about a request whose session
  has ended, or about an engine no longer in the fleet, is dropped: what it reported is
  gone with them.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio

from .._codes import ErrorCode
from .._errors import EngineFailed, Unavailable
from ..fleet import Claim, EngineState, Generated
from ..placement import Placement
from ..prefix import PromptKey
from ..serving._context import RequestRecord, ServingContext
from ..serving._decisions import Decisions, Standing, first_slot, standing_of
from ..serving._request import ClientRequest
from ..serving._retry import Tried
from ..signals import DecodeGaps
from ._channel import CallHandler, NoteHandler
from ._remote import FirstAttempt

Reply = Callable[[object], None]
# The outcome of a request whose worker died while serving it.
WORKER_LOST = "worker_lost"


@attrs.define(eq=False)
class _Session:
    decisions: Decisions
    endpoint: str
    claims: dict[int, Claim] = attrs.field(factory=dict)
    finished: bool = False
    # The first attempt's grants the worker gave back (`FirstAttempt`).
    let_go: dict[str, trio.Event] = attrs.field(
        factory=lambda: {"decode_placed": trio.Event(), "slot": trio.Event()}
    )


class DecisionCore:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self._sessions: dict[tuple[int, str], _Session] = {}

    @property
    def sessions(self) -> int:
        """Requests the workers retain now."""
        return len(self._sessions)

    def handlers(self, worker: int) -> tuple[CallHandler, NoteHandler]:
        """The handlers of worker `worker`'s channel."""

        async def on_call(name: str, payload: object, reply: Reply) -> object:
            if name == "config":
                return self.ctx.config
            assert isinstance(payload, tuple)
            key, args = payload
            if name == "retained":
                address, endpoint = args
                await self._retained(worker, key, str(address), str(endpoint), reply)
                return None
            session = self._sessions.get((worker, key))
            if session is None:
                raise RuntimeError(f"worker {worker} asked `{name}` of request {key}, not retained")
            return await self._call(session, name, args, reply)

        def on_note(name: str, payload: object) -> None:
            if name == "up":
                return
            assert isinstance(payload, tuple)
            key, args = payload
            session = self._sessions.get((worker, key))
            if session is None and name == "finished":
                # Refused before it was retained: it ends here all the same, once.
                session = _Session(self.ctx.decisions_for(self.ctx.config), "")
            if session is not None:
                self._note(session, name, args)

        return on_call, on_note

    async def _retained(
        self, worker: int, key: str, address: str, endpoint: str, reply: Reply
    ) -> None:
        decisions = self.ctx.decisions_for(self.ctx.config)
        session = _Session(decisions, endpoint)
        async with decisions.retained(address):
            self._sessions[(worker, key)] = session
            try:
                reply(None)
                await trio.sleep_forever()
            finally:
                del self._sessions[(worker, key)]
                for claim in session.claims.values():
                    claim.release()
                if not session.finished:
                    # Its worker died with it: no byte of an answer can reach the client
                    # now, but the request still ends here once, counted.
                    decisions.finished(WORKER_LOST)
                    self.ctx.metrics.requests_by(endpoint, WORKER_LOST).inc()

    def mirror(
        self,
    ) -> tuple[dict[str, tuple[int, int, int, int | None, str]], float | None, Standing]:
        """What workers read of the core's engines: each one's decode legs and tokens,
        prefill legs and context length (`EngineLoad.mirror`); the measured characters
        per token; the fleet's standing."""
        engines = {
            engine.id: (
                engine.load.decode_active,
                engine.load.decode_tokens,
                engine.load.prefill_inflight,
                engine.context_length,
                engine.context_note,
            )
            for engine in self.ctx.fleet
        }
        return engines, self.ctx.measured_chars_per_token, standing_of(self.ctx)

    def _engine(self, engine_id: object) -> EngineState:
        engine = self.ctx.fleet.get(str(engine_id))
        if engine is None:
            raise Unavailable(
                f"engine {engine_id} left the fleet",
                code=ErrorCode.NO_ENGINE_AVAILABLE,
                public="the engine placed left the fleet",
            )
        return engine

    async def _call(
        self, session: _Session, name: str, args: tuple[object, ...], reply: Reply
    ) -> object:
        decisions = session.decisions
        now = trio.current_time()
        if name == "standing":
            return await decisions.standing()
        if name == "cached":
            (key,) = args
            assert key is None or isinstance(key, PromptKey)
            return await decisions.cached(key)
        if name == "place":
            request, tokens, cached, tried, key = args
            assert isinstance(request, ClientRequest)
            assert isinstance(cached, dict)
            assert isinstance(tried, Tried)
            assert key is None or isinstance(key, PromptKey)
            return await decisions.place(request, _int(tokens), cached, tried, key)
        if name == "retry":
            failure, engine_id, tried, placement, visible, left = args
            assert isinstance(failure, EngineFailed)
            assert isinstance(tried, Tried)
            assert isinstance(placement, Placement)
            return await decisions.retry(
                failure,
                self._engine(engine_id),
                tried,
                placement,
                visible=bool(visible),
                deadline=now + _float(left),
            )
        if name == "admission":
            request, tokens, key = args
            assert isinstance(request, ClientRequest)
            assert key is None or isinstance(key, PromptKey)
            await self._admission(session, request, _int(tokens), key, reply)
        if name == "decode_placed":
            engine_id, tokens = args
            async with decisions.decode_placed(self._engine(engine_id), _int(tokens)):
                reply(None)
                await trio.sleep_forever()
        if name == "phase_slot":
            engine_id, phase, tokens, left = args
            engine = self._engine(engine_id)
            assert phase in ("prefill", "decode")
            async with decisions.phase_slot(
                engine, phase, _int(tokens), not_after=now + _float(left)
            ):
                reply(decisions.alone(engine))
                await trio.sleep_forever()
        raise ValueError(f"the core has no call `{name}`")

    async def _admission(
        self,
        session: _Session,
        request: ClientRequest,
        tokens: int,
        key: PromptKey | None,
        reply: Reply,
    ) -> None:
        """Admit the request, place its first attempt, and take that attempt's decode
        claim and first phase slot, as the worker's legs would next: one answer for
        them all (`FirstAttempt`). The worker gives back the slot and the claim as its
        legs leave them (`let_go`), and the admission slot with the hold."""
        decisions = session.decisions
        async with decisions.admission(request, tokens, key) as admitted:
            placed = await decisions.place(request, tokens, admitted.cached, Tried(), key)
            slot = first_slot(placed)
            first = FirstAttempt(placed, slot)
            if slot is None or first.decode is None:
                reply((admitted, first))
                await trio.sleep_forever()
            engine_id, phase = slot
            engine = self._engine(engine_id)
            decode = self._engine(first.decode)
            async with decisions.decode_placed(decode, tokens):
                async with decisions.phase_slot(engine, phase, tokens):
                    reply((admitted, attrs.evolve(first, alone=decisions.alone(engine))))
                    await session.let_go["slot"].wait()
                await session.let_go["decode_placed"].wait()
            await trio.sleep_forever()

    def _note(self, session: _Session, name: str, args: tuple[object, ...]) -> None:
        decisions = session.decisions
        now = trio.current_time()
        if name == "body_read":
            decisions.body_read()
        elif name == "let_go":
            session.let_go[str(args[0])].set()
        elif name == "succeeded":
            decisions.succeeded()
        elif name == "finished":
            outcome, record = args
            assert record is None or isinstance(record, RequestRecord)
            session.finished = True
            decisions.finished(str(outcome), record)
        elif name == "claim":
            claim_id, kind, engine_id, *rest = args
            engine = self.ctx.fleet.get(str(engine_id))
            if engine is not None:
                session.claims[_int(claim_id)] = _claim(decisions, str(kind), engine, rest, now)
        elif name == "grow":
            claim_id, tokens = args
            grown = session.claims.get(_int(claim_id))
            if isinstance(grown, Generated):
                grown.add(_int(tokens))
        elif name == "release":
            released = session.claims.pop(_int(args[0]), None)
            if released is not None:
                released.release()
        else:
            engine = self.ctx.fleet.get(str(args[0]))
            if engine is not None:
                _engine_note(decisions, name, engine, args[1:])


def _claim(
    decisions: Decisions, kind: str, engine: EngineState, args: list[object], now: float
) -> Claim:
    """A worker's leg's claim on `engine`'s ledger; ages are seconds before `now`."""
    if kind == "generated":
        return decisions.generated(engine)
    if kind == "handoff":
        return decisions.handoff(engine)
    if kind == "local_prefill":
        tokens, cached = args
        return decisions.local_prefill(engine, _int(tokens), _int(cached))
    if kind == "awaiting_first_token":
        (age,) = args
        return decisions.awaiting_first_token(engine, now - _float(age))
    if kind == "unstreamed_decode":
        bound, age = args
        assert bound is None or isinstance(bound, int)
        return decisions.unstreamed_decode(engine, bound, now - _float(age))
    raise ValueError(f"the core has no claim `{kind}`")


def _engine_note(
    decisions: Decisions, name: str, engine: EngineState, args: tuple[object, ...]
) -> None:
    if name == "leg_ok":
        phase, duration_s, prompt_tokens, alone, gaps = args
        assert phase in ("prefill", "decode", "aggregate")
        assert alone is None or isinstance(alone, int)
        assert gaps is None or isinstance(gaps, DecodeGaps)
        decisions.leg_ok(
            engine,
            phase,
            _float(duration_s),
            prompt_tokens=_int(prompt_tokens),
            alone=alone,
            gaps=gaps,
        )
    elif name == "leg_failed":
        (failure,) = args
        assert isinstance(failure, EngineFailed)
        decisions.leg_failed(failure, engine)
    elif name == "kv_freed":
        decisions.kv_freed(engine, _int(args[0]))
    elif name == "first_token_lag":
        decisions.first_token_lag(engine, _float(args[0]))
    elif name == "decode_gaps":
        (summary,) = args
        assert isinstance(summary, DecodeGaps)
        decisions.decode_gaps(engine, summary)
    elif name == "first_token_timeout":
        decisions.first_token_timeout(engine)
    else:
        raise ValueError(f"the core has no note `{name}`")


def _int(value: object) -> int:
    assert isinstance(value, int)
    return value


def _float(value: object) -> float:
    assert isinstance(value, float | int)
    return float(value)
