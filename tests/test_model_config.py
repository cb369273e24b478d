"""`ModelConfig` reads both transformers 4 and 5 config layouts and rejects what it cannot run."""

from __future__ import annotations

import math

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


def test_attention_bias_puts_biases_on_q_k_v_and_o() -> None:
    llama = ModelConfig.from_dict({**BASE, "attention_bias": True})
    assert llama.qkv_bias and llama.o_bias
    qwen2 = ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.qkv_bias and not qwen2.o_bias


def test_sliding_windows_per_layer() -> None:
    mistral = ModelConfig.from_dict({**BASE, "architectures": ["MistralForCausalLM"],
                                     "sliding_window": 4096})
    assert [mistral.window(i) for i in (0, 31)] == [4096, 4096]
    # A window as long as the context never binds; none at all is full attention.
    for window in (131072, None):
        config = ModelConfig.from_dict({**BASE, "architectures": ["MistralForCausalLM"],
                                        "sliding_window": window})
        assert config.window(0) == 0
    qwen = {**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 512,
            "max_window_layers": 30, "num_hidden_layers": 32}
    assert ModelConfig.from_dict(qwen).window(31) == 0  # use_sliding_window is off
    on = ModelConfig.from_dict({**qwen, "use_sliding_window": True})
    assert [on.window(i) for i in (0, 29, 30, 31)] == [0, 0, 512, 512]
    # Gemma 3, transformers 4 layout: every 6th layer global, its own RoPE bases and scaling.
    gemma = ModelConfig.from_dict({
        **BASE, "architectures": ["Gemma3ForCausalLM"], "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": 1024, "sliding_window_pattern": 6, "rope_theta": 1e6,
        "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "query_pre_attn_scalar": 168})
    assert [gemma.window(i) for i in range(6)] == [1024] * 5 + [0]
    assert gemma.layer_rope(0).theta == 1e4 and gemma.layer_rope(0).rope_type == "default"
    assert gemma.layer_rope(5).theta == 1e6 and gemma.layer_rope(5).rope_type == "linear"
    assert gemma.tie_word_embeddings and gemma.query_pre_attn_scalar == 168


def test_phi3_longrope_resolves_its_attention_factor() -> None:
    raw = {**BASE, "architectures": ["Phi3ForCausalLM"], "max_position_embeddings": 131072,
           "original_max_position_embeddings": 4096,
           "rope_scaling": {"type": "su", "short_factor": [1.0] * 64, "long_factor": [4.0] * 64}}
    rope = ModelConfig.from_dict(raw).rope
    assert rope.rope_type == "longrope"
    assert rope.scaling["original_max_position_embeddings"] == 4096
    assert rope.scaling["attention_factor"] == pytest.approx(
        (1 + math.log(32) / math.log(4096)) ** 0.5)


def test_mixtral_experts() -> None:
    mixtral = ModelConfig.from_dict({**BASE, "architectures": ["MixtralForCausalLM"],
                                     "num_local_experts": 8, "num_experts_per_tok": 2})
    assert (mixtral.num_experts, mixtral.num_experts_per_tok) == (8, 2)
    assert mixtral.moe_intermediate_size == BASE["intermediate_size"]
    assert mixtral.norm_topk_prob and mixtral.is_moe_layer(0)


@pytest.mark.parametrize(("change", "message"), [
    ({"architectures": ["FalconForCausalLM"]}, "FalconForCausalLM"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": 50.0},
     "attn_logit_softcapping"),
    ({"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True},
     "use_bidirectional_attention"),
    ({"architectures": ["Gemma3ForCausalLM"], "hidden_activation": "relu"},
     "hidden_activation"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 64,
      "layer_types": ["chunked_attention"] * 32}, "layer_types"),
    ({"architectures": ["Phi3ForCausalLM"], "rope_scaling": {
        "rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     "original_max_position_embeddings"),
])
def test_unsupported_configs_fail_with_a_clear_error(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**BASE, **change})
