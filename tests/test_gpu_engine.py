"""The engine on a GPU: every attention backend, CUDA graphs and overlap on and off.

Float32 runs must equal HF transformers token for token (FlashInfer has no float32 kernels, so
it is checked in bfloat16 against the torch reference backend instead). Skipped without CUDA.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from minisgl_backend import LLM, SamplingParams
from minisgl_backend.testing.tiny_models import build_tiny_model
from tests.conftest import CHECKED, hf_greedy, mixed_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
HAS_TRITON = importlib.util.find_spec("triton") is not None
MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
# Head dim 128, as the real shapes benchmarked (FlashInfer compiles its kernels per head dim).
GPU_SHAPES = {
    "llama": dict(hidden_size=512, intermediate_size=1024, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=3),
    "qwen3": dict(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=128, num_hidden_layers=3),
    "qwen3_moe": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=128, num_hidden_layers=2),
}


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu-models")
    return {arch: build_tiny_model(arch, root / arch, **shape)
            for arch, shape in GPU_SHAPES.items()}


def generate(model: Path, prompts: list[list[int]], **settings) -> list[list[int]]:  # noqa: ANN003
    with LLM(model, device="cuda", hooks=CHECKED, **settings) as llm:
        return [o.token_ids for o in llm.generate(prompts, GREEDY)]


FLOAT32_CASES = [  # arch, attention backend, largest CUDA-graph batch, overlap, page size
    ("qwen3", "torch", 0, False, 1),
    ("qwen3", "triton", 16, False, 16),
    ("qwen3", "triton", 16, True, 1),
    ("qwen3", "triton", 0, True, 16),
    ("llama", "triton", 16, True, 16),
]


@pytest.mark.parametrize(("arch", "backend", "graph_max_bs", "overlap", "page_size"),
                         FLOAT32_CASES)
def test_float32_greedy_equals_hf(gpu_models: dict[str, Path], arch: str, backend: str,
                                  graph_max_bs: int, overlap: bool, page_size: int) -> None:
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("needs triton")
    prompts = mixed_prompts(8)
    tokens = generate(gpu_models[arch], prompts, dtype="float32", attention_backend=backend,
                      cuda_graph_max_bs=graph_max_bs, overlap=overlap, page_size=page_size)
    assert tokens == hf_greedy(gpu_models[arch], prompts, MAX_TOKENS)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_float32_moe_equals_hf(gpu_models: dict[str, Path]) -> None:
    prompts = mixed_prompts(6)
    tokens = generate(gpu_models["qwen3_moe"], prompts, dtype="float32",
                      attention_backend="triton")
    assert tokens == hf_greedy(gpu_models["qwen3_moe"], prompts, MAX_TOKENS)


@pytest.mark.skipif(torch.cuda.device_count() < 2 or not HAS_TRITON, reason="needs 2 GPUs")
def test_float32_tensor_parallel_2_equals_hf(gpu_models: dict[str, Path]) -> None:
    prompts = mixed_prompts(8)
    tokens = generate(gpu_models["qwen3"], prompts, dtype="float32", attention_backend="triton",
                      tp_size=2)
    assert tokens == hf_greedy(gpu_models["qwen3"], prompts, MAX_TOKENS)


@pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer")
@pytest.mark.parametrize(("arch", "graph_max_bs", "overlap", "page_size"),
                         [("qwen3", 0, False, 1), ("qwen3", 16, True, 16), ("llama", 16, True, 1)])
def test_bfloat16_flashinfer_agrees_with_torch_reference(gpu_models: dict[str, Path], arch: str,
                                                          graph_max_bs: int, overlap: bool,
                                                          page_size: int) -> None:
    """bf16 kernels round differently, so a near-tie may flip a later greedy token; the first
    token of every prompt and most whole sequences must agree."""
    prompts = mixed_prompts(8)
    reference = generate(gpu_models[arch], prompts, dtype="bfloat16", attention_backend="torch",
                         cuda_graph_max_bs=0, overlap=False, page_size=page_size)
    fast = generate(gpu_models[arch], prompts, dtype="bfloat16", attention_backend="flashinfer",
                    cuda_graph_max_bs=graph_max_bs, overlap=overlap, page_size=page_size)
    assert [t[0] for t in fast] == [t[0] for t in reference]
    assert sum(f == r for f, r in zip(fast, reference)) >= 6, (fast, reference)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_float32_seeded_sampling_is_reproducible(gpu_models: dict[str, Path]) -> None:
    """Temperature sampling on the GPU (the Triton sampling kernels) gives each request the
    same tokens in a batch with graphs and overlap, alone without either, and on the CPU
    (torch path): draws depend only on the request's seed and positions."""
    prompts = mixed_prompts(4)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=11 * i,
                             ignore_eos=True) for i in range(len(prompts))]
    model = gpu_models["qwen3"]

    def run(device: str, batch: list[int], **settings) -> list[list[int]]:  # noqa: ANN003
        with LLM(model, device=device, dtype="float32", **settings) as llm:
            return [o.token_ids for o in llm.generate([prompts[i] for i in batch],
                                                      [params[i] for i in batch])]

    batched = run("cuda", list(range(len(prompts))), attention_backend="triton",
                  cuda_graph_max_bs=16, overlap=True)
    alone = [run("cuda", [i], attention_backend="triton", cuda_graph_max_bs=0,
                 overlap=False)[0] for i in range(len(prompts))]
    on_cpu = run("cpu", list(range(len(prompts))))
    assert batched == alone == on_cpu
    greedy = generate(model, prompts, dtype="float32", attention_backend="triton")
    assert batched != greedy  # really sampled


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize(("arch", "graph_max_bs", "overlap"),
                         [("llama", 16, True), ("qwen3", 0, False), ("qwen3", 4, True)])
