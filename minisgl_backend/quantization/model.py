"""Turn a model built on the meta device into its FP8 form before its weights are loaded.

The projections of attention and of dense MLPs (q/k/v, o, gate/up, down) become FP8 unless the
checkpoint's ignore list names them; embeddings, the LM head, norms and the MoE router stay in
the model's dtype. A merged projection is FP8 only as a whole: a checkpoint that quantizes some
of its parts and not others fails naming them.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from minisgl_backend.distributed import get_tp_info
from minisgl_backend.layers.linear import (MergedColumnParallelLinear, ParallelLinear,
                                           QKVParallelLinear, RowParallelLinear)
from minisgl_backend.models.projections import PROJECTION_MODULES
from minisgl_backend.quantization.config import QuantScheme
from minisgl_backend.quantization.fp8 import quantize_blocks, quantize_per_channel

logger = logging.getLogger(__name__)



def quantize_model(model: nn.Module, scheme: QuantScheme) -> None:
    """Make every projection `scheme` quantizes FP8 (weights still on the meta device)."""
    tp = get_tp_info().size
    count = 0
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}"
        if _experts_quantized(model.config, scheme, layer, prefix):
            raise ValueError(f"the checkpoint's FP8 experts of {prefix}.mlp are not supported: "
                             "FP8 MoE experts are not implemented (list them in the "
                             "quantization config's ignore list to keep them unquantized)")
        for name, modules in PROJECTION_MODULES.items():
            linear = layer.projection(name)
            if linear is None:
                continue  # an MoE layer's experts
            parent, fused = name.split(".")
            # The checkpoint's modules, stored apart or fused under the projection's name.
            flags = {f"{prefix}.{parent}.{part}": scheme.quantizes(f"{prefix}.{parent}.{part}")
                     for part in {*modules, fused}}
            if not any(flags.values()):
                continue
            if not all(flags.values()):
                raise ValueError(f"{parent}: the checkpoint quantizes "
                                 f"{sorted(k for k, v in flags.items() if v)} but not "
                                 f"{sorted(k for k, v in flags.items() if not v)}; the engine "
                                 "computes them in one GEMM")
            if scheme.block:
                _check_blocks(linear, f"{prefix}.{name}", scheme.block, tp)
            linear.to_fp8(scheme.block, scheme.static_inputs)
            count += 1
        if any(getattr(layer.projection(n), "fp8", False) for n in PROJECTION_MODULES):
            # The fused few-rows GEMVs read bf16 weights; FP8 layers take fp8_linear's own.
            layer.fused_gemv_fits = False
    logger.info("%s: %d projections in FP8", scheme.describe(), count)


def _experts_quantized(config: object, scheme: QuantScheme, layer: nn.Module,
                       prefix: str) -> bool:
    if scheme.online or isinstance(getattr(layer.mlp, "gate_up_proj", None), ParallelLinear):
        return False  # online FP8 leaves experts in the model's dtype
    return scheme.quantizes(f"{prefix}.mlp.experts.0.{config.spec.expert_names[0]}")


def _part_rows(linear: ParallelLinear) -> list[int]:
    if isinstance(linear, QKVParallelLinear):
        return [linear.q_size, linear.kv_size, linear.kv_size]
    if isinstance(linear, MergedColumnParallelLinear):
        return list(linear.local_sizes)
    return [linear.weight.shape[0]]


def _check_blocks(linear: ParallelLinear, name: str, block: tuple[int, int], tp: int) -> None:
    """Block scales split with their weights only at whole blocks: every part's rows (and,
    split over ranks, the row-parallel inputs) must fill whole blocks."""
    rows = _part_rows(linear)
    ragged = [r for i, r in enumerate(rows) if r % block[0] and (tp > 1 or i < len(rows) - 1)]
    if ragged:
        raise ValueError(f"{name}: weight_block_size {list(block)} does not divide the rows "
                         f"of its parts on each rank ({rows})")
    in_features = linear.weight.shape[1]
    if tp > 1 and isinstance(linear, RowParallelLinear) and in_features % block[1]:
        raise ValueError(f"{name}: weight_block_size {list(block)} does not divide its "
                         f"{in_features} input columns on each of {tp} ranks")


def quantize_weight(linear: ParallelLinear, weight: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """A full-precision weight in `linear`'s FP8 layout: (e4m3 values, scale)."""
    if linear.block is not None:
        return quantize_blocks(weight, linear.block)
    return quantize_per_channel(weight)


def fp8_projections(model: nn.Module) -> dict[str, ParallelLinear]:
    """Name -> layer of every FP8 projection of `model`."""
    return {name: module for name, module in model.named_modules()
            if isinstance(module, ParallelLinear) and module.fp8}
