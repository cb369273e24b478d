"""An engine client stand-in that answers every step at once, without a model: the scheduler
alone, for measuring its host time per step (`scripts/bench_scheduler.py`)."""

from __future__ import annotations

from collections import deque

import numpy as np

from minisgl_backend.engine import protocol


class InstantEngine:
    """`EngineClient`'s interface. Each STEP is answered with one token per request of the
    step (`token`, never an EOS of the benchmark's workloads), in the order the steps came."""

    def __init__(self, num_pages: int, max_seq_len: int, token: int = 5) -> None:
        self.num_pages = num_pages
        self.max_seq_len = max_seq_len
        self.long_rope_from = 0  # no LongRoPE
        self.token = token
        self.steps_received = 0
        self._pending: deque[int] = deque()  # batch sizes of steps not answered yet

    @property
    def alive(self) -> bool:
        return True

    @property
    def pids(self) -> list[int]:
        return []

    @property
    def private_dir(self) -> str:
        return ""

    def send(self, message: bytes) -> None:
        kind, arrays = protocol.decode(message)
        if kind == protocol.STEP:
            self.steps_received += 1
            self._pending.append(len(arrays["rows"]))

    def receive_step(self, timeout: float | None = None) -> protocol.StepReply:
        return protocol.StepReply(np.full(self._pending.popleft(), self.token, dtype=np.int32))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._pending.clear()
