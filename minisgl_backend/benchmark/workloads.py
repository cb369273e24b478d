"""Request sets of the benchmarks: token-id prompts with their sampling settings.

Every workload is a pure function of its arguments (a seeded `random.Random`), so runs of
different engines or settings see exactly the same requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from minisgl_backend.core import SamplingParams


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    params: list[SamplingParams]

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        """Requested output tokens (every request runs to max_tokens: ignore_eos)."""
        return sum(p.max_tokens for p in self.params)


def random_tokens(rng: random.Random, vocab_size: int, length: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(length)]


def anchor_workload(
    vocab_size: int, num_requests: int = 256, min_len: int = 100, max_len: int = 1024,
    seed: int = 0, temperature: float = 0.6, max_token_id: int = 10000,
) -> Workload:
    """The anchor offline workload, drawn as upstream mini-sglang's `benchmark/offline/bench.py`.

    From one `random.Random(seed)` (the same stream as upstream's `random.seed(seed)`): every
    prompt in turn, its length `randint(min_len, max_len)` then its ids `randint(0, top)`; then
    every output length `randint(min_len, max_len)`. `top` is `max_token_id`, or the vocabulary's
    last id when the vocabulary is smaller (tiny shapes: a different stream). With the defaults
    and a vocabulary above 10,000 ids: 142,827 input and 133,966 output tokens. Sampling is
    seeded per request (its index); every request runs to its output length (ignore_eos).
    """
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len} and {max_len}")
    rng = random.Random(seed)
    top = min(max_token_id, vocab_size - 1)
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(min_len, max_len))]
               for _ in range(num_requests)]
    params = [SamplingParams(max_tokens=rng.randint(min_len, max_len), temperature=temperature,
                             ignore_eos=True, seed=i) for i in range(num_requests)]
    return Workload(prompts, params)


def shared_prefix_workload(
    vocab_size: int, num_requests: int = 64, prefix_len: int = 2000, suffix_len: int = 32,
    output_len: int = 16, seed: int = 0,
) -> Workload:
    """One random "system prompt" of `prefix_len` tokens shared by every request, each followed
    by its own random suffix; short greedy outputs (a prefix-cache workload)."""
    rng = random.Random(seed)
    prefix = random_tokens(rng, vocab_size, prefix_len)
    prompts = [prefix + random_tokens(rng, vocab_size, suffix_len) for _ in range(num_requests)]
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    return Workload(prompts, [params] * num_requests)


def fixed_workload(
    vocab_size: int, batch_size: int, prompt_len: int, max_tokens: int, seed: int = 0
) -> Workload:
    """`batch_size` random prompts of `prompt_len` tokens, greedy, exactly `max_tokens` each."""
    rng = random.Random(seed)
    prompts = [random_tokens(rng, vocab_size, prompt_len) for _ in range(batch_size)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Workload(prompts, [params] * batch_size)
