"""Host data to the device without waiting for the device.

A plain `tensor.to("cuda")` (or `torch.tensor(data, device="cuda")`) from ordinary host memory
ends in a stream synchronization: the host waits until every kernel queued before the copy has
run. Inside an engine step that stalls overlap scheduling (step N+1 could not be prepared while
step N runs). Going through pinned memory with a non-blocking copy keeps the host free; torch's
caching host allocator keeps each pinned block until its copy has completed, so the host data
may change right after the call.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def host_to_device(data: np.ndarray | Sequence[int] | Sequence[float], device: torch.device,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """`data` (a numpy array or a list) as a tensor on `device`, copied asynchronously."""
    array = np.asarray(data)
    if device.type != "cuda":
        host = torch.from_numpy(array.copy())  # a private copy: the caller may reuse its array
        return host if dtype is None else host.to(dtype)
    dtype = dtype or torch.from_numpy(np.empty(0, array.dtype)).dtype
    pinned = torch.empty(array.shape, dtype=dtype, pin_memory=True)
    # numpy's copy (and cast), on this thread: torch's copy_ of a large array wakes its thread
    # pool, which is slow to answer on a busy host.
    np.copyto(pinned.numpy(), array, casting="unsafe")
    return pinned.to(device, non_blocking=True)


def stack_to_device(arrays: Sequence[np.ndarray], device: torch.device,
                    dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, ...]:
    """Several host arrays of one length, in one asynchronous copy, as rows of one tensor."""
    return tuple(host_to_device(np.stack(arrays), device, dtype).unbind(0))
