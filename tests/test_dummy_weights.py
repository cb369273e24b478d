"""`load_format="dummy"`: random weights from config.json alone, finite through many layers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl_backend import LLM, SamplingParams
from minisgl_backend.attention.torch_ref import TorchAttentionBackend
from minisgl_backend.core import Batch, Context, set_global_ctx
from minisgl_backend.distributed import set_tp_info
from minisgl_backend.kvcache.pool import PagedKVPool
from minisgl_backend.models import ModelConfig, create_model

_SMALL: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
}


def _hf_config(arch: str, **overrides: Any) -> Any:  # a transformers config
    import transformers

    settings = dict(_SMALL)
    if arch == "LlamaForCausalLM":
        cls = transformers.LlamaConfig
        settings.update(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 1024})
    elif arch == "Qwen3ForCausalLM":
        cls = transformers.Qwen3Config
        settings.update(head_dim=16, tie_word_embeddings=True)
    else:
        cls = transformers.Qwen3MoeConfig
        settings.update(head_dim=16, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, norm_topk_prob=True)
    settings.update(overrides)
    return cls(architectures=[arch], **settings)


ARCHS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def config_only_folder(path: Path, arch: str, **overrides: Any) -> Path:
    _hf_config(arch, **overrides).save_pretrained(path)
    assert [p.name for p in path.iterdir()] == ["config.json"]
    return path


def dummy_model(folder: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return create_model(folder, ModelConfig.from_folder(folder), torch.device("cpu"), dtype,
                        load_format="dummy")


def prefill_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Logits of the last token of one prompt, through the reference attention backend."""
    attn = model.model.layers[0].self_attn.qkv_proj
    mc = model.config
    n = len(ids)
    dtype = model.lm_head.weight.dtype
    pool = PagedKVPool(mc.num_layers, n, 1, attn.num_local_kv_heads, mc.head_dim, dtype,
                       torch.device("cpu"))
    backend = TorchAttentionBackend(pool, attn.num_local_heads, mc.head_dim)
    positions = torch.arange(n)
    batch = Batch(phase="prefill", rows=torch.tensor([0]), input_ids=torch.tensor(ids),
                  positions=positions, out_slots=positions, extend_lens=[n], seq_lens=[n])
    backend.prepare(batch, page_table=positions.to(torch.int32)[None])
    ctx = Context(page_size=1, kv_pool=pool, attn_backend=backend)
    set_global_ctx(ctx)
    try:
        with torch.inference_mode(), ctx.forward_batch(batch):
            return model()
    finally:
        set_global_ctx(None)


@pytest.mark.parametrize("arch", ARCHS)
def test_dummy_weights_need_only_config_json(tmp_path: Path, arch: str) -> None:
    folder = config_only_folder(tmp_path, arch)
    with pytest.raises(FileNotFoundError):  # "auto" would need a checkpoint
        create_model(folder, ModelConfig.from_folder(folder), torch.device("cpu"), torch.float32)
    model = dummy_model(folder)
    for name, param in model.named_parameters():
        assert param.device.type == "cpu" and param.dtype == torch.float32, name
        assert torch.isfinite(param).all(), name
        assert param.abs().sum() > 0, name
        if name.endswith("norm.weight"):
            assert torch.equal(param, torch.ones_like(param)), name
        elif param.dim() >= 2:
            assert 0.015 < param.std().item() < 0.025, name
    if model.config.tie_word_embeddings:
        assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    if model.config.num_experts:
        assert model.model.layers[0].mlp.w13.std() > 0


def test_dummy_weights_are_seeded(tmp_path: Path) -> None:
    folder = config_only_folder(tmp_path, "LlamaForCausalLM")
    a, b = dummy_model(folder).state_dict(), dummy_model(folder).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bias_is_small_uniform(tmp_path: Path) -> None:
    folder = config_only_folder(tmp_path, "LlamaForCausalLM", attention_bias=True)
    bias = dummy_model(folder).model.layers[0].self_attn.qkv_proj.bias
    assert bias.abs().max() <= 0.02 and bias.std() > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_activations_stay_finite_through_many_layers(tmp_path: Path, arch: str) -> None:
    folder = config_only_folder(tmp_path, arch, num_hidden_layers=24)
    logits = prefill_logits(dummy_model(folder, torch.bfloat16), list(range(1, 33)))
    assert logits.shape == (1, 512)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.1  # not collapsed to a constant


def test_each_rank_fills_its_own_shard(tmp_path: Path) -> None:
    folder = config_only_folder(tmp_path, "Qwen3MoeForCausalLM")
    states = []
    try:
        for rank in range(2):
            set_tp_info(rank, 2)
            states.append(dummy_model(folder).state_dict())
    finally:
        set_tp_info(0, 1)
    rank0, rank1 = states
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert rank0[qkv].shape == (2 * 16 + 2 * 16, 64)  # 2 of 4 query heads, 1 of 2 KV heads
    assert not torch.equal(rank0[qkv], rank1[qkv])
    assert not torch.equal(rank0["model.layers.0.mlp.w13"], rank1["model.layers.0.mlp.w13"])
    # Replicated weights agree, so every rank routes each token to the same experts.
    router = "model.layers.0.mlp.gate.weight"
    assert torch.equal(rank0[router], rank1[router])


def test_unknown_load_format_is_rejected(tmp_path: Path) -> None:
    folder = config_only_folder(tmp_path, "LlamaForCausalLM")
    with pytest.raises(ValueError, match="load_format"):
        create_model(folder, ModelConfig.from_folder(folder), torch.device("cpu"), torch.float32,
                     load_format="npz")


def test_llm_generates_from_a_config_only_folder(tmp_path: Path) -> None:
    folder = config_only_folder(tmp_path, "Qwen3MoeForCausalLM")
    with LLM(folder, load_format="dummy", device="cpu") as llm:
        out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out) == 1 and len(out[0].token_ids) == 4
    assert all(0 <= t < 512 for t in out[0].token_ids)
