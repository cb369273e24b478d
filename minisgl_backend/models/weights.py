"""Load a HF safetensors checkpoint into a model built on the meta device, strictly.

Each parameter of the model is filled straight from the checkpoint files onto the target device,
reading only this rank's slice: q/k/v and gate/up are merged (or, stored fused as in Phi-3,
sliced per rank), column-parallel weights are split by output rows, row-parallel ones by input
columns, embeddings by vocabulary rows (padded), and the MoE experts are stacked into `w13` /
`w2`.

Every checkpoint tensor must be read, or be one the engine knows it does not need
(`KNOWN_UNUSED`); anything else fails the load naming it, so that no weight the model
computes with (a bias, say) is dropped without a word.
"""

from __future__ import annotations

import logging
import math
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from minisgl_backend.layers.embedding import vocab_shard
from minisgl_backend.models.config import ModelConfig
from minisgl_backend.models.projections import ROW_PARALLEL_PROJECTIONS, rank_parts, rank_split
from minisgl_backend.quantization.config import QuantScheme
from minisgl_backend.quantization.fp8 import FP8
from minisgl_backend.quantization.model import fp8_projections, quantize_weight

logger = logging.getLogger(__name__)

# Checkpoint tensors no supported model computes with: pattern -> why.
KNOWN_UNUSED: dict[str, str] = {
    r"(^|\.)rotary_emb\.inv_freq$": "RoPE frequencies are recomputed from the config",
}
# The vision tower of a multimodal checkpoint whose text model is served alone.
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                   "model.multi_modal_projector.")
# Where a multimodal checkpoint keeps the text model's `model.` and `lm_head.` tensors.
TEXT_PREFIXES = (("language_model.model.", "language_model.lm_head."),
                 ("model.language_model.", "lm_head."))


# The layers split by input columns, and their FP8 scales.
ROW_PARALLEL = re.compile(r"(.*)\.(o_proj|down_proj)\.(weight|weight_scale|input_scale)$")


