"""The engine's scheduler and step arithmetic, with no I/O.

A simplified vLLM v1 scheduler: running requests are scheduled first (one token each for
decodes, the next chunk for partial prefills), then waiting requests are admitted FIFO while
the step's token budget, ``max_num_seqs`` and free KV blocks allow. KV is allocated in blocks
as it grows; when a decode cannot get a block the newest running request is preempted and
recomputed later, as vLLM does. The engine's step loop calls `schedule()`, sleeps for the
plan's duration and calls `complete()`; tests drive the same two calls without sockets.
"""

from __future__ import annotations

import enum
from collections import deque
from typing import Any

import attrs

from ._timing import Noise, SimTiming, blocks_for


class ReqState(enum.Enum):
    WAITING = "waiting"
    # KV allocated, waiting for the remote producer's blocks (vLLM WAITING_FOR_REMOTE_KVS).
    PULLING = "pulling"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@attrs.define(eq=False)
class CoreRequest:
    rid: str
    prompt_tokens: int
    max_tokens: int
    # P leg: the blocks outlive the request (they are leased to a decoder).
    hold_kv: bool = False
    # D leg: the prompt's KV comes from a producer instead of a local prefill.
    remote_kv: bool = False
    state: ReqState = ReqState.WAITING
    # Tokens whose KV is resident.
    computed: int = 0
    # Tokens to compute before the next sample: the prompt, or prompt + output after preemption.
    target: int = 0
    generated: int = 0
    preemptions: int = 0
    blocks: list[int] = attrs.Factory(list)
    # Opaque slot for the I/O layer's per-request context.
    owner: Any = None

    def __attrs_post_init__(self) -> None:
        self.target = self.prompt_tokens

    @property
    def finished(self) -> bool:
        return self.state is ReqState.FINISHED


@attrs.define
class StepPlan:
    chunks: list[tuple[CoreRequest, int, int]] = attrs.Factory(list)
    decodes: list[CoreRequest] = attrs.Factory(list)
    decode_kv_tokens: int = 0
    # Model seconds, noise included.
    duration_s: float = 0.0
    # Requests that just got their KV blocks and may now pull from their producer.
    pulls: list[CoreRequest] = attrs.Factory(list)
    preempted: list[CoreRequest] = attrs.Factory(list)

    @property
    def empty(self) -> bool:
        return not self.chunks and not self.decodes

    @property
    def prefill_tokens(self) -> int:
        return sum(e - s for _, s, e in self.chunks)


@attrs.define
class StepResult:
    # Requests that sampled a token in this step (each exactly one).
    progressed: list[CoreRequest] = attrs.Factory(list)
    finished: list[CoreRequest] = attrs.Factory(list)


