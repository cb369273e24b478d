"""The scheduler <-> engine byte codec in `minisgl_backend.engine.protocol`."""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from multiprocessing import reduction
from types import SimpleNamespace

import numpy as np
import pytest

from minisgl_backend.core import Req, RowSampling, SamplingParams
from minisgl_backend.engine import protocol
from minisgl_backend.engine.mask_buffer import MaskBuffer
from minisgl_backend.engine.protocol import STEP, StepMessage, decode, encode
from minisgl_backend.engine.sampler import seed_to_int64
from minisgl_backend.kvcache import create_prefix_cache
from minisgl_backend.scheduler.cache import CacheManager
from minisgl_backend.scheduler.lora import AdapterSlots
from minisgl_backend.scheduler.prefill import PrefillManager
from minisgl_backend.scheduler.scheduler import Scheduler
from minisgl_backend.scheduler.table import RowAllocator

# Dtypes as documented by StepMessage.to_bytes.
STEP_DTYPES = {
    "is_prefill": np.uint8,
    "rows": np.int32,
    "page_rows": np.int32,
    "page_counts": np.int32,
    "new_pages": np.int32,
    "starts": np.int32,
    "extend_lens": np.int32,
    "tokens": np.int32,
    "admit_rows": np.int32,
    "admit_temperature": np.float32,
    "admit_top_k": np.int32,
    "admit_top_p": np.float32,
    "admit_seed": np.int64,
    "admit_greedy": np.bool_,
}
VOCAB = 100
STEP_DTYPES.update({name: array.dtype
                    for name, array in RowSampling.of((), VOCAB).to_arrays("admit_").items()})
ADMIT_FIELDS = {k for k in STEP_DTYPES if k.startswith("admit_")}
PREFILL_FIELDS = {"starts", "extend_lens", "tokens"}
BASE_FIELDS = {"is_prefill", "rows", "page_rows", "page_counts", "new_pages"}
SEEDS_NEAR_2_64 = [0, 1, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1]


def _roundtrip(msg: StepMessage) -> dict[str, np.ndarray]:
    kind, arrays = decode(msg.to_bytes())
    assert kind == STEP
    for name, array in arrays.items():
        assert array.dtype == STEP_DTYPES[name], f"{name}: {array.dtype}"
    return arrays


def test_encode_decode_roundtrip_keeps_kind_names_order_values_and_dtypes() -> None:
    arrays = {
        "a": np.arange(5, dtype=np.int32) - 2,
        "b": np.array([-(2**63), -1, 0, 2**63 - 1], dtype=np.int64),
        "c": np.array([0.5, -1.25, np.inf], dtype=np.float32),
        "d": np.frombuffer(b"hello", dtype=np.uint8),
        "empty": np.zeros(0, dtype=np.int32),
        "strided": np.arange(10, dtype=np.int64)[::3],  # not contiguous
    }
    kind, out = decode(encode(protocol.TOKENS, arrays))
    assert kind == protocol.TOKENS
    assert list(out) == list(arrays)
    for name, array in arrays.items():
        assert out[name].dtype == array.dtype
        np.testing.assert_array_equal(out[name], array)


def test_encode_with_no_arrays_is_just_the_kind() -> None:
    assert encode(protocol.SHUTDOWN, {}) == bytes([protocol.SHUTDOWN])
    assert decode(encode(protocol.SHUTDOWN, {})) == (protocol.SHUTDOWN, {})


