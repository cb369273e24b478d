"""Mixed prefill steps (`mixed_prefill=True`): a prefill step also decodes one token of every
running request. Outputs must not change (greedy float32 == HF transformers; seeded sampling,
stops and min_tokens the same as without mixing); fewer steps are needed when requests arrive
while others decode."""

from __future__ import annotations

from pathlib import Path

import pytest

from minisgl_backend import LLM, SamplingParams
from tests.conftest import hf_greedy, mixed_prompts
from tests.test_overlap import mixed_workload

MAX_TOKENS = 10
# Few rows and a small prefill budget: requests are admitted while others decode, and long
# prompts are chunked over several (mixed) steps.
STAGGERED = dict(max_running_requests=3, chunked_prefill_size=24, page_size=4)


def generate(model: Path, prompts: list[list[int]], params: SamplingParams | list,
             **settings) -> tuple[list[list[int]], int]:  # noqa: ANN003
    with LLM(model, device="cpu", debug_checks=True, **settings) as llm:
        outputs = llm.generate(prompts, params)
        steps = llm.scheduler.num_steps
    return [o.token_ids for o in outputs], steps


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_equals_hf_with_fewer_steps(tiny_models: dict[str, Path], arch: str,
                                           overlap: bool) -> None:
    prompts = mixed_prompts(8)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    mixed, mixed_steps = generate(tiny_models[arch], prompts, greedy, mixed_prefill=True,
                                  overlap=overlap, **STAGGERED)
    assert mixed == hf_greedy(tiny_models[arch], prompts, MAX_TOKENS)
    plain, plain_steps = generate(tiny_models[arch], prompts, greedy, mixed_prefill=False,
                                  overlap=overlap, **STAGGERED)
    assert plain == mixed
    assert mixed_steps < plain_steps


def test_sampling_stops_and_min_tokens_are_unchanged(tiny_models: dict[str, Path]) -> None:
    model = tiny_models["qwen3"]
    prompts = mixed_prompts(10)
    probe, _ = generate(model, prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    params = mixed_workload(prompts, probe)
    mixed, _ = generate(model, prompts, params, mixed_prefill=True, **STAGGERED)
    plain, _ = generate(model, prompts, params, mixed_prefill=False, **STAGGERED)
    assert mixed == plain


def test_triton_extend_kernel_runs_mixed_steps(tiny_models: dict[str, Path]) -> None:
    """The project's Triton prefill (extend) kernel, in Triton's interpreter on CPU, with decode
    rows of one token in its prefill steps."""
    model = tiny_models["llama"]
    prompts = mixed_prompts(4)
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    tokens, _ = generate(model, prompts, greedy, mixed_prefill=True,
                         attention_backend="triton,torch", max_running_requests=2,
                         chunked_prefill_size=24, page_size=4)
    assert tokens == hf_greedy(model, prompts, 6)
