"""TensorRT-LLM's LoRA convention on the Triton model: `lora_task_id`, with `lora_weights` and
`lora_config` on the task's first request.

`lora_config` has one row per adapted module and layer: (module id, layer, adapter size);
`lora_weights` the matching rows: the module's A ([size, in_features], row-major) followed by
its B ([out_features, size], already multiplied by the adapter's scale), zero-padded to the
longest row. This is the layout TensorRT-LLM's `hf_lora_convert.py` writes from a PEFT adapter.
A task's adapter is written back as a PEFT folder (scale 1: B carries it) and served under the
name `trtllm-task-<id>`; later requests name the task alone.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.torch import save_file

from minisgl_backend.lora.config import projection_shapes
from minisgl_backend.models.config import ModelConfig
from minisgl_backend.models.projections import MODULE_BLOCK

# TensorRT-LLM's module ids (LoraManager.LORA_MODULE_IDS) of the modules the engine adapts.
MODULE_IDS = {1: "q_proj", 2: "k_proj", 3: "v_proj", 4: "o_proj", 5: "gate_proj",
              6: "down_proj", 7: "up_proj"}


def write_peft_adapter(weights: np.ndarray, config: np.ndarray, model: ModelConfig,
                       folder: Path) -> Path:
    """`lora_weights` [rows, size] and `lora_config` [rows, 3] (a leading batch dimension of 1
    allowed) as a PEFT folder; ValueError naming the input that does not fit `model`."""
    weights = weights.reshape(-1, weights.shape[-1]) if weights.ndim == 3 else weights
    config = config.reshape(-1, 3) if config.ndim == 3 else config
    if weights.ndim != 2 or config.ndim != 2 or config.shape[1] != 3:
        raise ValueError(f"lora_config must be [rows, 3] and lora_weights [rows, size], got "
                         f"{list(config.shape)} and {list(weights.shape)}")
    if len(weights) != len(config):
        raise ValueError(f"lora_weights has {len(weights)} rows, lora_config {len(config)}")
    shapes = projection_shapes(model)
    rank = int(config[:, 2].max()) if len(config) else 0
    tensors: dict[str, torch.Tensor] = {}
    for row, (module_id, layer, size) in zip(weights, config.tolist()):
        if module_id not in MODULE_IDS:
            raise ValueError(f"lora_config: module id {module_id} is not one the engine adapts "
                             f"({', '.join(f'{k}: {v}' for k, v in MODULE_IDS.items())})")
        if not 0 <= layer < model.num_layers or size < 1:
            raise ValueError(f"lora_config: row ({module_id}, {layer}, {size}) names no layer "
                             f"of the model's {model.num_layers} or no adapter size")
        module = MODULE_IDS[module_id]
        out_features, in_features = shapes[module]
        a_len, b_len = size * in_features, out_features * size
        if a_len + b_len > len(row):
            raise ValueError(f"lora_weights: the row of ({module_id}, {layer}, {size}) holds "
                             f"{len(row)} values, {a_len + b_len} needed")
        a = torch.zeros(rank, in_features)
        b = torch.zeros(out_features, rank)
        a[:size] = torch.from_numpy(row[:a_len].astype(np.float32).reshape(size, in_features))
        b[:, :size] = torch.from_numpy(row[a_len:a_len + b_len].astype(np.float32).reshape(
            out_features, size))
        prefix = f"base_model.model.model.layers.{layer}.{MODULE_BLOCK[module]}.{module}"
        tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
    if not tensors:
        raise ValueError("lora_config has no rows")
    folder.mkdir(parents=True, exist_ok=True)
    targets = sorted({name.split(".")[-3] for name in tensors})
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": targets,
         "bias": "none"}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


class TaskAdapters:
    """lora_task_id -> adapter name, the adapters written under `root` and loaded with
    `load(name, folder)` (`LLM.load_lora`)."""

    def __init__(self, root: Path, model: ModelConfig,
                 load: Callable[[str, Path], None]) -> None:
        self.root, self.model, self.load = root, model, load
        self.names: dict[int, str] = {}
        self._lock = threading.Lock()  # requests arrive on Triton's execute threads

    def resolve(self, task_id: int, weights: np.ndarray | None,
                config: np.ndarray | None) -> str:
        """The adapter name of task `task_id`, loading its weights the first time."""
        with self._lock:
            if task_id in self.names:
                return self.names[task_id]
            if weights is None or config is None:
                raise ValueError(f"lora_task_id: unknown task {task_id}: its first request "
                                 "must bring lora_weights and lora_config")
            name = f"trtllm-task-{task_id}"
            self.load(name, write_peft_adapter(weights, config, self.model,
                                               self.root / name))
            self.names[task_id] = name
            return name
