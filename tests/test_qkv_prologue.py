"""The fused q/k norm + RoPE + KV-store kernel against the torch path the layer runs today
(`rms_norm`'s and `RotaryEmbedding`'s torch branches, then `PagedKVPool.store`).

Without CUDA the kernel runs in Triton's interpreter on CPU tensors in fp32; with CUDA it runs
compiled in bf16 and fp16 against an fp32 reference of the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels import is_interpreted
from kernels.qkv_prologue import _qkv_prologue_kernel, fused_qk_norm_rope_store
from minisgl_backend.kvcache.pool import PagedKVPool
from minisgl_backend.layers.fast_ops import rms_norm
from minisgl_backend.layers.linear import QKVParallelLinear
from minisgl_backend.layers.rotary import RotaryEmbedding, rope_inv_freq
from minisgl_backend.models.config import RopeConfig

INTERPRETED = is_interpreted(_qkv_prologue_kernel)
CUDA = torch.cuda.is_available() and not INTERPRETED
LAYERS, LAYER = 2, 1  # the kernel writes layer 1; layer 0 must stay as it was
PAGE_SIZE = 16
MAX_POSITIONS = 32768
EPS = 1e-6


@dataclass(frozen=True)
class Target:
    device: str
    dtype: torch.dtype
    tol: float
    tokens: int


CPU = Target("cpu", torch.float32, 1e-5, tokens=13)  # the interpreter is slow: few tokens
BF16 = Target("cuda", torch.bfloat16, 1e-2, tokens=300)
FP16 = Target("cuda", torch.float16, 1e-2, tokens=300)
_CPU_MARK = pytest.mark.skipif(not INTERPRETED, reason="CPU runs need the kernels imported with "
                               "TRITON_INTERPRET=1 (the default where torch sees no CUDA)")
_GPU_MARKS = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]
TARGETS = [
    pytest.param(CPU, id="cpu-fp32", marks=_CPU_MARK),
    pytest.param(BF16, id="cuda-bf16", marks=_GPU_MARKS),
    pytest.param(FP16, id="cuda-fp16", marks=_GPU_MARKS),
]
HEADS = [pytest.param((8, 2), id="gqa8x2"), pytest.param((4, 4), id="mha4")]


class Case:
    """Fresh random q/k/v (the views `QKVParallelLinear` returns), mixed positions up to 30000,
    scattered distinct out_slots, and a pool full of random values with an fp32 twin."""

    def __init__(self, target: Target, heads: tuple[int, int], head_dim: int, qk_norm: bool,
                 tokens: int | None = None, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        dev, dtype = target.device, target.dtype
        self.target, self.head_dim = target, head_dim
        num_heads, num_kv_heads = heads
        tokens = target.tokens if tokens is None else tokens

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen)

        hidden = 32
        proj = QKVParallelLinear(hidden, num_heads, num_kv_heads, head_dim, bias=True)
        proj.weight.copy_(rand(*proj.weight.shape) / hidden**0.5)
        proj.bias.copy_(rand(*proj.bias.shape))
        proj.to(device=dev, dtype=dtype)
        q, k, v = proj(rand(tokens, hidden).to(device=dev, dtype=dtype))
        self.q = q.view(tokens, num_heads, head_dim)
        self.k = k.view(tokens, num_kv_heads, head_dim)
        self.v = v.view(tokens, num_kv_heads, head_dim)
        self.norms = (1 + 0.5 * rand(head_dim), 1 + 0.5 * rand(head_dim)) if qk_norm else None
        if self.norms:
            self.norms = tuple(w.to(device=dev, dtype=dtype) for w in self.norms)

        fixed = torch.tensor([0, 1, MAX_POSITIONS - 1, 29999, 7])[:tokens]
        positions = torch.randint(0, 30000, (tokens,), generator=gen)
        positions[: len(fixed)] = fixed
        self.positions = positions.to(dev)
        self.rope = RotaryEmbedding(rope_inv_freq(head_dim, RopeConfig(theta=1e6)),
                                    MAX_POSITIONS)
        self.rope.to(torch.device(dev))

        num_pages = 2 * tokens // PAGE_SIZE + 3
        args = (LAYERS, num_pages, PAGE_SIZE, num_kv_heads, head_dim)
        self.pool = PagedKVPool(*args, dtype, torch.device(dev))
        self.pool.buffer.copy_(rand(*self.pool.buffer.shape))
        self.ref_pool = PagedKVPool(*args, torch.float32, torch.device(dev))
        self.ref_pool.buffer.copy_(self.pool.buffer)
        self.before = self.pool.buffer.clone()
        slots = torch.randperm(num_pages * PAGE_SIZE, generator=gen)[:tokens]
        self.out_slots = slots.to(dev)

    def run(self, out: torch.Tensor | None = None,
            heads_per_program: int | None = None) -> torch.Tensor:
        q_w, k_w = self.norms or (None, None)
        return fused_qk_norm_rope_store(
            self.q, self.k, self.v, self.positions, self.rope.cos_sin_cache(), self.out_slots,
            self.pool.k_cache(LAYER), self.pool.v_cache(LAYER),
            q_norm_weight=q_w, k_norm_weight=k_w, eps=EPS, out=out,
            heads_per_program=heads_per_program)

    def reference(self) -> torch.Tensor:
        """The layer's torch ops in fp32 on the same inputs; fills `ref_pool`."""
        q, k, v = self.q.float(), self.k.float(), self.v.float()
        if self.norms:
            q, k = rms_norm(q, self.norms[0].float(), EPS), rms_norm(k, self.norms[1].float(), EPS)
        q, k = self.rope.apply(self.positions, q, k)
        self.ref_pool.store(LAYER, self.out_slots, k, v)
        return q

    def check(self, q_out: torch.Tensor) -> None:
        tol = self.target.tol
        ref_q = self.reference()
        torch.testing.assert_close(q_out.float(), ref_q, atol=tol, rtol=tol)
        written = torch.zeros(self.pool.buffer.shape[:-2], dtype=torch.bool,
                              device=self.target.device)
        written[:, LAYER].view(2, -1)[:, self.out_slots] = True
        torch.testing.assert_close(self.pool.buffer[written].float(),
                                   self.ref_pool.buffer[written], atol=tol, rtol=tol)
        assert torch.equal(self.pool.buffer[~written], self.before[~written]), \
            "slots outside out_slots (or another layer) changed"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "no_norm"])
