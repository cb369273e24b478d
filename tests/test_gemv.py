"""The few-rows GEMV kernel (with its optional RMSNorm / SiLU-and-mul prologue and residual
epilogue) against the torch ops it replaces.

Without CUDA the kernel runs in Triton's interpreter on CPU tensors in fp32 (the interpreter's
half-precision `tl.dot` is not usable); with CUDA it runs compiled in bf16, fp16 and fp32 (the
last with full-precision `tl.dot`, as the float32 engine uses it).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import is_interpreted
from kernels.gemv import FMA_MAX_ROWS, GemvLaunch, _gemv_kernel, fused_gemv
from tests.kernel_targets import cpu_mark, gpu_marks

INTERPRETED = is_interpreted(_gemv_kernel)
CUDA = torch.cuda.is_available() and not INTERPRETED
# The interpreter trips numpy's deprecation of int() on 1-element arrays at every loop bound.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
EPS = 1e-5
TARGETS = [
    pytest.param(("cpu", torch.float32), id="cpu-fp32", marks=cpu_mark(_gemv_kernel)),
    *(pytest.param(("cuda", dtype), id=f"cuda-{name}", marks=gpu_marks(_gemv_kernel))
      for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16),
                          ("fp32", torch.float32))),
]
VARIANTS = ["plain", "norm", "gated", "residual", "norm+residual"]


def _reference(variant: str, x: torch.Tensor, weight: torch.Tensor, norm_w: torch.Tensor,
               residual: torch.Tensor) -> torch.Tensor:
    """The torch ops of the layer, computed in float32 from the same inputs, rounded where the
    kernel rounds (to the weight's dtype; with the norm, 1/RMS scales the product)."""
    dtype = weight.dtype
    inv_rms = 1.0
    if variant.startswith("norm"):
        x32 = x.float()
        inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
        x = (norm_w.float() * x32).to(dtype)
    elif variant == "gated":
        gate, up = x.float().chunk(2, dim=-1)
        x = (F.silu(gate).to(dtype).float() * up).to(dtype)
    y = (F.linear(x.float(), weight.float()) * inv_rms).to(dtype)
    if variant.endswith("residual"):
        y = (y.float() + residual.float()).to(dtype)
    return y


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows,use_dot", [(1, True), (3, True), (16, True), (1, False),
                                          (3, False)])
def test_matches_torch(target: tuple[str, torch.dtype], variant: str, rows: int,
                       use_dot: bool) -> None:
    """N and K that are not multiples of the blocks; a strided x; both ways to multiply."""
    device, dtype = target
    n, k = (40, 96) if device == "cpu" else (1000, 1500)
    gen = torch.Generator().manual_seed(rows)
    width = 2 * k if variant == "gated" else k
    wide = torch.randn(rows, width + 8, generator=gen).to(device=device, dtype=dtype)
    x = wide[:, :width]
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(device=device, dtype=dtype)
    norm_w = (1 + 0.3 * torch.randn(k, generator=gen)).to(device=device, dtype=dtype)
    residual = torch.randn(rows, n, generator=gen).to(device=device, dtype=dtype)
    out = fused_gemv(
        x, weight, norm_weight=norm_w if variant.startswith("norm") else None, eps=EPS,
        gated=variant == "gated", residual=residual if variant.endswith("residual") else None,
        launch=GemvLaunch(block_n=16 if use_dot else 8, block_k=32 if device == "cpu" else 256,
                          use_dot=use_dot))
    assert out.shape == (rows, n) and out.dtype == dtype
    expected = _reference(variant, x, weight, norm_w, residual)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


def test_engine_setting_limit_is_the_kernels() -> None:
    from kernels.gemv import MAX_ROWS
    from minisgl_backend.settings import FUSED_GEMV_MAX_BS

    assert FUSED_GEMV_MAX_BS == MAX_ROWS


