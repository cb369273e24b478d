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
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from minisgl_backend.distributed import get_tp_info
from minisgl_backend.layers.embedding import vocab_shard
from minisgl_backend.models.config import ModelConfig

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
        self.model_prefix, self.head_prefix = _text_prefixes(reader)
        spec = config.spec
        self.moe_block = spec.moe_block
        self.gate_name, self.up_name, self.down_name = spec.expert_names
        self.rules: list[tuple[re.Pattern[str], Callable[[re.Match[str]], torch.Tensor]]] = [
            (re.compile(r"(.*)\.qkv_proj\.(weight|bias)$"), self._qkv),
            (re.compile(r"(.*)\.gate_up_proj\.weight$"), self._gate_up),
            (re.compile(r"(.*)\.(o_proj|down_proj)\.weight$"), self._row_parallel),
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
        prefix, kind = self.checkpoint_name(m.group(1)), m.group(2)
        c, hd = self.config, self.config.head_dim
        q0, q1 = _split(c.num_heads)
        k0, k1 = _kv_head_range(c)
        fused = f"{prefix}.qkv_proj.{kind}"
        if fused in self.reader:  # Phi-3: [q; k; v] rows in one tensor
            k_at, v_at = c.num_heads * hd, (c.num_heads + c.num_kv_heads) * hd
            parts = [(fused, q0 * hd, q1 * hd), (fused, k_at + k0 * hd, k_at + k1 * hd),
                     (fused, v_at + k0 * hd, v_at + k1 * hd)]
        else:
            parts = [(f"{prefix}.q_proj.{kind}", q0 * hd, q1 * hd),
                     (f"{prefix}.k_proj.{kind}", k0 * hd, k1 * hd),
                     (f"{prefix}.v_proj.{kind}", k0 * hd, k1 * hd)]
        return torch.cat([self.reader.rows(*part) for part in parts])

    def _gate_up(self, m: re.Match[str]) -> torch.Tensor:
        prefix = self.checkpoint_name(m.group(1))
        size = self.config.intermediate_size
        start, stop = _split(size)
        fused = f"{prefix}.gate_up_proj.weight"
        if fused in self.reader:  # Phi-3: [gate; up] rows in one tensor
            return torch.cat([self.reader.rows(fused, start, stop),
                              self.reader.rows(fused, size + start, size + stop)])
        return torch.cat([self.reader.rows(f"{prefix}.{part}_proj.weight", start, stop)
                          for part in ("gate", "up")])

    def _row_parallel(self, m: re.Match[str]) -> torch.Tensor:
        name = self.checkpoint_name(f"{m.group(1)}.{m.group(2)}.weight")
        full_in = (self.config.num_heads * self.config.head_dim if m.group(2) == "o_proj"
                   else self.config.intermediate_size)
        return self.reader.cols(name, *_split(full_in))

    def _moe(self, layer: str) -> str:
        return f"{self.checkpoint_name(layer)}.{self.moe_block}"

    def _router(self, m: re.Match[str]) -> torch.Tensor:
        return self.reader.rows(f"{self._moe(m.group(1))}.gate.weight")

    def _experts_w13(self, m: re.Match[str]) -> torch.Tensor:
        start, stop = _split(self.config.moe_intermediate_size)
        experts = []
        for e in range(self.config.num_experts):
            base = f"{self._moe(m.group(1))}.experts.{e}"
            gate = self.reader.rows(f"{base}.{self.gate_name}.weight", start, stop)
            up = self.reader.rows(f"{base}.{self.up_name}.weight", start, stop)
            experts.append(torch.cat([gate, up]))
        return torch.stack(experts)

    def _experts_w2(self, m: re.Match[str]) -> torch.Tensor:
        start, stop = _split(self.config.moe_intermediate_size)
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
                 dtype: torch.dtype) -> None:
    """Replace every (meta) parameter of `model` with its checkpoint slice on `device`; fail
    naming any checkpoint tensor the model would leave unused."""
    config: ModelConfig = model.config  # type: ignore[assignment]
    with ExitStack() as stack:
        loader = WeightLoader(config, CheckpointReader(Path(model_dir), stack, device))
        state = {}
        for name, param in model.state_dict().items():
            tensor = loader.load(name).to(device=device, dtype=dtype)
            if tensor.shape != param.shape:
                raise ValueError(f"checkpoint tensor for {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)}")
            state[name] = tensor
        unused = loader.unused()
    if unused:
        shown = ", ".join(unused[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
        raise ValueError(f"{len(unused)} checkpoint tensor(s) of {str(model_dir)!r} are not used "
                         f"by the {config.architecture} model the config describes: {shown}")
    model.load_state_dict(state, assign=True, strict=True)
