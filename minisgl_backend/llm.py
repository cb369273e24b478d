"""The offline Python API: `LLM(model).generate(prompts, sampling_params)`.

It drives the same scheduler thread and engine processes as the Triton model.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any, Sequence

from minisgl_backend.core import SamplingParams, check_token_ids
from minisgl_backend.engine.config import EngineConfig
from minisgl_backend.lora.config import (check_adapter_tensors, read_adapter_config,
                                         read_adapter_configs)
from minisgl_backend.scheduler import Scheduler, SchedulerConfig
from minisgl_backend.scheduler.output import GenerationOutput, OutputCallback, RequestOutput
from minisgl_backend.settings import EngineHooks, split_settings
from minisgl_backend.startup_heap import freeze_startup_heap, thaw_startup_heap
from minisgl_backend.tokenizer import encode_prompt

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class LoadedModel:
    """What the engine loaded (the metrics' model description)."""

    weight_bytes: int  # over every rank
    kv_tokens: int  # the KV pool's capacity
    quantization: str  # `QuantScheme.label`, or "none"
    kv_cache_dtype: str  # "fp8_e4m3", or "auto" (the model's dtype)


class LLM:
    """An engine for offline batch generation.

    Args:
        model: a HF model folder (config.json, *.safetensors, tokenizer files).
        hooks: test and benchmark knobs (`EngineHooks`), not settings.
        **settings: the engine settings, each declared once in `minisgl_backend.settings`
            (`EngineSettings`) and `minisgl_backend.speculative.SpeculativeConfig`, with its
            default and range; the README's settings table lists them. An unknown or invalid
            setting raises ValueError naming it.
    """

    def __init__(self, model: str | Path, *, hooks: EngineHooks | None = None,
                 **settings: Any) -> None:
        general, spec = split_settings(settings)
        model_dir = Path(model)
        if not (model_dir / "config.json").is_file():
            raise ValueError(f"model: {str(model)!r} is not a HF model folder (no config.json)")
        from minisgl_backend.models import ModelConfig

        model_config = ModelConfig.from_folder(model_dir)  # fails early on unknown architectures
        for adapter in read_adapter_configs(general.lora_adapters, general.max_lora_rank):
            check_adapter_tensors(adapter, model_config)  # and on adapters that do not fit
        self.model_config = model_config
        self.lora_enabled = general.lora_enabled
        self.max_loras = general.max_loras
        self._max_lora_rank = general.max_lora_rank
        self.vocab_size = model_config.vocab_size
        self.tokenizer = _load_tokenizer(model_dir)
        drafts = spec.num_speculative_tokens if spec.enabled or general.jump_forward else 0
        engine = EngineConfig(**vars(general), model_dir=str(model_dir),
                              samples_per_row=1 + drafts)
        config = SchedulerConfig(engine=engine, speculative=spec, hooks=hooks or EngineHooks())
        self.scheduler = Scheduler(config, self.tokenizer, _eos_ids(model_config, self.tokenizer),
                                   model_config.vocab_size)
        freeze_startup_heap()  # the scheduler thread's collections skip what is alive now
        self._frozen = True
        from minisgl_backend.quantization.config import resolve_scheme

        scheme = resolve_scheme(model_dir, general.quantization)
        client = self.scheduler.engine
        self.loaded = LoadedModel(
            weight_bytes=client.weight_bytes, kv_tokens=client.num_pages * general.page_size,
            quantization=scheme.label if scheme else "none",
            kv_cache_dtype="fp8_e4m3" if general.kv_cache_dtype.startswith("fp8") else "auto")

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora: str | None | Sequence[str | None] = None) -> list[GenerationOutput]:
        """Generate for every prompt (a string or a list of token ids); results in prompt order,
        `n` per prompt (`SamplingParams.n`; prompt 0's samples first, by `.index`). `lora`: the
        LoRA adapter (a name of the `lora_adapters` setting) of every prompt, or one per prompt;
        None: the base model.

        Raises ValueError for an invalid prompt or settings, RuntimeError if the engine fails.
        """
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        adapters = _as_lora_list(lora, len(prompt_list))
        token_lists = [self._tokenize(p, i) for i, p in enumerate(prompt_list)]
        checked = []
        for i, (ids, p) in enumerate(zip(token_lists, params)):
            if p.stop and self.tokenizer is None:
                raise ValueError(f"sampling_params[{i}].stop needs a tokenizer in the model folder")
            try:
                self.scheduler.loras.id_of(adapters[i])
                checked.append(self.scheduler.check_request(ids, p))
            except ValueError as exc:
                raise ValueError(f"prompts[{i}]: {exc}") from None
        collector = _Collector([p.n for p in params])
        for i, (ids, p) in enumerate(zip(token_lists, params)):
            self.scheduler.submit(ids, p, collector.callback_for(i), checked[i], stream=False,
                                  lora=adapters[i])
        return collector.wait()

    def load_lora(self, name: str, folder: str | Path) -> None:
        """Serve the PEFT LoRA adapter in `folder` as `name` from now on (LoRA must be on:
        `enable_lora` or `lora_adapters`). ValueError naming what does not fit."""
        if not self.lora_enabled:
            raise ValueError("lora: adapters cannot be loaded: LoRA is off (set enable_lora, or "
                             "name adapters in lora_adapters)")
        adapter = read_adapter_config(name, Path(folder), self._max_lora_rank)
        check_adapter_tensors(adapter, self.model_config)
        self.scheduler.loras.register(name, Path(folder))

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name` to new requests (those already queued finish under it)."""
        self.scheduler.loras.unregister(name)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix (KV-cache events: `AllBlocksCleared`); False, dropping
        nothing, while a request runs or waits."""
        return self.scheduler.reset_prefix_cache()

    def _tokenize(self, prompt: Prompt, index: int) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompts: text prompts need a tokenizer in the model folder")
            return encode_prompt(self.tokenizer, prompt)
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"prompts[{index}] must be a string or a list of token ids")
        check_token_ids(f"prompts[{index}]", ids, self.vocab_size)
        return ids

    def shutdown(self) -> None:
        """Stop the scheduler thread and the engine processes."""
        self.scheduler.shutdown()
        if self._frozen:
            self._frozen = False
            thaw_startup_heap()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class _Collector:
    """Gathers the outputs of one `generate` call; `wait` returns them in prompt order, each
    prompt's samples in index order."""

    def __init__(self, samples: list[int]) -> None:
        self.first = [0, *accumulate(samples)]  # prompt -> the slot of its sample 0
        self.results = [GenerationOutput() for _ in range(self.first[-1])]
        self.errors: list[str] = []
        self.remaining = len(self.results)
        self.done = threading.Event()
        self.lock = threading.Lock()
        if not self.results:
            self.done.set()

    def callback_for(self, index: int) -> OutputCallback:
        def on_output(out: RequestOutput) -> None:
            self.results[self.first[index] + out.index].add(out)
            if out.finished:
                with self.lock:
                    if out.error is not None:
                        self.errors.append(f"prompts[{index}]: {out.error}")
                    self.remaining -= 1
                    if self.remaining == 0:
                        self.done.set()

        return on_output

    def wait(self) -> list[GenerationOutput]:
        self.done.wait()
        if self.errors:
            raise RuntimeError("; ".join(dict.fromkeys(self.errors)))
        return self.results


def _load_tokenizer(model_dir: Path):  # noqa: ANN202 - a transformers tokenizer or None
    if not any((model_dir / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def _eos_ids(model_config, tokenizer) -> frozenset[int]:  # noqa: ANN001
    ids = set(model_config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return prompts


def _as_lora_list(lora: str | None | Sequence[str | None], count: int) -> list[str | None]:
    if lora is None or isinstance(lora, str):
        return [lora] * count
    adapters = list(lora)
    if len(adapters) != count:
        raise ValueError(f"lora: {len(adapters)} adapters for {count} prompts")
    return adapters


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None,
                    count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"sampling_params: got {len(params)} for {count} prompts")
    if not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError("sampling_params must be SamplingParams objects")
    return params
