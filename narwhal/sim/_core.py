"""The engine's scheduler and step arithmetic, with no I/O.

A simplified vLLM v1 scheduler: running requests are scheduled first (one token each for
decodes, the next chunk for partial prefills), then waiting requests are admitted FIFO while
the step's token budget, ``max_num_seqs`` and free KV blocks allow. KV is allocated in blocks
as it grows; when a decode cannot get a block the newest running request is preempted and
recomputed later, as vLLM does. With prefix caching on (`_blocks.BlockPool`) a request
admitted with cached blocks starts at the end of its hit: the prefill computes, and is
priced on, the uncached tokens only (their attention over the cached prefix still pays
the quadratic term). The engine's step loop calls `schedule()`, sleeps for the plan's
duration and calls `complete()`; tests drive the same two calls without sockets.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from typing import Any

import attrs

from narwhal.prefix import block_hashes

from ._blocks import BlockPool
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
    # The prompt's token ids, given when the engine caches prefixes, and the hashes of
    # its full blocks (`SchedulerCore.add` computes them).
    token_ids: Sequence[int] = ()
    hashes: list[bytes] = attrs.Factory(list)
    # Leading blocks of `blocks` that are in the prefix cache.
    cached_blocks: int = 0
    # Prompt tokens found in the cache when first admitted (vLLM's num_cached_tokens),
    # and prompt tokens it computed into the cache by its first token (created).
    cached_tokens: int | None = None
    created_tokens: int = 0
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
    def __init__(
        self,
        timing: SimTiming,
        *,
        seed: int | str = 0,
        prefix_caching: bool = False,
        kv_events: bool = False,
    ) -> None:
        self.timing = timing
        self._noise = Noise(timing.noise_sigma, seed)
        self.pool = BlockPool(
            timing.total_blocks, timing.block_size, caching=prefix_caching, events=kv_events
        )
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
        return self.pool.free_count

    @property
    def used_blocks(self) -> int:
        return self.timing.total_blocks - self.pool.free_count

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
        if self.pool.caching and req.token_ids and not req.hashes:
            req.hashes = block_hashes(req.token_ids, self.timing.block_size)
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
        # The pulled KV is this engine's now, cached as if computed here.
        self._cache(req, req.prompt_tokens)
        req.state = ReqState.RUNNING
        self.running.append(req)

    def release_held(self, blocks: list[int], tokens: int) -> None:
        """Return a lease's blocks (expired, pulled or released by the decoder)."""
        self.pool.free(blocks)
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
                self._cache(r, r.computed + n)
                budget -= n
                i += 1
                continue
            # A decode writes one more token of KV (except the first sample after a remote
            # load, which reuses the last prompt position).
            need = blocks_for(r.computed + (1 if r.generated else 0), t.block_size)
            scheduled = True
            while len(r.blocks) < need:
                if self.pool.free_count:
                    r.blocks += self.pool.allocate(1)
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
            pool = self.pool
            hit = pool.lookup(r.hashes, r.prompt_tokens)
            need = blocks_for(r.target, t.block_size) - len(hit)
            if need + pool.evictable(hit) > pool.free_count:
                break
            self.waiting.popleft()
            pool.touch(hit)
            r.blocks = hit + pool.allocate(need)
            r.cached_blocks = len(hit)
            r.computed = len(hit) * t.block_size
            if r.cached_tokens is None:
                # vLLM counts the first admission's hit, not a preempted one's.
                r.cached_tokens = r.computed
                if pool.caching:
                    pool.count_lookup(r.prompt_tokens, len(hit))
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
                self._cache(r, r.computed + n)
                budget -= n
        return chunk_cost

    def _cache(self, r: CoreRequest, upto_token: int) -> None:
        """Cache the prompt's full blocks below `upto_token` once they are scheduled (vLLM
        caches a block when the step that computes it is planned)."""
        if not r.hashes:
            return
        upto = min(upto_token // self.timing.block_size, len(r.hashes))
        if upto > r.cached_blocks:
            self.pool.cache(r.blocks, r.hashes, r.token_ids, r.cached_blocks, upto)
            r.cached_blocks = upto

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
                if not r.generated:
                    # What vLLM reports as created_cache_tokens.
                    cached = min(r.cached_blocks * self.timing.block_size, r.prompt_tokens)
                    r.created_tokens = max(0, cached - (r.cached_tokens or 0))
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
            self.pool.free(r.blocks)
            r.blocks = []
        r.cached_blocks = 0


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
