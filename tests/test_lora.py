"""LoRA adapters: the engine's greedy output under each adapter equals HF transformers + PEFT
float32 token for token, with adapters of different ranks and targets and base-only rows mixed
in one `generate` call, on two architectures; with page sizes 1 and 16, chunked prefill,
prefix-cache hits (the same prompt under two adapters and the base: three outputs, each its
oracle's), speculative decoding, tensor parallelism 2, and fewer device slots than adapters
(adapters evicted and loaded again mid-run). Bad adapters and unknown names are refused by name.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from minisgl_backend import LLM, SamplingParams
from minisgl_backend.core import Req
from minisgl_backend.testing.tiny_models import build_tiny_model
from tests.conftest import CHECKED, mixed_prompts

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
# name -> (rank, alpha, target modules, rsLoRA)
ADAPTERS = {
    "qv4": (4, 8, ["q_proj", "v_proj"], False),
    "all8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"], True),
    "mlp2": (2, 4, ["o_proj", "gate_proj", "down_proj"], False),
}


def make_adapter(base: Path, folder: Path, rank: int, alpha: int, targets: list[str],
                 rslora: bool, seed: int) -> Path:
    """A PEFT LoRA adapter of `base` with random (non-zero) A and B, saved by PEFT itself. The
    values are float16 numbers (TensorRT-LLM's `lora_weights` carry them exactly)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                        init_lora_weights=False, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # B of a size that moves the tiny model's greedy tokens
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
            if "lora_" in name:
                param.copy_(param.half().float())
    peft_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """arch -> {"base": folder, adapter name: folder}."""
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for arch in ("llama", "qwen3"):
        base = build_tiny_model(arch, root / arch, seed=4)
        out[arch] = {"base": base, **{
            name: make_adapter(base, root / f"{arch}-{name}", *spec, seed=i)
            for i, (name, spec) in enumerate(ADAPTERS.items())}}
    return out


@lru_cache(maxsize=None)
def _peft_model(base: str, adapters: tuple[tuple[str, str], ...]) -> torch.nn.Module:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    (first, folder), *rest = adapters
    peft_model = PeftModel.from_pretrained(model, folder, adapter_name=first)
    for name, other in rest:
        peft_model.load_adapter(other, adapter_name=name)
    return peft_model.eval()


def oracle(folders: dict[str, Path], prompts: list[list[int]],
           loras: list[str | None]) -> list[list[int]]:
    """PEFT's greedy tokens of each prompt under its adapter (None: adapters disabled)."""
    model = _peft_model(str(folders["base"]), tuple(
        (name, str(folders[name])) for name in ADAPTERS))
    outputs = []
    with torch.no_grad():
        for prompt, lora in zip(prompts, loras):
            ids = torch.tensor([prompt])
            kwargs = dict(max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
                          eos_token_id=None)
            if lora is None:
                with model.disable_adapter():
                    out = model.generate(input_ids=ids, **kwargs)
            else:
                model.set_adapter(lora)
                out = model.generate(input_ids=ids, **kwargs)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def adapters_setting(folders: dict[str, Path]) -> str:
    return ",".join(f"{name}={folders[name]}" for name in ADAPTERS)


def check(folders: dict[str, Path], prompts: list[list[int]], loras: list[str | None],
          **settings) -> None:  # noqa: ANN003
    """One call cold, the same call again warm (prefix-cache hits): both equal PEFT's."""
    expected = oracle(folders, prompts, loras)
    with LLM(folders["base"], device="cpu", hooks=CHECKED, max_lora_rank=8,
             lora_adapters=adapters_setting(folders), **settings) as llm:
        cold = llm.generate(prompts, GREEDY, lora=loras)
        warm = llm.generate(prompts, GREEDY, lora=loras)
    assert [o.token_ids for o in cold] == expected
    assert [o.token_ids for o in warm] == expected
    assert sum(o.cached_tokens for o in warm) > 0


MIXED = ["qv4", None, "all8", "mlp2", "all8", None, "qv4", "mlp2"]


@pytest.mark.parametrize("arch, settings", [
    ("llama", dict(page_size=1, chunked_prefill_size=16)),
    ("qwen3", dict(page_size=16)),
    ("qwen3", dict(page_size=16, tp_size=2)),
    ("llama", dict(page_size=16, max_loras=2)),  # 3 adapters, 2 slots: evicted and reloaded
    ("llama", dict(speculative="ngram")),
])
def test_mixed_adapters_equal_peft(models: dict[str, dict[str, Path]], arch: str,
                                   settings: dict) -> None:
    check(models[arch], mixed_prompts(8), MIXED, **settings)


def test_same_prompt_under_two_adapters_and_the_base(
        models: dict[str, dict[str, Path]]) -> None:
    """The prefix cache keys KV by adapter: three different outputs, each PEFT's."""
    prompt = mixed_prompts(2)[1]
    loras = [None, "qv4", "all8", None, "qv4", "all8"]
    expected = oracle(models["llama"], [prompt] * 6, loras)
    assert len({tuple(tokens) for tokens in expected}) == 3
    check(models["llama"], [prompt] * 6, loras, page_size=4)


def test_unknown_adapter_names_and_bad_adapters_are_refused(
        models: dict[str, dict[str, Path]], tmp_path: Path) -> None:
    folders = models["llama"]
    with LLM(folders["base"], device="cpu", max_lora_rank=8,
             lora_adapters=adapters_setting(folders)) as llm:
        with pytest.raises(ValueError, match="prompts\\[1\\]: lora: unknown adapter 'nope'"):
            llm.generate([[5, 6, 7], [8, 9]], GREEDY, lora=["qv4", "nope"])
        assert len(llm.generate([[5, 6, 7]], GREEDY, lora="qv4")[0].token_ids) == MAX_TOKENS
    with pytest.raises(ValueError, match="r' = 8 is not supported: above max_lora_rank"):
        LLM(folders["base"], device="cpu", max_lora_rank=4,
            lora_adapters=adapters_setting(folders))
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((folders["qv4"] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="'dora'.*'use_dora' = True is not supported"):
        LLM(folders["base"], device="cpu", lora_adapters=f"dora={dora}")
    with pytest.raises(ValueError, match="lora_adapters"):
        LLM(folders["base"], device="cpu", lora_adapters="no-folder")


def test_adapter_slots_evict_the_least_recently_used_free_slot() -> None:
    from minisgl_backend.scheduler.lora import AdapterSlots

    slots = AdapterSlots("a=/x,b=/y,c=/z", max_loras=2)
    assert slots.acquire(1) == (0, True) and slots.acquire(2) == (1, True)
    assert not slots.can_acquire(3)  # both held
    slots.release(0)
    assert slots.acquire(3) == (0, True)  # a's slot, free, now c's
    assert slots.acquire(3) == (0, False)  # resident: shared, no load
    slots.release(1)
    assert slots.acquire(2) == (1, False)  # b is still there
    with pytest.raises(ValueError, match="unknown adapter 'd'"):
        slots.id_of("d")


def test_adapters_loaded_at_run_time_equal_peft(models: dict[str, dict[str, Path]]) -> None:
    """Loaded after start (two slots for three adapters), unloaded: new requests naming it are
    refused, the others unchanged."""
    folders = models["qwen3"]
    prompts = mixed_prompts(8)
    expected = oracle(folders, prompts, MIXED)
    with LLM(folders["base"], device="cpu", hooks=CHECKED, enable_lora=True, max_lora_rank=8,
             max_loras=2, page_size=16) as llm:
        with pytest.raises(ValueError, match="unknown adapter 'qv4'"):
            llm.generate(prompts[:1], GREEDY, lora="qv4")
        for name in ADAPTERS:
            llm.load_lora(name, folders[name])
        with pytest.raises(ValueError, match="'qv4' is already loaded"):
            llm.load_lora("qv4", folders["qv4"])
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, lora=MIXED)] == expected
        llm.unload_lora("all8")
        with pytest.raises(ValueError, match="unknown adapter 'all8'"):
            llm.generate(prompts[:1], GREEDY, lora="all8")
        kept = [i for i, name in enumerate(MIXED) if name != "all8"]
        outputs = llm.generate([prompts[i] for i in kept], GREEDY, lora=[MIXED[i] for i in kept])
        assert [o.token_ids for o in outputs] == [expected[i] for i in kept]
    with LLM(folders["base"], device="cpu") as llm, pytest.raises(ValueError, match="LoRA is off"):
        llm.load_lora("qv4", folders["qv4"])


