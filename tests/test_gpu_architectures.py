"""The architectures users deploy beyond Llama and Qwen, on a GPU: float32 greedy output equals
HF transformers token for token on tiny random models, with the Triton kernels, CUDA graphs and
overlap (their CPU runs, every setting, are in test_architectures.py; Gemma 3's and Mistral's
windows on a GPU in test_sliding_window_gpu.py). Skipped without CUDA."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from minisgl_backend.testing.tiny_models import build_tiny_model
from tests.conftest import hf_greedy, mixed_prompts
from tests.test_gpu_engine import MAX_TOKENS, generate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]
# Phi-3 (fused qkv and gate_up), Phi-3 with LongRoPE (prompts on both sides of its original
# context), Mixtral (the fused MoE kernels), Llama with attention biases.
ARCHITECTURES = ("phi3", "phi3_longrope", "mixtral", "llama_bias")


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize(("graph_max_bs", "overlap"), [(0, False), (16, True)])
def test_float32_greedy_equals_hf(tmp_path: Path, arch: str, graph_max_bs: int,
                                  overlap: bool) -> None:
    model = build_tiny_model(arch, tmp_path / arch, seed=2)
    prompts = mixed_prompts(8)
    tokens = generate(model, prompts, dtype="float32", attention_backend="triton",
                      cuda_graph_max_bs=graph_max_bs, overlap=overlap, page_size=16)
    assert tokens == hf_greedy(model, prompts, MAX_TOKENS)
