"""A subscriber that drains an engine's KV-cache events while a benchmark runs, so that a run
with `kv_events_endpoint` set pays for sending them as it would behind a router."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


PUBLISHER_THREAD = "minisgl-kv-events"


def publisher_cpu_seconds() -> float:
    """CPU time of this process's KV-events publisher thread so far (Linux; 0.0 elsewhere)."""
    thread = next((t for t in threading.enumerate() if t.name == PUBLISHER_THREAD), None)
    try:
        stat = Path(f"/proc/self/task/{thread.native_id}/stat").read_text() if thread else ""
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2:].split() if stat else []
    ticks = int(fields[11]) + int(fields[12]) if fields else 0  # utime + stime
    return ticks / os.sysconf("SC_CLK_TCK")


@contextmanager
def drained_events(endpoint: str) -> Iterator[list[float]]:
    """Subscribe to the (bound) `endpoint` until the block ends; the list holds the number of
    messages and of bytes received and the publisher thread's CPU seconds meanwhile, filled in
    when it ends."""
    import zmq

    counts = [0, 0, 0.0]
    cpu_before = publisher_cpu_seconds()
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
        counts[2] = publisher_cpu_seconds() - cpu_before
        stop.set()
        thread.join()
        sub.close(linger=0)
        context.term()
