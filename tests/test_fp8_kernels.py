"""The FP8 kernels (activation quantization, block-scaled GEMM, few-rows GEMV) and
`fp8_linear` against the reference arithmetic of `minisgl_backend.quantization.fp8`.

Quantized values match the reference bit for bit; products match the reference's float32
sums of the same quantized values up to float32 accumulation order (tight on CPU, where the
kernels run in Triton's interpreter; looser on a GPU, whose FP8 MMA accumulates with fewer
bits, and for bf16 outputs).
"""

from __future__ import annotations

import pytest
import torch

from kernels import is_interpreted
from kernels.fp8_gemm import (
    _block_scaled_matmul_kernel,
    _quantize_kernel,
    block_scaled_matmul,
    quantize_activations,
)
from kernels.fp8_gemv import _fp8_gemv_kernel, fp8_gemv
from kernels.gemv import FMA_MAX_ROWS, GemvLaunch
from minisgl_backend.quantization import fp8
from minisgl_backend.quantization.fp8_ops import fp8_linear
from tests.kernel_targets import devices, gpu_marks

CUDA = torch.cuda.is_available() and not is_interpreted(_fp8_gemv_kernel)
# The interpreter trips numpy's deprecation of int() on 1-element arrays at every loop bound.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
SCHEMES = ["channel", "block", "static", "static-block"]


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def _activations(rows: int, cols: int, seed: int, dtype: torch.dtype = torch.float32,
                 device: str = "cpu") -> torch.Tensor:
    """Rows of different magnitudes (from 3 rows on, the last all zero and one with an
    outlier), strided (a column slice of a wider tensor)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols + 8, generator=gen) * torch.logspace(-3, 2, rows)[:, None]
    if rows > 2:
        x[-1] = 0.0
        x[1, 5] = 1e4
    return x.to(device=device, dtype=dtype)[:, :cols]


def _weight(scheme: str, n: int, k: int, block: tuple[int, int], seed: int, device: str
            ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None, torch.Tensor | None]:
    """(w_q, w_scale, block or None, static input scale or None) of `scheme`."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, n)[:, None] / k**0.5
    blocked = scheme.endswith("block")
    w_q, w_scale = fp8.quantize_blocks(w, block) if blocked else fp8.quantize_per_channel(w)
    input_scale = torch.tensor([0.02], device=device) if scheme.startswith("static") else None
    return w_q.to(device), w_scale.to(device), block if blocked else None, input_scale


def _e4m3_edges() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours (ties), points just off them
    and values past 448 (saturated), with both signs."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8.FP8).float()
    values = values[values.isfinite() & (values >= 0)].unique()
    mids = (values[1:] + values[:-1]) / 2
    edges = torch.cat([values, mids, mids.nextafter(values[1:]), mids.nextafter(values[:-1]),
                       torch.tensor([448.5, 464.0, 500.0, 1e9, 2.0**-10, 1e-30])])
    return torch.cat([edges, -edges])


@pytest.mark.parametrize("device", devices(_quantize_kernel))
def test_rounding_to_e4m3_is_torch_s(device: str) -> None:
    x = _e4m3_edges()
    q, scale = quantize_activations(x.to(device).view(1, -1), input_scale=torch.ones(1))
    assert scale.shape == (1, 1)
    assert _bits(q.cpu()).equal(_bits(fp8.saturate(x, 1.0)).view(1, -1))


@pytest.mark.parametrize("device", devices(_quantize_kernel))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [0, 32, 48, 200, "static"])
def test_quantize_activations_is_quantize_input(device: str, dtype: torch.dtype,
                                                group: int | str) -> None:
    """Per token, per token and column group (ragged last group; a group as wide as the
    row is per token), static: the same bits and scales."""
    x = _activations(5, 200, seed=1, dtype=dtype, device=device)
    input_scale = torch.tensor([0.05], device=device) if group == "static" else None
    group = 0 if group == "static" else group
    q, scale = quantize_activations(x, group, input_scale)
    ref_q, ref_scale = fp8.quantize_input(x.cpu(), group=group, input_scale=(
        None if input_scale is None else input_scale.cpu()))
    assert q.dtype == fp8.FP8 and q.shape == x.shape
    assert _bits(q.cpu()).equal(_bits(ref_q))
    assert scale.cpu().equal(ref_scale)


