"""Greedy output of the engine equals HF transformers token for token (float32, CPU) for the
architectures and features beyond the shared fixture's: a Llama with attention biases, Mixtral,
Phi-3 with and without LongRoPE, Mistral with a sliding window shorter than the prompts,
Gemma 3 (text, and the text model of a multimodal checkpoint); each for 8 prompts of mixed
length in one call, with page sizes 1 and 16, chunked prefill shorter than the window, prefix
cache hits and tensor parallelism 2.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from minisgl_backend import LLM, SamplingParams
from minisgl_backend.models import ModelConfig, create_model
from minisgl_backend.testing.tiny_models import TINY_SLIDING_WINDOW, build_tiny_model
from tests.conftest import CHECKED, hf_greedy, mixed_prompts
from tests.test_engine_equivalence import GREEDY, MAX_TOKENS

ARCHS = ("llama_bias", "mixtral", "phi3", "phi3_longrope", "mistral", "gemma3")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("arch-models")
    return {arch: build_tiny_model(arch, root / arch, seed=1) for arch in ARCHS}


_EXPECTED: dict[str, list[list[int]]] = {}


def check_cold_and_warm(model: Path, **settings) -> None:  # noqa: ANN003
    """8 mixed prompts in one call equal HF; the same call again hits the prefix cache and
    gives the same tokens."""
    prompts = mixed_prompts(8)
    with LLM(model, device="cpu", hooks=CHECKED, **settings) as llm:
        cold = llm.generate(prompts, GREEDY)
        warm = llm.generate(prompts, GREEDY)
    if str(model) not in _EXPECTED:  # HF's generate is the slow part: once per model
        _EXPECTED[str(model)] = hf_greedy(model, prompts, MAX_TOKENS)
    assert [o.token_ids for o in cold] == _EXPECTED[str(model)]
    assert [o.prompt_tokens for o in cold] == [len(p) for p in prompts]
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    assert sum(o.cached_tokens for o in warm) > 0


CHUNK = TINY_SLIDING_WINDOW // 2 + 2  # shorter than the window, not a multiple of it


WINDOWED = ("mistral", "gemma3")


@pytest.mark.parametrize("arch", ARCHS)
def test_page_1_chunked_prefill_and_prefix_hits_equal_hf(models: dict[str, Path],
                                                         arch: str) -> None:
    chunk = CHUNK if arch in WINDOWED else 16  # few steps where no window is crossed
    check_cold_and_warm(models[arch], page_size=1, chunked_prefill_size=chunk)


@pytest.mark.parametrize("arch", ARCHS)
def test_page_16_tensor_parallel_2_equals_hf(models: dict[str, Path], arch: str) -> None:
    check_cold_and_warm(models[arch], page_size=16, tp_size=2)


def test_sliding_window_binds(models: dict[str, Path]) -> None:
    """The prompts run past Mistral's window: full attention would give other tokens."""
    from transformers import AutoModelForCausalLM

    prompts = mixed_prompts(8)
    assert max(map(len, prompts)) > TINY_SLIDING_WINDOW
    full = AutoModelForCausalLM.from_pretrained(models["mistral"], sliding_window=None)
    with torch.no_grad():
        unwindowed = [full.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS,
                                    do_sample=False, pad_token_id=0, eos_token_id=None)
                      [0, len(p):].tolist() for p in prompts]
    assert unwindowed != hf_greedy(models["mistral"], prompts, MAX_TOKENS)


def test_triton_kernels_with_windows_equal_hf(models: dict[str, Path]) -> None:
    """Gemma 3's windowed and global layers through the project's Triton kernels (Triton's
    interpreter on CPU: slow, so two prompts twice the window long and a few tokens)."""
    prompts = [p[: 2 * TINY_SLIDING_WINDOW] for p in mixed_prompts(4)[1::2]]
    with LLM(models["gemma3"], device="cpu", attention_backend="triton", page_size=4,
             chunked_prefill_size=CHUNK) as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert [o.token_ids for o in outputs] == hf_greedy(models["gemma3"], prompts, 4)


def test_gemma3_multimodal_checkpoint_serves_its_text_model(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = build_tiny_model("gemma3_multimodal", tmp_path / "gemma3mm", seed=2)
    config = ModelConfig.from_folder(folder)
    with caplog.at_level(logging.INFO, logger="minisgl_backend.models.weights"):
        create_model(folder, config, torch.device("cpu"), torch.float32)
    assert "vision tensors" in caplog.text
    prompts = mixed_prompts(8)
    with LLM(folder, device="cpu", hooks=CHECKED, page_size=16) as llm:
        outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == hf_greedy(folder, prompts, MAX_TOKENS)
