"""The KV-event subscriber against a publisher played by the test on loopback ZMQ sockets:
every message of a burst applied (the edge-triggered descriptor), gaps filled from the
replay socket or reset, a new publisher, a restart and a reload reset; a role change keeps
the index."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import attrs
import trio
import zmq
from prometheus_client import CollectorRegistry, generate_latest

from narwhal.caches import EngineCaches
from narwhal.caches._zmq import closing, receive
from narwhal.config import Config, load_config
from narwhal.fleet import Fleet
from narwhal.prefix import (
    END_SEQ,
    BlockStored,
    EventBatch,
    encode_batch,
    encode_seq,
    prompt_key,
)

from ..support import free_port

TOPIC = "kv"


def stored(*hashes: int, block_size: int = 16) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=[],
        block_size=block_size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


@attrs.define
class FakeEngine:
    """vLLM's publisher as seen on the wire: an XPUB (a PUB that also hears who
    subscribes, so nothing is sent before anyone listens) and a replay ROUTER."""

    pub: zmq.Socket[bytes]
    replay: zmq.Socket[bytes]
    pub_port: int
    replay_port: int
    buffer: dict[int, bytes] = attrs.field(factory=dict)

    def send(self, seq: int, *events: Any, lost: bool = False) -> None:
        payload = encode_batch(EventBatch(ts=0.0, events=list(events)))
        self.buffer[seq] = payload
        if not lost:
            self.pub.send_multipart([TOPIC.encode(), encode_seq(seq), payload])

    async def wait_subscribed(self) -> None:
        with trio.fail_after(10):
            assert (await receive(self.pub)) == [b"\x01" + TOPIC.encode()]

    async def serve_replay(self) -> None:
        while True:
            client, _, first = await receive(self.replay)
            start = int.from_bytes(first, "big")
            for seq, payload in sorted(self.buffer.items()):
                if seq >= start:
                    self.replay.send_multipart(
                        [client, b"", TOPIC.encode(), encode_seq(seq), payload]
                    )
            self.replay.send_multipart([client, b"", b"", END_SEQ, b""])


@contextmanager
def fake_engine(connect_to: str | None = None) -> Iterator[FakeEngine]:
    """Binding its PUB on loopback, or connecting it to `connect_to` (Narwhal binds)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with closing(ctx, zmq.XPUB) as pub, closing(ctx, zmq.ROUTER) as replay:
            if connect_to is None:
                pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
            else:
                pub.connect(connect_to)
                pub_port = 0
            replay_port = replay.bind_to_random_port("tcp://127.0.0.1")
            yield FakeEngine(pub, replay, pub_port, replay_port)
    finally:
        ctx.term()


def config_for(endpoint: str, replay_port: int | None, **cache: Any) -> Config:
    events: dict[str, Any] = {"endpoint": endpoint, "topic": TOPIC}
    if replay_port is not None:
        events["replay_endpoint"] = f"tcp://*:{replay_port}"
    return load_config(
        {
            "engines": [{"id": "a", "url": "http://127.0.0.1:9", "kv_events": events}],
            "cache": cache,
        }
    )


@asynccontextmanager
async def running(
    engine: FakeEngine, config: Config | None = None, *, replay: bool = True
) -> AsyncIterator[tuple[EngineCaches, Fleet, CollectorRegistry]]:
    if config is None:
        config = config_for(f"tcp://*:{engine.pub_port}", engine.replay_port if replay else None)
    fleet = Fleet(config)
    registry = CollectorRegistry()
    caches = EngineCaches(fleet, config, registry)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.serve_replay)
        await nursery.start(caches.run)
        await engine.wait_subscribed()
        yield caches, fleet, registry
        nursery.cancel_scope.cancel()


async def applied(caches: EngineCaches, seq: int) -> dict[str, Any]:
    with trio.fail_after(10):
        await caches.wait_seq("a", seq)
    return attrs.asdict(caches.state().engines["a"])


