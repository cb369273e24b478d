"""FP8 checkpoints of every published layout, and online FP8, equal their HF oracle token for
token (float32 on CPU, the oracle patched to quantize as the format says: tests/fp8_checkpoints.py).

Each format runs on two architectures: a Llama with page size 1, chunked prefill and prefix-cache
hits, and a Qwen3 (q/k norms) with page size 16 and tensor parallelism 2; with the FP8 KV cache
on (the checkpoint's KV scales where it has them); online FP8 also under speculative decoding.
Bad or unsupported quantization configs fail naming the field.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from minisgl_backend import LLM, SamplingParams
from minisgl_backend.models import ModelConfig, create_model
from minisgl_backend.testing.tiny_models import build_tiny_model
from tests.conftest import CHECKED, mixed_prompts
from tests.fp8_checkpoints import (FORMATS, KV_SCALES, fp8_oracle, greedy,
                                   write_fp8_checkpoint)

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
RUNS = {  # architecture -> engine settings
    "llama": dict(page_size=1, chunked_prefill_size=16),
    "qwen3": dict(page_size=16, tp_size=2),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8-sources")
    return {arch: build_tiny_model(arch, root / arch, seed=3) for arch in (*RUNS, "qwen3_moe")}


def check(model: Path, expected: list[list[int]], prompts: list[list[int]],
          **settings) -> None:  # noqa: ANN003
    """One call cold, the same call again warm (prefix-cache hits): both equal `expected`."""
    with LLM(model, device="cpu", hooks=CHECKED, **settings) as llm:
        cold = llm.generate(prompts, GREEDY)
        warm = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in cold] == expected
    assert [o.token_ids for o in warm] == expected
    assert sum(o.cached_tokens for o in warm) > 0


@pytest.mark.parametrize("arch", list(RUNS))
@pytest.mark.parametrize("name", list(FORMATS))
def test_fp8_checkpoint_equals_its_oracle(sources: dict[str, Path], tmp_path: Path,
                                          name: str, arch: str) -> None:
    prompts = mixed_prompts(6)
    checkpoint = write_fp8_checkpoint(sources[arch], tmp_path / name, name, prompts)
    oracle = fp8_oracle(sources[arch], name, checkpoint, RUNS[arch].get("tp_size", 1))
    expected = greedy(oracle, prompts, MAX_TOKENS)
    check(checkpoint, expected, prompts, **RUNS[arch])


@pytest.mark.parametrize("arch", [*RUNS, "qwen3_moe"])
def test_online_fp8_equals_its_oracle(sources: dict[str, Path], arch: str) -> None:
    """Online FP8 quantizes every projection; an MoE model's experts stay in its dtype (the
    oracle quantizes the `nn.Linear` projections only, which HF's experts are not)."""
    prompts = mixed_prompts(6)
    settings = RUNS.get(arch, {"page_size": 16})
    oracle = fp8_oracle(sources[arch], "online", tp_size=settings.get("tp_size", 1))
    expected = greedy(oracle, prompts, MAX_TOKENS)
    check(sources[arch], expected, prompts, quantization="fp8", **settings)


@pytest.mark.parametrize("name, arch", [("fp8_tensor_static", "llama"),
                                        ("compressed_channel", "qwen3"), ("modelopt", "llama"),
                                        ("fp8_block", "qwen3"), ("online", "llama")])
def test_fp8_weights_with_fp8_kv_cache(sources: dict[str, Path], tmp_path: Path, name: str,
                                       arch: str) -> None:
    """Weights and KV cache in FP8: the checkpoint's KV scales where it has them, else 1.0."""
    prompts = mixed_prompts(6)
    tp_size = RUNS[arch].get("tp_size", 1)
    if name == "online":
        checkpoint, kv_scales, settings = sources[arch], (1.0, 1.0), {"quantization": "fp8"}
        oracle = fp8_oracle(sources[arch], name, tp_size=tp_size, kv_scales=kv_scales)
    else:
        checkpoint = write_fp8_checkpoint(sources[arch], tmp_path / name, name, prompts)
        kv_scales = KV_SCALES if FORMATS[name].kv_scale_names else (1.0, 1.0)
        oracle = fp8_oracle(sources[arch], name, checkpoint, tp_size, kv_scales)
        settings = {}
    check(checkpoint, greedy(oracle, prompts, MAX_TOKENS), prompts, kv_cache_dtype="fp8_e4m3",
          **settings, **RUNS[arch])


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_online_fp8_with_speculative_decoding(sources: dict[str, Path],
                                              kv_cache_dtype: str) -> None:
    # Repetitive prompts give the n-gram drafter something to propose.
    prompts = [list(range(5, 15)) * 4, [7, 8, 9] * 10, mixed_prompts(1)[0]]
    kv_scales = (1.0, 1.0) if kv_cache_dtype != "auto" else None
    oracle = fp8_oracle(sources["llama"], "online", kv_scales=kv_scales)
    check(sources["llama"], greedy(oracle, prompts, MAX_TOKENS), prompts, quantization="fp8",
          speculative="ngram", kv_cache_dtype=kv_cache_dtype)