class SchedulerCore:
    def __init__(self, timing: SimTiming, *, seed: int | str = 0) -> None:
        self.timing = timing
        self._noise = Noise(timing.noise_sigma, seed)
        self._free: deque[int] = deque(range(timing.total_blocks))
        self.waiting: deque[CoreRequest] = deque()
        self.running: list[CoreRequest] = []
        self.pulling: set[CoreRequest] = set()
        # Blocks of finished P requests still leased to a decoder.
        self.held_blocks = 0
        self.held_tokens = 0
        self.preemptions = 0
        self.steps = 0

    # -- queries ----------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.timing.total_blocks - len(self._free)

    @property
    def kv_usage(self) -> float:
        total = self.timing.total_blocks
        return self.used_blocks / total if total else 0.0

    def resident_tokens(self) -> int:
        active = sum(r.computed for r in self.running) + sum(r.computed for r in self.pulling)
        return active + self.held_tokens

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- mutations from the I/O layer ------------------------------------------------------
    def add(self, req: CoreRequest) -> None:
        req.state = ReqState.WAITING
        self.waiting.append(req)

    def abort(self, req: CoreRequest) -> None:
        """Drop a request wherever it is and free its KV at once. Idempotent."""
        state = req.state
        if state is ReqState.ABORTED:
            return
        if state is ReqState.WAITING:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        elif state is ReqState.RUNNING:
            try:
                self.running.remove(req)
            except ValueError:
                pass
        elif state is ReqState.PULLING:
            self.pulling.discard(req)
        elif state is ReqState.FINISHED:
            # Finished requests only keep blocks when they are leased (`release_held`).
            req.state = ReqState.ABORTED
            return
        self._free_blocks(req)
        req.state = ReqState.ABORTED

    def pull_done(self, req: CoreRequest) -> None:
        """The producer's KV arrived: the request joins the batch and samples next step."""
        if req.state is not ReqState.PULLING:
            return
        self.pulling.discard(req)
        req.computed = req.prompt_tokens
        req.target = req.prompt_tokens
        req.state = ReqState.RUNNING
        self.running.append(req)

    def release_held(self, blocks: list[int], tokens: int) -> None:
        """Return a lease's blocks (expired, pulled or released by the decoder)."""
        self._free.extend(blocks)
        self.held_blocks -= len(blocks)
        self.held_tokens -= tokens

    # -- the step ---------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        t = self.timing
        plan = StepPlan()
        budget = t.chunk_tokens
        chunk_cost = 0.0
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            if r.computed < r.target:
                n = min(budget, r.target - r.computed)
                plan.chunks.append((r, r.computed, r.computed + n))
                chunk_cost += t.chunk_cost_s(r.computed, r.computed + n)
                budget -= n
                i += 1
                continue
            # A decode writes one more token of KV (except the first sample after a remote
            # load, which reuses the last prompt position).
            need = blocks_for(r.computed + (1 if r.generated else 0), t.block_size)
            scheduled = True
            while len(r.blocks) < need:
                if self._free:
                    r.blocks.append(self._free.popleft())
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is r:
                    scheduled = False
                    break
            if not scheduled:
                break
            plan.decodes.append(r)
            plan.decode_kv_tokens += r.computed
            budget -= 1
            i += 1

        # vLLM admits nothing new in a step that had to preempt.
        if not plan.preempted:
            chunk_cost = self._admit(plan, budget, chunk_cost)

        if plan.empty:
            return plan
        base = t.step_s(chunk_cost, plan.decode_kv_tokens, len(plan.decodes))
        plan.duration_s = max(base * self._noise(), t.min_step_s)
        return plan

    def _admit(self, plan: StepPlan, budget: int, chunk_cost: float) -> float:
        t = self.timing
        while self.waiting:
            if len(self.running) + len(self.pulling) >= t.max_num_seqs:
                break
            r = self.waiting[0]
            if not r.remote_kv and budget <= 0:
                break
            need = blocks_for(r.target, t.block_size)
            if need > len(self._free):
                break
            self.waiting.popleft()
            for _ in range(need):
                r.blocks.append(self._free.popleft())
            if r.remote_kv:
                r.state = ReqState.PULLING
                self.pulling.add(r)
                plan.pulls.append(r)
                continue
            r.state = ReqState.RUNNING
            self.running.append(r)
            n = min(budget, r.target - r.computed)
            if n > 0:
                plan.chunks.append((r, r.computed, r.computed + n))
                chunk_cost += t.chunk_cost_s(r.computed, r.computed + n)
                budget -= n
        return chunk_cost

    def _preempt(self, r: CoreRequest) -> None:
        self._free_blocks(r)
        r.computed = 0
        # Recompute prompt and the output so far; a remote load is not repeated.
        r.target = r.prompt_tokens + r.generated
        r.remote_kv = False
        r.preemptions += 1
        r.state = ReqState.WAITING
        self.preemptions += 1
        self.waiting.appendleft(r)

    def complete(self, plan: StepPlan) -> StepResult:
        """Apply a finished step: advance KV, sample tokens, retire finished requests."""
        self.steps += 1
        result = StepResult()
        progressed = result.progressed
        for r, _start, end in plan.chunks:
            if r.state is not ReqState.RUNNING:
                continue
            r.computed = end
            if end >= r.target:
                r.generated += 1
                progressed.append(r)
        for r in plan.decodes:
            if r.state is not ReqState.RUNNING:
                continue
            if r.generated:
                r.computed += 1
            r.generated += 1
            progressed.append(r)
        done = [r for r in progressed if r.generated >= r.max_tokens]
        if done:
            gone = set(done)
            self.running = [r for r in self.running if r not in gone]
            for r in done:
                r.state = ReqState.FINISHED
                if r.hold_kv:
                    self.held_blocks += len(r.blocks)
                    self.held_tokens += r.computed
                else:
                    self._free_blocks(r)
            result.finished = done
        return result

    def _free_blocks(self, r: CoreRequest) -> None:
        if r.blocks:
            self._free.extend(r.blocks)
            r.blocks = []


def idle_prefill_s(timing: SimTiming, prompt_tokens: int) -> float:
    """TTFT of one request on an otherwise idle engine, measured through the scheduler."""
    core = SchedulerCore(attrs.evolve(timing, noise_sigma=0.0))
    req = CoreRequest(rid="probe", prompt_tokens=prompt_tokens, max_tokens=1)
    core.add(req)
    elapsed = 0.0
    for _ in range(prompt_tokens // timing.chunk_tokens + 2):
        plan = core.schedule()
        elapsed += plan.duration_s
        if req in core.complete(plan).finished:
            return elapsed
    raise AssertionError("prefill did not finish")  # pragma: no cover