@pytest.mark.parametrize("device", devices(_block_scaled_matmul_kernel))
@pytest.mark.parametrize("scheme", SCHEMES)
def test_block_scaled_matmul_sums_the_dequantized_products(device: str, scheme: str) -> None:
    """M, N and K not multiples of the tiles or the weight blocks; a weight per output
    channel is the block (1, K); a bias; float32 out (the sums themselves) and bf16 out."""
    m, n, k = (5, 40, 80) if device == "cpu" else (300, 1000, 1000)
    w_q, w_scale, block, input_scale = _weight(scheme, n, k, (16, 32) if device == "cpu"
                                               else (128, 128), seed=2, device=device)
    x = _activations(m, k, seed=3, device=device)
    group = block[1] if block else 0
    x_q, x_scale = quantize_activations(x, group, input_scale)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(4)).to(device)
    x_block = (1, group) if group and input_scale is None else None
    expected = (fp8.dequantize(x_q.cpu(), x_scale.cpu(), x_block).double()
                @ fp8.dequantize(w_q.cpu(), w_scale.cpu(), block).double().T) + bias.cpu()
    out = block_scaled_matmul(x_q, x_scale, w_q, w_scale, block or (1, k), torch.float32,
                              bias=bias)
    # fp32 sums on CPU; a GPU's FP8 MMA keeps fewer bits within each K step.
    tol = 1e-5 if device == "cpu" else 1e-3
    torch.testing.assert_close(out.cpu().double(), expected, rtol=tol,
                               atol=tol * expected.abs().mean().item())
    out16 = block_scaled_matmul(x_q, x_scale, w_q, w_scale, block or (1, k), torch.bfloat16,
                                bias=bias)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.cpu().double(), expected, rtol=1e-2,
                               atol=1e-2 * expected.abs().mean().item())


def _gemv_cases() -> list:
    """(rows, tl.dot or element-wise products): element-wise up to FMA_MAX_ROWS rows."""
    return [(rows, use_dot) for rows in (1, 2, 3, 4, 7, 16) for use_dot in (True, False)
            if use_dot or rows <= FMA_MAX_ROWS]


@pytest.mark.parametrize("device", devices(_fp8_gemv_kernel))
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("rows,use_dot", _gemv_cases())
def test_fp8_gemv_is_the_reference_linear(device: str, scheme: str, rows: int,
                                          use_dot: bool) -> None:
    """Every way x is quantized, with and without weight blocks, both ways to multiply: the
    reference's result, in float32 to its summation order, in bf16 to a rounding."""
    n, k = (40, 96) if device == "cpu" else (1000, 1000)
    block_size = (16, 32) if device == "cpu" else (128, 128)
    w_q, w_scale, block, input_scale = _weight(scheme, n, k, block_size, seed=rows,
                                               device=device)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(device)
    for dtype in (torch.float32, torch.bfloat16):
        x = _activations(rows, k, seed=rows, dtype=dtype, device=device)
        launch = GemvLaunch(block_n=16, block_k=block[1] if block else 32, use_dot=use_dot)
        out = fp8_gemv(x, w_q, w_scale, block=block, input_scale=input_scale, bias=bias,
                       launch=launch)
        expected = fp8.reference_linear(x.cpu().float(), w_q.cpu(), w_scale.cpu(), block=block,
                                        input_scale=None if input_scale is None
                                        else input_scale.cpu(), bias=bias.cpu())
        assert out.shape == (rows, n) and out.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 and device == "cpu" else 1e-2
        torch.testing.assert_close(out.cpu().float(), expected, rtol=tol,
                                   atol=tol * expected.abs().mean().item())


def test_fp8_gemv_rejects_what_it_cannot_do() -> None:
    w_q, w_scale = fp8.quantize_blocks(torch.randn(32, 64), (16, 32))
    with pytest.raises(AssertionError, match="1 to 16 rows"):
        fp8_gemv(torch.zeros(17, 64), w_q, w_scale, block=(16, 32))
    with pytest.raises(AssertionError, match="block's width"):
        fp8_gemv(torch.zeros(2, 64), w_q, w_scale, block=(16, 32),
                 launch=GemvLaunch(block_n=16, block_k=64, use_dot=True))
    with pytest.raises(AssertionError, match="does not fit"):
        fp8_gemv(torch.zeros(2, 64), w_q, w_scale, block=(16, 16))


