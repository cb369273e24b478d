"""The garbage collector's pauses in this process during a timed call (`gc.callbacks`): each
holds the GIL, so the scheduler thread stops for it too (`minisgl_backend.startup_heap`)."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class CollectorPauses:
    counts: list[int] = field(default_factory=lambda: [0, 0, 0])  # collections by generation
    seconds: float = 0.0  # all of them
    longest_full_s: float = 0.0  # the longest of generation 2 (a full collection)

    def describe(self) -> str:
        return (f"{self.counts[2]} full collections (longest {1e3 * self.longest_full_s:.1f} "
                f"ms), {sum(self.counts)} in all, {1e3 * self.seconds:.1f} ms paused")


@contextmanager
def collector_pauses() -> Iterator[CollectorPauses]:
    """Count and time the collections (of any thread of this process) inside the block."""
    pauses = CollectorPauses()
    started = [0.0]

    def on_collection(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        took = time.perf_counter() - started[0]
        generation = info["generation"]
        pauses.counts[generation] += 1
        pauses.seconds += took
        if generation == 2:
            pauses.longest_full_s = max(pauses.longest_full_s, took)

    gc.callbacks.append(on_collection)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(on_collection)
