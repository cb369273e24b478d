"""LoRA weights in an engine process.

Each projection some adapter targets holds `max_loras` slots (`LoraStack`): A [slots, parts * R,
K] and B [slots, N, parts * R], R = `max_lora_rank`. A merged projection (q/k/v, gate/up) keeps
each part's A in its own R rows and each part's B in its own R columns (zeros elsewhere), so one
pair of GEMMs serves all parts; a smaller rank is zero-padded. Zeros add nothing, so the delta is
exactly each part's `B @ (A @ x)`. B carries the adapter's scale (alpha / r, rsLoRA alpha /
sqrt(r)). Tensor parallelism splits like the base weights: B by output rows in column-parallel
layers, A by input columns in row-parallel ones (their partial deltas are summed with the
layer's output by its all-reduce).

An adapter is read once, this rank's slices only, and kept on the host (those named at startup
then, the others when a step first loads them); `load(slot, adapter)` copies one into a slot
(the scheduler picks slots and says when: `scheduler/lora.py`).
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn

from minisgl_backend.lora.config import AdapterConfig
from minisgl_backend.lora.ops import LoraStack
from minisgl_backend.models.config import ModelConfig
from minisgl_backend.models.projections import (PROJECTION_MODULES, ROW_PARALLEL_PROJECTIONS,
                                                rank_parts)
from minisgl_backend.models.weights import CheckpointReader

PEFT_PREFIX = "base_model.model."


class LoraSet:
    """The adapters of one engine process: host copies of the adapters read so far (by id,
    from 1), device slots on every projection of the model."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.config: ModelConfig = model.config
        self.max_rank = max_rank
        self.dtype = dtype
        self.stacks: dict[tuple[int, str], LoraStack] = {}
        for i, layer in enumerate(model.model.layers):
            for name, parts in PROJECTION_MODULES.items():
                linear = layer.projection(name)
                if linear is None:
                    continue  # an MoE layer's experts: not adaptable
                n, k = linear.weight.shape
                stack = LoraStack(
                    torch.zeros(max_loras, len(parts) * max_rank, k, device=device, dtype=dtype),
                    torch.zeros(max_loras, n, len(parts) * max_rank, device=device, dtype=dtype))
                linear.lora = stack
                self.stacks[(i, name)] = stack
        self.host: dict[int, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]] = {}

    def read(self, adapter_id: int, adapter: AdapterConfig) -> None:
        """Keep this rank's slices of `adapter` on the host as `adapter_id`."""
        self.host[adapter_id] = self._read(adapter, self.dtype)

    def drop(self, adapter_id: int) -> None:
        self.host.pop(adapter_id, None)

    def load(self, slot: int, adapter_id: int) -> None:
        """Copy adapter `adapter_id` (read before) into `slot` of every stack."""
        weights = self.host[adapter_id]
        for key, stack in self.stacks.items():
            a, b = weights.get(key, (None, None))
            if a is None:
                stack.a[slot].zero_()
                stack.b[slot].zero_()
            else:
                stack.a[slot].copy_(a, non_blocking=True)
                stack.b[slot].copy_(b, non_blocking=True)

    def _read(self, adapter: AdapterConfig, dtype: torch.dtype
              ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        files = sorted(Path(adapter.folder).glob("*.safetensors"))
        if [f.name for f in files] != ["adapter_model.safetensors"]:
            raise ValueError(f"LoRA adapter {adapter.name!r}: {str(adapter.folder)!r} must hold "
                             "adapter_model.safetensors (and no other safetensors file)")
        out = {}
        with ExitStack() as stack:
            reader = CheckpointReader(Path(adapter.folder), stack, torch.device("cpu"))
            for (layer, name), lora_stack in self.stacks.items():
                split = "row" if name in ROW_PARALLEL_PROJECTIONS else "column"
                a = torch.zeros(lora_stack.a.shape[1:], dtype=torch.float32)
                b = torch.zeros(lora_stack.b.shape[1:], dtype=torch.float32)
                found = False
                rows = 0
                for p, (part, start, stop) in enumerate(rank_parts(self.config, name)):
                    module = f"{PEFT_PREFIX}model.layers.{layer}.{name.split('.')[0]}.{part}"
                    if part in adapter.targets:
                        a_part, b_part = self._pair(reader, adapter, module, split, start, stop)
                        if a_part.shape[1] != a.shape[1] or b_part.shape[0] != (
                                stop - start if split == "column" else b.shape[0]):
                            raise ValueError(
                                f"LoRA adapter {adapter.name!r}: {module} has A "
                                f"{tuple(a_part.shape)} and B {tuple(b_part.shape)} (this "
                                "rank's part), which do not fit the base model's layer")
                        r = adapter.rank
                        a[p * self.max_rank: p * self.max_rank + r] = a_part
                        b[rows: rows + b_part.shape[0], p * self.max_rank:
                          p * self.max_rank + r] = b_part * adapter.scale
                        found = True
                    rows += stop - start if split == "column" else 0
                if found:
                    out[(layer, name)] = (a.to(dtype), b.to(dtype))
            unread = sorted(set(reader.names()) - reader.read)
        if unread:
            raise ValueError(f"LoRA adapter {adapter.name!r}: tensors the engine cannot apply "
                             f"to the {self.config.architecture} model: {', '.join(unread[:4])}")
        return out

    def _pair(self, reader: CheckpointReader, adapter: AdapterConfig, module: str, split: str,
              start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        a_name, b_name = f"{module}.lora_A.weight", f"{module}.lora_B.weight"
        for tensor in (a_name, b_name):
            if tensor not in reader:
                raise ValueError(f"LoRA adapter {adapter.name!r} targets {module} but has no "
                                 f"{tensor}")
        if split == "column":
            a, b = reader.rows(a_name), reader.rows(b_name, start, stop)
        else:
            a, b = reader.cols(a_name, start, stop), reader.rows(b_name)
        if a.shape[0] != adapter.rank or b.shape[1] != adapter.rank:
            raise ValueError(f"LoRA adapter {adapter.name!r}: {module} has rank "
                             f"{a.shape[0]}/{b.shape[1]}, its config says r = {adapter.rank}")
        return a.float(), b.float()