@pytest.mark.parametrize("block", [None, (16, 32)])
def test_fp8_linear_on_cpu_is_the_reference(block: tuple[int, int] | None) -> None:
    """Any leading dims; the CPU path is `reference_linear` itself."""
    w = torch.randn(24, 64)
    w_q, w_scale = fp8.quantize_blocks(w, block) if block else fp8.quantize_per_channel(w)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    out = fp8_linear(x, w_q, w_scale, block=block)
    assert out.shape == (2, 3, 24) and out.dtype == torch.bfloat16
    assert out.equal(fp8.reference_linear(x, w_q, w_scale, block=block))


@pytest.mark.parametrize("rows", [1, 4, 16, 64, 300])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("n,k,dtype", [(1024, 512, torch.bfloat16), (1000, 520, torch.bfloat16),
                                       (1024, 512, torch.float16)],
                         ids=["aligned", "ragged", "fp16"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu_marks(_fp8_gemv_kernel))])
def test_fp8_linear_matches_the_reference_on_gpu(device: str, rows: int, scheme: str, n: int,
                                                 k: int, dtype: torch.dtype) -> None:
    """Every dispatch path: the GEMV (<= 16 rows), cuBLASLt's rowwise scaled GEMM (aligned
    bf16), the Triton GEMM (blocks, and what cuBLASLt cannot take: ragged or fp16)."""
    w_q, w_scale, block, input_scale = _weight(scheme, n, k, (128, 128), seed=6, device=device)
    x = _activations(rows, k, seed=7, dtype=dtype, device=device).contiguous()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(8)).to(device, dtype)
    out = fp8_linear(x, w_q, w_scale, block=block, input_scale=input_scale, bias=bias)
    expected = fp8.reference_linear(x.cpu().float(), w_q.cpu(), w_scale.cpu(), block=block,
                                    input_scale=None if input_scale is None
                                    else input_scale.cpu(), bias=bias.cpu())
    assert out.shape == (rows, n) and out.dtype == dtype
    torch.testing.assert_close(out.cpu().float(), expected, rtol=1e-2,
                               atol=1e-2 * expected.abs().mean().item())


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu_marks(_fp8_gemv_kernel))])
@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_fp8_linear_replays_in_a_cuda_graph(device: str, rows: int, scheme: str) -> None:
    """No host syncs: captured once, replayed on new inputs, the eager result."""
    w_q, w_scale, block, _ = _weight(scheme, 1024, 512, (128, 128), seed=9, device=device)
    x = torch.zeros(rows, 512, device=device, dtype=torch.bfloat16)
    fp8_linear(x, w_q, w_scale, block=block)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, w_q, w_scale, block=block)
    x.copy_(_activations(rows, 512, seed=10, dtype=torch.bfloat16, device=device))
    graph.replay()
    assert out.equal(fp8_linear(x, w_q, w_scale, block=block))


def test_kernel_benchmark_times_the_fp8_gemv_at_the_projection_shapes() -> None:
    """Llama-3.1-8B's projections; a tiny shape's first case runs each kernel on CPU."""
    import argparse

    from minisgl_backend.benchmark.kernels import gemv_cases, projection_shapes
    from minisgl_backend.benchmark.shapes import SHAPES

    assert projection_shapes(SHAPES["llama-3.1-8b"]) == {
        "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    args = argparse.Namespace(shapes=["tiny-llama"], batch_sizes=[1, 64], calls=2)
    case, timed = next(gemv_cases(args, torch.device("cpu"), torch.float32))
    assert case == "tiny-llama qkv 128x64 batch 1"
    assert list(timed) == ["torch linear", "gemv", "fp8 gemv channel", "fp8 gemv block"]
    results = [fn() for fn, _ in timed.values()]
    for out in results[1:]:
        torch.testing.assert_close(out, results[0], rtol=0.1, atol=0.1)
    assert [size for _, size in timed.values()] == [4 * 128 * 64] * 2 + [128 * 64] * 2
