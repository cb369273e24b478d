"""The Triton sampling kernels against the inverse-CDF rule they implement and torch.argmax.

Without CUDA the kernels run in Triton's interpreter on CPU tensors; with CUDA they run
compiled. Rows span several chunks of the vocabulary. Draws are placed at the middle of a
chosen token's probability interval (computed in float64), so the expected pick is exact and
no rounding can move it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import is_interpreted
from kernels.sampling import _pick_kernel, sample_from_logits
from minisgl_backend.engine.sampler import sample, seeded_uniform_host
from tests.test_sampler import sampling_tensors

INTERPRETED = is_interpreted(_pick_kernel)
CUDA = torch.cuda.is_available() and not INTERPRETED
# The interpreter's numpy warns about -inf - -inf in the branch that tl.where then discards.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered")
DEVICES = [
    pytest.param("cpu", id="cpu", marks=pytest.mark.skipif(
        not INTERPRETED, reason="CPU runs need the kernels imported with TRITON_INTERPRET=1")),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu,
                                          pytest.mark.skipif(not CUDA, reason="needs CUDA")]),
]
VOCAB = 1300  # six 256-wide chunks (padded to 8 in the pick kernel), the last one partial
CHUNK = 256


def _cdf64(row: torch.Tensor, temperature: float) -> np.ndarray:
    scaled = row.double().cpu().numpy() / temperature
    probs = np.exp(scaled - scaled.max())
    return np.cumsum(probs / probs.sum())


def _midpoint_draw(cdf: np.ndarray, token: int) -> float:
    """A uniform draw that selects `token` under the inverse CDF, far from either boundary."""
    low = cdf[token - 1] if token > 0 else 0.0
    return float((low + cdf[token]) / 2)


def _logits(bs: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(bs, VOCAB, generator=gen) * 3


@pytest.mark.parametrize("device", DEVICES)
def test_temperature_rows_pick_the_token_of_their_draw(device: str) -> None:
    """Each row gets a draw inside a chosen token's interval (first, last, middle, and tokens
    in different chunks); masked (-inf) logits are never picked, also a whole masked chunk."""
    logits = _logits(6, seed=1)
    logits[:, VOCAB - 40:] = float("-inf")  # like min_tokens' masked stop ids
    logits[2, 0] = 12.0  # a dominant first token
    logits[4, CHUNK: 2 * CHUNK] = float("-inf")  # a chunk without mass
    temperatures = [0.6, 1.0, 0.6, 1.7, 0.3, 1.0]
    rng = np.random.default_rng(0)
    uniforms, expected = [], []
    for i, t in enumerate(temperatures):
        cdf = _cdf64(logits[i], t)
        probs = np.diff(cdf, prepend=0.0)
        candidates = np.nonzero(probs > 1e-4)[0]
        token = int(candidates[0] if i == 2 else rng.choice(candidates))
        uniforms.append(_midpoint_draw(cdf, token))
        expected.append(token)
    ids = sample_from_logits(
        logits.to(device), torch.tensor(temperatures, device=device),
        torch.tensor(uniforms, dtype=torch.float64, device=device), chunk=CHUNK)
    assert ids.dtype == torch.int64
    assert ids.cpu().tolist() == expected


@pytest.mark.parametrize("device", DEVICES)
def test_draw_at_the_top_picks_the_last_token_with_mass(device: str) -> None:
    """A draw at the very top of the range (rounding may leave the scan short of it) falls back
    to the last token with non-zero mass, never to a masked one (chunks 3-5 have none)."""
    logits = _logits(2, seed=2)
    logits[:, 700:] = float("-inf")
    uniform = torch.full((2,), 1.0 - 0.5 / 2**32, dtype=torch.float64)
    ids = sample_from_logits(logits.to(device), torch.ones(2, device=device), uniform.to(device),
                             chunk=CHUNK)
    assert ids.cpu().tolist() == [699, 699]


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_take_the_first_largest_logit(device: str) -> None:
    """Temperature 0 (a greedy row's, decided on admission: `core.RowSampling`) means argmax,
    ties going to the lowest index (torch's rule): a tie within one chunk and a tie across
    chunks."""
    logits = _logits(4, seed=3)
    logits[0, [10, 20]] = 50.0  # same chunk
    logits[1, [100, 900]] = 50.0  # different chunks
    logits[3, VOCAB - 1] = 50.0  # in the partial last chunk
    ids = sample_from_logits(logits.to(device), torch.zeros(4, device=device),
                             torch.full((4,), 0.5, dtype=torch.float64, device=device),
                             chunk=CHUNK)
    assert ids.cpu().tolist() == torch.argmax(logits, dim=-1).tolist()
    assert ids.cpu().tolist()[:2] == [10, 100]
    assert ids.cpu().tolist()[:2] == [10, 100]


@pytest.mark.parametrize("device", DEVICES)
def test_draws_from_seed_and_position_equal_the_hosts(device: str) -> None:
    """Given seeds and positions, the kernel draws `seeded_uniform` itself, bit for bit: the
    same ids as with the host's draws, over seeds of all 64 bits (negative int64 patterns)
    and positions past 2**32; float64 temperatures sample as their float32 values."""
    bs = 48
    logits = _logits(bs, seed=6) * 0.3  # flat rows: a different draw picks another token
    rng = np.random.default_rng(7)
    seeds = rng.integers(-(2**63), 2**63 - 1, bs, dtype=np.int64)
    positions = rng.integers(0, 2**34, bs, dtype=np.int64)
    temperature = torch.tensor(rng.uniform(0.5, 1.5, bs), dtype=torch.float64)
    temperature[::8] = 0.0  # greedy rows too
    uniform = torch.from_numpy(seeded_uniform_host(seeds, positions))
    want = sample_from_logits(logits.to(device), temperature.float().to(device),
                              uniform.to(device), chunk=CHUNK)
    got = sample_from_logits(logits.to(device), temperature.to(device), chunk=CHUNK,
                             seed=torch.from_numpy(seeds).to(device),
                             position=torch.from_numpy(positions).to(device))
    assert got.tolist() == want.tolist()
    # The draws decide: one position later, the sampled rows pick other tokens.
    later = sample_from_logits(logits.to(device), temperature.to(device), chunk=CHUNK,
                               seed=torch.from_numpy(seeds).to(device),
                               position=torch.from_numpy(positions + 1).to(device))
    changed = (later != got).cpu()
    assert not changed[::8].any() and changed.sum() > bs // 2
    with pytest.raises(ValueError, match="either uniform or seed and position"):
        sample_from_logits(logits.to(device), temperature.to(device), uniform.to(device),
                           seed=torch.from_numpy(seeds).to(device),
                           position=torch.from_numpy(positions).to(device))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_sampler_uses_the_kernel_for_unfiltered_batches_on_gpu() -> None:
    """`sample` on a GPU: a batch without top-k / top-p (mixed greedy and temperature rows)
    gives the same ids as the torch path, here with draws far from any boundary."""
    logits = _logits(4, seed=4).cuda()
    temperatures, tokens = [0.0, 0.7, 1.0, 0.7], [None, 3, 500, 999]
    positions, seeds = [5, 6, 7, 8], [1, 2, 3, 4]
    params = sampling_tensors(temperatures, [-1] * 4, [1.0] * 4, seeds, positions, "cuda",
                              vocab=VOCAB)
    assert not params.any_filtered
    uniforms = []
    for i, (t, token) in enumerate(zip(temperatures, tokens)):
        if token is None:
            uniforms.append(0.5)
            continue
        logits[i, token] = logits[i].max() + 1.0  # make the token likely enough to draw
        uniforms.append(_midpoint_draw(_cdf64(logits[i], t), token))
    params.uniform = torch.tensor(uniforms, dtype=torch.float64, device="cuda")
    ids = sample(logits, params).tolist()
    assert ids == [int(torch.argmax(logits[0])), 3, 500, 999]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernel_agrees_with_the_torch_path_at_real_sizes() -> None:
    """Batch 256 over Qwen3's vocabulary with random draws: the kernel and the torch path pick
    the same token except where a draw lies within float rounding of a boundary (rare)."""
    bs, vocab = 256, 151936
    gen = torch.Generator(device="cuda").manual_seed(5)
    logits = torch.randn(bs, vocab, device="cuda", generator=gen) * 4
    temperatures = [0.0 if i % 16 == 0 else 0.6 for i in range(bs)]
    params = sampling_tensors(temperatures, [-1] * bs, [1.0] * bs, list(range(bs)),
                              [100] * bs, "cuda", vocab=vocab)
    uniform = torch.rand(bs, device="cuda", dtype=torch.float64, generator=gen)
    from minisgl_backend.engine.sampler import sample_with_torch

    expected = sample_with_torch(logits, params, uniform)
    ids = sample_from_logits(logits, params.temperature, uniform)
    assert (ids == expected).float().mean().item() >= 0.99
    assert bool((ids[::16] == torch.argmax(logits[::16], dim=-1)).all())