async def test_a_burst_is_applied_to_its_last_message() -> None:
    with fake_engine() as engine:
        async with running(engine) as (caches, _, _):
            # Sent before the subscriber runs again: one wakeup for all of them.
            for seq in range(200):
                engine.send(seq, stored(seq))
            state = await applied(caches, 199)
            assert caches.match("a", list(range(200))) == 200
            assert (state["blocks"], state["events"], state["resets"]) == (200, 200, {})
            assert caches.match("b", [0]) == 0


async def test_a_gap_is_filled_from_the_replay_socket() -> None:
    with fake_engine() as engine:
        async with running(engine) as (caches, _, _):
            engine.send(0, stored(1))
            engine.send(1, stored(2), lost=True)
            engine.send(2, stored(3), lost=True)
            engine.send(3, stored(4))
            state = await applied(caches, 3)
            assert caches.match("a", [1, 2, 3, 4]) == 4
            assert (state["resets"], state["replays"]) == ({}, {"filled": 1})


async def test_a_gap_the_replay_cannot_fill_resets_the_index() -> None:
    with fake_engine() as engine:
        async with running(engine) as (caches, _, registry):
            engine.send(0, stored(1))
            engine.send(1, stored(2), lost=True)
            del engine.buffer[1]  # past the engine's buffer_steps
            engine.send(2, stored(3))
            state = await applied(caches, 2)
            assert caches.match("a", [1]) == 0
            assert caches.match("a", [3]) == 1
            assert (state["resets"], state["replays"]) == ({"gap": 1}, {"short": 1})
            scraped = generate_latest(registry).decode()
            assert 'narwhal_cache_resets_total{engine="a",reason="gap"} 1.0' in scraped
            assert 'narwhal_cache_blocks{engine="a"} 1.0' in scraped
            assert 'narwhal_cache_event_seq{engine="a"} 2.0' in scraped


async def test_without_a_replay_socket_a_gap_resets() -> None:
    with fake_engine() as engine:
        async with running(engine, replay=False) as (caches, _, _):
            engine.send(0, stored(1))
            engine.send(2, stored(3))
            state = await applied(caches, 2)
            assert (state["blocks"], state["resets"], state["replays"]) == (1, {"gap": 1}, {})


async def test_the_first_batch_heard_is_preceded_by_what_the_replay_holds() -> None:
    with fake_engine() as engine:
        for seq in range(3):
            engine.send(seq, stored(seq), lost=True)  # before Narwhal listened
        async with running(engine) as (caches, _, _):
            engine.send(3, stored(3))
            state = await applied(caches, 3)
            assert caches.match("a", [0, 1, 2, 3]) == 4
            assert (state["resets"], state["replays"]) == ({}, {"filled": 1})


async def test_a_seq_going_back_is_a_new_publisher() -> None:
    with fake_engine() as engine:
        async with running(engine, replay=False) as (caches, _, _):
            engine.send(0, stored(1))
            engine.send(1, stored(2))
            await applied(caches, 1)
            engine.buffer.clear()
            for seq in range(3):
                engine.send(seq, stored(9 + seq))
            state = await applied(caches, 2)
            assert state["resets"] == {"seq_back": 1}
            assert caches.match("a", [1]) == 0
            assert caches.match("a", [9, 10, 11]) == 3


async def test_a_detected_restart_resets_and_a_role_change_does_not() -> None:
    with fake_engine() as engine:
        async with running(engine) as (caches, fleet, _):
            engine.send(0, stored(1))
            await applied(caches, 0)
            live = fleet.get("a")
            assert live is not None
            live.recovery_new_instance()
            assert caches.match("a", [1]) == 0
            engine.send(1, stored(2))
            await applied(caches, 1)
            # A role move is the router's: the engine keeps what it cached.
            live.role = "decode"
            assert caches.match("a", [2]) == 1
            state = attrs.asdict(caches.state().engines["a"])
            # Block 1 too: the first batch after the reset came with what the replay holds.
            assert (state["blocks"], state["resets"]) == (2, {"restart": 1})


