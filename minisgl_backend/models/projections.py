"""The projections of a decoder layer as checkpoints name them, and each rank's slice of them.

An engine projection merges HF modules (q/k/v, gate/up) into one GEMM; tensor parallelism gives
each rank a slice of every part: output rows of the column-parallel ones, input columns of the
row-parallel ones. The weight loader, FP8 quantization and LoRA all slice by these.
"""

from __future__ import annotations

from minisgl_backend.distributed import get_tp_info
from minisgl_backend.models.config import ModelConfig


def rank_split(size: int) -> tuple[int, int]:
    """This rank's [start, stop) of a dimension split evenly over the ranks."""
    tp = get_tp_info()
    shard = size // tp.size
    return tp.rank * shard, (tp.rank + 1) * shard


def kv_head_range(config: ModelConfig) -> tuple[int, int]:
    tp = get_tp_info()
    if config.num_kv_heads >= tp.size:
        per_rank = config.num_kv_heads // tp.size
        return tp.rank * per_rank, (tp.rank + 1) * per_rank
    head = tp.rank * config.num_kv_heads // tp.size  # replicated KV head
    return head, head + 1


# Engine projection -> the HF modules it is made of, in the order the engine concatenates them
# (checkpoints may also store q/k/v or gate/up fused, under the projection's own name).
PROJECTION_MODULES: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}
ROW_PARALLEL_PROJECTIONS = ("self_attn.o_proj", "mlp.down_proj")
# HF module -> the block of the layer that holds it ("self_attn" or "mlp").
MODULE_BLOCK: dict[str, str] = {module: name.split(".")[0]
                                for name, modules in PROJECTION_MODULES.items()
                                for module in modules}


def rank_parts(config: ModelConfig, projection: str) -> list[tuple[str, int, int]]:
    """This rank's slice of each HF module of an engine projection: (module, first, after)
    output rows of a column-parallel part, input columns of a row-parallel layer."""
    hd = config.head_dim
    if projection == "self_attn.qkv_proj":
        (q0, q1), (k0, k1) = rank_split(config.num_heads), kv_head_range(config)
        return [("q_proj", q0 * hd, q1 * hd), ("k_proj", k0 * hd, k1 * hd),
                ("v_proj", k0 * hd, k1 * hd)]
    if projection == "mlp.gate_up_proj":
        start, stop = rank_split(config.intermediate_size)
        return [("gate_proj", start, stop), ("up_proj", start, stop)]
    full_in = config.num_heads * hd if projection == "self_attn.o_proj" \
        else config.intermediate_size
    return [(PROJECTION_MODULES[projection][0], *rank_split(full_in))]
