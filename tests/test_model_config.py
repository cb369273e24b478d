"""`ModelConfig` reads both transformers 4 and 5 config layouts and rejects what it cannot run."""

from __future__ import annotations

import pytest

from minisgl_backend.models.config import ModelConfig

BASE = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
    "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16",
}
LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def test_transformers4_layout_with_llama3_rope_scaling() -> None:
    scaling = {"rope_type": "llama3", **LLAMA3_SCALING}
    raw = {**BASE, "rope_theta": 500000.0, "rope_scaling": scaling}
    config = ModelConfig.from_dict(raw)
    assert config.head_dim == 128
    assert config.rope.theta == 500000.0 and config.rope.rope_type == "llama3"
    assert config.rope.scaling == LLAMA3_SCALING
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert config.torch_dtype == "bfloat16" and not config.tie_word_embeddings


def test_transformers5_layout_rope_parameters() -> None:
    raw = {**BASE, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
           "dtype": "float32", "eos_token_id": 2}
    del raw["torch_dtype"]
    config = ModelConfig.from_dict(raw)
    assert config.rope.theta == 1e6 and config.rope.rope_type == "default"
    assert config.eos_token_ids == (2,) and config.torch_dtype == "float32"


def test_qwen_flags_and_moe_layers() -> None:
    assert ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]}).qkv_bias
    qwen3 = ModelConfig.from_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 64})
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 64
    moe = ModelConfig.from_dict({**BASE, "architectures": ["Qwen3MoeForCausalLM"],
                                 "num_experts": 128, "num_experts_per_tok": 8,
                                 "moe_intermediate_size": 768, "decoder_sparse_step": 2,
                                 "mlp_only_layers": [3]})
    assert moe.num_experts == 128 and moe.num_experts_per_tok == 8
    assert [moe.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert not ModelConfig.from_dict(BASE).is_moe_layer(1)


@pytest.mark.parametrize(("change", "message"), [
    ({"architectures": ["FalconForCausalLM"]}, "FalconForCausalLM"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_unsupported_configs_fail_with_a_clear_error(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**BASE, **change})