def test_rejects_what_it_cannot_do() -> None:
    weight = torch.zeros(32, 16)
    with pytest.raises(AssertionError, match="1 to 16 rows"):
        fused_gemv(torch.zeros(17, 16), weight)
    with pytest.raises(AssertionError, match=f"1 to {FMA_MAX_ROWS} rows"):
        fused_gemv(torch.zeros(FMA_MAX_ROWS + 1, 16), weight,
                   launch=GemvLaunch(block_n=8, block_k=16, use_dot=False))
    with pytest.raises(AssertionError, match="does not fit"):
        fused_gemv(torch.zeros(2, 16), weight, gated=True)
    with pytest.raises(AssertionError, match="do not combine"):
        fused_gemv(torch.zeros(2, 32), weight, gated=True, norm_weight=torch.ones(16))


@pytest.mark.skipif(not INTERPRETED, reason="the CPU run needs the kernels' interpreter")
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_decoder_layers_with_fused_gemvs_match_their_usual_path(
        tmp_path, monkeypatch: pytest.MonkeyPatch, arch: str) -> None:  # noqa: ANN001
    """The decoder's few-rows path (four fused GEMVs per layer, the residual stream carried
    whole) gives the usual path's hidden states: float32 on CPU, the kernel interpreted;
    Qwen3-MoE's MoE layers keep their usual path between fused ones."""
    from types import SimpleNamespace

    import kernels.gemv
    from minisgl_backend.core import Context, set_global_ctx
    from minisgl_backend.models import ModelConfig, create_model
    from minisgl_backend.testing.tiny_models import build_tiny_model

    extra = {"mlp_only_layers": [1]} if arch == "qwen3_moe" else {}  # dense between MoE
    folder = build_tiny_model(arch, tmp_path / arch, num_hidden_layers=3, **extra)
    config = ModelConfig.from_folder(folder)
    model = create_model(folder, config, torch.device("cpu"), torch.float32)

    class MixingAttention:
        """Stands in for paged attention: any fixed function of q, k and v."""

        def forward(self, q, k, v, layer_id, batch):  # noqa: ANN001, ANN201
            heads = q.shape[1] // k.shape[1]
            return (q + 0.5 * k.repeat_interleave(heads, 1) * v.repeat_interleave(heads, 1)
                    ).flatten(1)

    rows = 3
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, config.hidden_size, generator=gen)
    positions = torch.tensor([5, 17, 40])

    def run_layers(max_rows: int) -> torch.Tensor:
        ctx = Context(16, None, MixingAttention(), fused_gemv_max_rows=max_rows)
        set_global_ctx(ctx)
        try:
            with ctx.forward_batch(SimpleNamespace(is_decode=True, lora=None)), torch.no_grad():
                h, residual = x.clone(), None
                for layer in model.model.layers:
                    h, residual = layer(h, residual, positions, model.rope)
            return h if residual is None else h + residual
        finally:
            set_global_ctx(None)

    calls = []
    monkeypatch.setattr(kernels.gemv, "fused_gemv",
                        lambda *a, **kw: calls.append(1) or fused_gemv(*a, **kw))
    usual = run_layers(0)
    assert not calls
    fused = run_layers(16)
    assert len(calls) == 4 * sum(not config.is_moe_layer(i) for i in range(3))
    assert len(calls) == (4 if arch == "qwen3_moe" else 12)
    torch.testing.assert_close(fused, usual, rtol=1e-4, atol=1e-4)
    assert run_layers(rows - 1).equal(usual)  # more rows than the setting: the usual path


def test_only_small_dense_layers_take_the_fused_gemvs() -> None:
    """The size bound: Qwen3-0.6B's layers (16M projection weights) fit, Llama-3.1-8B's (218M)
    and MoE layers do not (built on the meta device: no memory)."""
    from minisgl_backend.benchmark.shapes import shape_config
    from minisgl_backend.models import ModelConfig
    from minisgl_backend.models.decoder import DecoderLayer

    def first_layer(shape: str) -> DecoderLayer:
        with torch.device("meta"):
            return DecoderLayer(ModelConfig.from_dict(shape_config(shape, 1)), 0)

    assert first_layer("qwen3-0.6b").fused_gemv_fits
    assert not first_layer("llama-3.1-8b").fused_gemv_fits
    assert not first_layer("qwen3-30b-a3b").fused_gemv_fits
