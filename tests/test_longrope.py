"""Phi-3 with LongRoPE equals HF around its pretraining length (CPU, float32): a request whose
sequence crosses it is computed whole again in the long frequencies, as HF's generate does;
prompts past it take the long frequencies in every chunk; KV of the two sets never meets
through the prefix cache; penalties and speculative verify steps keep their state across the
restart. The reference is HF's forward of the whole sequence at every step
(`conftest.hf_greedy_whole`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl_backend import LLM, SamplingParams
from minisgl_backend.testing.tiny_models import TINY_LONGROPE_ORIGINAL, build_tiny_model
from tests.conftest import CHECKED, _hf_model, hf_greedy, hf_greedy_whole

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("phi3_longrope", tmp_path_factory.mktemp("longrope") / "m", seed=0)


def crossing_prompts() -> list[list[int]]:
    """Prompts that cross the pretraining length within MAX_TOKENS (the last one exactly at
    it: its first decode step crosses), one that stays below and one past it."""
    gen = torch.Generator().manual_seed(0)
    lengths = (22, 25, 27, 29, 30, 31, 32, 26, 8, TINY_LONGROPE_ORIGINAL + 9)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in lengths]


def run(model: Path, prompts: list[list[int]], params: SamplingParams = GREEDY,
        **settings: object) -> list[list[int]]:
    with LLM(model, device="cpu", hooks=CHECKED, **settings) as llm:
        return [o.token_ids for o in llm.generate(prompts, params)]


def test_the_restart_changes_the_output(model: Path) -> None:
    """Keeping the short-frequency KV past the crossing (what the engine did before) gives
    other tokens than HF for some of these prompts: the test below can fail."""
    hf = _hf_model(str(model))
    prompt = crossing_prompts()[6]  # 32 tokens: the next one is past the length
    ids = torch.tensor([prompt + [7]])
    with torch.no_grad():
        cache = hf(ids[:, :-1], use_cache=True).past_key_values
        kept = hf(ids[:, -1:], past_key_values=cache, use_cache=True).logits[0, -1]
        whole = hf(ids, use_cache=False).logits[0, -1]
    assert not torch.allclose(kept, whole, atol=1e-4)


@pytest.mark.parametrize("settings", [
    {"page_size": 1, "chunked_prefill_size": 16},
    {"page_size": 16, "overlap": False},
    {"page_size": 4, "tp_size": 2},
    {"page_size": 16, "chunked_prefill_size": 8, "max_running_requests": 2},
], ids=["page1-chunked", "page16-no-overlap", "page4-tp2", "page16-chunk8-admitted-over-time"])
def test_crossing_requests_equal_hf(model: Path, settings: dict) -> None:
    prompts = crossing_prompts()
    assert run(model, prompts, **settings) == hf_greedy(model, prompts, MAX_TOKENS)


def test_prefix_hits_keep_the_two_frequency_sets_apart(model: Path) -> None:
    """A prompt past the length sharing 24 tokens with one below it (whose short-frequency KV
    is cached, page-aligned), then the same requests again (their long KV now cached too)."""
    short = crossing_prompts()[0][:24]
    long = short + crossing_prompts()[9][:20]
    prompts = [short, long, short + [5, 6], long + [9]]
    expected = hf_greedy(model, prompts, MAX_TOKENS)
    with LLM(model, device="cpu", hooks=CHECKED, page_size=4) as llm:
        first = [o.token_ids for o in llm.generate(prompts[:1], GREEDY)]
        rest = [o.token_ids for o in llm.generate(prompts[1:], GREEDY)]
        again = llm.generate(prompts, GREEDY)
    assert first + rest == expected
    assert [o.token_ids for o in again] == expected
    assert sum(o.cached_tokens for o in again) > 0


def test_penalties_count_across_the_restart(model: Path) -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    prompts = crossing_prompts()[2:7]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.5)
    hf = _hf_model(str(model))
    expected = [hf_greedy_whole(hf, p, MAX_TOKENS, [RepetitionPenaltyLogitsProcessor(1.5)])
                for p in prompts]
    assert run(model, prompts, params, page_size=16, chunked_prefill_size=16) == expected


def test_speculative_verify_rows_stop_at_the_crossing(model: Path) -> None:
    """ngram drafts on repetitive prompts: a verify row never computes past the length in
    the short frequencies, and the output is HF's."""
    prompts = [([11, 12, 13, 14] * 8)[:n] for n in (23, 27, 30)]
    with LLM(model, device="cpu", hooks=CHECKED, page_size=16, speculative="ngram",
             num_speculative_tokens=4) as llm:
        out = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.scheduler.speculator.accepted > 0
    assert out == hf_greedy(model, prompts, MAX_TOKENS)


