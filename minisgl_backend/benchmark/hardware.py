"""The batch-1 decode roofline: measured copy bandwidth over the weight bytes a step must read.

A decode step at batch 1 reads every weight of its rank once, so it cannot take less than
`weight bytes / memory bandwidth`; the copy bandwidth (bytes read + written by a large
device-to-device copy) is the practical bandwidth a kernel can reach.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from minisgl_backend.distributed import get_tp_info, set_tp_info
from minisgl_backend.models.config import ModelConfig


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes per second (read + written) of copying `nbytes` on `device`; median of `repeats`."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)  # touched: no lazy zero pages
    dst = torch.empty_like(src)
    for _ in range(2):  # warm up (allocation, clocks, page faults)
        dst.copy_(src)
    seconds = [_time_copy(dst, src) for _ in range(repeats)]
    return 2 * nbytes / statistics.median(seconds)


def _time_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    if dst.device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    start_s = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - start_s


@dataclass(frozen=True)
class WeightBytes:
    """Parameter bytes of one tensor-parallel rank, by what a decode step reads of them."""

    total: int  # every parameter (a tied LM head is a separate copy in the engine)
    embedding: int  # the input embedding table: a step reads only its batch's rows
    experts: int  # MoE expert weights: a step reads only the experts its tokens are routed to
    num_experts: int = 0
    top_k: int = 0

    def per_decode_step(self, batch_size: int = 1) -> float:
        """Bytes a decode step of `batch_size` must read at least: all but the embedding table
        (so the LM head counts once), experts scaled by the expected share that any token of
        the batch is routed to (uniform routing)."""
        dense = self.total - self.embedding - self.experts
        if not self.num_experts:
            return float(dense)
        touched = 1.0 - (1.0 - self.top_k / self.num_experts) ** batch_size
        return dense + self.experts * touched


def weight_bytes(config: ModelConfig, dtype: torch.dtype, tp_size: int = 1,
                 projection_dtype: torch.dtype | None = None) -> WeightBytes:
    """Count rank 0's parameters by building the model on the meta device (exact shapes).
    With `projection_dtype` (FP8), the dense projections (`*_proj.weight`) are stored in it
    with a float32 scale per output channel; embeddings, the LM head, norms, the router and
    the experts stay in `dtype`."""
    from minisgl_backend.models.decoder import CausalLM

    saved = get_tp_info()
    set_tp_info(0, tp_size)
    try:
        with torch.device("meta"):
            model = CausalLM(config)
    finally:
        set_tp_info(saved.rank, saved.size)
    itemsize = torch.empty((), dtype=dtype).element_size()
    total = embedding = experts = 0
    for name, param in model.named_parameters():
        size = param.numel() * itemsize
        if projection_dtype is not None and name.endswith("_proj.weight"):
            size = param.numel() * projection_dtype.itemsize + param.shape[0] * 4
        total += size
        if name == "model.embed_tokens.weight":
            embedding += size
        elif name.endswith((".mlp.w13", ".mlp.w2")):
            experts += size
    return WeightBytes(total, embedding, experts, config.num_experts, config.num_experts_per_tok)


@dataclass(frozen=True)
class Roofline:
    bandwidth: float  # bytes/s, measured
    weights: WeightBytes

    @property
    def tokens_per_s(self) -> float:
        """Batch-1 decode tokens/s if a step took exactly its weight-read time."""
        return self.bandwidth / self.weights.per_decode_step(1)


def measure_roofline(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                     tp_size: int = 1, copy_mib: int | None = None) -> Roofline:
    """The batch-1 roofline of `config` on `device`: its copy bandwidth (a `copy_mib` probe,
    default 1 GiB on GPU and 64 MiB on CPU, whose memory is given back) over the weight bytes
    a step reads."""
    bandwidth = measure_copy_bandwidth(
        device, (copy_mib or (1024 if device.type == "cuda" else 64)) << 20)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # give the probe's memory back before an engine sizes KV
    return Roofline(bandwidth, weight_bytes(config, dtype, tp_size))
