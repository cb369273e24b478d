"""Greedy output of the engine equals HF transformers token for token (float32, CPU).

Every run turns on the scheduler's debug checks, so page accounting (free + cached + in use ==
total) is verified after every step as well.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from minisgl_backend import LLM, SamplingParams
from tests.conftest import CHECKED, hf_greedy, mixed_prompts

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def run_engine(model_dir: Path, prompts: list[list[int]], **settings) -> list:  # noqa: ANN003
    with LLM(model_dir, device="cpu", hooks=CHECKED, **settings) as llm:
        return llm.generate(prompts, GREEDY)


def assert_matches_hf(model_dir: Path, prompts: list[list[int]], outputs: list) -> None:
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)
    assert [o.prompt_tokens for o in outputs] == [len(p) for p in prompts]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_greedy_equals_hf(tiny_models: dict[str, Path], arch: str) -> None:
    prompts = mixed_prompts(8)
    assert_matches_hf(tiny_models[arch], prompts, run_engine(tiny_models[arch], prompts))


def test_llama3_rope_scaling_and_sharded_checkpoint_equal_hf(tmp_path: Path) -> None:
    """Llama 3.1-style frequency scaling, weights split over several safetensors files."""
    from minisgl_backend.testing.tiny_models import build_tiny_model

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    model = build_tiny_model("llama", tmp_path / "llama3", seed=3, max_shard_size="100KB",
                             rope_scaling=rope, rope_parameters=rope, tie_word_embeddings=True)
    assert len(list(model.glob("*.safetensors"))) > 1
    prompts = mixed_prompts(8)
    assert_matches_hf(model, prompts, run_engine(model, prompts))


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_kv_equals_hf(tiny_models: dict[str, Path], arch: str, page_size: int) -> None:
    prompts = mixed_prompts(8)
    outputs = run_engine(tiny_models[arch], prompts, page_size=page_size)
    assert_matches_hf(tiny_models[arch], prompts, outputs)


@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill_equals_hf(tiny_models: dict[str, Path], page_size: int) -> None:
    prompts = mixed_prompts(8)  # up to 80 tokens, computed 16 tokens per step
    outputs = run_engine(tiny_models["qwen3"], prompts, chunked_prefill_size=16,
                         page_size=page_size)
    assert_matches_hf(tiny_models["qwen3"], prompts, outputs)


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefix_cache_hits_equal_cold_run(tiny_models: dict[str, Path], page_size: int) -> None:
    model = tiny_models["llama"]
    prompts = mixed_prompts(8)
    shared = mixed_prompts(1, seed=7)[0] * 2  # a long shared prefix, then distinct tails
    branched = [shared + p[:6] for p in prompts]
    with LLM(model, device="cpu", hooks=CHECKED, page_size=page_size) as llm:
        cold = llm.generate(prompts, GREEDY)
        warm = llm.generate(prompts, GREEDY)  # the same prompts again
        first_branch = llm.generate(branched[:1], GREEDY)
        other_branches = llm.generate(branched[1:], GREEDY)
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    assert_matches_hf(model, prompts, cold)
    long_enough = [o for o, p in zip(warm, prompts) if len(p) > page_size]
    assert long_enough and all(o.cached_tokens > 0 for o in long_enough)
    assert all(o.cached_tokens <= o.prompt_tokens - 1 for o in warm)
    shared_aligned = len(shared) // page_size * page_size
    assert all(o.cached_tokens >= shared_aligned for o in other_branches)
    assert_matches_hf(model, branched, first_branch + other_branches)


def test_naive_cache_equals_hf_without_hits(tiny_models: dict[str, Path]) -> None:
    model = tiny_models["qwen2"]
    prompts = mixed_prompts(8)
    with LLM(model, device="cpu", hooks=CHECKED, cache="naive") as llm:
        first = llm.generate(prompts, GREEDY)
        again = llm.generate(prompts, GREEDY)
    assert all(o.cached_tokens == 0 for o in first + again)
    assert_matches_hf(model, prompts, first)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]


def test_scarce_kv_makes_requests_wait_and_evicts(tiny_models: dict[str, Path]) -> None:
    """A pool of 160 tokens holds about two requests: the rest wait, cached prefixes are
    evicted to make room, and every output is still right."""
    model = tiny_models["llama"]
    prompts = mixed_prompts(8)
    with LLM(model, device="cpu", hooks=CHECKED, max_total_tokens=160) as llm:
        outputs = llm.generate(prompts, GREEDY)
        stats = (llm.scheduler.peak_running, llm.scheduler.cache.evicted_pages)
    assert_matches_hf(model, prompts, outputs)
    peak_running, evicted = stats
    assert peak_running < len(prompts)
    assert evicted > 0


def test_tensor_parallel_2_equals_hf(tiny_models: dict[str, Path]) -> None:
    prompts = mixed_prompts(8)
    outputs = run_engine(tiny_models["llama"], prompts, tp_size=2, page_size=16)
    assert_matches_hf(tiny_models["llama"], prompts, outputs)


def test_tensor_parallel_2_moe_equals_hf(tiny_models: dict[str, Path]) -> None:
    prompts = mixed_prompts(8)
    outputs = run_engine(tiny_models["qwen3_moe"], prompts, tp_size=2)
    assert_matches_hf(tiny_models["qwen3_moe"], prompts, outputs)


def test_default_model_equals_hf(default_model: Path) -> None:
    """SmolLM2-135M-Instruct, chat prompts of mixed lengths, stopping at its real EOS."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    questions = [
        "What is the capital of France?", "Name three primary colors.",
        "Write a haiku about the sea.", "What is 12 times 12?",
        "Explain in one sentence what a CPU does.",
        "List the days of the week, separated by commas, and then say which one is your "
        "favourite and why, in two short sentences.",
        "Translate 'good morning' into Spanish.", "Hi!",
    ]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                           add_generation_prompt=True, tokenize=False)
             for q in questions]
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    params = SamplingParams(max_tokens=24)
    with LLM(default_model, device="cpu", hooks=CHECKED) as llm:
        outputs = llm.generate(prompts, params)
    expected = hf_greedy(default_model, prompts, 24, stop_at_eos=True)
    assert [o.token_ids for o in outputs] == expected
    assert "Paris" in outputs[0].text
    for out in outputs:
        assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("backend", ["torch,triton", "triton,torch"])
def test_triton_and_hybrid_attention_equal_hf(tiny_models: dict[str, Path], backend: str) -> None:
    """The project's Triton kernels (Triton's interpreter on CPU), alone or for one phase."""
    model = tiny_models["qwen3"]
    prompts = mixed_prompts(4)
    assert_matches_hf(model, prompts, run_engine(model, prompts, attention_backend=backend,
                                                 page_size=4))
