"""Random weights for a model built on the meta device (`load_format="dummy"`).

Benchmarks of real shapes need no checkpoint: every parameter is allocated on the target
device and dtype and filled there (no CPU round trip). The values keep activations finite in
half precision through many layers, like HF's initialization: normal(0, 0.02) matrices, unit
norm scales, small uniform biases.

FP8 layers draw full-precision values and quantize them in the layer's layout; static input
scales are 1.0 (random activations stay far inside e4m3's range).

Sharded parameters are drawn from a rank-dependent seed (each rank fills only its own shard);
replicated ones (norms, the MoE router) from a rank-independent one, so that every rank routes
tokens to the same experts.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl_backend.distributed import get_tp_info
from minisgl_backend.layers.linear import ParallelLinear, ReplicatedLinear
from minisgl_backend.layers.norm import RMSNorm

MATRIX_STD = 0.02
BIAS_BOUND = 0.02


def fill_dummy_weights(
    model: nn.Module, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> None:
    """Replace every (meta) parameter of `model` with seeded random values on `device`."""
    rank = get_tp_info().rank
    shared = torch.Generator(device=device).manual_seed(seed)
    sharded = torch.Generator(device=device).manual_seed(seed + 1 + rank)
    for module in model.modules():
        if isinstance(module, ParallelLinear) and module.fp8:
            _fill_fp8(module, device, dtype, sharded)
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            tensor = torch.empty(param.shape, device=device, dtype=dtype)
            if isinstance(module, RMSNorm):
                tensor.fill_(0.0 if module.gemma else 1.0)  # a unit scale either way
            elif name == "bias":
                tensor.uniform_(-BIAS_BOUND, BIAS_BOUND, generator=sharded)
            else:
                gen = shared if isinstance(module, ReplicatedLinear) else sharded
                tensor.normal_(0.0, MATRIX_STD, generator=gen)
            setattr(module, name, nn.Parameter(tensor, requires_grad=False))
    config = getattr(model, "config", None)
    if config is not None and config.tie_word_embeddings:
        # A tied checkpoint gives the LM head the embedding's values (see `WeightLoader._vocab`).
        model.lm_head.weight.data.copy_(model.model.embed_tokens.weight)


def _fill_fp8(layer: ParallelLinear, device: torch.device, dtype: torch.dtype,
              generator: torch.Generator) -> None:
    from minisgl_backend.quantization.model import quantize_weight

    weight = torch.empty(layer.weight.shape, device=device, dtype=dtype)
    weight.normal_(0.0, MATRIX_STD, generator=generator)
    values, scale = quantize_weight(layer, weight)
    layer.weight = nn.Parameter(values, requires_grad=False)
    layer.weight_scale = nn.Parameter(scale, requires_grad=False)
    if layer.input_scale is not None:
        layer.input_scale = nn.Parameter(torch.ones(1, device=device), requires_grad=False)
    bias = getattr(layer, "bias", None)
    if bias is not None:
        layer.bias = nn.Parameter(torch.empty(bias.shape, device=device, dtype=dtype).uniform_(
            -BIAS_BOUND, BIAS_BOUND, generator=generator), requires_grad=False)
