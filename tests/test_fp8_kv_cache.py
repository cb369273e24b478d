"""The FP8 KV cache (`kv_cache_dtype="fp8_e4m3"`): K/V are stored as `saturate(value, scale)`
with their layer's scale and attention reads `stored * scale`, the current step's tokens
included, so that outputs do not depend on chunking, prefix hits or the backend.

The pool and the Triton kernels (in Triton's interpreter on CPU) are checked bit for bit
against the torch arithmetic; the engine's greedy output against HF transformers (float32)
whose attention sees its key and value states quantized and dequantized the same way.
GPU-only tests (skipped without CUDA): the compiled kernels, FlashInfer, CUDA graphs.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kernels.kv_store import store_kv
from kernels.qkv_prologue import fused_qk_norm_rope_store
from minisgl_backend import LLM, SamplingParams
from minisgl_backend.core import RowSampling
from minisgl_backend.engine.config import EngineConfig
from minisgl_backend.engine.engine import Engine
from minisgl_backend.engine.protocol import StepMessage
from minisgl_backend.kvcache.pool import PagedKVPool, resolve_kv_dtype
from minisgl_backend.quantization.fp8 import FP8, FP8_MAX, saturate
from tests.conftest import CHECKED, hf_greedy, hf_model_greedy, mixed_prompts
from tests.test_qkv_prologue import LAYER, Case
from tests.test_qkv_prologue import TARGETS as PROLOGUE_TARGETS
from tests.test_triton_attention import (CPU, GPU, LAYERS, SCENARIOS, TARGETS, Target, World,
                                         assert_window_matches_reference)

# The interpreter trips numpy's deprecation of int() on 1-element arrays at every loop bound.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
CUDA = torch.cuda.is_available()
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
# Per-layer scales of the backend tests: none is a power of two (the e4m3 grid moves), and
# random values of a few units saturate under the second layer's.
K_SCALES = [0.37, 0.0061]
V_SCALES = [1.7, 0.0093]
MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == FP8 and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _fp8_pool(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
              head_dim: int, dtype: torch.dtype, device: str) -> PagedKVPool:
    scales = dict(k_scales=K_SCALES[-num_layers:], v_scales=V_SCALES[-num_layers:])
    return PagedKVPool(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype,
                       torch.device(device), kv_dtype=FP8, **scales)


# ----- the pool -------------------------------------------------------------------------------

def test_resolve_kv_dtype() -> None:
    assert resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype("auto", torch.float32) == torch.float32
    assert resolve_kv_dtype("fp8", torch.bfloat16) == FP8
    assert resolve_kv_dtype("fp8_e4m3", torch.float32) == FP8
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_dtype("int8", torch.float32)


def test_pool_stores_saturated_values_and_reads_them_dequantized() -> None:
    gen = torch.Generator().manual_seed(0)
    pool = _fp8_pool(2, 6, 4, 2, 16, torch.float32, "cpu")
    assert pool.quantized and pool.buffer.dtype == FP8 and pool.dtype == torch.float32
    assert [pool.k_scale(i) for i in range(2)] == K_SCALES
    assert [pool.v_scale(i) for i in range(2)] == V_SCALES
    slots = torch.randperm(pool.dummy_slot, generator=gen)[:9]
    # Large values saturate under layer 1's scales (448 * 0.0061 is about 2.7).
    k, v = (torch.randn(9, 2, 16, generator=gen) * 4 for _ in range(2))
    for layer in range(2):
        pool.store(layer, slots, k, v)
        ks, vs = pool.k_scale(layer), pool.v_scale(layer)
        assert same_bits(pool.k_cache(layer)[slots], saturate(k, ks))
        assert same_bits(pool.v_cache(layer)[slots], saturate(v, vs))
        for dtype in (torch.float32, torch.bfloat16):
            k_read, v_read = pool.gather(layer, slots[None, :], dtype)
            assert k_read.shape == (1, 9, 2, 16) and k_read.dtype == dtype
            assert torch.equal(k_read[0], (saturate(k, ks).float() * ks).to(dtype))
            assert torch.equal(v_read[0], (saturate(v, vs).float() * vs).to(dtype))
    assert k.abs().max() > FP8_MAX * K_SCALES[1]  # the saturation was exercised
    assert same_bits(pool.k_cache(0)[pool.dummy_slot], torch.zeros(2, 16, dtype=FP8))


def test_unquantized_pool_ignores_scales() -> None:
    pool = PagedKVPool(2, 4, 2, 1, 8, torch.float32, torch.device("cpu"),
                       k_scales=K_SCALES, v_scales=V_SCALES)
    assert not pool.quantized and pool.kv_dtype == torch.float32
    assert pool.k_scale(1) == pool.v_scale(1) == 1.0
    k = torch.randn(3, 1, 8)
    pool.store(1, torch.tensor([0, 3, 5]), k, -k)
    assert torch.equal(pool.gather(1, torch.tensor([3]), torch.float32)[0][0], k[1])


def test_pool_rejects_bad_scales() -> None:
    with pytest.raises(ValueError, match="2 layers"):
        PagedKVPool(2, 4, 2, 1, 8, torch.float32, torch.device("cpu"), kv_dtype=FP8,
                    k_scales=[1.0])
    with pytest.raises(ValueError, match="positive"):
        PagedKVPool(1, 4, 2, 1, 8, torch.float32, torch.device("cpu"), kv_dtype=FP8,
                    k_scales=[0.0], v_scales=[1.0])


def test_fp8_pages_hold_four_times_the_tokens_of_float32() -> None:
    """What the engine sizes its pool by (`Engine._decide_num_pages`): bytes per page of the
    storage dtype. FP8 pages take a quarter of float32's (CPU's model dtype) and half of
    bfloat16's (a GPU's), so the same memory holds 4x / 2x the tokens."""
    shape = (3, 16, 2, 64)
    fp8 = PagedKVPool.bytes_per_page(*shape, FP8)
    assert 4 * fp8 == PagedKVPool.bytes_per_page(*shape, torch.float32)
    assert 2 * fp8 == PagedKVPool.bytes_per_page(*shape, torch.bfloat16)
    pool = _fp8_pool(2, 10, 16, 2, 64, torch.float32, "cpu")
    assert pool.buffer.nbytes == 11 * PagedKVPool.bytes_per_page(2, 16, 2, 64, FP8)
    assert pool.capacity == 160


def test_engine_sizes_the_pool_by_the_storage_dtype(tiny_models: dict[str, Path],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`Engine._decide_num_pages` on CPU (a share of the RAM, here without the default cap)
    gives an FP8 pool four times the pages of a float32 one."""
    import minisgl_backend.engine.engine as engine_module
    from minisgl_backend.models import ModelConfig

    monkeypatch.setattr(engine_module, "MAX_CPU_DEFAULT_TOKENS", 1 << 60)
    config = EngineConfig(model_dir=str(tiny_models["llama"]), device="cpu")

    def pages(kv_dtype: torch.dtype) -> int:
        engine = SimpleNamespace(model_config=ModelConfig.from_folder(config.model_dir),
                                 config=config, page_size=16, device=torch.device("cpu"),
                                 kv_dtype=kv_dtype)
        return Engine._decide_num_pages(engine, 0)  # type: ignore[arg-type]

    assert abs(pages(FP8) - 4 * pages(torch.float32)) <= 4


