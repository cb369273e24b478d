"""Request sets of the benchmarks: token-id prompts with their sampling settings.

Every workload is a pure function of its arguments (a seeded `random.Random`, or fixed texts), so
runs of different engines or settings see exactly the same requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from minisgl_backend.core import SamplingParams
from minisgl_backend.tokenizer import encode_chat

QUESTIONS = (
    "What is the capital of France?", "Explain photosynthesis in simple terms.",
    "Write a short poem about the sea.", "How do I reverse a list in Python?",
    "Give three tips for better sleep.", "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet.", "Why is the sky blue?",
    "Describe how a bicycle works.", "What are prime numbers? Give examples.",
    "How does a refrigerator keep food cold?",
    "Suggest a name for a friendly robot and explain it.",
    "What is the difference between weather and climate?", "Explain what a hash table is.",
    "Write a haiku about autumn leaves.", "List some healthy breakfast ideas.",
)
CONTEXT_SENTENCES = (
    "The library opens at nine in the morning and closes at six in the evening.",
    "Many students prefer to study in the quiet reading room on the second floor.",
    "Last year the city planted more than two thousand trees along its main avenues.",
    "A small bakery near the station sells fresh bread and pastries every day.",
    "The museum recently added a new wing dedicated to ancient maritime history.",
    "Volunteers meet every Saturday to clean the beach and sort recyclable waste.",
    "The river that crosses the town used to power several old flour mills.",
    "Local farmers bring vegetables, cheese and honey to the market on Sundays.",
    "An old lighthouse stands on the rocky cape at the northern end of the bay.",
    "The school choir won a regional competition with a medley of folk songs.",
    "Cyclists can follow a marked trail that runs along the canal for forty kilometres.",
    "In winter the lake sometimes freezes thick enough for people to skate on it.",
)
# Context sentences per prompt: spreads prompt lengths from ~40 to ~220 tokens.
CONTEXT_COUNTS = (0, 11, 2, 7, 0, 5, 9, 1, 12, 3, 6, 0, 10, 4, 8, 12)
# Passages a "repeat this" request asks for again: outputs that copy their input.
PASSAGES = (
    "The quick brown fox jumps over the lazy dog. The dog did not move, because it was "
    "sleeping in the warm afternoon sun next to the old red barn on the hill.",
    "def add(a, b):\n    return a + b\n\n\ndef multiply(a, b):\n    return a * b\n",
    "Our meeting is moved to Thursday at 3 pm in room 204. Please bring the quarterly report "
    "and the budget draft, and send your slides to Maria before noon.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens in "
    "the chloroplasts of plant cells, mostly in the leaves.",
)
ASKS = ("Repeat this text exactly, word for word:\n\n", "Rewrite this text without changes:\n\n")


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
        """Requested output tokens (every request runs to max_tokens when it ignores EOS)."""
        return sum(p.max_tokens for p in self.params)


def random_tokens(rng: random.Random, vocab_size: int, length: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(length)]


def anchor_workload(
    vocab_size: int, num_requests: int = 256, min_len: int = 100, max_len: int = 1024,
    seed: int = 0, temperature: float = 0.6, max_token_id: int = 10000,
) -> Workload:
    """The anchor offline workload, drawn as upstream mini-sglang's `benchmark/offline/bench.py`
    from `random.Random(seed)`: every prompt's length `randint(min_len, max_len)` then its ids
    `randint(0, top)` (`top`: `max_token_id` or the vocabulary's last id), then every output
    length. With the defaults and a vocabulary above 10,000 ids: 142,827 input and 133,966 output
    tokens. Sampling is seeded per request (its index), every request runs to its length."""
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


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """A user message through the chat template, or plain tokens where the tokenizer has none
    (a shape's benchmark tokenizer)."""
    if getattr(tokenizer, "chat_template", None):
        return encode_chat(tokenizer, [{"role": "user", "content": text}])
    return list(tokenizer.encode(text))


def chat_text(i: int, context: bool = True) -> str:
    """The i-th chat request: a question, with `context` after some background sentences."""
    count = CONTEXT_COUNTS[i % len(CONTEXT_COUNTS)] if context else 0
    background = " ".join(CONTEXT_SENTENCES[(i + j) % len(CONTEXT_SENTENCES)]
                          for j in range(count))
    question = QUESTIONS[i % len(QUESTIONS)]
    return f"Background: {background}\n\nQuestion: {question}" if background else question


def repeat_text(i: int) -> str:
    """The i-th "repeat this passage" request, whose answer copies its input."""
    return ASKS[i // len(PASSAGES) % len(ASKS)] + PASSAGES[i % len(PASSAGES)]


def text_workload(tokenizer: Any, texts: list[str], max_tokens: int,
                  ignore_eos: bool = True) -> Workload:
    """Greedy requests of `texts` (chat-templated where the tokenizer can)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    return Workload([encode_text(tokenizer, t) for t in texts], [params] * len(texts))