class CheckpointReader:
    """Name -> lazily sliced tensor over one or many `*.safetensors` files; remembers which
    tensors were read."""

    def __init__(self, model_dir: Path, stack: ExitStack, device: torch.device) -> None:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {str(model_dir)!r}")
        self._handles: dict[str, Any] = {}
        for file in files:
            handle = stack.enter_context(safe_open(str(file), framework="pt", device=str(device)))
            for name in handle.keys():
                self._handles[name] = handle
        self.read: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self._handles

    def names(self) -> list[str]:
        return list(self._handles)

    def _slice(self, name: str) -> Any:
        if name not in self._handles:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        self.read.add(name)
        return self._handles[name].get_slice(name)

    def rows(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows [start, stop) of a tensor (all of it by default)."""
        part = self._slice(name)
        return part[start:stop] if stop is not None else part[start:]

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._slice(name)[:, start:stop]

    def tensor(self, name: str) -> torch.Tensor:
        """A whole tensor (of any rank, scalars included)."""
        self._slice(name)
        return self._handles[name].get_tensor(name)

    def numel(self, name: str) -> int:
        if name not in self._handles:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return math.prod(self._handles[name].get_slice(name).get_shape())


class WeightLoader:
    """Builds each local parameter tensor from its checkpoint name(s)."""

    def __init__(self, config: ModelConfig, reader: CheckpointReader,
                 scheme: QuantScheme | None = None) -> None:
        self.config = config
        self.reader = reader
        self.scheme = scheme
        self.model_prefix, self.head_prefix = _text_prefixes(reader)
        spec = config.spec
        self.moe_block = spec.moe_block
        self.gate_name, self.up_name, self.down_name = spec.expert_names
        self.rules: list[tuple[re.Pattern[str], Callable[[re.Match[str]], torch.Tensor]]] = [
            (re.compile(r"(.*)\.qkv_proj\.(weight|bias|weight_scale|input_scale)$"), self._qkv),
            (re.compile(r"(.*)\.gate_up_proj\.(weight|weight_scale|input_scale)$"),
             self._gate_up),
            (ROW_PARALLEL, self._row_parallel),
            (re.compile(r"(.*)\.mlp\.w13$"), self._experts_w13),
            (re.compile(r"(.*)\.mlp\.w2$"), self._experts_w2),
            (re.compile(r"(.*)\.mlp\.gate\.weight$"), self._router),
            (re.compile(r"^model\.embed_tokens\.weight$"), self._vocab),
            (re.compile(r"^lm_head\.weight$"), self._vocab),
        ]

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's name of a model tensor (multimodal checkpoints nest the text model)."""
        if name.startswith("model."):
            return self.model_prefix + name[len("model."):]
        if name.startswith("lm_head."):
            return self.head_prefix + name[len("lm_head."):]
        return name

    def load(self, name: str) -> torch.Tensor:
        for pattern, build in self.rules:
            match = pattern.match(name)
            if match:
                return build(match)
        return self.reader.rows(self.checkpoint_name(name))  # replicated: norms, biases of o

    def _qkv(self, m: re.Match[str]) -> torch.Tensor:
        c, hd = self.config, self.config.head_dim
        # Phi-3 stores [q; k; v] rows in one tensor.
        return self._merged(m, "self_attn.qkv_proj",
                            (0, c.num_heads * hd, (c.num_heads + c.num_kv_heads) * hd))

    def _gate_up(self, m: re.Match[str]) -> torch.Tensor:
        # Phi-3 stores [gate; up] rows in one tensor.
        return self._merged(m, "mlp.gate_up_proj", (0, self.config.intermediate_size))

    def _merged(self, m: re.Match[str], projection: str, fused_offsets: tuple[int, ...]
                ) -> torch.Tensor:
        """A merged column-parallel tensor from its parts, stored apart or fused (each part at
        its row offset in the fused tensor)."""
        prefix, kind = self.checkpoint_name(m.group(1)), m.group(2)
        fused = f"{prefix}.{projection.split('.')[1]}"
        parts = rank_parts(self.config, projection)
        if f"{fused}.weight" in self.reader:
            return self._column([(fused, at + start, at + stop)
                                 for (_, start, stop), at in zip(parts, fused_offsets)], kind)
        return self._column([(f"{prefix}.{module}", start, stop)
                             for module, start, stop in parts], kind)

    def _column(self, parts: list[tuple[str, int, int]], kind: str) -> torch.Tensor:
        """A column-parallel tensor made of `parts`: (checkpoint module, first row, row after)
        of each, in order. FP8 scales follow their weight rows; the parts share the largest
        static input scale."""
        if kind == "input_scale":
            return self._input_scale([module for module, _, _ in parts])
        if kind == "weight_scale":
            return torch.cat([self._scale_rows(*part) for part in parts])
        tensors = [self.reader.rows(f"{module}.{kind}", start, stop)
                   for module, start, stop in parts]
        dtypes = {f"{module}.{kind}": t.dtype for (module, _, _), t in zip(parts, tensors)}
        if len(set(dtypes.values())) > 1:
            raise ValueError(f"checkpoint tensors merged into one layer differ in dtype: "
                             f"{dtypes}")
        return torch.cat(tensors)

    def _row_parallel(self, m: re.Match[str]) -> torch.Tensor:
        module, kind, (start, stop) = self._row_parallel_columns(m)
        if kind == "weight":
            return self.reader.cols(f"{module}.weight", start, stop)
        if kind == "input_scale":
            return self._input_scale([module])
        assert self.scheme is not None
        if self.scheme.block:  # split by whole blocks of columns (`quantize_model` checks)
            bk = self.scheme.block[1]
            return self.reader.cols(f"{module}.{self.scheme.scale_name}", start // bk,
                                    -(-stop // bk))
        return self._scale_rows(module, 0, self.config.hidden_size)

    def _row_parallel_columns(self, m: re.Match[str]) -> tuple[str, str, tuple[int, int]]:
        """(checkpoint module, tensor kind, this rank's [start, stop) input columns)."""
        projection = next(p for p in ROW_PARALLEL_PROJECTIONS if p.endswith(m.group(2)))
        (_, start, stop), = rank_parts(self.config, projection)
        return self.checkpoint_name(f"{m.group(1)}.{m.group(2)}"), m.group(3), (start, stop)

    def quantized_online(self, name: str, layer: torch.nn.Module,
                         device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """A full-precision weight quantized for an FP8 layer: (e4m3 values, scale). A
        row-parallel weight is quantized whole and then split, so that each row's scale is the
        same on every rank (and the same as without tensor parallelism)."""
        match = ROW_PARALLEL.match(name)
        if match is None:
            return quantize_weight(layer, self.load(name).to(device, torch.float32))
        module, _, (start, stop) = self._row_parallel_columns(match)
        values, scale = quantize_weight(
            layer, self.reader.rows(f"{module}.weight").to(device, torch.float32))
        return values[:, start:stop].contiguous(), scale

    def _scale_rows(self, module: str, start: int, stop: int) -> torch.Tensor:
        """The FP8 weight scale of rows [start, stop) of `module`'s weight, in the engine's
        layout: block rows of a block scale, else one scale per row (a per-tensor scale is
        repeated)."""
        assert self.scheme is not None
        name = f"{module}.{self.scheme.scale_name}"
        if self.scheme.block:
            bn = self.scheme.block[0]
            return self.reader.rows(name, start // bn, -(-stop // bn))
        if self.reader.numel(name) == 1:
            return self.reader.tensor(name).float().reshape(1, 1).expand(stop - start, 1)
        return self.reader.rows(name, start, stop).float().reshape(-1, 1)

    def _input_scale(self, modules: list[str]) -> torch.Tensor:
        scales = [self.reader.tensor(f"{module}.input_scale").float().reshape(())
                  for module in dict.fromkeys(modules)]
        return torch.stack(scales).max().reshape(1)

    def kv_scales(self, layer_id: int) -> tuple[float, float] | None:
        """The checkpoint's FP8 KV-cache scales of a layer (k, v), if it has them: under the
        attention module (compressed-tensors, fp8), under k_proj / v_proj (ModelOpt), or one
        `kv_scale` for both."""
        attn = self.checkpoint_name(f"model.layers.{layer_id}.self_attn")
        found = []
        for names in ((f"{attn}.k_scale", f"{attn}.k_proj.k_scale", f"{attn}.kv_scale"),
                      (f"{attn}.v_scale", f"{attn}.v_proj.v_scale", f"{attn}.kv_scale")):
            name = next((n for n in names if n in self.reader), None)
            found.append(None if name is None else float(self.reader.tensor(name).float()))
        if found[0] is None and found[1] is None:
            return None
        if found[0] is None or found[1] is None:
            raise ValueError(f"{attn}: the checkpoint has only one of the K and V cache scales")
        return found[0], found[1]

    def _moe(self, layer: str) -> str:
        return f"{self.checkpoint_name(layer)}.{self.moe_block}"

    def _router(self, m: re.Match[str]) -> torch.Tensor:
        return self.reader.rows(f"{self._moe(m.group(1))}.gate.weight")

    def _experts_w13(self, m: re.Match[str]) -> torch.Tensor:
        start, stop = rank_split(self.config.moe_intermediate_size)
        experts = []
        for e in range(self.config.num_experts):
            base = f"{self._moe(m.group(1))}.experts.{e}"
            gate = self.reader.rows(f"{base}.{self.gate_name}.weight", start, stop)
            up = self.reader.rows(f"{base}.{self.up_name}.weight", start, stop)
            experts.append(torch.cat([gate, up]))
        return torch.stack(experts)

    def _experts_w2(self, m: re.Match[str]) -> torch.Tensor:
        start, stop = rank_split(self.config.moe_intermediate_size)
        base = f"{self._moe(m.group(1))}.experts"
        return torch.stack([self.reader.cols(f"{base}.{e}.{self.down_name}.weight", start, stop)
                            for e in range(self.config.num_experts)])

    def _vocab(self, m: re.Match[str]) -> torch.Tensor:
        name = self.checkpoint_name(m.group(0))
        embed = self.checkpoint_name("model.embed_tokens.weight")
        if m.group(0) == "lm_head.weight" and (self.config.tie_word_embeddings
                                               or name not in self.reader):
            name = embed
        start, shard = vocab_shard(self.config.vocab_size)
        rows = self.reader.rows(name, start, min(start + shard, self.config.vocab_size))
        if rows.shape[0] < shard:  # the last rank's slice runs past the vocabulary
            rows = torch.cat([rows, rows.new_zeros(shard - rows.shape[0], rows.shape[1])])
        return rows

    def unused(self) -> list[str]:
        """Checkpoint tensors that were not read and are not known to be unneeded."""
        known = [re.compile(p) for p in KNOWN_UNUSED]
        if self.config.tie_word_embeddings:  # a tied head saved anyway: HF ignores it too
            known.append(re.compile(re.escape(self.checkpoint_name("lm_head.weight")) + "$"))
        unread = [n for n in self.reader.names() if n not in self.reader.read]
        vision = [n for n in unread if n.startswith(VISION_PREFIXES)]
        if vision and self.config.spec.text_config:
            logger.info("serving the text model only: %d vision tensors of the checkpoint are "
                        "not loaded (%s...)", len(vision), vision[0])
            unread = [n for n in unread if not n.startswith(VISION_PREFIXES)]
        return sorted(n for n in unread if not any(p.search(n) for p in known))


def _text_prefixes(reader: CheckpointReader) -> tuple[str, str]:
    """(prefix of `model.` tensors, of `lm_head.` tensors) in this checkpoint."""
    for model_prefix, head_prefix in TEXT_PREFIXES:
        if f"{model_prefix}embed_tokens.weight" in reader:
            return model_prefix, head_prefix
    return "model.", "lm_head."


def load_weights(model: torch.nn.Module, model_dir: str | Path, device: torch.device,
                 dtype: torch.dtype, scheme: QuantScheme | None = None) -> None:
    """Replace every (meta) parameter of `model` with its checkpoint slice on `device`; fail
    naming any checkpoint tensor the model would leave unused. FP8 layers (`quantize_model`)
    take the checkpoint's FP8 weights and scales as they are, or with an online `scheme`
    quantize its full-precision weights here."""
    config: ModelConfig = model.config  # type: ignore[assignment]
    fp8_layers = fp8_projections(model)
    with ExitStack() as stack:
        loader = WeightLoader(config, CheckpointReader(Path(model_dir), stack, device), scheme)
        state: dict[str, torch.Tensor] = {}
        for name, param in model.state_dict().items():
            if name in state:  # an online FP8 scale, made with its weight
                continue
            layer_name, _, kind = name.rpartition(".")
            layer = fp8_layers.get(layer_name)
            if layer is not None and kind == "weight" and scheme is not None and scheme.online:
                tensor, state[f"{name}_scale"] = loader.quantized_online(name, layer, device)
            elif layer is not None and kind == "weight":
                tensor = _fp8_weight(name, loader.load(name), device)
            elif layer is not None and kind in ("weight_scale", "input_scale"):
                tensor = loader.load(name).to(device=device, dtype=torch.float32)
            else:
                tensor = loader.load(name).to(device=device, dtype=dtype)
            if tensor.shape != param.shape:
                raise ValueError(f"checkpoint tensor for {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)}")
            state[name] = tensor
        for i, layer in enumerate(model.model.layers):
            scales = loader.kv_scales(i)
            if scales is not None:
                layer.self_attn.k_scale, layer.self_attn.v_scale = scales
        unused = loader.unused()
    if unused:
        shown = ", ".join(unused[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
        raise ValueError(f"{len(unused)} checkpoint tensor(s) of {str(model_dir)!r} are not used "
                         f"by the {config.architecture} model the config describes: {shown}")
    model.load_state_dict(state, assign=True, strict=True)


def _fp8_weight(name: str, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An FP8 layer's weight as the checkpoint stores it (which must be e4m3)."""
    if tensor.dtype != FP8:
        raise ValueError(f"checkpoint tensor for {name} is {tensor.dtype}, expected "
                         f"float8_e4m3fn (the quantization config says this layer is FP8)")
    return tensor.to(device)
