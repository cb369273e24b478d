"""The device's wait for a guided step's masks (`engine.device_wait`): a stream holds its copy of
the mask buffer until the scheduler marks the masks ready, and then copies what was written."""

from __future__ import annotations

import time

import pytest
import torch

from minisgl_backend.engine.device_wait import HostWordWait
from minisgl_backend.engine.mask_buffer import MASKS_RELEASED, MaskBuffer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_a_stream_copies_the_masks_written_before_the_ready_word_not_before_its_wait() -> None:
    buffer = MaskBuffer(slots=2, words=4)
    assert buffer.lock_pages()
    wait = HostWordWait(buffer.ready_address)
    stream = torch.cuda.Stream()
    copies, done = [], []
    with torch.cuda.stream(stream):
        for seq, half in ((1, 0), (2, 1)):
            assert wait.enqueue(seq)
            copies.append(torch.from_numpy(buffer.view(half, 2)).to("cuda", non_blocking=True))
            done.append(torch.cuda.Event())
            done[-1].record()
    time.sleep(0.2)
    assert not done[0].query()  # held: nothing is marked ready yet
    buffer.view(0, 2)[:] = 7  # written after the copy was queued, before the mark
    buffer.mark_ready(1)
    done[0].synchronize()
    assert (copies[0].cpu() == 7).all()
    time.sleep(0.1)
    assert not done[1].query()  # the second step waits for its own mark
    buffer.mark_ready(MASKS_RELEASED)  # an engine's release at shutdown lets every wait go
    done[1].synchronize()