def test_prefill_step_with_admissions_roundtrips() -> None:
    msg = StepMessage(
        is_prefill=True,
        rows=[3, 0, 7],
        starts=[0, 16, 0],
        extend_lens=[5, 9, 1],
        tokens=list(range(100, 115)),
        page_rows=[3, 0, 7],
        page_counts=[1, 1, 1],
        new_pages=[40, 41, 2**31 - 1],
        admit_rows=[3, 7],
        admit=RowSampling.of([(SamplingParams(), seed_to_int64(2**64 - 1)),
                              (SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
                               seed_to_int64(12345))], VOCAB),
    )
    arrays = _roundtrip(msg)
    assert set(arrays) == BASE_FIELDS | PREFILL_FIELDS | ADMIT_FIELDS
    assert arrays["is_prefill"].tolist() == [1]
    for name in ("rows", "starts", "extend_lens", "tokens", "page_rows", "page_counts",
                 "new_pages", "admit_rows"):
        assert arrays[name].tolist() == getattr(msg, name), name
    assert msg.admit is not None
    for name in ("top_k", "seed", "greedy", "filtered"):
        assert arrays["admit_" + name].tolist() == getattr(msg.admit, name), name
    np.testing.assert_array_equal(arrays["admit_temperature"],
                                  np.asarray(msg.admit.temperature, dtype=np.float32))
    np.testing.assert_array_equal(arrays["admit_top_p"],
                                  np.asarray(msg.admit.top_p, dtype=np.float32))
    decoded = StepMessage.from_bytes(msg.to_bytes())
    assert decoded.is_prefill and decoded.rows.tolist() == msg.rows
    assert decoded.admit is not None and decoded.min_rows.tolist() == []
    assert decoded.admit.top_k.tolist() == [-1, 50]
    assert decoded.admit.greedy.tolist() == [True, False]
    assert decoded.admit.filtered.tolist() == [False, True]
    assert arrays["admit_seed"].tolist() == [-1, 12345]


def test_decode_step_without_admissions_carries_no_prefill_or_admit_fields() -> None:
    msg = StepMessage(is_prefill=False, rows=[0, 1, 2], page_rows=[1], page_counts=[1],
                      new_pages=[17])
    arrays = _roundtrip(msg)
    assert set(arrays) == BASE_FIELDS
    assert arrays["is_prefill"].tolist() == [0]
    assert arrays["rows"].tolist() == [0, 1, 2]
    assert arrays["page_rows"].tolist() == [1]
    assert arrays["page_counts"].tolist() == [1]
    assert arrays["new_pages"].tolist() == [17]


def test_a_step_whose_masks_follow_says_so_and_names_its_mask_half() -> None:
    msg = StepMessage(is_prefill=False, rows=[0, 1, 2], guide_rows=[2], mask_half=[1],
                      mask_seq=[7], masks_follow=True)
    back = StepMessage.from_bytes(msg.to_bytes())
    assert back.masks_follow and back.guide_rows.tolist() == [2]
    assert back.mask_half.tolist() == [1] and back.mask_seq.tolist() == [7]
    assert not StepMessage.from_bytes(StepMessage(is_prefill=False).to_bytes()).masks_follow
    kind, arrays = decode(protocol.masks_ready(7))  # the masks of step 7 are in the buffer
    assert kind == protocol.MASKS and arrays["mask_seq"].tolist() == [7]


def test_mask_buffer_halves_are_shared_through_the_handed_descriptor() -> None:
    writer = MaskBuffer(slots=3, words=2)
    ours, theirs = multiprocessing.Pipe(duplex=True)
    writer.share(ours, os.getpid())  # what the scheduler does for each rank
    reader = MaskBuffer(slots=3, words=2, fd=reduction.recv_handle(theirs))  # a rank's
    with pytest.raises(ValueError, match="only the buffer's creator shares it"):
        reader.share(theirs, os.getpid())
    writer.view(0, 2)[:] = [[1, 2], [3, 4]]
    writer.view(1, 1)[:] = -1
    assert reader.view(0, 2).tolist() == [[1, 2], [3, 4]]
    assert reader.view(1, 1).tolist() == [[-1, -1]]
    assert reader.view(0, 3)[2].tolist() == [0, 0]  # never written: zero pages
    with pytest.raises(ValueError, match="4 guided slots in one step, the mask buffer holds 3"):
        writer.view(0, 4)


