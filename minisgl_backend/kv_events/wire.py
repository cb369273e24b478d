"""The KV-cache events on the wire, in vLLM's layout (`vllm/distributed/kv_events.py`), which
Dynamo's KV router, llm-d's KV-cache indexer and SGLang's gateway decode.

Each ZeroMQ message has three frames: the topic, an 8-byte big-endian sequence number (one per
message, from 0) and a msgpack payload `[timestamp, [event, ...], data_parallel_rank]`. An event
is an array whose first item names its type and whose other items are its fields in declaration
order (msgspec's tagged `array_like` structs): the field order of the NamedTuples below.

The replay socket (ZeroMQ ROUTER) answers a request whose last frame is an 8-byte big-endian
sequence number with one `[sequence, payload]` reply per buffered message from that number on,
then `[END_SEQ, b""]`.
"""

from __future__ import annotations

import time
from typing import NamedTuple

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last reply


class BlockStored(NamedTuple):
    """Pages entered the cache: one hash per block of `block_size` tokens, chained from
    `parent_block_hash` (None: the blocks start a sequence)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # the engine's adapter id (None: the base model)
    medium: str  # "GPU" or "CPU": where the pool lives
    lora_name: str | None  # the adapter's name; what the hashes are salted with


class BlockRemoved(NamedTuple):
    """Pages left the cache (evicted)."""

    block_hashes: list[int]
    medium: str


class AllBlocksCleared(NamedTuple):
    """Every page left the cache (a reset)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


def encode_batch(events: list[KvEvent], data_parallel_rank: int = 0) -> bytes:
    """The msgpack payload of one message: `[now, [[type, *fields], ...], rank]`."""
    import msgpack

    wire = [(type(event).__name__, *event) for event in events]
    return msgpack.packb((time.time(), wire, data_parallel_rank))


def frames(topic: bytes, seq: int, payload: bytes) -> tuple[bytes, bytes, bytes]:
    """One message's frames: topic, sequence number, payload."""
    return topic, seq.to_bytes(8, "big"), payload