def test_float32_fused_gemvs_equal_hf(gpu_models: dict[str, Path], arch: str, graph_max_bs: int,
                                      overlap: bool) -> None:
    """Decode batches of up to 8 rows run the fused few-rows GEMVs (full-precision dot in
    float32): eagerly, in CUDA graphs with overlap, and both in one run (graphs up to 4)."""
    prompts = mixed_prompts(8)
    tokens = generate(gpu_models[arch], prompts, dtype="float32", attention_backend="triton",
                      cuda_graph_max_bs=graph_max_bs, overlap=overlap, fused_gemv_max_bs=8)
    assert tokens == hf_greedy(gpu_models[arch], prompts, MAX_TOKENS)


@pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer")
def test_bfloat16_fused_gemvs_agree_with_torch_reference(gpu_models: dict[str, Path]) -> None:
    prompts = mixed_prompts(8)
    reference = generate(gpu_models["llama"], prompts, dtype="bfloat16",
                         attention_backend="torch", cuda_graph_max_bs=0, overlap=False)
    fast = generate(gpu_models["llama"], prompts, dtype="bfloat16", attention_backend="auto",
                    fused_gemv_max_bs=16)
    assert [t[0] for t in fast] == [t[0] for t in reference]
    assert sum(f == r for f, r in zip(fast, reference)) >= 6, (fast, reference)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_float32_admissions_between_decode_steps_equal_hf(gpu_models: dict[str, Path]) -> None:
    """Chunked prefill steps between decode steps (requests admitted while others decode),
    graphs and overlap on."""
    prompts = mixed_prompts(8)
    tokens = generate(gpu_models["llama"], prompts, dtype="float32", attention_backend="triton",
                      max_running_requests=3, chunked_prefill_size=24, page_size=4)
    assert tokens == hf_greedy(gpu_models["llama"], prompts, MAX_TOKENS)


@pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer")
def test_bfloat16_flashinfer_chunked_admissions_agree_with_torch_reference(
        gpu_models: dict[str, Path]) -> None:
    """FlashInfer's chunked prefill with requests admitted while others decode."""
    prompts = mixed_prompts(8)
    settings = dict(dtype="bfloat16", max_running_requests=3, chunked_prefill_size=24,
                    page_size=4)
    reference = generate(gpu_models["qwen3"], prompts, attention_backend="torch",
                         cuda_graph_max_bs=0, overlap=False, **settings)
    fast = generate(gpu_models["qwen3"], prompts, attention_backend="flashinfer", **settings)
    assert [t[0] for t in fast] == [t[0] for t in reference]
    assert sum(f == r for f, r in zip(fast, reference)) >= 6, (fast, reference)
