"""Load a HF safetensors checkpoint into a model built on the meta device.

Each parameter of the model is filled straight from the checkpoint files onto the target device,
reading only this rank's slice: q/k/v and gate/up are merged, column-parallel weights are split
by output rows, row-parallel ones by input columns, embeddings by vocabulary rows (padded), and
the MoE experts are stacked into `w13` / `w2`.
"""

from __future__ import annotations

import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from minisgl_backend.distributed import get_tp_info
from minisgl_backend.layers.embedding import vocab_shard
from minisgl_backend.models.config import ModelConfig


class CheckpointReader:
    """Name -> lazily sliced tensor over one or many `*.safetensors` files."""

    def __init__(self, model_dir: Path, stack: ExitStack, device: torch.device) -> None:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {str(model_dir)!r}")
        self._handles: dict[str, Any] = {}
        for file in files:
            handle = stack.enter_context(safe_open(str(file), framework="pt", device=str(device)))
            for name in handle.keys():
                self._handles[name] = handle

    def __contains__(self, name: str) -> bool:
        return name in self._handles

    def rows(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows [start, stop) of a tensor (all of it by default)."""
        if name not in self._handles:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        part = self._handles[name].get_slice(name)
        return part[start:stop] if stop is not None else part[start:]

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._handles[name].get_slice(name)[:, start:stop]


def _split(size: int) -> tuple[int, int]:
    """This rank's [start, stop) of a dimension split evenly over the ranks."""
    tp = get_tp_info()
    shard = size // tp.size
    return tp.rank * shard, (tp.rank + 1) * shard


def _kv_head_range(config: ModelConfig) -> tuple[int, int]:
    tp = get_tp_info()
    if config.num_kv_heads >= tp.size:
        per_rank = config.num_kv_heads // tp.size
        return tp.rank * per_rank, (tp.rank + 1) * per_rank
    head = tp.rank * config.num_kv_heads // tp.size  # replicated KV head
    return head, head + 1


class WeightLoader:
    """Builds each local parameter tensor from its checkpoint name(s)."""

    def __init__(self, config: ModelConfig, reader: CheckpointReader) -> None:
        self.config = config
        self.reader = reader
        self.rules: list[tuple[re.Pattern[str], Callable[[re.Match[str]], torch.Tensor]]] = [
            (re.compile(r"(.*)\.qkv_proj\.(weight|bias)$"), self._qkv),
            (re.compile(r"(.*)\.gate_up_proj\.weight$"), self._gate_up),
            (re.compile(r"(.*)\.(o_proj|down_proj)\.weight$"), self._row_parallel),
            (re.compile(r"(.*)\.w13$"), self._experts_w13),
            (re.compile(r"(.*)\.w2$"), self._experts_w2),
            (re.compile(r"^model\.embed_tokens\.weight$"), self._vocab),
            (re.compile(r"^lm_head\.weight$"), self._vocab),
        ]

    def load(self, name: str) -> torch.Tensor:
        for pattern, build in self.rules:
            match = pattern.match(name)
            if match:
                return build(match)
        return self.reader.rows(name)  # replicated: norms, the MoE router

    def _qkv(self, m: re.Match[str]) -> torch.Tensor:
        prefix, kind = m.group(1), m.group(2)
        c, hd = self.config, self.config.head_dim
        q0, q1 = _split(c.num_heads)
        k0, k1 = _kv_head_range(c)
        q = self.reader.rows(f"{prefix}.q_proj.{kind}", q0 * hd, q1 * hd)
        k = self.reader.rows(f"{prefix}.k_proj.{kind}", k0 * hd, k1 * hd)
        v = self.reader.rows(f"{prefix}.v_proj.{kind}", k0 * hd, k1 * hd)
        return torch.cat([q, k, v])

    def _gate_up(self, m: re.Match[str]) -> torch.Tensor:
        prefix = m.group(1)
        start, stop = _split(self.config.intermediate_size)
        gate = self.reader.rows(f"{prefix}.gate_proj.weight", start, stop)
        up = self.reader.rows(f"{prefix}.up_proj.weight", start, stop)
        return torch.cat([gate, up])

    def _row_parallel(self, m: re.Match[str]) -> torch.Tensor:
        name = f"{m.group(1)}.{m.group(2)}.weight"
        full_in = (self.config.num_heads * self.config.head_dim if m.group(2) == "o_proj"
                   else self.config.intermediate_size)
        return self.reader.cols(name, *_split(full_in))

    def _experts_w13(self, m: re.Match[str]) -> torch.Tensor:
        start, stop = _split(self.config.moe_intermediate_size)
        experts = []
        for e in range(self.config.num_experts):
            base = f"{m.group(1)}.experts.{e}"
            gate = self.reader.rows(f"{base}.gate_proj.weight", start, stop)
            up = self.reader.rows(f"{base}.up_proj.weight", start, stop)
            experts.append(torch.cat([gate, up]))
        return torch.stack(experts)

    def _experts_w2(self, m: re.Match[str]) -> torch.Tensor:
        start, stop = _split(self.config.moe_intermediate_size)
        return torch.stack([
            self.reader.cols(f"{m.group(1)}.experts.{e}.down_proj.weight", start, stop)
            for e in range(self.config.num_experts)
        ])

    def _vocab(self, m: re.Match[str]) -> torch.Tensor:
        name = m.group(0)
        tied = self.config.tie_word_embeddings or name not in self.reader
        if name == "lm_head.weight" and tied:
            name = "model.embed_tokens.weight"
        start, shard = vocab_shard(self.config.vocab_size)
        rows = self.reader.rows(name, start, min(start + shard, self.config.vocab_size))
        if rows.shape[0] < shard:  # the last rank's slice runs past the vocabulary
            rows = torch.cat([rows, rows.new_zeros(shard - rows.shape[0], rows.shape[1])])
        return rows


def load_weights(
    model: torch.nn.Module, model_dir: str | Path, device: torch.device, dtype: torch.dtype
) -> None:
    """Replace every (meta) parameter of `model` with its checkpoint slice on `device`."""
    config: ModelConfig = model.config  # type: ignore[assignment]
    with ExitStack() as stack:
        loader = WeightLoader(config, CheckpointReader(Path(model_dir), stack, device))
        state = {}
        for name, param in model.state_dict().items():
            tensor = loader.load(name).to(device=device, dtype=dtype)
            if tensor.shape != param.shape:
                raise ValueError(
                    f"checkpoint tensor for {name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(param.shape)}"
                )
            state[name] = tensor
    model.load_state_dict(state, assign=True, strict=True)
