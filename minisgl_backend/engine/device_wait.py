"""A CUDA stream that waits for a word of page-locked host memory to reach a value, through the
driver's stream memory operations (`cuStreamWaitValue64`): work queued after the wait runs once
another process (the scheduler) has written the value, without the engine's host waiting."""

from __future__ import annotations

import ctypes
import logging
from functools import lru_cache

logger = logging.getLogger(__name__)

_WAIT_VALUE_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int64)(*addr - value) >= 0


class _Driver:
    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self.wait = getattr(lib, "cuStreamWaitValue64_v2", None) or lib.cuStreamWaitValue64
        self.wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
        self.wait.restype = ctypes.c_int
        self.device_pointer = (getattr(lib, "cuMemHostGetDevicePointer_v2", None)
                               or lib.cuMemHostGetDevicePointer)
        self.device_pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p,
                                        ctypes.c_uint]
        self.device_pointer.restype = ctypes.c_int


@lru_cache(maxsize=1)
def _driver() -> _Driver | None:
    try:
        return _Driver()
    except (OSError, AttributeError) as exc:
        logger.warning("no CUDA stream memory operations (%s): the engine waits for the masks",
                       exc)
        return None


class HostWordWait:
    """Waits of the current CUDA stream on one 64-bit word of page-locked host memory."""

    def __init__(self, address: int) -> None:
        self.address = address
        self._device_address: int | None = None

    def enqueue(self, value: int) -> bool:
        """Make the current stream wait until the word is at least `value` (signed, so it may
        wrap); False, with nothing queued, where the driver cannot."""
        import torch

        driver = _driver()
        if driver is None:
            return False
        if self._device_address is None:
            pointer = ctypes.c_uint64()
            result = driver.device_pointer(ctypes.byref(pointer), ctypes.c_void_p(self.address), 0)
            if result != 0:
                logger.warning("the mask buffer's ready word has no device address (CUDA "
                               "error %d): the engine waits for the masks", result)
                return False
            self._device_address = pointer.value
        stream = torch.cuda.current_stream().cuda_stream
        result = driver.wait(ctypes.c_void_p(stream), self._device_address, value,
                             _WAIT_VALUE_GEQ)
        if result != 0:
            logger.warning("cuStreamWaitValue64 failed (CUDA error %d): the engine waits for "
                           "the masks", result)
            return False
        return True
