"""FP8 checkpoints written by the tests, in each published layout, and their HF oracle.

Written from the formats' published layouts (not from the engine's code): a float32 tiny model's
projection weights are quantized to e4m3 with scales per tensor, per output channel or per
block, static input scales come from a calibration pass (the largest input each layer saw,
over 448), and `quantization_config` says how. The oracle is HF transformers float32 with every
quantized weight replaced by its dequantized values and every quantized linear layer patched to
quantize its input the way the format says (dynamic per token, per token and column group, or
static), then dequantize it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = (16, 32)  # divides every tiny model's per-rank rows and columns at tp_size 2


@dataclass(frozen=True)
class Format:
    """One checkpoint layout: how weights and inputs are quantized and what config says so."""

    weights: str  # "tensor", "channel" or "block"
    inputs: str  # "token", "group" or "static"
    config: dict[str, Any]
    scale_name: str = "weight_scale"
    kv_scale_names: tuple[str, str] | None = None  # under self_attn: (k, v)
    ignore: tuple[str, ...] = ()  # modules left in float32
    extra_files: dict[str, Any] = field(default_factory=dict)


FORMATS: dict[str, Format] = {
    "fp8_block": Format(
        "block", "group", {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": list(BLOCK)}, scale_name="weight_scale_inv"),
    "fp8_tensor_static": Format(
        "tensor", "static", {"quant_method": "fp8", "activation_scheme": "static"},
        kv_scale_names=("k_scale", "v_scale")),
    "fp8_tensor_dynamic": Format(
        "tensor", "token", {"quant_method": "fp8", "activation_scheme": "dynamic",
                            "ignored_layers": ["model.layers.1.mlp.down_proj"]},
        ignore=("model.layers.1.mlp.down_proj",)),
    "compressed_channel": Format(
        "channel", "token", {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed",
            "ignore": ["lm_head", "re:.*layers\\.0\\.mlp\\..*"],
            "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                "dynamic": False, "symmetric": True},
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                            "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                      "symmetric": True, "dynamic": True}}}},
        kv_scale_names=("k_scale", "v_scale"),
        ignore=tuple(f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj"))),
    "compressed_tensor_static": Format(
        "tensor", "static", {
            "quant_method": "compressed-tensors", "format": "naive-quantized",
            "ignore": ["lm_head"], "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "tensor",
                            "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                      "symmetric": True, "dynamic": False}}}}),
    "compressed_block": Format(
        "block", "group", {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "ignore": ["lm_head"], "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                            "block_structure": list(BLOCK), "symmetric": True,
                            "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "group",
                                      "group_size": BLOCK[1], "symmetric": True,
                                      "dynamic": True}}}}),
    "modelopt": Format(
        "tensor", "static", {"quant_method": "modelopt", "quant_algo": "FP8",
                             "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]},
        kv_scale_names=("k_proj.k_scale", "v_proj.v_scale")),
}


def e4m3(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_weight(w: torch.Tensor, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, scale) of a weight [N, K]: one scale, one per row, or one per block."""
    if how == "tensor":
        scale = (w.abs().max() / E4M3_MAX).reshape(())
        return e4m3(w, scale), scale
    if how == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX
        return e4m3(w, scale), scale
    bn, bk = BLOCK
    n, k = w.shape
    scale = torch.empty(-(-n // bn), -(-k // bk))
    values = torch.empty(n, k, dtype=E4M3)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            scale[i, j] = tile.abs().max() / E4M3_MAX
            values[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = e4m3(tile, scale[i, j])
    return values, scale


def dequantize_weight(values: torch.Tensor, scale: torch.Tensor, how: str) -> torch.Tensor:
    if how != "block":
        return values.float() * scale
    bn, bk = BLOCK
    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    return values.float() * full[: values.shape[0], : values.shape[1]]


def quantize_input(x: torch.Tensor, how: str, scale: float | None = None,
                   group: int = BLOCK[1]) -> torch.Tensor:
    """x [..., K] quantized to e4m3 and back as a layer of the format does: "static" with
    `scale`, "token" with one scale per token, "group" with one per token and `group` columns."""
    if how == "static":
        return e4m3(x, scale).float() * scale
    if how == "token":
        s = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
        return e4m3(x, s).float() * s
    groups = x.unflatten(-1, (-1, group))
    s = groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    return (e4m3(groups, s).float() * s).flatten(-2)


def _hf(model_dir: Path, kv_scales: tuple[float, float] | None = None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    extra = {} if kv_scales is None else {"attn_implementation": kv_e4m3_attention(*kv_scales)}
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **extra).eval()


def through_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x stored in e4m3 with `scale` and read back."""
    return (e4m3(x.float(), scale).float() * scale).to(x.dtype)


def kv_e4m3_attention(k_scale: float, v_scale: float) -> str:
    """The name of an HF attention implementation (SDPA) that sees its key and value states
    (after RoPE and k-norm, the cached ones included) through an e4m3 KV cache with these
    scales, as an FP8 KV cache stores them; registered on first use."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = f"sdpa_kv_e4m3_{k_scale}_{v_scale}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

        def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      **kwargs: object) -> tuple[torch.Tensor, None]:
            return sdpa(module, query, through_e4m3(key, k_scale),
                        through_e4m3(value, v_scale), attention_mask, **kwargs)

        AttentionInterface.register(name, attention)
    return name


def _quantized_modules(model: torch.nn.Module, fmt: Format) -> dict[str, torch.nn.Linear]:
    return {name: module for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS
            and name not in fmt.ignore}


def calibrate(model_dir: Path, fmt: Format, prompts: list[list[int]]) -> dict[str, float]:
    """Static input scales: the largest input each quantized layer sees over `prompts`, / 448
    (q/k/v and gate/up read the same input, so they get the same scale)."""
    model = _hf(model_dir)
    amax: dict[str, float] = {}

    def hook(name: str):  # noqa: ANN202
        def record(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))
        return record

    for name, module in _quantized_modules(model, fmt).items():
        module.register_forward_pre_hook(hook(name))
    with torch.no_grad():
        for prompt in prompts:
            model(torch.tensor([prompt]))
    # Generated tokens may see larger inputs than the prompts: head room as calibration
    # tools leave.
    return {name: 1.5 * value / E4M3_MAX for name, value in amax.items()}


KV_SCALES = (0.5, 0.25)  # the k and v cache scales of the formats that carry them


def write_fp8_checkpoint(src: Path, dst: Path, name: str, prompts: list[list[int]],
                         kv_scales: tuple[float, float] = KV_SCALES) -> Path:
    """`src` (a float32 tiny model) written to `dst` in format `name`."""
    fmt = FORMATS[name]
    shutil.copytree(src, dst, dirs_exist_ok=True)
    for old in dst.glob("*.safetensors"):
        old.unlink()
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(file))
    input_scales = calibrate(src, fmt, prompts) if fmt.inputs == "static" else {}
    out: dict[str, torch.Tensor] = {}
    for tensor_name, tensor in tensors.items():
        module, _, kind = tensor_name.rpartition(".")
        if kind != "weight" or module.rsplit(".", 1)[-1] not in PROJECTIONS \
                or module in fmt.ignore:
            out[tensor_name] = tensor
            continue
        values, scale = quantize_weight(tensor.float(), fmt.weights)
        out[tensor_name] = values
        out[f"{module}.{fmt.scale_name}"] = scale.float().contiguous()
        if module in input_scales:
            out[f"{module}.input_scale"] = torch.tensor(input_scales[module])
    if fmt.kv_scale_names:
        layers = {n.split(".layers.")[1].split(".")[0] for n in tensors if ".layers." in n}
        for layer in layers:
            for scale_name, value in zip(fmt.kv_scale_names, kv_scales):
                out[f"model.layers.{layer}.self_attn.{scale_name}"] = torch.tensor(value)
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = fmt.config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def fp8_oracle(src: Path, name: str, checkpoint: Path | None = None,
               tp_size: int = 1, kv_scales: tuple[float, float] | None = None
               ) -> torch.nn.Module:
    """HF float32 on `src`'s weights as format `name` stores them, inputs quantized as it says.
    `name="online"`: per-channel weights, per-token inputs, every projection.

    With tensor parallelism a row-parallel layer (o_proj, down_proj) sees its input split by
    columns over the ranks, and each rank quantizes its part: per-token scales become
    per-token scales of each rank's columns. `kv_scales`: attention reads K and V through an
    e4m3 KV cache of these scales."""
    fmt = FORMATS.get(name) or Format("channel", "token", {})
    model = _hf(src, kv_scales)
    stored = load_file(checkpoint / "model.safetensors") if checkpoint else {}
    for module_name, module in _quantized_modules(model, fmt).items():
        if checkpoint is not None:
            values = stored[f"{module_name}.weight"]
            scale = stored[f"{module_name}.{fmt.scale_name}"]
        else:
            values, scale = quantize_weight(module.weight.detach().float(), fmt.weights)
        module.weight.data = dequantize_weight(values, scale, fmt.weights)
        input_scale = stored.get(f"{module_name}.input_scale")
        how, group = fmt.inputs, BLOCK[1]
        if how == "token" and tp_size > 1 and module_name.endswith(("o_proj", "down_proj")):
            how, group = "group", module.in_features // tp_size
        _quantize_inputs(module, how, None if input_scale is None else float(input_scale),
                         group)
    return model


def _quantize_inputs(module: torch.nn.Linear, how: str, scale: float | None,
                     group: int) -> None:
    def pre_hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]):  # noqa: ANN202
        return (quantize_input(args[0], how, scale, group),)

    module.register_forward_pre_hook(pre_hook)


def greedy(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs
