"""The guided rows' token masks, shared by the scheduler and the engine ranks in anonymous shared
memory (a memfd whose descriptor the scheduler hands each rank once, after READY) instead of
travelling through the pipes: a batch of 64 guided rows over a 152k vocabulary is 1.2 MB a
step, too much to push through a pipe in the guided step's critical path. On a GPU each rank
registers the memory with CUDA (page-locked), so a step's masks are copied to the device
straight from where the scheduler wrote them, without a host copy. Nothing is left behind on
disk or in /dev/shm: the memory goes with the last process that maps it. The creator keeps its
descriptor (closed with the buffer) to hand it to each rank (`share`).

After the masks, an int64 "ready word": the scheduler writes into it the `mask_seq` of the
step whose masks it has just written, and a GPU rank's stream waits for that value before it
copies them (`engine.device_wait`), so that the rank's host need not wait.

The buffer has two halves; a step's masks go in the half of its step number's parity. The
scheduler writes a step's masks once the step before it has been answered (or before sending
it, when nothing is in flight), and every rank's device copies them out before it samples that
step: the half a step uses is written again only for the step after next, which the scheduler
fills after rank 0 answered the step between, whose forward every rank's device has reached
(its collectives wait for all of them), so every rank's copy of this step's masks is done by
then.
"""

from __future__ import annotations

import mmap
import os
import weakref
from multiprocessing import reduction
from multiprocessing.connection import Connection

import numpy as np

from minisgl_backend.engine.config import EngineConfig
from minisgl_backend.grammar import mask_words

# The ready word's value past every step's `mask_seq`: every wait for masks goes on.
MASKS_RELEASED = 1 << 62


class MaskBuffer:
    """[2, slots, words] int32 (bit set: the token may be sampled) in shared memory."""

    def __init__(self, slots: int, words: int, fd: int | None = None) -> None:
        """A new buffer (zeros), or, with `fd`, the mapping of one another process made."""
        shape = (2, max(1, slots), words)
        masks_size = int(np.prod(shape)) * 4  # a multiple of 8: the ready word is aligned
        size = masks_size + 8
        owned = fd is None
        if fd is None:
            fd = os.memfd_create("minisgl-guide-masks", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        try:
            self._mmap = mmap.mmap(fd, size)
        finally:
            if not owned:
                os.close(fd)  # the mapping keeps the memory
        self._fd = fd if owned else None
        if owned:
            weakref.finalize(self, os.close, fd)
        self._array = np.frombuffer(self._mmap, dtype=np.int32, count=masks_size // 4
                                    ).reshape(shape)
        # The ready word: the `StepMessage.mask_seq` of the last step whose masks are written.
        self._ready = np.frombuffer(self._mmap, dtype=np.int64, count=1, offset=masks_size)
        self.page_locked = False

    @classmethod
    def of_engine(cls, config: EngineConfig, vocab_size: int,
                  fd: int | None = None) -> MaskBuffer:
        """An engine's buffer (new, or the one `fd` maps): a row for every sample one step may
        take, of the vocabulary's mask words."""
        return cls(config.max_samples, mask_words(vocab_size), fd)

    def share(self, conn: Connection, pid: int) -> None:
        """Hand the buffer to the process `pid` at the other end of `conn` (`receive` there)."""
        if self._fd is None:
            raise ValueError("only the buffer's creator shares it")
        reduction.send_handle(conn, self._fd, pid)

    @classmethod
    def receive(cls, conn: Connection, config: EngineConfig, vocab_size: int) -> MaskBuffer:
        """The buffer the scheduler hands this rank with `share`."""
        return cls.of_engine(config, vocab_size, reduction.recv_handle(conn))

    def lock_pages(self) -> bool:
        """Register the buffer with CUDA as page-locked memory (a device copy from it is then
        asynchronous, without a staging copy) until the buffer is collected; False where CUDA
        refuses."""
        import torch

        ptr = self._array.ctypes.data
        self.page_locked = int(torch.cuda.cudart().cudaHostRegister(
            ptr, self._array.nbytes + self._ready.nbytes, 0)) == 0
        if self.page_locked:
            # Before the memory is unmapped: a range left registered would refuse the next
            # mapping placed there.
            weakref.finalize(self, _unlock_pages, ptr)
        else:
            _clear_cuda_error()
        return self.page_locked

    @property
    def slots(self) -> int:
        return self._array.shape[1]

    @property
    def words(self) -> int:
        return self._array.shape[2]

    @property
    def ready_address(self) -> int:
        """Where the ready word lies in this process (page-locked with the masks)."""
        return self._ready.ctypes.data

    @property
    def ready(self) -> int:
        """The ready word: the `mask_seq` of the last step whose masks are written."""
        return int(self._ready[0])

    def mark_ready(self, seq: int) -> None:
        """The masks of the step whose `mask_seq` is `seq` are written (a device waiting for
        that value goes on; x86 keeps the masks' stores before this one)."""
        self._ready[0] = seq

    def view(self, half: int, slots: int) -> np.ndarray:
        """The first `slots` rows of half `half` (0 or 1; a step's is its number % 2) as
        [slots, words], a view."""
        if slots > self.slots:
            raise ValueError(f"{slots} guided slots in one step, the mask buffer holds "
                             f"{self.slots}")
        return self._array[half, :slots]


def _unlock_pages(ptr: int) -> None:
    try:
        import torch

        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - the interpreter is shutting down
        pass


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error (a refused registration sets it, and torch's next
    kernel launch check would raise it), where the runtime's symbols are global (torch loads
    its CUDA libraries so)."""
    import ctypes

    try:
        ctypes.CDLL(None).cudaGetLastError()
    except (AttributeError, OSError):
        pass
