"""The fused Triton MoE path (`kernels.fused_moe`, `kernels.moe_align`) against the torch
reference `experts_forward_torch`.

Without CUDA the kernels run in Triton's interpreter on CPU tensors in fp32 (and one fp16 case;
the interpreter's bf16 `tl.dot` is not usable); with CUDA they run compiled in bf16 and fp16
against an fp32 reference of the same rounded inputs. Every buffer the launcher allocates is
poisoned (NaN, or an impossible index), so a row or entry left unwritten shows.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest
import torch

from kernels import is_interpreted
from kernels.fused_moe import MoETileConfig, _grouped_gemm_kernel, fused_experts
from kernels.moe_align import align_block_size, padded_capacity
from minisgl_backend.layers.moe import experts_forward_torch, route
from tests.kernel_targets import cpu_mark, gpu_marks

INTERPRETED = is_interpreted(_grouped_gemm_kernel)
CUDA = torch.cuda.is_available() and not INTERPRETED
# The interpreter trips numpy's deprecation of int() on 1-element arrays at every loop bound.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
POISON_INDEX = -123456789


@dataclass(frozen=True)
class Target:
    device: str
    dtype: torch.dtype
    tol: float


CPU = Target("cpu", torch.float32, 1e-4)
CPU_FP16 = Target("cpu", torch.float16, 2e-2)
BF16 = Target("cuda", torch.bfloat16, 2e-2)
FP16 = Target("cuda", torch.float16, 2e-2)
_CPU_MARK = cpu_mark(_grouped_gemm_kernel)
_GPU_MARKS = gpu_marks(_grouped_gemm_kernel)
TARGETS = [
    pytest.param(CPU, id="cpu-fp32", marks=_CPU_MARK),
    pytest.param(BF16, id="cuda-bf16", marks=_GPU_MARKS),
    pytest.param(FP16, id="cuda-fp16", marks=_GPU_MARKS),
]
ROUTINGS = [pytest.param((8, 2), id="e8k2"), pytest.param((16, 4), id="e16k4")]
# (hidden, intermediate); 96 is not a multiple of the K tile: the masked path.
SIZES = [pytest.param((64, 32), id="h64i32"), pytest.param((128, 96), id="h128i96")]


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """The test's id hashed: fresh inputs per test, the same ones on every run."""
    return zlib.crc32(request.node.nodeid.encode())


@pytest.fixture
def poison(monkeypatch: pytest.MonkeyPatch) -> None:
    """`torch.empty` returns NaN (floats) or POISON_INDEX (integers) instead of stale memory."""
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs) -> torch.Tensor:
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else POISON_INDEX)

    monkeypatch.setattr(torch, "empty", poisoned_empty)


class Case:
    """Random x and experts (scaled so every stage stays O(1)) and a softmax-top-k routing."""

    def __init__(self, target: Target, seed: int, tokens: int, num_experts: int, top_k: int,
                 hidden: int, inter: int) -> None:
        self.target = target
        dev, dtype = target.device, target.dtype
        # Drawn on the device: the GPU shapes have 400M-element expert weights.
        self.gen = torch.Generator(device=dev).manual_seed(seed)

        def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=self.gen, device=dev) * scale).to(dtype)

        self.x = rand(tokens, hidden)
        self.w13 = rand(num_experts, 2 * inter, hidden, scale=hidden**-0.5)
        self.w2 = rand(num_experts, hidden, inter, scale=inter**-0.5)
        self.top_k, self.num_experts = top_k, num_experts
        self.reroute()

    def reroute(self, renormalize: bool = True) -> None:
        logits = torch.randn(self.x.shape[0], self.num_experts, generator=self.gen,
                             device=self.target.device)
        weights, ids = route(logits, self.top_k, renormalize)
        self.weights, self.ids = weights.to(self.target.dtype), ids

    def run(self, **kwargs) -> torch.Tensor:
        return fused_experts(self.x, self.w13, self.w2, self.weights, self.ids, **kwargs)

    def check(self, out: torch.Tensor) -> None:
        """fp32 reference on the same (rounded) inputs."""
        ref = experts_forward_torch(self.x.float(), self.w13.float(), self.w2.float(),
                                    self.weights.float(), self.ids.long())
        assert out.shape == self.x.shape and out.dtype == self.x.dtype
        tol = self.target.tol
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("tokens", [1, 3, 17, 64])
def test_matches_reference(target: Target, routing: tuple[int, int], sizes: tuple[int, int],
                           tokens: int, seed: int, poison: None) -> None:
    case = Case(target, seed, tokens, *routing, *sizes)
    case.check(case.run())


@pytest.mark.parametrize("target", [
    pytest.param(CPU, id="cpu-fp32", marks=_CPU_MARK),
    pytest.param(CPU_FP16, id="cpu-fp16", marks=_CPU_MARK),
    pytest.param(BF16, id="cuda-bf16", marks=_GPU_MARKS),
])
def test_odd_inputs(target: Target, seed: int, poison: None) -> None:
    """Strided x rows, int32 ids, fp32 weights with half inputs, no renormalization, all tokens
    on the same experts (one long group), 64-row blocks, and no tokens at all."""
    case = Case(target, seed, 19, 8, 2, 64, 32)
    wide = torch.zeros(19, 80, device=target.device, dtype=target.dtype)
    wide[:, :64] = case.x
    case.x = wide[:, :64]
    case.reroute(renormalize=False)
    case.ids = case.ids.to(torch.int32)
    case.weights = case.weights.float()
    case.check(case.run())
    case.ids = torch.tensor([[5, 2]] * 19, device=target.device)
    case.check(case.run())
    case.check(case.run(config=MoETileConfig(64, 32, 32, num_warps=4, num_stages=2)))
    empty = Case(target, seed, 0, 8, 2, 64, 32)
    assert empty.run().shape == (0, 64)


