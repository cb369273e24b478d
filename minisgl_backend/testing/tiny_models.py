"""Tiny random HF models of every supported architecture, for tests (built in about a second).

Each folder holds config.json, model.safetensors and a small byte-level BPE tokenizer, so the
engine and HF transformers can load the same weights and be compared token for token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from minisgl_backend.testing.tiny_tokenizer import build_tiny_tokenizer

TINY_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe")

_COMMON: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
    rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0, pad_token_id=0,
)


def _config(arch: str, overrides: dict[str, Any]):  # noqa: ANN202 - a transformers config
    import transformers

    settings = dict(_COMMON)
    if arch == "llama":
        cls = transformers.LlamaConfig
        settings.update(tie_word_embeddings=False, rope_theta=10000.0)
    elif arch == "qwen2":
        cls = transformers.Qwen2Config
        settings.update(tie_word_embeddings=True)
    elif arch == "qwen3":
        cls = transformers.Qwen3Config
        settings.update(head_dim=16, tie_word_embeddings=False)
    elif arch == "qwen3_moe":
        cls = transformers.Qwen3MoeConfig
        settings.update(head_dim=16, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                        mlp_only_layers=[])
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; known: {TINY_ARCHITECTURES}")
    settings.update(overrides)
    return cls(**settings)


def build_tiny_model(arch: str, output_dir: str | Path, seed: int = 0,
                     max_shard_size: str | None = None, **overrides: Any) -> Path:
    """Save a random-weight float32 model of `arch` (see TINY_ARCHITECTURES) with a tokenizer.

    `overrides` replace config fields; `max_shard_size` (e.g. "100KB") splits the checkpoint
    into several safetensors files.
    """
    from transformers import AutoModelForCausalLM

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _config(arch, overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    build_tiny_tokenizer(out, vocab_size=config.vocab_size)
    return out