def test_decode_step_with_an_admission_carries_admit_but_no_prefill_fields() -> None:
    msg = StepMessage(is_prefill=False, rows=[0], admit_rows=[0], admit=RowSampling.of(
        [(SamplingParams(temperature=1.0, top_k=1, top_p=0.5), 7)], VOCAB))
    arrays = _roundtrip(msg)
    assert set(arrays) == BASE_FIELDS | ADMIT_FIELDS
    assert StepMessage.from_bytes(msg.to_bytes()).admit is not None
    assert StepMessage.from_bytes(StepMessage(is_prefill=False).to_bytes()).admit is None
    assert arrays["admit_rows"].tolist() == [0] and arrays["admit_seed"].tolist() == [7]


def test_decode_step_for_256_rows_with_a_few_new_pages_is_under_2_kib() -> None:
    msg = StepMessage(is_prefill=False, rows=list(range(256)), page_rows=[3, 100, 255],
                      page_counts=[1, 1, 1], new_pages=[1000, 2000, 3000])
    data = msg.to_bytes()
    arrays = _roundtrip(msg)
    assert arrays["rows"].tolist() == list(range(256))
    assert arrays["page_rows"].tolist() == [3, 100, 255]
    assert len(data) < 2048, f"a 256-row decode step encodes to {len(data)} bytes"


@pytest.mark.parametrize("seed", SEEDS_NEAR_2_64)
def test_uint64_seed_survives_the_step_message_as_its_int64_bit_pattern(seed: int) -> None:
    msg = StepMessage(is_prefill=False, rows=[0], admit_rows=[0], admit=RowSampling.of(
        [(SamplingParams(temperature=1.0), seed_to_int64(seed))], VOCAB))
    wire = _roundtrip(msg)["admit_seed"]
    assert wire.dtype == np.int64
    assert -(2**63) <= int(wire[0]) < 2**63
    assert int(wire[0]) % 2**64 == seed
    assert int(wire.view(np.uint64)[0]) == seed


def test_scheduler_step_message_sends_admitted_seeds_and_new_pages() -> None:
    """`Scheduler._step_message` (with a stand-in `self`) builds a message that decodes back."""
    page_size = 4
    cache = CacheManager(64, page_size, create_prefix_cache("radix", page_size))
    prefill = PrefillManager(cache, RowAllocator(8), chunk_size=64, max_running=8)
    reqs = []
    for i, seed in enumerate(SEEDS_NEAR_2_64):
        params = SamplingParams(max_tokens=3, temperature=0.0 if i % 2 else 0.8, top_k=-1,
                                top_p=0.9, seed=seed)
        prompt = [i + 1] * (i + 2)
        req = Req(uid=i, input_ids=prompt, prompt_len=len(prompt), sampling_params=params,
                  seed=seed)
        reqs.append(req)
        prefill.add(req)
    batch, admitted = prefill.schedule([])
    assert batch == admitted == reqs
    fake_scheduler = SimpleNamespace(cache=cache, guided_uids=set(), _long_rope_rows=[],
                                     vocab_size=VOCAB, loras=AdapterSlots("", 1))
    fake_scheduler._admission = lambda msg, req: Scheduler._admission(  # type: ignore[attr-defined]
        fake_scheduler, msg, req)  # type: ignore[arg-type]
    msg = Scheduler._step_message(fake_scheduler, batch, admitted, True,  # type: ignore[arg-type]
                                  len(batch), [])
    arrays = _roundtrip(msg)

    assert set(arrays) == BASE_FIELDS | PREFILL_FIELDS | ADMIT_FIELDS
    assert arrays["rows"].tolist() == [r.table_idx for r in reqs]
    assert arrays["starts"].tolist() == [0] * len(reqs)
    assert arrays["extend_lens"].tolist() == [r.prompt_len for r in reqs]
    assert arrays["tokens"].tolist() == [t for r in reqs for t in r.input_ids]
    assert arrays["page_rows"].tolist() == [r.table_idx for r in reqs if r.pages]
    assert arrays["page_counts"].tolist() == [len(r.pages) for r in reqs if r.pages]
    assert arrays["new_pages"].tolist() == [p for r in reqs for p in r.pages]
    assert all(r.pages_sent == len(r.pages) for r in reqs)
    assert arrays["admit_rows"].tolist() == [r.table_idx for r in reqs]
    assert [int(s) % 2**64 for s in arrays["admit_seed"]] == SEEDS_NEAR_2_64
    assert arrays["admit_temperature"].tolist() == [0.0 if i % 2 else pytest.approx(0.8)
                                                    for i in range(len(reqs))]

    # The next (decode) step sends only the rows, and only pages not sent before.
    for req in batch:
        req.cached_len = req.device_len
        req.device_len += 1
    msg = Scheduler._step_message(fake_scheduler, batch, [], False, 0, [])  # type: ignore[arg-type]
    arrays = _roundtrip(msg)
    assert set(arrays) == BASE_FIELDS
    grew = [r for r in reqs if r.device_len % page_size == 1]  # crossed into a new page
    assert arrays["page_rows"].tolist() == [r.table_idx for r in grew]
    assert arrays["page_counts"].tolist() == [1] * len(grew)
    assert arrays["new_pages"].tolist() == [r.pages[-1] for r in grew]

    # A mixed prefill step: a new request's prompt, then the running requests as decode rows
    # (rows only: the engine takes their input tokens from its token pool).
    for req in batch:
        req.cached_len = req.device_len
        req.device_len += 1
    new = Req(uid=99, input_ids=[7] * 5, prompt_len=5, sampling_params=SamplingParams(),
              seed=1)
    prefill.add(new)
    step, admitted = prefill.schedule(batch)
    assert step == admitted == [new]
    msg = Scheduler._step_message(fake_scheduler, [new, *batch], [new],  # type: ignore[arg-type]
                                  True, 1, [])
    arrays = _roundtrip(msg)
    assert arrays["rows"].tolist() == [new.table_idx, *(r.table_idx for r in batch)]
    assert arrays["starts"].tolist() == [0] and arrays["extend_lens"].tolist() == [5]
    assert arrays["tokens"].tolist() == [7] * 5
    assert arrays["admit_rows"].tolist() == [new.table_idx]


