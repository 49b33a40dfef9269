"""vLLM's KV cache events on the wire: the records, their msgpack form and the framing.

Owns: `EventBatch`, `BlockStored`, `BlockRemoved`, `AllBlocksCleared` (as
vllm/distributed/kv_events.py defines them), `encode_batch` / `decode_batch`, and the
ZMQ framing constants: a PUB message is ``[topic, seq, payload]`` with ``seq`` an 8-byte
big-endian counter from 0 per publisher process; a replay request to the ROUTER socket
is the first wanted ``seq`` (8 bytes), answered by ``[topic, seq, payload]`` messages
then ``[b"", END_SEQ, b""]``.
Invariants: a batch encodes as msgpack array ``[ts, events, data_parallel_rank]``; an
event as a map whose first key ``type`` names its class, fields in vLLM's order, fields
left at their default omitted (msgspec's ``omit_defaults``). vLLM itself encodes with
msgspec, so these structs give the same bytes (tests/prefix checks a batch vLLM encoded).
Errors: `decode_batch` raises `msgspec.DecodeError` / `msgspec.ValidationError` on a
payload that is not a batch.
"""

from __future__ import annotations

import msgspec

# The replay socket's end-of-replay marker (seq -1, signed).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# Where the blocks live, as vLLM's GPU block pool reports it (also on the CPU backend).
MEDIUM_GPU = "GPU"


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[object, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(EventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> EventBatch:
    return _DECODER.decode(payload)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)
