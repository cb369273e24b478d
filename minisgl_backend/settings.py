"""The engine's settings, declared once.

`EngineSettings` (and, for speculative decoding, `SpeculativeConfig`) declare every engine
setting with `spec_field`: name, kind, default, range and meaning. `LLM(model, **settings)`
takes them as keywords, the Triton model reads the `config.pbtxt` parameters of the same names
(`from_parameters`), `scripts/gen_configs.py` writes those parameters and `scripts/gen_docs.py`
the README's settings table, all from these declarations.

Knobs that exist only for tests and benchmarks are not settings: they travel in
`EngineHooks`, which neither `config.pbtxt` nor the README knows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minisgl_backend.fields import Spec, check_value, spec_field, specs_of, validate
from minisgl_backend.lora.config import check_lora_adapters
from minisgl_backend.speculative.config import SpeculativeConfig

FUSED_GEMV_MAX_BS = 16  # rows the few-rows GEMV kernel takes (kernels/gemv.py MAX_ROWS)
ATTENTION_BACKENDS = ("torch", "triton", "flashinfer")
# KV-cache events report pages as blocks; routers hash and match blocks of at least this many
# tokens (vLLM's smallest block), and smaller ones would flood them with events.
KV_EVENTS_MIN_PAGE_SIZE = 16
ZMQ_TRANSPORTS = ("tcp://", "ipc://", "inproc://")


def _attention_backend(value: object) -> str:
    """"auto", a backend name, or "PREFILL,DECODE" (one backend per phase)."""
    if not isinstance(value, str):
        raise ValueError(value)
    parts = [part.strip() for part in value.split(",")]
    if value != "auto" and (len(parts) > 2 or any(p not in ATTENTION_BACKENDS for p in parts)):
        raise ValueError(value)
    return value


def _zmq_endpoint(value: object) -> str:
    """"" (off) or a ZeroMQ endpoint of a bindable transport."""
    if not isinstance(value, str) or (value and not value.startswith(ZMQ_TRANSPORTS)):
        raise ValueError(value)
    return value


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(value)
    return value


@dataclass(frozen=True)
class EngineSettings:
    """How the engine runs: parallelism, memory, scheduling, kernels. Invalid values raise
    ValueError naming the setting."""

    tp_size: int = spec_field(1, "int", "tensor-parallel ranks, one engine process each", low=1)
    page_size: int = spec_field(1, "int", "tokens per KV page", low=1)
    max_running_requests: int = spec_field(
        256, "int", "requests decoded together at most", low=1)
    chunked_prefill_size: int = spec_field(
        8192, "int", "prompt tokens computed per step at most (longer prompts are chunked)",
        low=1)
    max_total_tokens: int | None = spec_field(
        None, "int", "KV pool size in tokens (None: what fits the device)", low=1,
        nullable=True)
    kv_memory_fraction: float = spec_field(
        0.85, "float", "GPU: share of free memory the weights and KV pool may take", low=0,
        high=1, low_open=True)
    cache: str = spec_field("radix", "str", "prefix cache: `radix` (shared prefixes are "
                            "computed once) or `naive` (none)", choices=("radix", "naive"))
    device: str = spec_field("auto", "str", "`auto`: a GPU when there is one",
                             choices=("auto", "cpu", "cuda"))
    dtype: str = spec_field("auto", "str", "`auto`: float32 on CPU, the checkpoint's half type "
                            "on GPU", choices=("auto", "float32", "bfloat16", "float16"))
    attention_backend: str = spec_field(
        "auto", "custom", "`auto`: FlashInfer prefill and the project's Triton decode kernels "
        "on a GPU, the torch reference on CPU; or a backend (`torch`, `triton`, "
        "`flashinfer`), or `PREFILL,DECODE`", normalize=_attention_backend,
        accepts="'auto', a backend name or 'PREFILL,DECODE'")
    quantization: str = spec_field(
        "auto", "str", "`auto`: the checkpoint's own scheme (bf16 or one of the FP8 formats); "
        "`fp8`: a bf16 checkpoint's linear layers are quantized to FP8 at load (weights per "
        "output channel, activations per token)", choices=("auto", "fp8"))
    kv_cache_dtype: str = spec_field(
        "auto", "str", "`auto`: the model's dtype; `fp8_e4m3` (alias `fp8`): the KV pool stores "
        "FP8 with per-layer scales (the checkpoint's, else 1.0), twice the tokens in the same "
        "memory", choices=("auto", "fp8", "fp8_e4m3"))
    load_format: str = spec_field(
        "auto", "str", "`dummy`: random weights from `config.json` alone (benchmarks of real "
        "shapes)", choices=("auto", "dummy"))
    cuda_graph_max_bs: int = spec_field(
        256, "int", "GPU: decode batches up to this size replay CUDA graphs (0: off)", low=0)
    overlap: bool = spec_field(
        True, "bool", "GPU: the engine prepares and launches step N+1 while step N runs "
        "(outputs are identical either way)")
    fused_gemv_max_bs: int = spec_field(
        2, "int", "GPU, `tp_size` 1: decode batches up to this size run each small dense "
        "layer as few-rows GEMV kernels with the norms, SiLU-and-mul and residual adds folded "
        "in (0: off)", low=0, high=FUSED_GEMV_MAX_BS)
    lora_adapters: str = spec_field(
        "", "custom", "LoRA adapters served beside the base model, `name=folder` pairs "
        "separated by commas (PEFT folders); requests pick one by name",
        normalize=check_lora_adapters, accepts="'name=folder,name=folder'")
    enable_lora: bool = spec_field(
        False, "bool", "LoRA adapters may be loaded at run time (`LLM.load_lora`, TensorRT-LLM's "
        "`lora_task_id`); on whenever `lora_adapters` names any")
    max_loras: int = spec_field(
        4, "int", "LoRA adapters on the device at once; requests for others wait for a slot "
        "no running request uses", low=1)
    max_lora_rank: int = spec_field(16, "int", "the largest LoRA rank accepted", low=1)
    max_cpu_loras: int = spec_field(
        32, "int", "LoRA adapters kept in host memory (least recently used ones are read "
        "again from their folders when next needed; those in device slots are always kept)",
        low=1)
    jump_forward: bool = spec_field(
        True, "bool", "structured output: the tokens a grammar forces are verified in one "
        "step (same output)")
    kv_events_endpoint: str = spec_field(
        "", "custom", "KV-cache events (vLLM's format, for KV-aware routers; "
        "docs/scale-out.md): the ZeroMQ endpoint of their PUB socket, bound if its host is a "
        "wildcard (`tcp://*:5557`) and connected to otherwise, as vLLM's; needs `page_size` >= "
        f"{KV_EVENTS_MIN_PAGE_SIZE} (empty: no events)",
        normalize=_zmq_endpoint, accepts="'' or a ZeroMQ endpoint (tcp://, ipc://, inproc://)")
    kv_events_replay_endpoint: str = spec_field(
        "", "custom", "KV-cache events: the endpoint the replay socket (ZeroMQ ROUTER) binds; "
        "it sends a subscriber the recent messages from a sequence number on (empty: none)",
        normalize=_zmq_endpoint, accepts="'' or a ZeroMQ endpoint (tcp://, ipc://, inproc://)")
    kv_events_topic: str = spec_field(
        "", "custom", "KV-cache events: the topic of every message", normalize=_text,
        accepts="a string")

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_adapters.strip())

    def __post_init__(self) -> None:
        validate(self)
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"max_total_tokens must be an integer >= page_size "
                             f"({self.page_size}), got {self.max_total_tokens!r}")
        if self.kv_events_endpoint and self.page_size < KV_EVENTS_MIN_PAGE_SIZE:
            raise ValueError(f"page_size must be >= {KV_EVENTS_MIN_PAGE_SIZE} when "
                             f"kv_events_endpoint is set (events report whole pages as blocks), "
                             f"got {self.page_size}")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")


@dataclass(frozen=True)
class EngineHooks:
    """Test and benchmark knobs, outside the public settings."""

    debug_checks: bool = spec_field(
        False, "bool", "verify the page accounting after every step (slow)")
    synthetic_acceptance: float | None = spec_field(
        None, "float", "random-weight benchmarks: accept each draft token with this "
        "probability instead of checking it against the model (the outputs are then "
        "meaningless)", low=0.0, high=1.0, nullable=True)

    def __post_init__(self) -> None:
        validate(self)


def setting_specs() -> dict[str, tuple[Spec, Any]]:
    """Every engine setting: name -> (spec, default), the general ones first."""
    return {**specs_of(EngineSettings), **specs_of(SpeculativeConfig)}


def split_settings(settings: dict[str, Any]) -> tuple[EngineSettings, SpeculativeConfig]:
    """The validated settings of `LLM(**settings)`; ValueError names an unknown or bad one."""
    general, speculative = specs_of(EngineSettings), specs_of(SpeculativeConfig)
    unknown = sorted(set(settings) - set(general) - set(speculative))
    if unknown:
        raise ValueError(f"unknown setting {unknown[0]!r} (settings: "
                         f"{', '.join(setting_specs())})")
    return (EngineSettings(**{k: v for k, v in settings.items() if k in general}),
            SpeculativeConfig(**{k: v for k, v in settings.items() if k in speculative}))


_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def parse_text(name: str, spec: Spec, text: str) -> Any:
    """A setting's value from its text (a `config.pbtxt` parameter), checked by its spec."""
    value: Any = text
    try:
        if spec.kind == "bool":
            value = _BOOLS[text.lower()]
        elif spec.kind == "int":
            value = int(text)
        elif spec.kind == "float":
            value = float(text)
    except (KeyError, ValueError):
        raise ValueError(f"parameter {name} must be {spec.describe()}, got {text!r}") from None
    return check_value(name, spec, value)


def from_parameters(specs: dict[str, tuple[Spec, Any]],
                    parameters: dict[str, str]) -> dict[str, Any]:
    """The values of the declared `specs` among `parameters` that are set (empty: default)."""
    values = {}
    for name, (spec, _) in specs.items():
        text = parameters.get(name, "").strip()
        if text:
            values[name] = parse_text(name, spec, text)
    return values


def shipped_text(spec: Spec) -> str:
    """What the repository's `config.pbtxt` sets a parameter to ("": the default)."""
    if spec.shipped is None:
        return ""
    return str(spec.shipped).lower() if isinstance(spec.shipped, bool) else str(spec.shipped)