def test_the_host_wait_for_masks_keeps_an_earlier_step_and_skips_older_masks() -> None:
    """The scheduler sends step N+2 before the masks of step N+1, and a step whose sampling
    the device held for its masks leaves its MASKS message behind: waiting for step N+1's
    masks keeps the STEP that came first and skips the older MASKS."""
    from minisgl_backend.engine.worker import _wait_for_masks

    ours, theirs = multiprocessing.Pipe(duplex=True)
    later = StepMessage(is_prefill=False, rows=[0], guide_rows=[0], mask_half=[0],
                        mask_seq=[3], masks_follow=True).to_bytes()
    for data in (protocol.masks_ready(1), later, protocol.masks_ready(2),
                 protocol.masks_ready(9)):
        ours.send_bytes(data)
    waiting = StepMessage(is_prefill=False, rows=[0], mask_seq=[2], masks_follow=True)
    early: deque[bytes] = deque()
    _wait_for_masks(theirs, waiting, early)
    assert list(early) == [later]
    assert decode(theirs.recv_bytes())[1]["mask_seq"].tolist() == [9]  # left for later
    ours.send_bytes(protocol.encode(protocol.SHUTDOWN, {}))
    with pytest.raises(EOFError):  # the scheduler stopped before the masks
        _wait_for_masks(theirs, waiting, early)


def test_the_ready_word_follows_the_masks_and_every_mapping_sees_it() -> None:
    """`mark_ready` writes the step's `mask_seq` after its masks, in the memory every process
    maps: what a GPU rank's stream waits for."""
    from minisgl_backend.engine.mask_buffer import MASKS_RELEASED

    writer = MaskBuffer(slots=2, words=3)
    ours, theirs = multiprocessing.Pipe(duplex=True)
    writer.share(ours, os.getpid())
    reader = MaskBuffer(2, 3, reduction.recv_handle(theirs))
    writer.view(1, 2)[:] = 5
    writer.mark_ready(4)
    assert reader.ready == 4 and (reader.view(1, 2) == 5).all()
    assert reader.ready_address % 8 == 0 and reader.ready_address != writer.ready_address
    reader.mark_ready(MASKS_RELEASED)  # an engine's release at shutdown
    assert writer.ready == MASKS_RELEASED