def test_online_fp8_layers_and_bytes(sources: dict[str, Path]) -> None:
    """Online FP8 makes every projection e4m3 (a byte per weight) and leaves the embeddings,
    the head and the norms in the model's dtype."""
    folder = sources["qwen3"]
    model = create_model(folder, ModelConfig.from_folder(folder), torch.device("cpu"),
                         torch.float32, quantization="fp8")
    for name, param in model.named_parameters():
        proj = name.rsplit(".", 2)[-2] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        if proj and name.endswith(".weight"):
            assert param.dtype == torch.float8_e4m3fn, name
        elif proj and name.endswith(".weight_scale"):
            assert param.dtype == torch.float32 and param.shape[1] == 1, name
        else:
            assert param.dtype == torch.float32, name
    assert model.quant_scheme.online


def _with_config(src: Path, dst: Path, quantization_config: object) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


BLOCK_CONFIG = FORMATS["fp8_block"].config
CT = FORMATS["compressed_channel"].config
CT_GROUP = CT["config_groups"]["group_0"]


@pytest.mark.parametrize("config, field", [
    ({"quant_method": "awq", "bits": 4}, "quantization_config.quant_method"),
    ({**BLOCK_CONFIG, "fmt": "e5m2"}, "quantization_config.fmt"),
    ({**BLOCK_CONFIG, "activation_scheme": "static"}, "quantization_config.activation_scheme"),
    ({**BLOCK_CONFIG, "weight_block_size": [128]}, "quantization_config.weight_block_size"),
    ({**CT, "format": "pack-quantized"}, "quantization_config.format"),
    ({**CT, "config_groups": {"group_0": {**CT_GROUP, "weights": {
        **CT_GROUP["weights"], "num_bits": 4, "type": "int"}}}},
     "quantization_config.config_groups.group_0.weights"),
    ({**CT, "config_groups": {"group_0": {**CT_GROUP, "input_activations": None}}},
     "quantization_config.config_groups.group_0.input_activations"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quantization_config.quant_algo"),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "INT8"},
     "quantization_config.kv_cache_quant_algo"),
])
def test_unsupported_quantization_configs_fail_naming_the_field(
        sources: dict[str, Path], tmp_path: Path, config: dict, field: str) -> None:
    folder = _with_config(sources["llama"], tmp_path / "model", config)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        create_model(folder, ModelConfig.from_folder(folder), torch.device("cpu"),
                     torch.float32)


def test_missing_or_wrongly_typed_fp8_tensors_fail_the_load(sources: dict[str, Path],
                                                           tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    prompts = mixed_prompts(2)
    folder = write_fp8_checkpoint(sources["llama"], tmp_path / "ckpt", "fp8_block", prompts)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    scale = tensors.pop("model.layers.0.self_attn.k_proj.weight_scale_inv")
    save_file(tensors, str(path))
    with pytest.raises(KeyError, match="k_proj.weight_scale_inv"):
        create_model(folder, ModelConfig.from_folder(folder), torch.device("cpu"),
                     torch.float32)
    tensors["model.layers.0.self_attn.k_proj.weight_scale_inv"] = scale
    tensors["model.layers.0.mlp.up_proj.weight"] = \
        tensors["model.layers.0.mlp.up_proj.weight"].float()
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match="differ in dtype.*up_proj.weight.: torch.float32"):
        create_model(folder, ModelConfig.from_folder(folder), torch.device("cpu"),
                     torch.float32)