@pytest.mark.parametrize("target", [
    pytest.param(CPU, id="cpu", marks=_CPU_MARK),
    pytest.param(BF16, id="cuda", marks=_GPU_MARKS),
])
@pytest.mark.parametrize("tokens,num_experts,top_k,block_m", [
    (1, 8, 2, 16), (3, 16, 4, 16), (64, 16, 4, 64), (700, 8, 2, 16),  # 2 count chunks
    (300, 128, 8, 16), (300, 128, 8, 64),  # 38 chunks: two passes of the prefix loop
    (5, 60, 4, 16),  # not a power of two
])
def test_alignment_is_consistent(target: Target, tokens: int, num_experts: int, top_k: int,
                                 block_m: int, seed: int, poison: None) -> None:
    pairs = tokens * top_k
    logits = torch.randn(tokens, num_experts, generator=torch.Generator().manual_seed(seed))
    for ids in (logits.topk(top_k, dim=-1).indices,  # spread over the experts
                torch.arange(top_k).expand(tokens, top_k)):  # every token on experts 0..k-1
        ids = ids.to(target.device)
        sorted_ids, expert_ids, num_padded, _ = align_block_size(ids, num_experts, block_m)
        capacity = padded_capacity(pairs, num_experts, block_m)
        assert capacity <= pairs + num_experts * (block_m - 1) and capacity % block_m == 0
        assert sorted_ids.shape == (capacity,) and expert_ids.shape == (capacity // block_m,)
        assert num_padded.shape == (1,)
        assert sorted_ids.dtype == expert_ids.dtype == num_padded.dtype == torch.int32
        sorted_ids, expert_ids = sorted_ids.cpu().long(), expert_ids.cpu().long()
        flat, n = ids.cpu().flatten(), int(num_padded)
        counts = torch.bincount(flat, minlength=num_experts)
        assert n == int(((counts + block_m - 1) // block_m * block_m).sum())
        assert torch.all((sorted_ids >= 0) & (sorted_ids <= pairs)), "unwritten entries"
        assert torch.all(sorted_ids[n:] == pairs), "the tail must hold the sentinel"
        used = sorted_ids[:n]
        assert torch.equal(used[used < pairs].sort().values, torch.arange(pairs)), \
            "every (token, slot) pair exactly once"
        assert torch.all((expert_ids >= 0) & (expert_ids < num_experts))
        blocks = used.view(-1, block_m)
        owners = expert_ids[: n // block_m]
        assert torch.all(owners[1:] >= owners[:-1]), "blocks sorted by expert"
        for block, owner in zip(blocks, owners.tolist()):
            real = block[block < pairs]
            assert len(real) > 0, "a block of padding only inside the used range"
            assert torch.all(flat[real] == owner) and torch.all(real[1:] > real[:-1])
            assert torch.all(block[len(real):] == pairs), "padding only at a group's end"


def test_rejects_bad_shapes() -> None:
    x = torch.zeros(3, 64)
    w13, w2 = torch.zeros(8, 64, 64), torch.zeros(8, 64, 32)
    weights, ids = torch.zeros(3, 2), torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(AssertionError, match="w2"):
        fused_experts(x, w13, w2.transpose(1, 2), weights, ids)
    with pytest.raises(AssertionError, match="dtypes"):
        fused_experts(x.half(), w13, w2, weights, ids)
    with pytest.raises(AssertionError, match="powers of two"):
        fused_experts(x, w13, w2, weights, ids, config=MoETileConfig(16, 48, 32, 4, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 8, 64, 512, 2048])
@pytest.mark.parametrize("inter", [768, 96], ids=["tp1", "tp8"])
def test_qwen3_moe_shapes(tokens: int, inter: int, seed: int, poison: None) -> None:
    """Qwen3-30B-A3B's layer (128 experts, top 8, hidden 2048), whole and split 8 ways: decode
    sizes take 16-row blocks, prefill sizes 64-row blocks."""
    case = Case(BF16, seed, tokens, 128, 8, 2048, inter)
    case.check(case.run())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_graph_replay(seed: int, poison: None) -> None:
    """Captured once; replays read new x, routing weights and expert ids (including all tokens
    on the same experts) from the same buffers."""
    case = Case(BF16, seed, 24, 64, 8, 256, 128)
    x, weights, ids = case.x.clone(), case.weights.clone(), case.ids.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: Triton compiles outside the capture
        fused_experts(x, case.w13, case.w2, weights, ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, case.w13, case.w2, weights, ids)
    for step in range(3):
        case.x = torch.randn(x.shape, generator=case.gen, device="cuda").to(x.dtype)
        case.reroute()
        if step == 2:
            case.ids = torch.arange(8, device="cuda").expand_as(ids).contiguous()
        x.copy_(case.x)
        weights.copy_(case.weights)
        ids.copy_(case.ids)
        graph.replay()
        torch.cuda.synchronize()
        case.check(out)
