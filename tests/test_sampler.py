"""Tests for minisgl_backend.engine.sampler."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from minisgl_backend.core import RowSampling, SamplingParams
from minisgl_backend.engine.sampler import (
    SamplingTensors,
    sample,
    seed_to_int64,
    seeded_uniform,
    seeded_uniform_host,
)

VOCAB = 64


def sampling_tensors(temperatures: Sequence[float], top_ks: Sequence[int],
                     top_ps: Sequence[float], seeds: Sequence[int], positions: Sequence[int],
                     device: str = "cpu", vocab: int = VOCAB) -> SamplingTensors:
    """The engine's tensors for rows of these settings (64-bit seeds), sampling at
    `positions`."""
    requests = [(SamplingParams(temperature=t, top_k=k, top_p=p), seed_to_int64(s))
                for t, k, p, s in zip(temperatures, top_ks, top_ps, seeds, strict=True)]
    rows, table = np.arange(len(requests)), RowSampling.table(len(requests))
    table.put(rows, RowSampling.of(requests, vocab))  # as the engine admits them
    params = SamplingTensors.of(table, rows, device)
    return dataclasses.replace(params, position=torch.tensor(positions, device=device))


def _params(
    n: int,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    seed: int = 1234,
    positions: list[int] | None = None,
) -> SamplingTensors:
    positions = list(range(n)) if positions is None else positions
    return sampling_tensors([temperature] * n, [top_k] * n, [top_p] * n, [seed] * n, positions)


def _random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * 3.0


def _repeat(logits_row: torch.Tensor, n: int) -> torch.Tensor:
    return logits_row.unsqueeze(0).expand(n, -1).contiguous()


def test_sampling_tensors_dtypes_and_the_rows_decided_rules() -> None:
    """Greedy rows (temperature 0 or top_k 1) sample at temperature 0; a row filters where its
    top-k or top-p removes tokens of the vocabulary."""
    p = sampling_tensors([0.0, 0.7, 0.5, 0.9], [5, -1, VOCAB, 1], [1.0, 0.9, 1.0, 1.0],
                         [1, 2**64 - 1, 2, 3], [3, 4, 5, 6])
    assert p.temperature.dtype == torch.float64 and p.top_p.dtype == torch.float64
    assert p.top_k.dtype == torch.int64 and p.seed.dtype == torch.int64
    assert p.position is not None and p.position.dtype == torch.int64
    assert p.seed.tolist() == [1, -1, 2, 3] and p.temperature.tolist()[3] == 0.0
    assert p.filtered.tolist() == [False, True, False, False] and p.any_filtered
    assert not p.all_greedy
    assert sampling_tensors([0.0, 1.0], [3, 1], [1.0, 1.0], [0, 0], [0, 0]).all_greedy


def test_seed_to_int64_bit_pattern() -> None:
    assert seed_to_int64(0) == 0
    assert seed_to_int64(2**63 - 1) == 2**63 - 1
    assert seed_to_int64(2**63) == -(2**63)
    assert seed_to_int64(2**64 - 1) == -1


def test_seeded_uniform_range_and_statistics() -> None:
    n = 20000
    seeds = torch.full((n,), seed_to_int64(2**64 - 5), dtype=torch.int64)
    u = seeded_uniform(seeds, torch.arange(n))
    assert ((u > 0) & (u < 1)).all()
    assert abs(u.mean().item() - 0.5) < 0.01
    hist = torch.histc(u.float(), bins=10, min=0.0, max=1.0)
    assert (hist - n / 10).abs().max().item() < 160  # ~4 standard deviations
    # Consecutive positions are not correlated.
    corr = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()
    assert abs(corr) < 0.03


def test_seeded_uniform_depends_on_both_seed_halves_and_position() -> None:
    pos = torch.zeros(4, dtype=torch.int64)
    seeds = torch.tensor([seed_to_int64(s) for s in (1, 1 + 2**32, 2**63, 2**64 - 1)])
    u = seeded_uniform(seeds, pos)
    assert len(set(u.tolist())) == 4
    big_pos = torch.tensor([5, 5 + 2**32])
    u = seeded_uniform(torch.tensor([7, 7]), big_pos)
    assert u[0].item() != u[1].item()


def test_seeded_uniform_known_values_are_stable() -> None:
    # Pure integer hash: values must be bit-identical in every process and on every device.
    seeds = torch.tensor([0, 42, seed_to_int64(2**64 - 1)])
    pos = torch.tensor([0, 7, 123456789])
    a = seeded_uniform(seeds, pos)
    b = seeded_uniform(seeds.flip(0), pos.flip(0)).flip(0)
    assert torch.equal(a, b)
    assert torch.equal(a, seeded_uniform(seeds.clone(), pos.clone()))


def test_host_uniforms_equal_device_uniforms_bit_for_bit() -> None:
    rng = np.random.default_rng(3)
    seeds = rng.integers(-(2**63), 2**63 - 1, size=500, dtype=np.int64)
    seeds[:3] = [0, -1, -(2**63)]
    positions = rng.integers(0, 2**40, size=500, dtype=np.int64)
    host = seeded_uniform_host(seeds, positions)
    assert host.dtype == np.float64
    assert np.array_equal(host, seeded_uniform(torch.from_numpy(seeds),
                                               torch.from_numpy(positions)).numpy())


def test_precomputed_uniforms_give_the_same_samples() -> None:
    logits = _random_logits(64, vocab=500)
    params = sampling_tensors([0.8] * 64, [20, -1] * 32, [1.0] * 64, [12345] * 64,
                              list(range(64)), vocab=500)  # half the rows take the sorted path
    assert params.any_filtered and params.position is not None
    expected = sample(logits, params)
    params.uniform = torch.from_numpy(
        seeded_uniform_host(params.seed.numpy(), params.position.numpy()))
    assert torch.equal(sample(logits, params), expected)


def test_greedy_is_argmax() -> None:
    logits = _random_logits(16)
    logits[3, :] = 1.0  # all ties: argmax picks the first
    expected = torch.argmax(logits, dim=-1)
    assert torch.equal(sample(logits, _params(16, temperature=0.0)), expected)
    assert torch.equal(sample(logits, _params(16, temperature=1.3, top_k=1)), expected)
    # Not flagged all_greedy, but every row is greedy anyway.
    p = _params(16, temperature=0.0)
    p.all_greedy = False
    assert torch.equal(sample(logits, p), expected)


def test_top_k_never_outside_k_largest() -> None:
    n, k = 2000, 5
    row = _random_logits(1, seed=3)[0]
    allowed = set(torch.topk(row, k).indices.tolist())
    out = sample(_repeat(row, n), _params(n, temperature=2.0, top_k=k))
    assert set(out.tolist()) <= allowed
    assert len(set(out.tolist())) == k  # high temperature: all of them show up


def test_top_p_never_outside_nucleus() -> None:
    n = 4000
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    row = torch.full((VOCAB,), -1e4)
    perm = torch.tensor([10, 3, 50, 0, 33])
    row[perm] = probs.log()
    # Mass before: 0, 0.4, 0.65, 0.85, 0.95 -> top_p=0.6 keeps {0.4, 0.25}.
    out = sample(_repeat(row, n), _params(n, top_p=0.6))
    counts = torch.bincount(out, minlength=VOCAB)
    assert set(out.tolist()) == {10, 3}
    frac = counts[10].item() / n
    assert abs(frac - 0.4 / 0.65) < 0.03
    # top_p=0.9 keeps four tokens; a tiny top_p keeps only the top one.
    assert set(sample(_repeat(row, n), _params(n, top_p=0.9)).tolist()) == {10, 3, 50, 0}
    assert set(sample(_repeat(row, n), _params(n, top_p=1e-6)).tolist()) == {10}


def test_top_k_and_top_p_together() -> None:
    n = 3000
    row = torch.log(torch.tensor([0.3, 0.3, 0.2, 0.1, 0.1] + [1e-9] * (VOCAB - 5)))
    # top_k=4 renormalizes to 0.333, 0.333, 0.222, 0.111; top_p=0.7 then keeps the first three.
    out = sample(_repeat(row, n), _params(n, top_k=4, top_p=0.7))
    assert set(out.tolist()) == {0, 1, 2}


def test_empirical_distribution_matches_softmax() -> None:
    n, vocab, temperature = 8000, 8, 0.7
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.2])
    expected = torch.softmax(row / temperature, dim=-1) * n
    out = sample(_repeat(row, n), _params(n, temperature=temperature, seed=99))
    observed = torch.bincount(out, minlength=vocab).double()
    chi2 = ((observed - expected.double()) ** 2 / expected.double()).sum().item()
    assert chi2 < 24.3  # chi-square, 7 degrees of freedom, p = 0.001


def test_same_seed_same_token_regardless_of_batch() -> None:
    vocab = 1000
    rows = _random_logits(9, vocab=vocab, seed=5)
    temps = [0.8, 0.0, 1.0, 1.5, 0.9, 0.0, 1.2, 0.6, 1.0]
    top_ks = [-1, -1, 50, -1, 10, 3, 1, -1, 2000]
    top_ps = [1.0, 1.0, 0.9, 0.5, 1.0, 0.3, 1.0, 0.95, 0.8]
    seeds = [7, 7, 2**64 - 1, 123, 2**63, 5, 6, 7, 8]
    positions = [100, 3, 17, 0, 5, 9, 11, 100, 2**40]
    batch = sample(rows, sampling_tensors(temps, top_ks, top_ps, seeds, positions, vocab=vocab))
    for i in range(len(temps)):
        alone = sampling_tensors([temps[i]], [top_ks[i]], [top_ps[i]], [seeds[i]],
                                 [positions[i]], vocab=vocab)
        assert sample(rows[i : i + 1], alone).item() == batch[i].item()
    # A different order of the same rows gives the same tokens.
    perm = [8, 2, 5, 0, 7, 1, 4, 3, 6]
    shuffled = sampling_tensors(
        [temps[i] for i in perm], [top_ks[i] for i in perm], [top_ps[i] for i in perm],
        [seeds[i] for i in perm], [positions[i] for i in perm], vocab=vocab,
    )
    assert sample(rows[perm], shuffled).tolist() == [batch[i].item() for i in perm]


def test_repeated_calls_are_deterministic() -> None:
    logits = _random_logits(256, vocab=500)
    params = _params(256, temperature=1.0, seed=2**64 - 2)
    assert torch.equal(sample(logits, params), sample(logits, params))


def test_different_seeds_give_different_samples() -> None:
    n = 500
    row = torch.zeros(VOCAB)  # uniform distribution
    a = sample(_repeat(row, n), _params(n, seed=1))
    b = sample(_repeat(row, n), _params(n, seed=2))
    assert (a != b).float().mean().item() > 0.9
    # Within one seed, different positions give different samples too.
    assert len(set(a.tolist())) > VOCAB // 2


def test_mixed_greedy_and_sampled_batch() -> None:
    n = 400
    logits = torch.zeros(n, VOCAB)
    logits[:, 7] = 0.5  # argmax is 7, but sampling at T=1 rarely picks it
    temps = [0.0 if i % 2 == 0 else 1.0 for i in range(n)]
    top_ks = [-1] * n
    top_ks[1] = 1  # greedy via top_k
    params = sampling_tensors(temps, top_ks, [1.0] * n, [11] * n, list(range(n)))
    assert not params.all_greedy
    out = sample(logits, params)
    assert (out[0::2] == 7).all()
    assert out[1].item() == 7
    assert len(set(out[3::2].tolist())) > VOCAB // 2


def test_extreme_seeds_work() -> None:
    n = 300
    row = torch.zeros(VOCAB)
    for seed in (2**64 - 1, 2**64 - 2, 2**63, 2**63 - 1, 0):
        out = sample(_repeat(row, n), _params(n, seed=seed))
        assert out.dtype == torch.int64
        assert len(set(out.tolist())) > VOCAB // 2


def test_bfloat16_and_float16_logits() -> None:
    logits = _random_logits(32, vocab=300)
    params = _params(32, temperature=0.9, top_k=20, top_p=0.9)
    ref = sample(logits.bfloat16().float(), params)
    out = sample(logits.bfloat16(), params)
    assert out.dtype == torch.int64 and out.shape == (32,)
    assert torch.equal(out, ref)
    greedy = sample(logits.half(), _params(32, temperature=0.0))
    assert torch.equal(greedy, torch.argmax(logits.half().float(), dim=-1))


def test_negative_infinity_logits_are_never_sampled() -> None:
    n = 1000
    row = torch.full((VOCAB,), float("-inf"))
    row[[2, 9, 40]] = torch.tensor([0.0, 1.0, 0.5])
    out = sample(_repeat(row, n), _params(n, temperature=1.5))
    assert set(out.tolist()) == {2, 9, 40}


def test_low_temperature_approaches_greedy() -> None:
    logits = _random_logits(64, vocab=200, seed=8)
    out = sample(logits, _params(64, temperature=1e-4))
    assert torch.equal(out, torch.argmax(logits, dim=-1))