async def test_narwhal_binds_an_endpoint_the_engine_connects_to() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with fake_engine(connect_to=endpoint) as engine:
        config = config_for(endpoint, engine.replay_port)
        async with running(engine, config) as (caches, _, _):
            engine.send(0, stored(1, 2))
            state = await applied(caches, 0)
            assert (state["endpoint"], state["binds"], state["blocks"]) == (endpoint, True, 2)


async def test_a_reload_that_moves_the_endpoint_resets_and_reads_the_new_one() -> None:
    with fake_engine() as first, fake_engine() as second:
        async with running(first) as (caches, fleet, _):
            first.send(0, stored(1))
            await applied(caches, 0)
            new = config_for(f"tcp://*:{second.pub_port}", None, max_blocks_per_engine=1)
            live = fleet.get("a")
            assert live is not None
            live.reconfigure(new.engines[0], new)
            caches.reconfigure(new)
            assert caches.state().engines["a"].resets == {"reconfigured": 1}
            await second.wait_subscribed()
            second.send(0, stored(5, 6))
            state = await applied(caches, 0)
            assert state["endpoint"] == f"tcp://127.0.0.1:{second.pub_port}"
            assert (state["blocks"], state["dropped"]) == (1, 1)
            # An engine without events learns from the prompts routed to it, unless
            # the TTL is 0: then nothing is known cached.
            off = load_config({"engines": [{"id": "a", "url": "http://127.0.0.1:9"}]})
            live.reconfigure(off.engines[0], off)
            caches.reconfigure(off)
            assert caches.state().engines["a"].source == "approximate"
            assert repr(caches) == "<EngineCaches [a: ~0]>"
            off = load_config(
                {
                    "engines": [{"id": "a", "url": "http://127.0.0.1:9"}],
                    "cache": {"approximate_ttl_s": 0},
                }
            )
            caches.reconfigure(off)
            assert caches.state().engines["a"].source == "none"
            assert repr(caches) == "<EngineCaches []>"


async def test_cached_tokens_are_the_leading_blocks_held_in_the_events_block_size() -> None:
    ids = list(range(1000, 1040))  # 40 tokens: 2 full blocks of 16
    key = prompt_key("t" * 160, len(ids), ids)
    h0, h1 = key.block_chain(16)
    with fake_engine() as engine:
        async with running(engine) as (caches, fleet, registry):
            # No block size known yet: nothing cached, whatever the key.
            assert caches.cached_tokens("a", key, 0.0) == 0
            assert caches.state().engines["a"].block_size is None
            engine.send(0, stored(h0))
            await applied(caches, 0)
            assert caches.cached_tokens("a", key, 0.0) == 16
            engine.send(1, stored(h1))
            state = await applied(caches, 1)
            assert (state["source"], state["block_size"]) == ("events", 16)
            assert caches.cached_tokens("a", key, 0.0) == 32
            # The whole prompt held: all of it but its last token.
            exact = prompt_key("t" * 128, 32, ids[:32])
            assert caches.cached_tokens("a", exact, 0.0) == 31
            # No token ids, no chain to match; routing teaches an events engine nothing.
            assert caches.cached_tokens("a", prompt_key("t" * 160, 40), 0.0) == 0
            caches.routed("a", key, 0.0)
            assert caches.state().engines["a"].learnt == 0
            scraped = generate_latest(registry).decode()
            assert 'narwhal_cache_source{engine="a",source="events"} 1.0' in scraped
            # A restart forgets the blocks and the block size.
            live = fleet.get("a")
            assert live is not None
            live.recovery_new_instance()
            assert caches.cached_tokens("a", key, 0.0) == 0
            assert caches.state().engines["a"].block_size is None
