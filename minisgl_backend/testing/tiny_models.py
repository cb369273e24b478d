"""Tiny random HF models of every supported architecture, for tests (built in about a second).

Each folder holds config.json, model.safetensors and a small byte-level BPE tokenizer, so the
engine and HF transformers can load the same weights and be compared token for token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from minisgl_backend.testing.tiny_tokenizer import build_tiny_tokenizer

_COMMON: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
    rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0, pad_token_id=0,
)
# Where the sliding-window models' windows end: shorter than most test prompts.
TINY_SLIDING_WINDOW = 12
# LongRoPE's pretraining length in the tiny Phi-3: prompts and outputs cross it.
TINY_LONGROPE_ORIGINAL = 32
_HALF = 16 // 2  # frequencies of a 16-wide head
_GEMMA3_TEXT: dict[str, Any] = {
    **_COMMON, "head_dim": 16, "query_pre_attn_scalar": 24, "num_hidden_layers": 3,
    "sliding_window": TINY_SLIDING_WINDOW,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}

# name -> (transformers config class, its settings over _COMMON)
_ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False, rope_theta=10000.0)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
    "llama_bias": ("LlamaConfig", dict(tie_word_embeddings=False, attention_bias=True)),
    "mistral": ("MistralConfig", dict(head_dim=16, sliding_window=TINY_SLIDING_WINDOW)),
    "mixtral": ("MixtralConfig", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                      intermediate_size=32)),
    "phi3": ("Phi3Config", {}),
    "phi3_longrope": ("Phi3Config", dict(
        original_max_position_embeddings=TINY_LONGROPE_ORIGINAL, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.25 * i for i in range(_HALF)],
            "long_factor": [1.5 + 2.0 * i for i in range(_HALF)],
            "original_max_position_embeddings": TINY_LONGROPE_ORIGINAL})),
    "gemma3": ("Gemma3TextConfig", _GEMMA3_TEXT),
}
_MULTIMODAL = "gemma3_multimodal"  # Gemma3Config: the text model above and a tiny vision tower
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
               image_size=28, patch_size=14)

# The architectures of the shared `tiny_models` test fixture.
TINY_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe")
# Every architecture `build_tiny_model` knows: the fixture's, and one model per further feature.
ALL_TINY_ARCHITECTURES = (*_ARCHS, _MULTIMODAL)


def _config(arch: str, overrides: dict[str, Any]):  # noqa: ANN202 - a transformers config
    import transformers

    if arch == _MULTIMODAL:
        cls_name = "Gemma3Config"
        settings = dict(text_config=_GEMMA3_TEXT, vision_config=_VISION, mm_tokens_per_image=4)
    elif arch in _ARCHS:
        cls_name, own = _ARCHS[arch]
        settings = {**_COMMON, **own}
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; known: {ALL_TINY_ARCHITECTURES}")
    return getattr(transformers, cls_name)(**{**settings, **overrides})


def _randomize_vectors(model: torch.nn.Module) -> None:
    """HF initializes biases to 0 and norm weights to their neutral value: random ones make the
    comparison see whether each is applied (and how: Gemma's norms scale by 1 + weight)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and ("norm" in name or name.endswith("bias")):
                param.add_(torch.randn_like(param) * 0.2)


def build_tiny_model(arch: str, output_dir: str | Path, seed: int = 0,
                     max_shard_size: str | None = None, **overrides: Any) -> Path:
    """Save a random-weight float32 model of `arch` (see ALL_TINY_ARCHITECTURES) with a
    tokenizer.

    `overrides` replace config fields; `max_shard_size` (e.g. "100KB") splits the checkpoint
    into several safetensors files.
    """
    import transformers

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _config(arch, overrides)
    torch.manual_seed(seed)
    if arch == _MULTIMODAL:
        model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch not in TINY_ARCHITECTURES:
        _randomize_vectors(model)
    model.save_pretrained(out, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    vocab = config.text_config.vocab_size if arch == _MULTIMODAL else config.vocab_size
    build_tiny_tokenizer(out, vocab_size=vocab)
    return out