def test_adapters_that_do_not_fit_the_base_are_refused(
        models: dict[str, dict[str, Path]], tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(models["llama"]["qv4"], bad)
    tensors = load_file(bad / "adapter_model.safetensors")
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[name] = torch.zeros(4, 32)  # the base's hidden size is 64
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with LLM(models["llama"]["base"], device="cpu", enable_lora=True, max_lora_rank=8) as llm:
        with pytest.raises(ValueError, match=r"q_proj.lora_A.weight' has shape \(4, 32\), "
                                             r"the base model needs \(4, 64\)"):
            llm.load_lora("bad", bad)
        llm.load_lora("good", models["llama"]["qv4"])  # the engine keeps serving
        assert len(llm.generate([[5, 6]], GREEDY, lora="good")[0].token_ids) == MAX_TOKENS


def test_default_model_adapter_changes_outputs_and_unloading_restores_them(
        default_model: Path, tmp_path: Path) -> None:
    """The real default model with a rank-8 adapter whose B is non-zero: its answers differ;
    base requests beside it, and after it is unloaded, answer exactly as before."""
    folder = make_adapter(default_model, tmp_path / "adapter", 8, 16, ["q_proj", "v_proj"],
                          False, seed=7)
    prompt = "The capital of France is"
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with LLM(default_model, device="cpu", enable_lora=True, max_lora_rank=8) as llm:
        base = llm.generate(prompt, params)[0].token_ids
        llm.load_lora("tuned", folder)
        tuned, beside = (o.token_ids for o in llm.generate([prompt, prompt], params,
                                                             lora=["tuned", None]))
        llm.unload_lora("tuned")
        after = llm.generate(prompt, params)[0].token_ids
    assert tuned != base
    assert beside == base and after == base


def test_host_copies_beyond_max_cpu_loras_are_read_again(
        models: dict[str, dict[str, Path]]) -> None:
    """One device slot, one host copy, three adapters taking turns: each is freed and read
    again from its folder, and the outputs still equal PEFT's."""
    folders = models["llama"]
    prompts = mixed_prompts(6)
    loras = ["qv4", "all8", "mlp2", "qv4", "mlp2", "all8"]
    expected = oracle(folders, prompts, loras)
    with LLM(folders["base"], device="cpu", hooks=CHECKED, max_lora_rank=8, max_loras=1,
             max_cpu_loras=1, lora_adapters=adapters_setting(folders)) as llm:
        for prompt, lora, tokens in zip(prompts, loras, expected):
            assert llm.generate([prompt], GREEDY, lora=lora)[0].token_ids == tokens
        assert len(llm.scheduler.loras.engine_has) == 1


def test_slots_drop_host_copies_they_do_not_hold() -> None:
    from minisgl_backend.engine.protocol import StepMessage
    from minisgl_backend.scheduler.lora import AdapterSlots

    slots = AdapterSlots("a=/x,b=/y,c=/z", max_loras=1, max_cpu_loras=1)
    req = Req(uid=0, input_ids=[1], prompt_len=1, sampling_params=SamplingParams(), seed=0,
              table_idx=0, lora_id=3)
    req.lora_slot, req.lora_load = slots.acquire(3)
    msg = StepMessage(is_prefill=True)
    slots.admit(msg, req)
    assert list(msg.lora_drop_ids) == [1, 2]  # startup copies beyond the limit
    assert list(msg.lora_read_ids) == []  # c was read at startup
    assert list(msg.lora_load_slots) == [0] and list(msg.lora_load_ids) == [3]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("graph_max_bs, overlap", [(0, False), (16, True)])
def test_gpu_float32_adapters_equal_peft(models: dict[str, dict[str, Path]], graph_max_bs: int,
                                         overlap: bool) -> None:
    """On a GPU (float32, the LoRA kernels; with graphs on, decode steps replay the LoRA or
    the plain graphs as their rows take adapters or not)."""
    folders = models["qwen3"]
    prompts = mixed_prompts(8)
    expected = oracle(folders, prompts, MIXED)
    with LLM(folders["base"], device="cuda", dtype="float32", hooks=CHECKED, max_lora_rank=8,
             lora_adapters=adapters_setting(folders), attention_backend="triton",
             cuda_graph_max_bs=graph_max_bs, overlap=overlap) as llm:
        outputs = llm.generate(prompts, GREEDY, lora=MIXED)
    assert [o.token_ids for o in outputs] == expected
