"""Shared fixtures: tiny random models of each architecture, the default model, HF references."""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path

import pytest
import torch

# Before any test module imports triton: without CUDA, importing `kernels` selects Triton's
# interpreter, which Triton must know before `triton.language` is first imported.
import kernels  # noqa: F401
from minisgl_backend.settings import EngineHooks
from minisgl_backend.testing.tiny_models import TINY_ARCHITECTURES, build_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[1]
CHECKED = EngineHooks(debug_checks=True)  # engines in tests verify page accounting every step


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: build_tiny_model(arch, root / arch) for arch in TINY_ARCHITECTURES}


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The embedded SmolLM2-135M-Instruct folder, built on first use."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    from build_default_model import DEFAULT_MODEL_DIR, build_default_model

    return build_default_model(Path(DEFAULT_MODEL_DIR))


def mixed_prompts(count: int = 8, vocab: int = 500, seed: int = 0) -> list[list[int]]:
    """`count` token-id prompts of mixed lengths (5 to about 80 tokens)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [5, 80, 17, 33, 9, 61, 24, 47, 12, 70][:count] + [20] * max(0, count - 10)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


@lru_cache(maxsize=None)
def _hf_model(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int,
              stop_at_eos: bool = False) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt (one at a time, float32)."""
    return hf_model_greedy(_hf_model(str(model_dir)), prompts, max_tokens, stop_at_eos)


def hf_model_greedy(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int,
                    stop_at_eos: bool = False) -> list[list[int]]:
    """`hf_greedy` of a loaded HF model."""
    if _longrope(model):
        return [hf_greedy_whole(model, prompt, max_tokens) for prompt in prompts]
    outputs = []
    for prompt in prompts:
        extra = {} if stop_at_eos else {"eos_token_id": None}
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0, **extra)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def _longrope(model: torch.nn.Module) -> bool:
    rope = getattr(model.config, "rope_parameters", None) or {}
    return rope.get("rope_type") == "longrope"


def hf_greedy_whole(model: torch.nn.Module, prompt: list[int], max_tokens: int,
                    processors: list | None = None) -> list[int]:
    """Greedy tokens from HF's forward of the whole sequence at every step (no KV cache),
    logits processors applied. For LongRoPE this is what HF's generate computes: a sequence
    crossing the pretraining length is computed whole again in the long frequencies
    (`Phi3ForCausalLM.prepare_inputs_for_generation`), which some transformers versions'
    generate got wrong at that step (5.17 computed the last token alone)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(ids, use_cache=False).logits[:, -1].float()
            for processor in processors or []:
                logits = processor(ids, logits)
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()
