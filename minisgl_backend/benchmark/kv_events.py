"""A subscriber that drains an engine's KV-cache events while a benchmark runs, so that a run
with `kv_events_endpoint` set pays for sending them as it would behind a router."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def drained_events(endpoint: str) -> Iterator[list[int]]:
    """Subscribe to the (bound) `endpoint` until the block ends; the list holds the number of
    messages and of bytes received, filled in when it ends."""
    import zmq

    counts = [0, 0]
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    stop = threading.Event()

    def drain() -> None:
        while not stop.is_set() or sub.poll(0):
            if sub.poll(50):
                frames = sub.recv_multipart()
                counts[0] += 1
                counts[1] += sum(map(len, frames))

    thread = threading.Thread(target=drain, name="kv-events-drain", daemon=True)
    thread.start()
    try:
        yield counts
    finally:
        stop.set()
        thread.join()
        sub.close(linger=0)
        context.term()
