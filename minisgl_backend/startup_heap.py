"""Python's cyclic garbage collector kept off a process's startup heap.

Before it serves anything, a process of ours holds a few hundred thousand objects from its
imports (torch, transformers, xgrammar) and its model. A full collection walks them all with the
GIL held for tens of milliseconds or more, which stalls the scheduler's or the engine's thread
(on a GPU the device then waits). Serving's own allocations set one off now and then, a burst of
submitted requests for one. `gc.freeze`
moves every object alive at startup into a permanent generation that collections skip;
reference counting still frees them. vLLM does the same once its engine is up.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_holders = 0  # freezes not yet thawed (several `LLM`s may share a process)


def freeze_startup_heap() -> None:
    """Collect once, then freeze every object alive now. A process that goes on to make more
    engines calls `thaw_startup_heap` for each freeze: the last one lets the collector see the
    frozen objects again (an engine's closed cycles would otherwise stay)."""
    global _holders
    with _lock:
        gc.collect()
        gc.freeze()
        _holders += 1


def thaw_startup_heap() -> None:
    """Undo one `freeze_startup_heap`; after the last, every frozen object is collectable."""
    global _holders
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0:
            gc.unfreeze()
