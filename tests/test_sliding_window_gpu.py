"""Sliding-window attention on a GPU: the compiled Triton kernels and FlashInfer (`window_left`),
eager and in CUDA graphs. Skipped without CUDA (the CPU runs are in test_architectures.py and
test_triton_attention.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from minisgl_backend.testing.tiny_models import build_tiny_model
from tests.conftest import hf_greedy, mixed_prompts
from tests.test_gpu_engine import MAX_TOKENS, generate
from tests.test_triton_attention import (
    GPU,
    SCENARIOS,
    World,
    assert_window_matches_reference,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
# Head dim 128 (FlashInfer compiles per head dim); Gemma 3 mixes windowed and global layers.
SHAPES = {
    "mistral": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=128, num_hidden_layers=2),
    "gemma3": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=128, query_pre_attn_scalar=128),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("window-gpu-models")
    return {arch: build_tiny_model(arch, root / arch, seed=1, **shape)
            for arch, shape in SHAPES.items()}


@pytest.mark.parametrize("arch", list(SHAPES))
@pytest.mark.parametrize(("graph_max_bs", "overlap"), [(0, False), (16, True)])
def test_float32_triton_windows_equal_hf(models: dict[str, Path], arch: str, graph_max_bs: int,
                                         overlap: bool) -> None:
    prompts = mixed_prompts(8)
    tokens = generate(models[arch], prompts, dtype="float32", attention_backend="triton",
                      cuda_graph_max_bs=graph_max_bs, overlap=overlap, page_size=16)
    assert tokens == hf_greedy(models[arch], prompts, MAX_TOKENS)


@pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer")
@pytest.mark.parametrize("arch", list(SHAPES))
@pytest.mark.parametrize("graph_max_bs", [0, 16])
def test_bfloat16_flashinfer_windows_agree_with_torch_reference(
        models: dict[str, Path], arch: str, graph_max_bs: int) -> None:
    """As test_gpu_engine's bf16 check: near-ties may flip a later token."""
    prompts = mixed_prompts(8)
    reference = generate(models[arch], prompts, dtype="bfloat16", attention_backend="torch",
                         cuda_graph_max_bs=0, overlap=False, page_size=16)
    fast = generate(models[arch], prompts, dtype="bfloat16", attention_backend="flashinfer",
                    cuda_graph_max_bs=graph_max_bs, page_size=16)
    assert [t[0] for t in fast] == [t[0] for t in reference]
    assert sum(f == r for f, r in zip(fast, reference)) >= 6, (fast, reference)


@pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_flashinfer_window_matches_torch_reference(page_size: int, scenario: str) -> None:
    from minisgl_backend.attention.flashinfer_backend import FlashInferAttentionBackend

    world = World(GPU, 8, 2, page_size)
    backend = FlashInferAttentionBackend(world.pool, 8, world.head_dim, torch.device("cuda"),
                                         world.page_table.shape[1])
    assert_window_matches_reference(world, backend, scenario)
