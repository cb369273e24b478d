"""`ModelConfig`: the fields of a HF `config.json` the engine needs, for every architecture.

Both config layouts are read: transformers 5's `rope_parameters` (per layer type for Gemma 3)
and `layer_types`, and transformers 4's `rope_theta` / `rope_scaling` / `rope_local_base_freq`
and `sliding_window_pattern` / `max_window_layers`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minisgl_backend.models.architectures import (SUPPORTED_ARCHITECTURES, ArchSpec,
                                                  check_unsupported_fields)

ROPE_TYPES = ("default", "linear", "llama3", "longrope")
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    # llama3: factor / low_freq_factor / high_freq_factor / original_max_position_embeddings;
    # linear: factor; longrope: short_factor / long_factor / original_max_position_embeddings
    # and attention_factor (the cos/sin scale, resolved at parse time as HF does).
    scaling: dict[str, Any] = field(default_factory=dict)

    @property
    def long_from(self) -> int:
        """LongRoPE's pretraining length: a sequence longer than this is computed, whole, with
        the long frequencies (0: not LongRoPE)."""
        if self.rope_type != "longrope":
            return 0
        return int(self.scaling["original_max_position_embeddings"])


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False  # a bias on the attention output projection (`attention_bias`)
    qk_norm: bool = False
    gemma: bool = False  # see `ArchSpec.gemma`
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 (Gemma) instead of
    # head_dim ** -0.5 when set.
    query_pre_attn_scalar: float | None = None
    # Sliding-window attention: the layers of the sliding kind attend to their last
    # `sliding_window` tokens (0: no window); `local_rope` is their RoPE where it differs.
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    local_rope: RopeConfig | None = None
    # Mixture of experts (Qwen3-MoE, Mixtral); num_experts == 0 means a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"

    @property
    def spec(self) -> ArchSpec:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    def is_moe_layer(self, layer_id: int) -> bool:
        return (self.num_experts > 0 and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    def window(self, layer_id: int) -> int:
        """Tokens a query of this layer attends to, itself included (0: all before it)."""
        return self.sliding_window if layer_id in self.sliding_layers else 0

    def layer_rope(self, layer_id: int) -> RopeConfig:
        if self.local_rope is not None and layer_id in self.sliding_layers:
            return self.local_rope
        return self.rope

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported model architecture {archs or raw.get('model_type')!r}; "
                             f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
        spec = SUPPORTED_ARCHITECTURES[arch]
        text = {**raw, **raw["text_config"]} if spec.text_config else raw
        check_unsupported_fields(text, spec)
        num_heads = text["num_attention_heads"]
        head_dim = text.get("head_dim") or text["hidden_size"] // num_heads
        num_layers = text["num_hidden_layers"]
        max_positions = text.get("max_position_embeddings", 4096)
        attention_bias = bool(text.get("attention_bias", False))
        moe = spec.moe
        sliding_layers, window = _sliding_layers(text, spec, num_layers)
        rope, local_rope = _parse_ropes(text, spec, max_positions)
        return cls(
            architecture=arch,
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            intermediate_size=text.get("intermediate_size", 0),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=text.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope=rope,
            max_position_embeddings=max_positions,
            # Multimodal configs tie at the top level.
            tie_word_embeddings=bool(raw.get("tie_word_embeddings",
                                             text.get("tie_word_embeddings", spec.gemma))),
            qkv_bias=spec.qkv_bias or attention_bias,
            o_bias=attention_bias,
            qk_norm=spec.qk_norm,
            gemma=spec.gemma,
            query_pre_attn_scalar=text.get("query_pre_attn_scalar") if spec.gemma else None,
            # A window as long as the model's context never binds.
            sliding_window=window if window < max_positions else 0,
            sliding_layers=sliding_layers,
            local_rope=local_rope,
            num_experts=(text.get("num_experts") or text.get("num_local_experts") or 0)
            if moe else 0,
            num_experts_per_tok=text.get("num_experts_per_tok", 0) if moe else 0,
            # Mixtral's experts are `intermediate_size` wide and always renormalized.
            moe_intermediate_size=(text.get("moe_intermediate_size")
                                   or text.get("intermediate_size", 0)) if moe else 0,
            norm_topk_prob=bool(text.get("norm_topk_prob", arch == "MixtralForCausalLM")),
            decoder_sparse_step=text.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(text.get("mlp_only_layers") or ()),
            eos_token_ids=_as_id_tuple(raw.get("eos_token_id", text.get("eos_token_id"))),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or text.get("dtype")
                            or "float32"),
        )

    @classmethod
    def from_folder(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model folder {str(model_dir)!r} has no config.json")
        return cls.from_dict(json.loads(path.read_text()))


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _layer_types(text: dict[str, Any], spec: ArchSpec, num_layers: int) -> list[str]:
    """The attention kind of every layer (`layer_types`, or its transformers 4 equivalents)."""
    kinds = text.get("layer_types")
    if kinds is None:
        if spec.windows == "layer_types":  # Gemma 3: every pattern-th layer is global
            pattern = text.get("sliding_window_pattern") or text.get("_sliding_window_pattern") \
                or 6
            kinds = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
        elif spec.windows == "qwen":
            first = text.get("max_window_layers", num_layers)
            kinds = [SLIDING if i >= first else FULL for i in range(num_layers)]
        else:
            kinds = [SLIDING] * num_layers
    if len(kinds) != num_layers or any(k not in (SLIDING, FULL) for k in kinds):
        raise ValueError(f"config field 'layer_types' = {kinds!r} is not supported: one of "
                         f"{SLIDING!r} or {FULL!r} per layer ({num_layers}) is implemented")
    return list(kinds)


def _sliding_layers(text: dict[str, Any], spec: ArchSpec, num_layers: int
                    ) -> tuple[tuple[int, ...], int]:
    """(layers of the sliding kind, their window), as HF's modeling code reads them."""
    window = text.get("sliding_window")
    if spec.windows in ("qwen", "qwen_all") and not text.get("use_sliding_window"):
        window = None
    if not spec.windows or (window is None and spec.windows != "layer_types"):
        return (), 0
    if spec.windows == "qwen_all":
        kinds = [SLIDING] * num_layers
    else:
        kinds = _layer_types(text, spec, num_layers)
    layers = tuple(i for i, kind in enumerate(kinds) if kind == SLIDING)
    return layers, int(window or 0)


