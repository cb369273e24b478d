"""config.json contents of real model shapes, and tiny versions of them for CPU smoke tests.

A folder holding only such a config.json is enough for `LLM(folder, load_format="dummy")` and
for HF's `AutoConfig.from_pretrained(folder)`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_LLAMA_3_1_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "max_position_embeddings": 131072, "bos_token_id": 128000, "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}

_QWEN3_0_6B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": True,
    "rope_theta": 1000000.0, "max_position_embeddings": 40960,
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
}

_QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
    "rope_theta": 1000000.0, "max_position_embeddings": 40960,
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
}

# Tiny versions keep every feature of their real shape (rope scaling, tying, GQA, experts)
# with sizes that run in milliseconds on a CPU.
_TINY_SIZES: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
    "max_position_embeddings": 16384, "bos_token_id": 1, "eos_token_id": 2,
}
_TINY_MOE_SIZES: dict[str, Any] = {"num_experts": 8, "num_experts_per_tok": 2,
                                   "moe_intermediate_size": 32}

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": _LLAMA_3_1_8B,
    "qwen3-0.6b": _QWEN3_0_6B,
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "tiny-llama": {**_LLAMA_3_1_8B, **_TINY_SIZES},
    "tiny-qwen3": {**_QWEN3_0_6B, **_TINY_SIZES},
    "tiny-qwen3-moe": {**_QWEN3_30B_A3B, **_TINY_SIZES, **_TINY_MOE_SIZES},
}

# The tokenizer of each shape's benchmark model folder (`minisgl_backend.benchmark.tokenizer`):
# a committed one in this package's tokenizers/<name>/; shapes not named get a word-level tokenizer
# over their vocabulary (tiny-llama too: its 512 ids are not Llama 3's).
SHAPE_TOKENIZERS: dict[str, str] = {"llama-3.1-8b": "llama-3"}


def shape_config(name: str, num_layers: int | None = None,
                 vocab_size: int | None = None) -> dict[str, Any]:
    """A copy of the config.json dict of shape `name`, optionally with fewer/more layers or
    another vocabulary size."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    config = json.loads(json.dumps(SHAPES[name]))  # deep copy
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        config["num_hidden_layers"] = num_layers
    if vocab_size is not None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        config["vocab_size"] = vocab_size
    return config


def write_config(config: dict[str, Any], folder: str | Path) -> Path:
    """Write `config` as `folder/config.json` (creating the folder); return the folder."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def describe(config: dict[str, Any]) -> str:
    """A one-line summary, e.g. for the header of a benchmark report."""
    moe = (f", {config['num_experts']} experts (top {config['num_experts_per_tok']})"
           if config.get("num_experts") else "")
    return (f"{config['architectures'][0]}: hidden {config['hidden_size']}, "
            f"{config['num_hidden_layers']} layers, {config['num_attention_heads']} heads / "
            f"{config['num_key_value_heads']} KV heads, vocab {config['vocab_size']}{moe}")