def test_drafts_end_before_the_length() -> None:
    from minisgl_backend.core import Req
    from minisgl_backend.kvcache import create_prefix_cache
    from minisgl_backend.scheduler.cache import CacheManager
    from minisgl_backend.scheduler.speculation import Speculator
    from minisgl_backend.speculative import SpeculativeConfig

    cache = CacheManager(64, 4, create_prefix_cache("radix", 4), long_rope_from=32)
    config = SpeculativeConfig(speculative="ngram", num_speculative_tokens=4)
    speculator = Speculator(config, False, 4, cache.short_rope_room, synthetic_acceptance=1.0)
    # No n-gram repeats: the synthetic acceptance drafts as many tokens as allowed.
    req = Req(uid=0, input_ids=list(range(100, 130)), prompt_len=28, sampling_params=GREEDY,
              seed=0)
    req.cached_len = req.device_len = 29  # the next step computes position 29
    speculator.draft([req], set(), 0)
    assert len(req.drafts) == 2  # positions 29, 30, 31: below 32
    req.device_len, req.long_rope = 29, True
    speculator.draft([req], set(), 0)
    assert len(req.drafts) == 4


def test_restart_caches_the_short_kv_and_starts_the_long_one_apart() -> None:
    from minisgl_backend.core import Req
    from minisgl_backend.kvcache import create_prefix_cache
    from minisgl_backend.scheduler.cache import CacheManager
    from minisgl_backend.scheduler.prefill import PrefillManager
    from minisgl_backend.scheduler.table import RowAllocator

    cache = CacheManager(32, 4, create_prefix_cache("radix", 4), long_rope_from=8)
    prefill = PrefillManager(cache, RowAllocator(2), chunk_size=64, max_running=2)
    req = Req(uid=0, input_ids=list(range(10, 16)), prompt_len=6, sampling_params=GREEDY,
              seed=0)
    prefill.add(req)
    assert prefill.schedule([])[0] == [req] and not req.long_rope
    req.cached_len = 6
    cache.grow(req)
    cache.cache_prefix(req)
    req.input_ids += [20, 21, 22]  # two decode steps, then the token of the crossing step
    req.cached_len = req.device_len = 8
    cache.grow(req)
    assert cache.short_rope_room(req) == 0
    short_pages = list(req.pages)

    cache.restart_long(req)
    prefill.restart(req)
    assert req.long_rope and req.prefill_len == 9 and req.cached_len == 0 and not req.pages
    assert req.cache_handle is None  # it holds nothing until its restart starts
    # The short KV of the first 8 tokens is cached for short requests, not for long ones.
    short_twin = Req(uid=1, input_ids=req.input_ids[:8] + [1], prompt_len=9,
                     sampling_params=GREEDY, seed=0)
    assert cache.prefix_cache.match(short_twin.input_ids[:8]).pages == short_pages
    short_twin.long_rope = True
    assert cache.match(short_twin).cached_len == 0
    cache.check_accounting([req])
    # The restart computes every token so far in one prefill chunk; then it decodes.
    batch, admitted = prefill.schedule([])
    assert batch == [req] and not admitted and req.device_len == 9 and req.prompt_done
    assert not prefill.restarting and not prefill.has_work
    # Aborted while restarting: nothing is left behind.
    prefill.restart(req)
    assert prefill.remove(req) and not prefill.restarting


def test_scarce_kv_restarts_wait_for_their_pages(model: Path) -> None:
    """Four samples of one prompt share its cached KV (6 pages each of 4 tokens, plus 4 own
    pages); each restart needs all 10 of its pages anew, which the pool cannot give the four
    at once: they wait, one after another, and every output is HF's."""
    prompt = crossing_prompts()[1]  # 25 tokens: 37 with the output, past 32
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, n=4)
    with LLM(model, device="cpu", hooks=CHECKED, page_size=4,
             max_total_tokens=24 * 4) as llm:
        assert llm.scheduler.cache.num_pages < 4 * 10
        out = [o.token_ids for o in llm.generate([prompt], params)]
        assert llm.scheduler.peak_running == 4
    assert out == hf_greedy(model, [prompt], MAX_TOKENS) * 4