def _parse_ropes(text: dict[str, Any], spec: ArchSpec, max_positions: int
                 ) -> tuple[RopeConfig, RopeConfig | None]:
    """(the RoPE of full-attention layers, that of sliding layers if it differs)."""
    params = text.get("rope_parameters") or {}
    if spec.gemma:
        if FULL in params:  # transformers 5: one set per layer type
            return (_parse_rope(params[FULL], {}, max_positions),
                    _parse_rope(params[SLIDING], {}, max_positions))
        local = {"rope_theta": text.get("rope_local_base_freq", 10000.0)}
        return _parse_rope({}, text, max_positions), _parse_rope(local, {}, max_positions)
    return _parse_rope(params, text, max_positions), None


def _parse_rope(params: dict[str, Any], text: dict[str, Any], max_positions: int) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`.
    params = {**(text.get("rope_scaling") or {}), **params}
    theta = params.pop("rope_theta", text.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default")) or "default"
    params.pop("partial_rotary_factor", None)  # 1.0 (check_unsupported_fields)
    if rope_type == "su":  # Phi-3's first name for LongRoPE
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config field 'rope_scaling' has unsupported rope_type {rope_type!r} "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    if rope_type == "longrope":
        params = _resolve_longrope(params, text, max_positions)
    return RopeConfig(theta=float(theta), rope_type=rope_type, scaling=params)


def _resolve_longrope(params: dict[str, Any], text: dict[str, Any], max_positions: int
                      ) -> dict[str, Any]:
    """LongRoPE's pretraining length and cos/sin scale, as HF's `_compute_longrope_parameters`."""
    original = params.get("original_max_position_embeddings") \
        or text.get("original_max_position_embeddings")
    if not original:
        raise ValueError("config field 'original_max_position_embeddings' is missing: "
                         "LongRoPE needs it")
    factor = params.get("factor") or max_positions / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else \
            math.sqrt(1 + math.log(factor) / math.log(original))
    return {**params, "original_max_position_embeddings": int(original),
            "attention_factor": float(attention_factor)}
