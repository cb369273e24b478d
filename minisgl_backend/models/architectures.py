"""The HF architectures the shared decoder runs, and the config fields it refuses.

Each architecture is a few switches of the one decoder (`ArchSpec`). A config field that changes
the math and that the engine does not implement fails the parse naming the field
(`check_unsupported_fields`), so a checkpoint never loads into a model that computes something
else than HF transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from minisgl_backend.quantization.config import parse_quantization_config


@dataclass(frozen=True)
class ArchSpec:
    """What the shared decoder needs for one HF architecture."""

    qkv_bias: bool = False  # q/k/v biases whatever `attention_bias` says (Qwen2)
    qk_norm: bool = False  # RMSNorm of each query and key head
    moe: bool = False
    # Gemma 3: (1 + weight) RMSNorms, norms around attention and MLP outputs, GELU-tanh MLP,
    # embeddings scaled by sqrt(hidden_size), a RoPE base per layer type.
    gemma: bool = False
    # Where the sliding windows come from: "all" layers get `sliding_window`; "qwen": only with
    # `use_sliding_window`, on the layers `layer_types` / `max_window_layers` name; "qwen_all":
    # with `use_sliding_window`, every layer; "layer_types": the layers `layer_types` (or
    # `sliding_window_pattern`) name.
    windows: str = "all"
    text_config: bool = False  # the text model's fields sit in `text_config` (multimodal)
    # MoE checkpoint names: the block holding router and experts, and each expert's gate, up
    # and down projections.
    moe_block: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


SUPPORTED_ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(windows=""),
    "MistralForCausalLM": ArchSpec(),
    "MixtralForCausalLM": ArchSpec(moe=True, moe_block="block_sparse_moe",
                                   expert_names=("w1", "w3", "w2")),
    "Phi3ForCausalLM": ArchSpec(),
    "Qwen2ForCausalLM": ArchSpec(qkv_bias=True, windows="qwen"),
    "Qwen3ForCausalLM": ArchSpec(qk_norm=True, windows="qwen"),
    "Qwen3MoeForCausalLM": ArchSpec(qk_norm=True, moe=True, windows="qwen_all"),
    "Gemma3ForCausalLM": ArchSpec(qk_norm=True, gemma=True, windows="layer_types"),
    "Gemma3ForConditionalGeneration": ArchSpec(qk_norm=True, gemma=True, windows="layer_types",
                                               text_config=True),
}

GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


def _is_false(value: Any) -> bool:
    return not value


def _is_none(value: Any) -> bool:
    return value is None


def _is_one(value: Any) -> bool:
    return value is None or float(value) == 1.0


# field -> (accepts its value?, what the accepted values are). Every field here changes what
# the model computes; training-only fields (dropouts, router jitter, pretraining_tp) do not.
_COMMON_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "mlp_bias": (_is_false, "MLP biases are not implemented"),
    "partial_rotary_factor": (_is_one, "only full-width RoPE (1.0) is implemented"),
    "attn_logit_softcapping": (_is_none, "attention logit soft-capping is not implemented"),
    "final_logit_softcapping": (_is_none, "final logit soft-capping is not implemented"),
    "use_bidirectional_attention": (_is_false, "only causal attention is implemented"),
}


def check_unsupported_fields(text: dict[str, Any], spec: ArchSpec) -> None:
    """Raise ValueError naming the first field of the text model's config the engine would
    compute differently from HF."""
    for name, (accepts, why) in _COMMON_FIELDS.items():
        if name in text and not accepts(text[name]):
            raise ValueError(f"config field {name!r} = {text[name]!r} is not supported: {why}")
    if text.get("quantization_config") is not None:
        parse_quantization_config(text["quantization_config"])  # FP8 formats only
    rope_params = text.get("rope_parameters") or {}
    nested = [p for p in rope_params.values() if isinstance(p, dict)] or [rope_params]
    for params in [*nested, text.get("rope_scaling") or {}]:
        if not _is_one(params.get("partial_rotary_factor")):
            raise ValueError(f"config field 'partial_rotary_factor' = "
                             f"{params['partial_rotary_factor']!r} is not supported: only "
                             "full-width RoPE (1.0) is implemented")
    if spec.gemma:
        act = text.get("hidden_activation") or text.get("hidden_act") or GEMMA_ACTIVATIONS[0]
        if act not in GEMMA_ACTIVATIONS:
            raise ValueError(f"config field 'hidden_activation' = {act!r} is not supported "
                             f"(only {', '.join(GEMMA_ACTIVATIONS)})")
    elif text.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config field 'hidden_act' = {text['hidden_act']!r} is not supported "
                         "(only silu)")
