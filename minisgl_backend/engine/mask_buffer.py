"""The guided rows' token masks, shared by the scheduler and the engine ranks through a file in
the engine's private folder (mapped in memory, never written back in the hot path) instead of
travelling through the pipes: a batch of 64 guided rows over a 152k vocabulary is 1.2 MB a
step, which took 1.4 ms to send on a CPU host, in the guided step's critical path.

The buffer has two halves; a step's masks go in the half of its step number's parity. The
scheduler writes a step's masks once the step before it has been answered (or before sending
it, when nothing is in flight), and every rank copies them out while it finishes that step:
the half a step uses is written again only for the step after next, which the scheduler
fills after rank 0 answered the step between, whose forward every rank has launched (its
collectives wait for all of them), so every rank has copied this step's masks by then.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from minisgl_backend.engine.config import EngineConfig
from minisgl_backend.grammar import mask_words

MASKS_FILE = "guide-masks"


class MaskBuffer:
    """[2, slots, words] int32 (bit set: the token may be sampled), in the file `path`."""

    def __init__(self, path: str | Path, slots: int, words: int, create: bool = False) -> None:
        shape = (2, max(1, slots), words)
        self.path = Path(path)
        if create:
            with open(self.path, "wb") as f:  # sparse: pages exist once written
                f.truncate(int(np.prod(shape)) * 4)
        self._array = np.memmap(self.path, dtype=np.int32, mode="r+", shape=shape)

    @classmethod
    def of_engine(cls, folder: str | Path, config: EngineConfig, vocab_size: int,
                  create: bool = False) -> MaskBuffer:
        """The buffer in an engine's private `folder`: a row for every sample one step may
        take, of the vocabulary's mask words."""
        return cls(Path(folder) / MASKS_FILE, config.max_samples, mask_words(vocab_size),
                   create)

    @property
    def slots(self) -> int:
        return self._array.shape[1]

    def view(self, half: int, slots: int) -> np.ndarray:
        """The first `slots` rows of half `half` (0 or 1; a step's is its number % 2) as
        [slots, words], a view."""
        if slots > self.slots:
            raise ValueError(f"{slots} guided slots in one step, the mask buffer holds "
                             f"{self.slots}")
        return self._array[half, :slots]
