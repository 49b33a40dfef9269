"""KV cache events of one simulated vLLM engine, published as vLLM publishes them.

Owns: `KvEventsConfig` (vLLM's ``--kv-events-config``, the fields the simulator plays)
and `EventPublisher`: a ZMQ PUB socket sending one ``[topic, seq, payload]`` message
per scheduler step that changed the cache (`narwhal.prefix` has the payload's form),
and, with a ``replay_endpoint``, a ROUTER socket that resends the last
``buffer_steps`` batches from a requested seq.
Invariants: as vllm/distributed/kv_events.py ZmqEventPublisher: an endpoint with ``*``,
``::``, ``ipc://`` or ``inproc://`` is bound, any other is connected to (the subscriber
binds); seq counts from 0 for each engine instance, so a restarted engine starts again at
0 and says nothing else (a real vLLM's new process does the same); engine i of a fleet
offsets a TCP port by i, as vLLM offsets it by data-parallel rank. Publishing never
blocks: past ``hwm`` queued messages ZMQ drops them, as it does for vLLM.
Errors: a bad endpoint raises `zmq.ZMQError` when the engine starts.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import attrs
import trio
import zmq

from narwhal.prefix import END_SEQ, EventBatch, KvEvent, encode_batch, encode_seq

_KNOWN = {
    "enable_kv_cache_events",
    "publisher",
    "endpoint",
    "replay_endpoint",
    "buffer_steps",
    "hwm",
    "max_queue_size",
    "topic",
}


def _positive_int(_inst: object, attr: attrs.Attribute[Any], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attr.name} is {value!r}; must be >= 1")


@attrs.frozen(kw_only=True)
class KvEventsConfig:
    """Where an engine publishes its KV events (vLLM's KVEventsConfig, defaults alike)."""

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = attrs.field(default=10_000, validator=_positive_int)
    hwm: int = attrs.field(default=100_000, validator=_positive_int)

    @classmethod
    def from_json(cls, data: object) -> KvEventsConfig | None:
        """vLLM's --kv-events-config object; None when it publishes nothing (events off
        or the null publisher)."""
        if not isinstance(data, dict):
            raise ValueError("the KV events config must be a JSON object")
        unknown = sorted(set(data) - _KNOWN)
        if unknown:
            raise ValueError(f"unknown KV events field(s): {', '.join(unknown)}")
        enabled = bool(data.get("enable_kv_cache_events", False))
        publisher = data.get("publisher") or ("zmq" if enabled else "null")
        if publisher not in ("zmq", "null"):
            raise ValueError(f"publisher is {publisher!r}; must be 'zmq' or 'null'")
        if not enabled or publisher == "null":
            return None
        fields = {k: data[k] for k in ("endpoint", "replay_endpoint", "topic") if k in data}
        for key in ("buffer_steps", "hwm"):
            if key in data:
                fields[key] = int(data[key])
        return cls(**fields)

    def for_engine(self, index: int) -> KvEventsConfig:
        """Engine `index`'s endpoints: a TCP port offset by the index (port 0 kept)."""
        if index == 0:
            return self
        return attrs.evolve(
            self,
            endpoint=_offset(self.endpoint, index),
            replay_endpoint=_offset(self.replay_endpoint, index)
            if self.replay_endpoint is not None
            else None,
        )


def _offset(endpoint: str, index: int) -> str:
    if "inproc" in endpoint:
        return f"{endpoint}_dp{index}"
    base, _, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp") or not port.isdigit() or int(port) == 0:
        return endpoint
    return f"{base}:{int(port) + index}"


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class EventPublisher:
    """One engine instance's publisher: `open()` at start, `close()` at its end."""

    def __init__(self, config: KvEventsConfig) -> None:
        self.config = config
        self._topic = config.topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        # The endpoints as bound (a port 0 resolved), for /_sim/state.
        self.endpoint = config.endpoint
        self.replay_endpoint = config.replay_endpoint
        self.published = 0

    def open(self) -> None:
        ctx = self._ctx = zmq.Context()
        pub = self._pub = ctx.socket(zmq.PUB)
        pub.set_hwm(self.config.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        if _binds(self.config.endpoint):
            pub.bind(self.config.endpoint)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            pub.connect(self.config.endpoint)
        if self.config.replay_endpoint is not None:
            replay = self._replay = ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(self.config.replay_endpoint)
            self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)

    def publish(self, events: list[KvEvent]) -> None:
        if self._pub is None or not events:
            return
        # Wall clock, as vLLM stamps its batches (time.time()).
        payload = encode_batch(EventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        seq = self._seq
        self._seq += 1
        try:
            self._pub.send_multipart((self._topic, encode_seq(seq), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # past the high-water mark: dropped, as vLLM's is
        self._buffer.append((seq, payload))
        self.published += 1

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled (nothing without a replay socket)."""
        sock = self._replay
        if sock is None:
            return
        fd = int(sock.getsockopt(zmq.FD))
        while True:
            # ZMQ's descriptor is edge-triggered: drain what is readable before waiting.
            while int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                self._answer(sock.recv_multipart(zmq.NOBLOCK))
            await trio.lowlevel.wait_readable(fd)

    def _answer(self, frames: list[bytes]) -> None:
        assert self._replay is not None
        if len(frames) != 3:
            return  # vLLM logs "Invalid replay request" and answers nothing
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, encode_seq(seq), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        if self._replay is not None:
            trio.lowlevel.notify_closing(int(self._replay.getsockopt(zmq.FD)))
            self._replay.close(linger=0)
            self._replay = None
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
