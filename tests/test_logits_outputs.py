"""Returned logits (`return_context_logits`, `return_generation_logits`) against HF transformers
float32 on CPU: the prompt's logits are HF's at every prompt position, a generated token's are
the raw logits HF computes at the position that produced it (before any sampling control).
Requests that ask for none come back without them and unchanged, under every engine setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

from minisgl_backend import LLM, SamplingParams
from tests.conftest import CHECKED, _hf_model

MAX_TOKENS = 6
TOL = 1e-4  # float32 engine vs HF
PROMPTS = [
    [5, 17, 99, 3, 250, 41, 7, 12, 88, 301, 2, 64, 19, 33],  # longer than a chunk of 4 or 16
    [9, 8, 7],
    [14, 15, 92, 65, 35, 89, 79],
    [200, 100, 50, 25, 12, 6],
]


def hf_logits(model_dir: Path, seq: list[int]) -> np.ndarray:
    with torch.no_grad():
        return _hf_model(str(model_dir))(torch.tensor([seq])).logits[0].float().numpy()


def mix() -> list[SamplingParams]:
    both = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, return_context_logits=True,
                          return_generation_logits=True)
    return [
        both,
        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),  # asks for none
        # penalties and bias edit the logits before sampling: the returned ones are raw
        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.5,
                       logit_bias={3: 5.0}, return_generation_logits=True),
        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, seed=3, n=2,
                       return_context_logits=True, return_generation_logits=True),
    ]


def check(model_dir: Path, outputs: list) -> None:
    """Outputs of `mix()` over PROMPTS (the n=2 request last, two results)."""
    assert len(outputs) == 5
    by_prompt = [[outputs[0]], [outputs[1]], [outputs[2]], outputs[3:]]
    for prompt, params, group in zip(PROMPTS, mix(), by_prompt):
        for out in group:
            full = hf_logits(model_dir, prompt + out.token_ids)
            if params.return_generation_logits:
                assert out.generation_logits.shape == (MAX_TOKENS, full.shape[1])
                np.testing.assert_allclose(out.generation_logits,
                                           full[len(prompt) - 1 : -1], atol=TOL)
            else:
                assert out.generation_logits is None
                assert out.token_ids == [int(t) for t in
                                         _greedy(model_dir, prompt, MAX_TOKENS)]
            if params.return_context_logits and out.index == 0:
                assert out.cached_tokens == 0  # computed in full, never from the cache
                np.testing.assert_allclose(out.context_logits, full[: len(prompt)], atol=TOL)
            else:
                assert out.context_logits is None


def _greedy(model_dir: Path, prompt: list[int], steps: int) -> list[int]:
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(np.argmax(hf_logits(model_dir, seq)[-1])))
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def engine(tiny_models: dict[str, Path]) -> Iterator[LLM]:
    with LLM(tiny_models["llama"], device="cpu", hooks=CHECKED) as llm:
        yield llm


def test_logits_equal_hf_and_bypass_the_prefix_cache(engine: LLM,
                                                     tiny_models: dict[str, Path]) -> None:
    model = tiny_models["llama"]
    check(model, engine.generate(PROMPTS, mix()))
    # the same prompts again: the plain request hits the prefix cache, the ones that return
    # their prompt's logits compute it again (and get the same logits)
    again = engine.generate(PROMPTS, mix())
    check(model, again)
    assert again[1].cached_tokens > 0


@pytest.mark.parametrize("settings", [
    {"overlap": False},
    {"chunked_prefill_size": 4},
    {"chunked_prefill_size": 16, "page_size": 16},
    {"chunked_prefill_size": 8, "max_running_requests": 2},
    {"tp_size": 2},
], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_logits_under_engine_settings(tiny_models: dict[str, Path], settings: dict) -> None:
    model = tiny_models["llama"]
    with LLM(model, device="cpu", hooks=CHECKED, **settings) as llm:
        check(model, llm.generate(PROMPTS, mix()))


def test_default_model_context_logits_equal_hf(default_model: Path) -> None:
    with LLM(default_model, device="cpu", chunked_prefill_size=4) as llm:
        prompt = llm.tokenizer.encode("The capital of France is", add_special_tokens=False)
        out = llm.generate([prompt], SamplingParams(max_tokens=3, return_context_logits=True,
                                                    return_generation_logits=True))[0]
    full = hf_logits(default_model, prompt + out.token_ids)
    np.testing.assert_allclose(out.context_logits, full[: len(prompt)], atol=TOL)
    np.testing.assert_allclose(out.generation_logits, full[len(prompt) - 1 : -1], atol=TOL)
