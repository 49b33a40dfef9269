"""A small fluid model of a P/D fleet, fixed profiles and synthetic traces: what the
replay tool and the scenario tests drive the pure decision core with, in simulated time.

No trio, no sockets, no sleeping: time is a float the driver advances.

The fleet model
---------------
* Prefill is a first-come-first-served queue served by the live prefill engines, each a
  server that runs one prompt at a time for ``prefill_s(n)`` (times the fleet's
  ``true_scale`` and a lognormal noise factor). A request's prefill finishes at
  ``max(arrival, earliest free server) + service``; that is exact FCFS with k servers.
* Decode is time-stepped in `dt` slices. A prefilled request joins the live decode
  engine with the fewest streams when its prefill finishes (handoff is instant). Each
  engine steps all its streams at ``interval_s(B, K)`` (B streams, K resident KV tokens,
  times ``true_scale`` and noise), so each stream gains ``dt / interval`` tokens per
  slice. A request's TTFT is prefill finish − arrival + its first interval; its TPOT is
  its mean interval.
* A role change affects only new work, as in Narwhal: a decode engine turned prefill
  keeps decoding its resident streams to completion (it also takes prefills at once;
  the model ignores the interference), a prefill engine turned decode finishes the
  prefill it runs.
* Measurements given to the controller: each prefill engine's predicted work (its
  remaining service plus an equal share of the queued prompts, priced with the
  profile), each decode engine's mean step interval since the last pass, and a decode
  correction of 1 (or the true/profile ratio when `report_correction` is set).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence

import attrs

from ..config import Config
from ._decide import Decision, Move, decide
from ._demand import Arrival, DemandEstimator
from ._profile import Profile
from ._snapshot import EngineSnapshot, FleetSnapshot, Role, measured_prefill_pressure
from ._state import ControllerState, initial_state

# --- fixed profiles -------------------------------------------------------------------


@attrs.frozen
class QuadraticPrefill:
    """``prefill_s(n) = a + b·n + c·n²`` over a measured prompt range."""

    a: float = 6.0e-3
    b: float = 2.0e-5
    c: float = 7.0e-10
    min_tokens: int = 1
    max_tokens: int = 32768

    def prefill_s(self, n: int) -> float:
        return self.a + self.b * n + self.c * n * n

    def in_domain(self, n: int) -> bool:
        return self.min_tokens <= n <= self.max_tokens


@attrs.frozen
class AffineDecode:
    """``interval_s(B, K) = t0 + per_kv·K + per_seq·B`` over a measured batch range."""

    t0: float = 6.0e-3
    per_kv: float = 4.4e-8
    per_seq: float = 3.0e-5
    max_active: int = 1024
    max_kv_tokens: int = 450_000

    @property
    def idle_floor_s(self) -> float:
        return self.t0

    def interval_s(self, active: float, kv_tokens: float) -> float:
        return self.t0 + self.per_kv * kv_tokens + self.per_seq * active

    def in_domain(self, active: int, kv_tokens: int) -> bool:
        # As `DecodeModel.in_domain`, which real profiles use: the idle point, or one
        # request and up.
        if active <= 0 and kv_tokens <= 0:
            return True
        return 1 <= active <= self.max_active and 0 <= kv_tokens <= self.max_kv_tokens


@attrs.frozen
class StaticProfile:
    """A fixed engine profile (defaults: Llama-3-8B bf16 on one H100, as the simulator)."""

    prefill: QuadraticPrefill = attrs.field(factory=QuadraticPrefill)
    decode: AffineDecode = attrs.field(factory=AffineDecode)
    kv_capacity_tokens: int = 450_000
    max_model_len: int = 32768
    max_num_seqs: int = 0  # unknown: the engine's cap does not bound a projection


# --- traces ---------------------------------------------------------------------------


@attrs.frozen
class FluidRequest:
    time: float
    prompt_tokens: int
    output_tokens: int


@attrs.frozen
class Phase:
    """A stretch of stationary synthetic traffic: Poisson arrivals, exponential prompt
    and output lengths around their means (at least 1 token each)."""

    duration_s: float
    rate: float  # requests/s
    prompt_tokens: float
    output_tokens: float
    name: str = ""


def synthetic_trace(
    phases: Sequence[Phase], *, seed: int = 0, max_prompt: int = 32768
) -> list[FluidRequest]:
    rng = random.Random(seed)
    out: list[FluidRequest] = []
    start = 0.0
    for phase in phases:
        t = start
        end = start + phase.duration_s
        while phase.rate > 0:
            t += rng.expovariate(phase.rate)
            if t >= end:
                break
            prompt = min(max_prompt, max(1, round(rng.expovariate(1.0 / phase.prompt_tokens))))
            output = max(1, round(rng.expovariate(1.0 / phase.output_tokens)))
            out.append(FluidRequest(t, prompt, output))
        start = end
    return out


# --- the fleet ------------------------------------------------------------------------


@attrs.define(eq=False)
class _Stream:
    request: FluidRequest
    ready_at: float
    remaining: float
    tokens: float = 0.0
    decode_time: float = 0.0
    ttft: float | None = None


@attrs.define(eq=False)
class FluidEngine:
    id: str
    role: Role
    pinned: bool = False
    drained: bool = False
    busy_until: float = 0.0
    streams: list[_Stream] = attrs.field(factory=list)
    _interval_sum: float = 0.0
    _interval_count: int = 0

    @property
    def decode_tokens(self) -> int:
        return round(sum(s.request.prompt_tokens + s.tokens for s in self.streams))


@attrs.frozen
class Outcome:
    arrival: float
    ttft: float
    tpot: float
    prompt_tokens: int
    output_tokens: int

    def meets(self, ttft_s: float, tpot_s: float) -> bool:
        return self.ttft <= ttft_s and self.tpot <= tpot_s


class FluidFleet:
    def __init__(
        self,
        roles: Sequence[Role],
        profile: StaticProfile,
        *,
        dt: float = 0.25,
        true_scale: float = 1.0,
        noise_sigma: float = 0.0,
        report_correction: bool = False,
        seed: int = 0,
        ids: Sequence[str] | None = None,
    ) -> None:
        names = list(ids) if ids is not None else [f"e{i}" for i in range(len(roles))]
        if len(names) != len(roles):
            raise ValueError(f"{len(names)} engine ids for {len(roles)} roles")
        self.engines = [FluidEngine(name, role) for name, role in zip(names, roles, strict=True)]
        self.profile = profile
        self.dt = dt
        self.true_scale = true_scale
        self.noise_sigma = noise_sigma
        self.report_correction = report_correction
        self._rng = random.Random(seed)
        self.now = 0.0
        self._queue: deque[FluidRequest] = deque()
        self._queued_work = 0.0  # profile-priced prefill work waiting in the queue
        self._prefilled: list[_Stream] = []
        self.outcomes: list[Outcome] = []

    def _noise(self) -> float:
        if self.noise_sigma == 0.0:
            return 1.0
        mu = -0.5 * self.noise_sigma * self.noise_sigma
        return self._rng.lognormvariate(mu, self.noise_sigma)

    def engine(self, engine_id: str) -> FluidEngine:
        for engine in self.engines:
            if engine.id == engine_id:
                return engine
        raise KeyError(engine_id)

    def apply(self, move: Move) -> None:
        engine = self.engine(move.engine)
        if engine.role != move.from_role or engine.pinned or engine.drained:
            raise ValueError(f"fluid engine {engine.id} cannot take {move}")
        engine.role = move.to_role

    def submit(self, request: FluidRequest) -> None:
        self._queue.append(request)
        self._queued_work += self.profile.prefill.prefill_s(request.prompt_tokens)

    def _prefill(self, until: float) -> None:
        scale = self.true_scale
        while self._queue:
            servers = [e for e in self.engines if e.role == "prefill" and not e.drained]
            if not servers:
                return
            request = self._queue[0]
            server = min(servers, key=lambda e: (e.busy_until, e.id))
            start = max(request.time, server.busy_until)
            if start >= until:
                return
            self._queue.popleft()
            priced = self.profile.prefill.prefill_s(request.prompt_tokens)
            self._queued_work = max(0.0, self._queued_work - priced) if self._queue else 0.0
            service = priced * scale * self._noise()
            server.busy_until = start + service
            self._prefilled.append(_Stream(request, start + service, float(request.output_tokens)))

    def advance(self, until: float) -> None:
        """Run the fleet from `now` to `until`."""
        self._prefill(until)
        self._prefilled.sort(key=lambda s: s.ready_at)
        t = self.now
        while t < until - 1e-12:
            h = min(self.dt, until - t)
            self._admit(t + h)
            for engine in self.engines:
                if engine.streams:
                    self._decode(engine, t, h)
            t += h
        self.now = until

    def _admit(self, by: float) -> None:
        decoders = [e for e in self.engines if e.role == "decode" and not e.drained]
        if not decoders:
            return
        keep: list[_Stream] = []
        for stream in self._prefilled:
            if stream.ready_at <= by:
                target = min(decoders, key=lambda e: (len(e.streams), e.id))
                target.streams.append(stream)
            else:
                keep.append(stream)
        self._prefilled = keep

    def _decode(self, engine: FluidEngine, t: float, h: float) -> None:
        batch = len(engine.streams)
        interval = (
            self.profile.decode.interval_s(batch, engine.decode_tokens)
            * self.true_scale
            * self._noise()
        )
        engine._interval_sum += interval
        engine._interval_count += 1
        end = t + h
        alive: list[_Stream] = []
        for stream in engine.streams:
            start = max(t, stream.ready_at)
            if stream.ttft is None:
                stream.ttft = stream.ready_at - stream.request.time + interval
            produce = max(0.0, end - start) / interval
            if produce >= stream.remaining:
                stream.decode_time += stream.remaining * interval
                stream.tokens += stream.remaining
                tokens = max(stream.tokens, 1.0)
                self.outcomes.append(
                    Outcome(
                        stream.request.time,
                        stream.ttft,
                        stream.decode_time / tokens,
                        stream.request.prompt_tokens,
                        stream.request.output_tokens,
                    )
                )
            else:
                stream.remaining -= produce
                stream.tokens += produce
                stream.decode_time += end - start
                alive.append(stream)
        engine.streams = alive

    def engine_snapshots(self, now: float, state: ControllerState) -> tuple[EngineSnapshot, ...]:
        """Snapshots as `Controller.snapshot` would build them (consumes intervals)."""
        servers = [e for e in self.engines if e.role == "prefill" and not e.drained]
        share = self._queued_work / len(servers) if servers else 0.0
        correction = self.true_scale if self.report_correction else 1.0
        out: list[EngineSnapshot] = []
        for e in self.engines:
            blocked = "drained" if e.drained else None
            interval = e._interval_sum / e._interval_count if e._interval_count else None
            e._interval_sum, e._interval_count = 0.0, 0
            work = max(0.0, e.busy_until - now) + (share if e in servers else 0.0)
            out.append(
                EngineSnapshot(
                    id=e.id,
                    role=e.role,
                    prefill_blocked=blocked,
                    decode_blocked=blocked,
                    pinned=e.pinned,
                    since_role_change_s=state.since_role_change(e.id, now),
                    decode_active=len(e.streams),
                    decode_tokens=e.decode_tokens,
                    prefill_inflight=int(e.busy_until > now),
                    prefill_work_s=work,
                    profile=self.profile,
                    decode_interval_s=interval,
                    decode_correction=correction,
                )
            )
        return tuple(out)

    def split(self) -> tuple[int, int]:
        return (
            sum(e.role == "prefill" and not e.drained for e in self.engines),
            sum(e.role == "decode" and not e.drained for e in self.engines),
        )


# --- driving the pure core ------------------------------------------------------------


@attrs.frozen
class Step:
    """One monitor pass of a fluid run."""

    time: float
    split: tuple[int, int]  # after the pass
    decision: Decision


@attrs.define
class FluidRun:
    fleet: FluidFleet
    steps: list[Step] = attrs.field(factory=list)
    flips: list[tuple[float, Move]] = attrs.field(factory=list)

    def flips_between(self, start: float, end: float) -> int:
        return sum(start <= t < end for t, _ in self.flips)

    def attainment(self, start: float, end: float, ttft_s: float, tpot_s: float) -> float:
        """Fraction of requests that arrived in [start, end) and met both SLOs."""
        window = [o for o in self.fleet.outcomes if start <= o.arrival < end]
        if not window:
            return math.nan
        return sum(o.meets(ttft_s, tpot_s) for o in window) / len(window)

    def split_at(self, time: float) -> tuple[int, int]:
        split = self.steps[0].split if self.steps else self.fleet.split()
        for step in self.steps:
            if step.time > time:
                break
            split = step.split
        return split


def run_fluid(
    trace: Iterable[FluidRequest],
    fleet: FluidFleet,
    config: Config,
    *,
    until: float,
    on_step: Callable[[Step], None] | None = None,
) -> FluidRun:
    """Drive `trace` through `fleet` with one `decide` per monitor interval.

    Moves the decisions name are applied to the fluid fleet (what the controller would
    have done). With `controller.advisory` set, decisions are made and recorded exactly
    the same way but no role changes, as on a production fleet in advisory mode.
    """
    profile: Profile = fleet.profile
    interval = config.controller.monitor_interval_s
    estimator = DemandEstimator.from_config(
        config.controller.reactive,
        started_at=fleet.now,
        # The fluid workload's prompts share nothing: none is ever cached.
        price=lambda tokens, _cached: profile.prefill.prefill_s(tokens),
    )
    state = initial_state(fleet.now)
    run = FluidRun(fleet)
    pending: Iterator[FluidRequest] = iter(sorted(trace, key=lambda r: r.time))
    nxt = next(pending, None)
    t = fleet.now
    while t < until - 1e-9:
        t_next = min(until, t + interval)
        while nxt is not None and nxt.time < t_next:
            fleet.submit(nxt)
            estimator.record(Arrival(nxt.time, nxt.prompt_tokens, nxt.output_tokens))
            nxt = next(pending, None)
        fleet.advance(t_next)
        t = t_next
        engines = fleet.engine_snapshots(t, state)
        short, long = estimator.estimates(t)
        snap = FleetSnapshot(
            engines=engines,
            mean_profile=profile,
            short=short,
            long=long,
            arrivals_total=estimator.total,
            prefill_pressure=measured_prefill_pressure(engines, config.slo.ttft_s),
        )
        decision = decide(snap, state, t, config)
        if decision.move is not None and decision.result == "move":
            fleet.apply(decision.move)
            run.flips.append((t, decision.move))
        state = decision.state
        step = Step(t, fleet.split(), decision)
        run.steps.append(step)
        if on_step is not None:
            on_step(step)
    return run
