"""What each engine has cached: one KV-event subscriber per engine that publishes them,
and an approximate index for each engine that does not.

Owns
  `EngineCaches`, a supervisor service (start protocol): for each engine whose
  `engines[].kv_events.endpoint` is set, a task reading its events off a SUB socket into
  that engine's `narwhal.prefix.BlockIndex` (source `events`); for every other engine,
  while cache.approximate_ttl_s > 0, a `narwhal.prefix.PromptIndex` learnt from the
  prompts `routed` to it (source `approximate`); `cached_tokens` (what a prompt would
  find cached on an engine), `match` (the leading blocks of a prompt an engine holds),
  the `caches` section of /narwhal/state and the `narwhal_cache_*` metrics.

Invariants
  An index holds only what the engine's current process reported, in order, since the
  last reset. A batch is applied only right after the one before it (`next_seq`): after
  a gap, the engine's replay socket is asked for the missing batches, and the index is
  reset (`gap`) when it cannot give them all within cache.replay_timeout_s. A seq at or
  before the last one is a new publisher, a restarted engine (`seq_back`). A restart
  recovery detects (`restart`), an undecodable batch (`malformed`) and a changed
  endpoint at reload (`reconfigured`) reset it too; an engine that leaves the fleet
  takes its index with it. A restart is checked whenever the index is read or written,
  so no reader sees blocks from before it. A role change resets nothing: the role is the
  router's, and the engine's process keeps its cache. The first
  batch heard (at start, after a reset) is preceded by what the replay still holds of
  the engine's earlier batches, so a Narwhal restarted beside running engines learns
  what they cached. An approximate index resets on a restart too, and goes with
  cache.approximate_ttl_s set to 0. `cached_tokens` is below the
  prompt's tokens: vLLM computes at least the last one again.

Errors
  None raised: a socket that cannot bind or connect is retried every RETRY_S, and the
  state shows why (`problem`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence

import attrs
import msgspec
import trio
import zmq
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from ..config import Config, KvEvents
from ..fleet import EngineState, Fleet
from ..prefix import (
    END_SEQ,
    BlockIndex,
    EventBatch,
    PromptIndex,
    PromptKey,
    Seq,
    decode_batch,
    decode_seq,
    encode_seq,
    next_seq as seq_verdict,
)
from ._zmq import Socket, closing, narwhal_binds, reachable, receive

log = logging.getLogger("narwhal.caches")

# Between attempts to open a subscriber's socket that failed (an address in use).
RETRY_S = 5.0


@attrs.frozen(kw_only=True)
class EngineCache:
    # "events", "approximate" (learnt from routed prompts), or "none": nothing known
    source: str
    endpoint: str | None  # the address Narwhal binds or connects to
    binds: bool | None  # whether Narwhal binds it (the engine connects)
    blocks: int  # token blocks (events) or text blocks (approximate) held
    block_size: int | None  # tokens per block, from the events; None until one says
    last_seq: int | None
    events: int
    batches: int
    learnt: int  # prompts learnt (approximate)
    dropped: int  # blocks forgotten by cache.max_blocks_per_engine
    expired: int  # blocks unused for cache.approximate_ttl_s (approximate)
    resets: Mapping[str, int]
    replays: Mapping[str, int]  # by outcome: filled, short, timeout, malformed
    problem: str | None


@attrs.frozen(kw_only=True)
class CachesSection:
    max_blocks_per_engine: int
    approximate_ttl_s: float
    engines: Mapping[str, EngineCache]


@attrs.define(eq=False)
class _Subscription:
    engine: EngineState
    events: KvEvents
    index: BlockIndex
    restarts: int
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    replays: dict[str, int] = attrs.field(factory=dict)
    problem: str | None = None
    progress: trio.Event = attrs.field(factory=trio.Event)

    @property
    def binds(self) -> bool:
        assert self.events.endpoint is not None
        return narwhal_binds(self.events.endpoint)

    @property
    def address(self) -> str:
        assert self.events.endpoint is not None
        if self.binds:
            return self.events.endpoint
        return reachable(self.events.endpoint, self.engine.host)


@attrs.define(eq=False)
class _Learnt:
    """An engine without events, and what the prompts routed to it taught."""

    engine: EngineState
    index: PromptIndex
    restarts: int


class EngineCaches:
    def __init__(self, fleet: Fleet, config: Config, registry: CollectorRegistry) -> None:
        self._fleet = fleet
        self.config = config
        self._subs: dict[str, _Subscription] = {}
        self._learnt: dict[str, _Learnt] = {}
        self._zmq: zmq.Context[Socket] | None = None
        self._nursery: trio.Nursery | None = None
        registry.register(_Collector(self))

    def __repr__(self) -> str:
        held = ", ".join(f"{i}: {len(s.index)}" for i, s in self._subs.items())
        learnt = ", ".join(f"{i}: ~{len(s.index)}" for i, s in self._learnt.items())
        return f"<EngineCaches [{', '.join(x for x in (held, learnt) if x)}]>"

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._zmq = zmq.Context()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.reconfigure(self.config)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._zmq.term()
            self._zmq = None

    def reconfigure(self, config: Config) -> None:
        """Follow the fleet and `config` (at start, and after each reload): a subscriber
        for each engine with events; a changed endpoint or a new engine instance starts
        its subscriber again, and an engine without events or gone loses its own. An
        engine without events has an approximate index while cache.approximate_ttl_s
        > 0; a new engine instance starts it again."""
        self.config = config
        bound = config.cache.max_blocks_per_engine
        ttl = config.cache.approximate_ttl_s
        live = {engine.id: engine for engine in self._fleet}
        for engine_id in [i for i in self._subs if i not in live]:
            self._subs.pop(engine_id).scope.cancel()
        for engine_id, learnt in list(self._learnt.items()):
            engine = live.get(engine_id)
            if engine is not learnt.engine or engine.spec.kv_events.enabled or not ttl:
                del self._learnt[engine_id]
        for engine in live.values():
            if engine.spec.kv_events.enabled or not ttl:
                continue
            kept = self._learnt.get(engine.id)
            if kept is None:
                self._learnt[engine.id] = _Learnt(
                    engine=engine,
                    index=PromptIndex(bound, ttl),
                    restarts=engine.restarts_detected,
                )
            else:
                kept.index.max_blocks = bound
                kept.index.ttl_s = ttl
        for engine in live.values():
            spec = engine.spec.kv_events
            sub = self._subs.get(engine.id)
            if sub is not None and sub.engine is engine and sub.events == spec:
                sub.index.max_blocks = bound
                continue
            if sub is not None:
                sub.scope.cancel()
                del self._subs[engine.id]
            if not spec.enabled:
                continue
            index = BlockIndex(bound)
            if sub is not None and sub.engine is engine:
                # The same engine, read elsewhere: its counters go on, its blocks do not.
                index = sub.index
                index.max_blocks = bound
                index.reset("reconfigured")
            fresh = _Subscription(
                engine=engine,
                events=spec,
                index=index,
                restarts=engine.restarts_detected,
            )
            self._subs[engine.id] = fresh
            assert self._nursery is not None, "EngineCaches is not running"
            self._nursery.start_soon(self._subscribe, fresh)

    # ------------------------------------------------------------------ reads

    def cached_tokens(self, engine_id: str, key: PromptKey, now: float) -> int:
        """The tokens of `key`'s prompt the engine would find cached, at most all but
        the last: its leading blocks held (events; 0 until an event tells the block
        size, or without token ids), else the matched share of the prompt's chars
        (approximate), else 0."""
        cached = 0
        sub = self._subs.get(engine_id)
        learnt = self._learnt.get(engine_id)
        if sub is not None:
            self._check(sub)
            size = sub.index.block_size
            if size is not None and key.token_ids is not None:
                cached = sub.index.match(key.block_chain(size)) * size
        elif learnt is not None and key.chars:
            self._check(learnt)
            cached = learnt.index.match(key, now) * key.tokens // key.chars
        return max(0, min(cached, key.tokens - 1))

    def routed(self, engine_id: str, key: PromptKey, now: float) -> None:
        """`key`'s prompt was prefilled on the engine at `now`: an approximate index
        learns it (an engine with events says what it cached itself)."""
        learnt = self._learnt.get(engine_id)
        if learnt is not None:
            self._check(learnt)
            learnt.index.learn(key, now)

    def match(self, engine_id: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt's chain (external hashes) the engine
        holds; 0 for an engine without events."""
        sub = self._subs.get(engine_id)
        if sub is None:
            return 0
        self._check(sub)
        return sub.index.match(hashes)

    async def wait_seq(self, engine_id: str, seq: int) -> None:
        """Until the engine's index has applied its batch `seq` (tests)."""
        while True:
            sub = self._subs[engine_id]
            self._check(sub)
            last = sub.index.last_seq
            if last is not None and last >= seq:
                await trio.lowlevel.checkpoint()
                return
            await sub.progress.wait()

    def state(self) -> CachesSection:
        engines = {engine.id: self._engine_state(engine.id) for engine in self._fleet}
        return CachesSection(
            max_blocks_per_engine=self.config.cache.max_blocks_per_engine,
            approximate_ttl_s=self.config.cache.approximate_ttl_s,
            engines=engines,
        )

    def _engine_state(self, engine_id: str) -> EngineCache:
        sub = self._subs.get(engine_id)
        if sub is not None:
            self._check(sub)
            stats = sub.index.statistics()
            return attrs.evolve(
                _NONE,
                source="events",
                endpoint=sub.address,
                binds=sub.binds,
                blocks=stats.blocks,
                block_size=stats.block_size,
                last_seq=stats.last_seq,
                events=stats.events,
                batches=stats.batches,
                dropped=stats.dropped,
                resets=stats.resets,
                replays=dict(sorted(sub.replays.items())),
                problem=sub.problem,
            )
        learnt = self._learnt.get(engine_id)
        if learnt is not None:
            self._check(learnt)
            approx = learnt.index.statistics()
            return attrs.evolve(
                _NONE,
                source="approximate",
                blocks=approx.blocks,
                learnt=approx.learnt,
                dropped=approx.dropped,
                expired=approx.expired,
                resets=approx.resets,
            )
        return _NONE

    def _check(self, sub: _Subscription | _Learnt) -> None:
        """Reset what the engine's process no longer holds: recovery does not call here,
        so every read and write asks. A role change keeps the index: Narwhal moves roles
        in the router, and the engine's process keeps its prefix cache (its events go on
        saying what it holds)."""
        engine = sub.engine
        if engine.restarts_detected != sub.restarts:
            sub.restarts = engine.restarts_detected
            self._reset(sub, "restart")

    def _reset(self, sub: _Subscription | _Learnt, reason: str) -> None:
        sub.index.reset(reason)
        log.info(
            "cache index of %s reset: %s",
            sub.engine.id,
            reason,
            extra={"event": "cache_reset", "engine": sub.engine.id, "reason": reason},
        )

    # ------------------------------------------------------------------ the subscriber

    async def _subscribe(self, sub: _Subscription) -> None:
        with sub.scope:
            while True:
                try:
                    await self._read(sub)
                except zmq.ZMQError as exc:
                    sub.problem = f"{sub.address}: {exc}"
                    log.warning(
                        "cannot read the KV events of %s at %s: %s; retrying in %s s",
                        sub.engine.id,
                        sub.address,
                        exc,
                        RETRY_S,
                        extra={
                            "event": "cache_events",
                            "engine": sub.engine.id,
                            "endpoint": sub.address,
                            "outcome": "error",
                            "problem": str(exc),
                        },
                    )
                await trio.sleep(RETRY_S)

    async def _read(self, sub: _Subscription) -> None:
        assert self._zmq is not None
        with closing(self._zmq, zmq.SUB) as sock:
            sock.setsockopt(zmq.SUBSCRIBE, sub.events.topic.encode())
            address = sub.address
            if sub.binds:
                sock.bind(address)
            else:
                sock.connect(address)
            sub.problem = None
            log.info(
                "reading the KV events of %s at %s",
                sub.engine.id,
                address,
                extra={
                    "event": "cache_events",
                    "engine": sub.engine.id,
                    "endpoint": address,
                    "outcome": "subscribed",
                },
            )
            while True:
                frames = await receive(sock)
                await self._receive(sub, frames)
                sub.progress.set()
                sub.progress = trio.Event()

    async def _receive(self, sub: _Subscription, frames: list[bytes]) -> None:
        index = sub.index
        if len(frames) != 3:
            return  # not vLLM's [topic, seq, payload]: nothing of the sequence
        seq = decode_seq(frames[1])
        batch = _decode(frames[2])
        self._check(sub)
        if batch is None:
            self._reset(sub, "malformed")
            return
        verdict = seq_verdict(index.last_seq, seq)
        if verdict is Seq.BACK:
            self._reset(sub, "seq_back")
            verdict = Seq.FIRST
        if verdict is Seq.FIRST and seq > 0:
            # What the engine cached before we heard it, as far as its replay goes back.
            earlier = await self._replay(sub, 0, seq)
            for number, missed in enumerate(earlier or ()):
                index.apply(number, missed.events)
        elif verdict is Seq.GAP:
            assert index.last_seq is not None
            missing = await self._replay(sub, index.last_seq + 1, seq)
            if missing is None:
                self._reset(sub, "gap")
            else:
                for number, missed in enumerate(missing, start=index.last_seq + 1):
                    index.apply(number, missed.events)
        self._check(sub)  # the replay waited: the engine may have moved meanwhile
        index.apply(seq, batch.events)

    async def _replay(self, sub: _Subscription, first: int, end: int) -> list[EventBatch] | None:
        """Batches [first, end) from the engine's replay socket; None unless it has
        every one of them."""
        endpoint = sub.events.replay_endpoint
        if endpoint is None:
            return None
        assert self._zmq is not None
        found: dict[int, bytes] = {}
        outcome = "timeout"
        with (
            closing(self._zmq, zmq.DEALER) as sock,
            trio.move_on_after(self.config.cache.replay_timeout_s),
        ):
            sock.connect(reachable(endpoint, sub.engine.host))
            # REQ's framing (an empty delimiter), which vLLM's ROUTER answers in kind.
            sock.send_multipart([b"", encode_seq(first)], flags=zmq.NOBLOCK)
            while True:
                frames = await receive(sock)
                if len(frames) != 4:
                    continue
                if frames[2] == END_SEQ:
                    outcome = "filled" if len(found) == end - first else "short"
                    break
                number = decode_seq(frames[2])
                if first <= number < end:
                    found[number] = frames[3]
        batches: list[EventBatch] = []
        if outcome == "filled":
            for number in range(first, end):
                batch = _decode(found[number])
                if batch is None:
                    outcome = "malformed"
                    break
                batches.append(batch)
        sub.replays[outcome] = sub.replays.get(outcome, 0) + 1
        return batches if outcome == "filled" else None

    # ------------------------------------------------------------------ metrics

    def families(self) -> Iterator[Metric]:
        # One family per meaning whatever the source, so that existing series and
        # queries stand; narwhal_cache_source tells the source, to join on `engine`.
        source = GaugeMetricFamily(
            "narwhal_cache_source",
            "1 for the source of what Narwhal knows of the engine's cache.",
            labels=["engine", "source"],
        )
        blocks = GaugeMetricFamily(
            "narwhal_cache_blocks",
            "Cached blocks the engine holds, as indexed: token blocks its KV events "
            "reported, or text blocks learnt from the prompts routed to it.",
            labels=["engine"],
        )
        seq = GaugeMetricFamily(
            "narwhal_cache_event_seq",
            "Seq of the last KV event batch applied; -1 since a reset.",
            labels=["engine"],
        )
        events = CounterMetricFamily(
            "narwhal_cache_events", "KV cache events applied to the index.", labels=["engine"]
        )
        dropped = CounterMetricFamily(
            "narwhal_cache_dropped_blocks",
            "Blocks forgotten by cache.max_blocks_per_engine, oldest first.",
            labels=["engine"],
        )
        expired = CounterMetricFamily(
            "narwhal_cache_expired_blocks",
            "Learnt blocks forgotten after cache.approximate_ttl_s unused.",
            labels=["engine"],
        )
        resets = CounterMetricFamily(
            "narwhal_cache_resets",
            "Times the engine's index was emptied, by reason.",
            labels=["engine", "reason"],
        )
        replays = CounterMetricFamily(
            "narwhal_cache_replays",
            "Replay requests after a gap, by outcome.",
            labels=["engine", "outcome"],
        )
        for engine_id, sub in self._subs.items():
            self._check(sub)
            stats = sub.index.statistics()
            blocks.add_metric([engine_id], stats.blocks)
            seq.add_metric([engine_id], -1 if stats.last_seq is None else stats.last_seq)
            events.add_metric([engine_id], stats.events)
            dropped.add_metric([engine_id], stats.dropped)
            for reason, n in stats.resets.items():
                resets.add_metric([engine_id, reason], n)
            for outcome, n in sorted(sub.replays.items()):
                replays.add_metric([engine_id, outcome], n)
        for engine_id, learnt in self._learnt.items():
            self._check(learnt)
            approx = learnt.index.statistics()
            blocks.add_metric([engine_id], approx.blocks)
            dropped.add_metric([engine_id], approx.dropped)
            expired.add_metric([engine_id], approx.expired)
            for reason, n in approx.resets.items():
                resets.add_metric([engine_id, reason], n)
        for engine in self._fleet:
            if engine.id in self._subs:
                source.add_metric([engine.id, "events"], 1)
            else:
                kind = "approximate" if engine.id in self._learnt else "none"
                source.add_metric([engine.id, kind], 1)
        yield from (source, blocks, seq, events, dropped, expired, resets, replays)


_NONE = EngineCache(
    source="none",
    endpoint=None,
    binds=None,
    blocks=0,
    block_size=None,
    last_seq=None,
    events=0,
    batches=0,
    learnt=0,
    dropped=0,
    expired=0,
    resets={},
    replays={},
    problem=None,
)


def _decode(payload: bytes) -> EventBatch | None:
    try:
        return decode_batch(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


class _Collector(Collector):
    def __init__(self, caches: EngineCaches) -> None:
        self.caches = caches

    def collect(self) -> Iterator[Metric]:
        return self.caches.families()


def events_without_ids_warning(config: Config) -> str | None:
    """The warning for engines whose KV events Narwhal reads but cannot match the prompts
    sent as text against (no `engine.tokenizer_path`), or None."""
    if config.engine.tokenizer_path is not None:
        return None
    ids = [spec.id for spec in config.engines if spec.kv_events.enabled]
    if not ids:
        return None
    return (
        f"engines[{', '.join(ids)}].kv_events: their events name blocks by token ids, and "
        "without engine.tokenizer_path Narwhal has ids only for prompts sent as ids: prompts "
        "sent as text are priced and placed there as uncached; set engine.tokenizer_path "
        "to the model's tokenizer"
    )