def test_matches_reference(target: Target, heads: tuple[int, int], head_dim: int,
                           qk_norm: bool) -> None:
    case = Case(target, heads, head_dim, qk_norm)
    k_before, v_before = case.k.clone(), case.v.clone()
    q_out = case.run()
    assert q_out.shape == case.q.shape and q_out.is_contiguous() and q_out.dtype == case.q.dtype
    case.check(q_out)
    assert torch.equal(case.k, k_before) and torch.equal(case.v, v_before), "k/v inputs changed"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("heads_per_program", [1, 2, 4, 8])
@pytest.mark.parametrize("heads", [pytest.param((12, 3), id="gqa12x3")])
def test_head_groups_give_the_same_result(target: Target, heads: tuple[int, int],
                                          heads_per_program: int) -> None:
    """Several heads per program, with groups that do not divide the head counts (the last
    query and KV groups are partly masked): same outputs as the reference, nothing else
    written."""
    case = Case(target, heads, 64, qk_norm=True, seed=4)
    case.check(case.run(heads_per_program=heads_per_program))


@pytest.mark.parametrize("target", TARGETS)
def test_in_place_and_given_out(target: Target) -> None:
    case = Case(target, (8, 2), 64, qk_norm=True, seed=1)
    q_in, k_before, v_before = case.q.clone(), case.k.clone(), case.v.clone()
    poisoned = torch.full_like(case.q, float("nan"))
    assert case.run(out=poisoned) is poisoned
    assert case.run(out=case.q) is case.q  # the second run stores the same K/V again
    torch.testing.assert_close(case.q, poisoned, atol=0, rtol=0)
    assert torch.equal(case.k, k_before) and torch.equal(case.v, v_before)
    case.q = q_in  # the reference starts from the original q
    case.check(poisoned)


@pytest.mark.parametrize("target", TARGETS)
def test_no_tokens(target: Target) -> None:
    case = Case(target, (8, 2), 64, qk_norm=True, tokens=0)
    assert case.run().shape == (0, 8, 64)
    assert torch.equal(case.pool.buffer, case.before)


def test_rejects_bad_shapes() -> None:
    case = Case(CPU, (4, 2), 64, qk_norm=True, tokens=3)
    cache = case.rope.cos_sin_cache()
    odd = torch.zeros(3, 4, 96)
    with pytest.raises(AssertionError, match="power of two"):
        fused_qk_norm_rope_store(odd, odd[:, :2], odd[:, :2], case.positions, cache,
                                 case.out_slots, case.pool.k_cache(0), case.pool.v_cache(0))
    with pytest.raises(AssertionError, match="heads_per_program must be a power of two"):
        fused_qk_norm_rope_store(case.q, case.k, case.v, case.positions, cache, case.out_slots,
                                 case.pool.k_cache(0), case.pool.v_cache(0), heads_per_program=3)
    with pytest.raises(AssertionError, match="both q and k norm weights"):
        fused_qk_norm_rope_store(case.q, case.k, case.v, case.positions, cache, case.out_slots,
                                 case.pool.k_cache(0), case.pool.v_cache(0),
                                 q_norm_weight=case.norms[0])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_graph_replay() -> None:
    """Captured once; replays read new q/k/v, positions and slots from the same buffers."""
    case = Case(BF16, (16, 8), 128, qk_norm=True, tokens=8, seed=2)
    q_w, k_w = case.norms
    cache = case.rope.cos_sin_cache()  # built before capture (it allocates)

    def launch() -> torch.Tensor:
        return fused_qk_norm_rope_store(
            case.q, case.k, case.v, case.positions, cache, case.out_slots,
            case.pool.k_cache(LAYER), case.pool.v_cache(LAYER),
            q_norm_weight=q_w, k_norm_weight=k_w, eps=EPS)

    launch()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out = launch()
    fresh = Case(BF16, (16, 8), 128, qk_norm=True, tokens=8, seed=3)
    for name in ("q", "k", "v", "positions", "out_slots"):
        getattr(case, name).copy_(getattr(fresh, name))
    case.pool.buffer.copy_(case.before)
    case.ref_pool.buffer.copy_(case.before)
    graph.replay()
    torch.cuda.synchronize()
    case.check(q_out)
