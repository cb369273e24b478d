"""A subscriber of KV-cache events written from vLLM's published layout
(`vllm/distributed/kv_events.py` and `examples/online_serving/kv_events_subscriber.py`), with
pyzmq and msgpack only: it shares no code with the engine's publisher.

Messages: [topic, sequence (8 bytes, big-endian), msgpack payload]. Payload: the array
`[ts, events, data_parallel_rank]`; an event is an array whose first item is its type's name,
then its fields in vLLM's order. Replay: a request ending in an 8-byte sequence number to the
ROUTER socket; replies `[sequence, payload]`, then `[-1, b""]`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


@dataclass
class Message:
    seq: int
    ts: float
    events: list[dict[str, Any]]
    data_parallel_rank: int | None
    payload: bytes


def decode(seq: int, payload: bytes) -> Message:
    ts, raw_events, *rest = msgpack.unpackb(payload)
    events = []
    for raw in raw_events:
        kind, *values = raw
        assert kind in FIELDS, f"unknown event type {kind!r}"
        assert len(values) <= len(FIELDS[kind]), raw
        events.append({"type": kind, **dict(zip(FIELDS[kind], values))})
    return Message(seq, float(ts), events, rest[0] if rest else None, payload)


class Subscriber:
    """A SUB socket on the events' endpoint (all topics, or `topic`; `bind`: the publisher
    connects to it), and a DEALER for replays."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None,
                 topic: bytes = b"", bind: bool = False) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.bind(endpoint) if bind else self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.messages: list[Message] = []
        self.topics: set[bytes] = set()
        time.sleep(0.3)  # PUB/SUB: messages sent before the subscription arrives are not seen

    def settle(self) -> None:
        """After a publisher connected to this (bound) subscriber: libzmq sends a bound SUB's
        subscription to a new peer only once the socket is polled (libzmq issue 2267)."""
        assert not self.sub.poll(300), "a message came before the subscription was sent"
        time.sleep(0.2)

    def poll(self, quiet_s: float = 1.0, timeout_s: float = 30.0) -> list[Message]:
        """Read messages until none came for `quiet_s`; the new ones, in order."""
        new = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.sub.poll(int(quiet_s * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            self.topics.add(topic)
            new.append(decode(int.from_bytes(seq, "big"), payload))
        self.messages += new
        return new

    def replay(self, start: int, timeout_s: float = 10.0) -> list[Message]:
        """The messages from sequence number `start` on, asked of the replay socket."""
        assert self.replay_endpoint is not None
        dealer = self.context.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            replies = []
            while True:
                assert dealer.poll(int(timeout_s * 1000)), "the replay socket did not answer"
                _, seq, payload = dealer.recv_multipart()
                number = int.from_bytes(seq, "big", signed=True)
                if number == -1:
                    assert payload == b""
                    return replies
                replies.append(decode(number, payload))
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.context.term()


def events_of(messages: list[Message], kind: str) -> list[dict[str, Any]]:
    return [event for m in messages for event in m.events if event["type"] == kind]


def stored_blocks(messages: list[Message]) -> dict[tuple[int | None, tuple[int, ...]], int]:
    """(parent hash, a block's token ids) -> its hash, over every BlockStored; each event's
    token ids are its blocks' in order, each block's parent the block before it."""
    blocks = {}
    for event in events_of(messages, "BlockStored"):
        size, hashes, tokens = event["block_size"], event["block_hashes"], event["token_ids"]
        assert len(tokens) == size * len(hashes), event
        parent = event["parent_block_hash"]
        for i, block_hash in enumerate(hashes):
            blocks[(parent, tuple(tokens[i * size:(i + 1) * size]))] = block_hash
            parent = block_hash
    return blocks


def chain_of(blocks: dict[tuple[int | None, tuple[int, ...]], int], tokens: list[int],
             size: int) -> list[int]:
    """The hashes of the whole blocks of `tokens` found chained from the sequence start, in
    order (as far as they were stored)."""
    hashes: list[int] = []
    parent = None
    for start in range(0, len(tokens) - len(tokens) % size, size):
        block_hash = blocks.get((parent, tuple(tokens[start:start + size])))
        if block_hash is None:
            break
        hashes.append(block_hash)
        parent = block_hash
    return hashes
