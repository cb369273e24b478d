"""An engine client stand-in that answers every step at once, without a model: the scheduler
alone, for measuring its host time per step (`python -m minisgl_backend.benchmark scheduler`)."""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from minisgl_backend.engine import protocol
from minisgl_backend.engine.mask_buffer import MaskBuffer
from minisgl_backend.grammar import mask_words

BYTE_BITS = np.array([bin(b).count("1") for b in range(256)], dtype=np.int32)


@dataclass
class _Pending:
    samples: int  # tokens the step's reply carries
    guide_rows: np.ndarray  # their slots under a grammar
    mask_half: int


class InstantEngine:
    """`EngineClient`'s interface. Each STEP is answered with one token per request of the
    step (`token`, never an EOS of the benchmark's workloads), in the order the steps came.
    With `vocab_size` it also holds the guide mask buffer, and a guided row gets a random
    token its mask allows (the time spent picking them: `pick_seconds`)."""

    def __init__(self, num_pages: int, max_seq_len: int, token: int = 5,
                 vocab_size: int | None = None, max_samples: int = 256, seed: int = 0) -> None:
        self.num_pages = num_pages
        self.max_seq_len = max_seq_len
        self.long_rope_from = 0  # no LongRoPE
        self.token = token
        self.steps_received = 0
        self.pick_seconds = 0.0
        self.masks = (MaskBuffer(max_samples, mask_words(vocab_size))
                      if vocab_size is not None else None)
        self._rng = random.Random(seed)
        self._pending: deque[_Pending] = deque()  # steps not answered yet

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
            half = arrays.get("mask_half")
            self._pending.append(_Pending(
                len(arrays["rows"]), arrays.get("guide_rows", np.zeros(0, np.int32)),
                int(half[0]) if half is not None and len(half) else 0))

    def receive_step(self, timeout: float | None = None) -> protocol.StepReply:
        """The oldest step's tokens; its guided rows' masks are written by now (the scheduler
        asks for a step's tokens only after sending its masks)."""
        step = self._pending.popleft()
        tokens = np.full(step.samples, self.token, dtype=np.int32)
        if len(step.guide_rows):
            start = time.perf_counter()
            assert self.masks is not None, "guided rows need InstantEngine(vocab_size=...)"
            masks = self.masks.view(step.mask_half, len(step.guide_rows))
            for mask, slot in zip(masks, step.guide_rows):
                tokens[slot] = self._allowed_token(mask)
            self.pick_seconds += time.perf_counter() - start
        return protocol.StepReply(tokens)

    def _allowed_token(self, mask: np.ndarray) -> int:
        """A token the mask allows, uniformly at random (as argmax over random logits), from
        the words' bit counts (no per-token array: it would evict the scheduler's caches)."""
        counts = np.cumsum(BYTE_BITS[mask.view(np.uint8)].reshape(-1, 4).sum(axis=1))
        nth = self._rng.randrange(int(counts[-1]))
        word = int(np.searchsorted(counts, nth, side="right"))
        nth -= int(counts[word - 1]) if word else 0
        bits = int(mask[word]) & 0xFFFFFFFF
        for _ in range(nth):
            bits &= bits - 1  # drop the lowest set bit
        return 32 * word + (bits & -bits).bit_length() - 1

    def shutdown(self, timeout: float = 10.0) -> None:
        self._pending.clear()