# ----- kernels and backends -------------------------------------------------------------------

def fp8_world(target: Target, num_heads: int, num_kv_heads: int, page_size: int) -> World:
    """A `World` whose pools (the Triton backend's, in the target dtype, and the reference's,
    float32) store FP8 with K_SCALES / V_SCALES and hold the same random e4m3 values."""
    world = World(target, num_heads, num_kv_heads, page_size)
    shape = (LAYERS, world.pool.num_pages, page_size, num_kv_heads, world.head_dim)
    world.pool = _fp8_pool(*shape, target.dtype, target.device)
    world.ref_pool = _fp8_pool(*shape, torch.float32, target.device)
    pages = world.pool.buffer[:, :, :-1]
    pages.copy_((torch.randn(pages.shape, generator=world.gen) * 100).to(FP8))
    world.ref_pool.buffer.copy_(world.pool.buffer)
    return world


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_equals_saturate(target: Target, dtype: torch.dtype) -> None:
    """The store kernel rounds as torch does, bit for bit: ties to even, carries into the
    exponent, saturation, subnormals, signed zeros (Triton's interpreter cast gets the first
    two wrong, which the kernels' own rounding avoids)."""
    gen = torch.Generator().manual_seed(1)
    pool = _fp8_pool(2, 8, 4, 2, 32, dtype, target.device)
    every = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    every = every[~every.isnan()].sort().values
    ties = (every[1:] + every[:-1]) / 2  # halfway between neighbours
    k = torch.cat([every, ties, torch.randn(256, generator=gen) * 3, -torch.zeros(16)])
    k = k[torch.randperm(len(k), generator=gen)][: len(k) // 64 * 64].view(-1, 2, 32)
    v = -k.flip(0)
    k, v = k.to(dtype).to(target.device), v.to(dtype).to(target.device)
    slots = torch.randperm(pool.dummy_slot, generator=gen)[: len(k)].to(target.device)
    for layer, scale in ((0, 1.0), (1, K_SCALES[1])):
        store_kv(k, v, pool.k_cache(layer), pool.v_cache(layer), slots, k_scale=scale,
                 v_scale=V_SCALES[layer])
        assert same_bits(pool.k_cache(layer)[slots], saturate(k, scale))
        assert same_bits(pool.v_cache(layer)[slots], saturate(v, V_SCALES[layer]))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("scenario", ["decode", "prefix", "chunked"])
def test_triton_backend_equals_torch_backend(target: Target, page_size: int,
                                             scenario: str) -> None:
    """Store and attention over an FP8 pool (layer 1: scales that saturate), a prefill with
    cached prefixes and a decode step; both backends store the same bits."""
    world = fp8_world(target, 8, 2, page_size)
    phase, reqs = SCENARIOS[scenario]
    batch = world.batch(phase, reqs)
    tri, ref = world.backends()
    tri.prepare(batch, world.page_table)
    q, k, v = world.qkv(len(batch.out_slots))
    k, v = k * 3, v * 3
    out = tri.forward(q, k, v, 1, batch)
    world.assert_close(out, world.reference(ref, batch, 1, q, k, v))
    assert same_bits(world.pool.buffer, world.ref_pool.buffer)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("scenario", ["decode", "prefix"])
def test_triton_sliding_window_equals_torch_backend(target: Target, page_size: int,
                                                    scenario: str) -> None:
    world = fp8_world(target, 8, 2, page_size)
    assert_window_matches_reference(world, world.backends()[0], scenario)


def test_torch_backend_reads_the_steps_own_kv_quantized() -> None:
    """A prefill without prefix attends over saturate-then-dequantize of its own fresh K/V
    (what a later decode step reads back), not over the fresh values."""
    world = fp8_world(CPU, 4, 2, page_size=4)
    reqs = [(0, 11), (0, 5)]
    batch = world.batch("prefill", reqs)
    ref = world.backends()[1]
    ref.prepare(batch, world.page_table)
    q, k, v = world.qkv(16)
    out = ref.forward(q, k, v, 1, batch).view(q.shape)
    ks, vs = K_SCALES[1], V_SCALES[1]
    k_deq, v_deq = saturate(k, ks).float() * ks, saturate(v, vs).float() * vs
    start = 0
    for _, n in reqs:
        part = slice(start, start + n)
        expected = F.scaled_dot_product_attention(
            q[part].transpose(0, 1), k_deq[part].transpose(0, 1), v_deq[part].transpose(0, 1),
            is_causal=True, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[part], expected)
        start += n
    fresh = F.scaled_dot_product_attention(q[:11].transpose(0, 1), k[:11].transpose(0, 1),
                                           v[:11].transpose(0, 1), is_causal=True,
                                           enable_gqa=True).transpose(0, 1)
    assert not torch.allclose(out[:11], fresh, atol=1e-3)


@pytest.mark.parametrize("target", PROLOGUE_TARGETS)
def test_fused_prologue_stores_what_store_kv_stores(target: object) -> None:
    """The fused norm + RoPE + store kernel into an FP8 pool: the rotated K rounded to k's
    dtype (what the same kernel writes into a pool of that dtype) then saturated; V likewise;
    q as without FP8."""
    case = Case(target, (8, 2), 64, qk_norm=True)  # type: ignore[arg-type]
    q_plain = case.run()
    pool = _fp8_pool(LAYERS, case.pool.num_pages, case.pool.page_size, 2, 64,
                     case.q.dtype, case.target.device)  # type: ignore[attr-defined]
    q_fp8 = fused_qk_norm_rope_store(
        case.q, case.k, case.v, case.positions, case.rope.cos_sin_cache(), case.out_slots,
        pool.k_cache(LAYER), pool.v_cache(LAYER), q_norm_weight=case.norms[0],
        k_norm_weight=case.norms[1], eps=1e-6, k_scale=pool.k_scale(LAYER),
        v_scale=pool.v_scale(LAYER))
    assert torch.equal(q_fp8, q_plain)
    slots = case.out_slots
    assert same_bits(pool.k_cache(LAYER)[slots],
                     saturate(case.pool.k_cache(LAYER)[slots], pool.k_scale(LAYER)))
    assert same_bits(pool.v_cache(LAYER)[slots], saturate(case.v, pool.v_scale(LAYER)))


# ----- the engine against HF transformers ---------------------------------------------------

def hf_quantized(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x through an e4m3 KV cache of `scale`, in plain torch (the oracle's own arithmetic)."""
    e4m3 = (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (e4m3.float() * scale).to(x.dtype)


@lru_cache(maxsize=None)
def fp8_kv_hf_model(model_dir: str, k_scale: float = 1.0, v_scale: float = 1.0,
                    quantize: bool = True) -> torch.nn.Module:
    """HF transformers' model (float32, SDPA) whose attention sees its key and value states
    (after RoPE and k-norm, cache included) quantized and dequantized with these scales.
    `quantize=False`: the same registration without the quantization (the patch's control)."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None,
                  **kwargs: object) -> tuple[torch.Tensor, None]:
        if quantize:
            key, value = hf_quantized(key, k_scale), hf_quantized(value, v_scale)
        return sdpa(module, query, key, value, attention_mask, **kwargs)

    name = f"sdpa_kv_e4m3_{k_scale}_{v_scale}_{quantize}"
    AttentionInterface.register(name, attention)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                attn_implementation=name).eval()


def oracle(model_dir: Path, prompts: list[list[int]], k_scale: float = 1.0,
           v_scale: float = 1.0) -> list[list[int]]:
    return hf_model_greedy(fp8_kv_hf_model(str(model_dir), k_scale, v_scale), prompts,
                           MAX_TOKENS)


def test_oracle_patch_is_hf_attention_on_quantized_kv(tiny_models: dict[str, Path]) -> None:
    """Registered without quantization the oracle's attention is HF's own, bit for bit; with
    it the logits move."""
    from tests.conftest import _hf_model

    model_dir = str(tiny_models["qwen3"])
    ids = torch.tensor([mixed_prompts(1)[0]])
    with torch.no_grad():
        plain = _hf_model(model_dir)(ids).logits
        control = fp8_kv_hf_model(model_dir, quantize=False)(ids).logits
        quantized = fp8_kv_hf_model(model_dir)(ids).logits
    assert torch.equal(control, plain)
    assert not torch.allclose(quantized, plain, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_fp8_greedy_equals_oracle(tiny_models: dict[str, Path], arch: str,
                                  page_size: int) -> None:
    """Chunked prefill (16 tokens a step), the same prompts again (prefix hits on every whole
    page) and prompts branching off a long shared prefix: every output equals the oracle."""
    model = tiny_models[arch]
    prompts = mixed_prompts(8)
    shared = mixed_prompts(1, seed=7)[0] * 2
    branched = [shared + p[:6] for p in prompts[:4]]
    with LLM(model, device="cpu", hooks=CHECKED, kv_cache_dtype="fp8_e4m3",
             page_size=page_size, chunked_prefill_size=16) as llm:
        cold = llm.generate(prompts, GREEDY)
        warm = llm.generate(prompts, GREEDY)
        first_branch = llm.generate(branched[:1], GREEDY)
        other_branches = llm.generate(branched[1:], GREEDY)
    expected = oracle(model, prompts)
    assert expected != hf_greedy(model, prompts, MAX_TOKENS)  # FP8 changes some tokens
    assert [o.token_ids for o in cold] == expected
    assert [o.token_ids for o in warm] == expected
    assert any(o.cached_tokens > 0 for o in warm)
    assert all(o.cached_tokens >= len(shared) // page_size * page_size for o in other_branches)
    assert [o.token_ids for o in first_branch + other_branches] == oracle(model, branched)


def engine_greedy(engine: Engine, prompt: list[int]) -> list[int]:
    """MAX_TOKENS greedy tokens of one request in table row 0, driven step by step."""
    pages = -(-(len(prompt) + MAX_TOKENS) // engine.page_size)
    admit = RowSampling.of([(SamplingParams(), 0)], engine.model_config.vocab_size)
    steps = [StepMessage(is_prefill=True, rows=[0], starts=[0], extend_lens=[len(prompt)],
                         tokens=prompt, page_rows=[0], page_counts=[pages],
                         new_pages=list(range(pages)), admit_rows=[0], admit=admit)]
    steps += [StepMessage(is_prefill=False, rows=[0])] * (MAX_TOKENS - 1)
    return [int(engine.launch(msg).wait().tokens[0]) for msg in steps]


def test_checkpoint_scales_equal_oracle(tiny_models: dict[str, Path], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Scales other than 1.0 on the attention layers (as an FP8 checkpoint's loader sets them)
    reach the pool: the engine (in this process) equals the oracle with the same scales."""
    import minisgl_backend.engine.engine as engine_module

    k_scale, v_scale = 0.011, 0.0037  # K and V values above 448 times these saturate
    create_model = engine_module.create_model

    def with_scales(*args: object, **kwargs: object) -> torch.nn.Module:
        model = create_model(*args, **kwargs)
        for layer in model.model.layers:
            layer.self_attn.k_scale, layer.self_attn.v_scale = k_scale, v_scale
        return model

    monkeypatch.setattr(engine_module, "create_model", with_scales)
    model = tiny_models["qwen3"]
    engine = Engine(EngineConfig(model_dir=str(model), device="cpu", page_size=4,
                                 kv_cache_dtype="fp8", max_total_tokens=256), 0,
                    str(tmp_path / "store"))
    assert engine.kv_pool.quantized and engine.kv_pool.k_scale(1) == k_scale
    prompts = mixed_prompts(3)
    outputs = [engine_greedy(engine, p) for p in prompts]
    assert outputs == oracle(model, prompts, k_scale, v_scale)
    assert outputs != oracle(model, prompts)  # the scales changed what was computed


# ----- GPU only -----------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA and HAS_FLASHINFER), reason="needs CUDA and flashinfer")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("scenario", ["decode", "prefix", "mixed"])
def test_flashinfer_equals_torch_backend(page_size: int, scenario: str) -> None:
    from minisgl_backend.attention.flashinfer_backend import FlashInferAttentionBackend

    world = fp8_world(GPU, 8, 2, page_size)
    phase, reqs = SCENARIOS[scenario]
    batch = world.batch(phase, reqs)
    backend = FlashInferAttentionBackend(world.pool, 8, world.head_dim, torch.device("cuda"),
                                         world.page_table.shape[1])
    backend.prepare(batch, world.page_table)
    q, k, v = world.qkv(len(batch.out_slots))
    for window in (0, 21):
        out = backend.forward(q, k, v, 1, batch, window=window)
        ref = world.backends()[1]
        world.assert_close(out, world.reference(ref, batch, 1, q, k, v, window=window))
    assert same_bits(world.pool.buffer, world.ref_pool.buffer)


def gpu_generate(model: Path, prompts: list[list[int]], **settings: object) -> list[list[int]]:
    with LLM(model, device="cuda", hooks=CHECKED, kv_cache_dtype="fp8", **settings) as llm:
        return [o.token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_triton_with_cuda_graphs_equals_oracle(tiny_models: dict[str, Path],
                                                   page_size: int) -> None:
    """Float32 on the GPU: the fused prologue, the Triton kernels and CUDA-graph replays."""
    model = tiny_models["qwen3"]
    prompts = mixed_prompts(8)
    tokens = gpu_generate(model, prompts, dtype="float32", attention_backend="triton",
                          cuda_graph_max_bs=16, page_size=page_size, chunked_prefill_size=32)
    assert tokens == oracle(model, prompts)


@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA and HAS_FLASHINFER), reason="needs CUDA and flashinfer")
def test_gpu_bfloat16_flashinfer_agrees_with_torch_reference(
        tiny_models: dict[str, Path]) -> None:
    """bf16 kernels sum in another order, so a near-tie may flip a later greedy token: the
    first token of every prompt and most whole sequences must agree."""
    model = tiny_models["llama"]
    prompts = mixed_prompts(8)
    reference = gpu_generate(model, prompts, dtype="bfloat16", attention_backend="torch",
                             cuda_graph_max_bs=0, overlap=False)
    fast = gpu_generate(model, prompts, dtype="bfloat16", attention_backend="flashinfer,triton",
                        cuda_graph_max_bs=16, page_size=16)
    assert [t[0] for t in fast] == [t[0] for t in reference]
    assert sum(f == r for f, r in zip(fast, reference)) >= 6, (fast, reference)
