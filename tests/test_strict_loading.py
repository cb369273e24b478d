"""Strict checkpoint loading: every checkpoint tensor is used or known to be unneeded; any
other fails the load naming it (a dropped bias would otherwise change outputs silently)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from minisgl_backend.models import ModelConfig, create_model
from minisgl_backend.testing.tiny_models import build_tiny_model


def load(folder: Path) -> torch.nn.Module:
    return create_model(folder, ModelConfig.from_folder(folder), torch.device("cpu"),
                        torch.float32)


def edit_checkpoint(folder: Path, add: dict[str, torch.Tensor] | None = None,
                    drop: tuple[str, ...] = ()) -> None:
    path = folder / "model.safetensors"
    tensors = {k: v for k, v in load_file(path).items() if k not in drop}
    save_file({**tensors, **(add or {})}, path, metadata={"format": "pt"})


def edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.fixture
def llama(tmp_path: Path) -> Path:
    return build_tiny_model("llama", tmp_path / "llama")


def test_an_unknown_tensor_fails_the_load_naming_it(llama: Path) -> None:
    edit_checkpoint(llama, add={"model.layers.1.self_attn.gate_bias": torch.zeros(4)})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.gate_bias"):
        load(llama)


def test_biases_the_config_does_not_declare_fail_the_load(tmp_path: Path) -> None:
    """The bug this guards against: attention_bias dropped from the config, biases ignored."""
    folder = build_tiny_model("llama_bias", tmp_path / "bias")
    edit_config(folder, attention_bias=False)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj\.bias"):
        load(folder)


def test_a_missing_tensor_fails_the_load_naming_it(tmp_path: Path) -> None:
    folder = build_tiny_model("llama_bias", tmp_path / "bias")
    edit_checkpoint(folder, drop=("model.layers.1.self_attn.o_proj.bias",))
    with pytest.raises(KeyError, match=r"model\.layers\.1\.self_attn\.o_proj\.bias"):
        load(folder)


def test_known_unused_tensors_load(llama: Path) -> None:
    """Rotary inv_freq buffers of old checkpoints, and a tied LM head saved anyway."""
    embed = load_file(llama / "model.safetensors")["model.embed_tokens.weight"]
    edit_checkpoint(llama, add={"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    edit_config(llama, tie_word_embeddings=True)
    model = load(llama)
    assert torch.equal(model.lm_head.weight, embed)


def test_attention_biases_are_loaded_on_q_k_v_and_o(tmp_path: Path) -> None:
    folder = build_tiny_model("llama_bias", tmp_path / "bias")
    ckpt = load_file(folder / "model.safetensors")
    attn = load(folder).model.layers[0].self_attn
    prefix = "model.layers.0.self_attn"
    expected = torch.cat([ckpt[f"{prefix}.{p}_proj.bias"] for p in "qkv"])
    assert torch.equal(attn.qkv_proj.bias, expected)
    assert torch.equal(attn.o_proj.bias, ckpt[f"{prefix}.o_proj.bias"])
    assert attn.o_proj.bias.abs().sum() > 0
