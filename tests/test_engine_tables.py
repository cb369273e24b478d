"""The engine's host copy of its page table, from which each step's KV slots are computed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from minisgl_backend.attention.torch_ref import token_slots
from minisgl_backend.core import RowSampling, SamplingParams
from minisgl_backend.engine.config import EngineConfig
from minisgl_backend.engine.engine import Engine
from minisgl_backend.engine.protocol import StepMessage

PAGE_SIZE = 4
VOCAB = 512


def _admit(*requests: tuple[dict, int]) -> RowSampling:
    """The per-row settings of requests of these SamplingParams fields and seeds."""
    return RowSampling.of([(SamplingParams(**fields), seed) for fields, seed in requests], VOCAB)


def test_host_slots_equal_device_slots() -> None:
    rng = np.random.default_rng(0)
    table = rng.integers(0, 1000, size=(5, 8)).astype(np.int32)
    rows = rng.integers(0, 5, size=20)
    positions = rng.integers(0, 8 * PAGE_SIZE, size=20)
    host = token_slots(table, rows, positions, PAGE_SIZE)
    device = token_slots(torch.from_numpy(table), torch.from_numpy(rows),
                         torch.from_numpy(positions), PAGE_SIZE)
    assert host.dtype == np.int64 and device.dtype == torch.int64
    np.testing.assert_array_equal(host, device.numpy())


def test_host_page_table_follows_the_device_table(tiny_models: dict[str, Path],
                                                  tmp_path: Path) -> None:
    """Prefill, decode steps that cross page boundaries, a row readmitted with other pages:
    the host table stays equal to the device one, and each step's out slots are where the
    device table puts its tokens."""
    engine = Engine(EngineConfig(model_dir=str(tiny_models["llama"]), device="cpu",
                                 page_size=PAGE_SIZE, max_running_requests=3,
                                 max_total_tokens=64), 0, str(tmp_path / "store"))
    prompts = [[5, 17, 42], [9, 8, 7, 6, 5]]
    # Row 0 gets pages 3 then 7; row 1 gets pages 0 and 1 then 5.
    steps = [
        StepMessage(is_prefill=True, rows=[0, 1], starts=[0, 0], extend_lens=[3, 5],
                    tokens=prompts[0] + prompts[1], page_rows=[0, 1], page_counts=[1, 2],
                    new_pages=[3, 0, 1], admit_rows=[0, 1], admit=_admit(({}, 0), ({}, 1))),
        StepMessage(is_prefill=False, rows=[0, 1], page_rows=[0], page_counts=[1],
                    new_pages=[7]),  # row 0 writes position 3, then 4: its second page
        StepMessage(is_prefill=False, rows=[0, 1]),
        StepMessage(is_prefill=False, rows=[1, 0], page_rows=[1], page_counts=[1],
                    new_pages=[5]),
    ]
    for msg in steps:
        handle = engine.launch(msg)
        np.testing.assert_array_equal(engine.host_page_table, engine.page_table.numpy())
        batch = handle.batch
        token_rows = torch.repeat_interleave(batch.rows, torch.tensor(batch.extend_lens))
        device = token_slots(engine.page_table, token_rows, batch.positions, PAGE_SIZE)
        torch.testing.assert_close(batch.out_slots, device)
        handle.wait()
    assert engine.host_page_table[0, :2].tolist() == [3, 7]
    assert engine.host_page_table[1, :3].tolist() == [0, 1, 5]
    # A readmitted row starts its page list over.
    engine.launch(StepMessage(is_prefill=True, rows=[0], starts=[0], extend_lens=[2],
                              tokens=[1, 2], page_rows=[0], page_counts=[1], new_pages=[9],
                              admit_rows=[0],
                              admit=_admit(({}, 0)))).wait()
    np.testing.assert_array_equal(engine.host_page_table, engine.page_table.numpy())
    assert engine.host_page_table[0, 0] == 9


def test_a_batch_uploads_its_sampling_parameters_once(tiny_models: dict[str, Path],
                                                      tmp_path: Path) -> None:
    """Steps of an unchanged batch reuse its sampling parameters on the device; only the torch
    path's draws follow the positions. An admission (a row taking a new request) uploads the
    batch's values again."""
    from minisgl_backend.engine.sampler import seeded_uniform_host

    engine = Engine(EngineConfig(model_dir=str(tiny_models["llama"]), device="cpu",
                                 page_size=PAGE_SIZE, max_running_requests=3,
                                 max_total_tokens=64), 0, str(tmp_path / "store"))
    engine._admit(StepMessage(is_prefill=True, admit_rows=[0, 1], admit=_admit(
        (dict(temperature=0.8), 3), (dict(temperature=1.2, top_k=5, top_p=0.9), 4))))
    rows, logits = np.array([0, 1]), torch.zeros(2, 8)
    steps = [engine.controls._sampling_tensors(logits, rows, torch.tensor(p), np.array(p))
             for p in ([5, 6], [6, 7])]
    assert steps[1].temperature is steps[0].temperature and steps[1].seed is steps[0].seed
    for step, positions in zip(steps, ([5, 6], [6, 7])):
        assert step.uniform is not None
        np.testing.assert_array_equal(step.uniform.numpy(),
                                      seeded_uniform_host(np.array([3, 4]), np.array(positions)))
    assert steps[0].any_filtered and not steps[0].all_greedy
    engine._admit(StepMessage(is_prefill=True, admit_rows=[1], admit=_admit(({}, 9))))
    after = engine.controls._sampling_tensors(logits, rows, torch.tensor([7, 1]),
                                              np.array([7, 1]))
    assert after.temperature.tolist() == [pytest.approx(0.8), 0.0]
    assert after.seed.tolist() == [3, 9]
    assert not after.any_filtered  # row 1's top-k and top-p went with its request
