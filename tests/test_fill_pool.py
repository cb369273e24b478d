"""The mask-fill workers (`grammar.fill_pool`): their rows equal what the scheduler's own
matchers fill, along random tokens, with mirrors made, caught up, dropped and remade; a dead
worker leaves the fills to the scheduler; and generation with the workers on is identical."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from minisgl_backend import LLM, SamplingParams
from minisgl_backend.engine.mask_buffer import MaskBuffer
from minisgl_backend.grammar import Guide, allowed_tokens, fill_masks, guide_of, mask_words
from minisgl_backend.grammar.fill_pool import MaskFillPool
from minisgl_backend.grammar.guide import accept_tokens
from minisgl_backend.models import ModelConfig
from tests.test_structured_output import KV_TOKENS, REGEXES, SCHEMAS, _mix, compile_guide

READY_S = 120.0
SLOTS = 24


@pytest.fixture
def pool_of(default_model: Path):
    pools = []

    def make(workers: int, masks: MaskBuffer) -> MaskFillPool:
        pool = MaskFillPool(workers, masks, min_rows=1)
        pool.start(compile_guide(default_model, SamplingParams(regex="a")).tokenizer_info)
        assert pool.wait_ready(READY_S)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


def _new_guide(model: Path, rng: random.Random) -> Guide:
    params = rng.choice([SamplingParams(json_schema=SCHEMAS["nested"]),
                         SamplingParams(json_schema=SCHEMAS["array_of_numbers"]),
                         SamplingParams(regex=REGEXES[0])])
    stop_ids = rng.choice([set(), {2}])  # none: the grammar ends the request itself
    return Guide(compile_guide(model, params), stop_ids, guide_of(params), mirrored=True)


def test_pool_rows_equal_the_scheduler_matchers_along_random_tokens(default_model: Path,
                                                                    pool_of) -> None:
    vocab = ModelConfig.from_folder(default_model).vocab_size
    masks = MaskBuffer(SLOTS, mask_words(vocab))
    pool = pool_of(2, masks)
    rng = random.Random(0)
    guides = [_new_guide(default_model, rng) for _ in range(10)]
    replaced = 0
    for step in range(40):
        half = step % 2
        rows = rng.sample(range(len(guides)), rng.randint(1, len(guides)))
        chosen = [guides[i] for i in rows]
        slots = rng.sample(range(SLOTS), len(chosen))
        view = masks.view(half, SLOTS)
        view[:] = 0
        # Every third step the scheduler's thread fills: the mirrors then catch up on two
        # tokens at once.
        if step % 3 == 2:
            fill_masks(chosen, view, slots)
        else:
            assert pool.fill(chosen, half, SLOTS, slots)
        expected = np.zeros((len(chosen), masks.words), dtype=np.int32)
        for i, guide in enumerate(chosen):
            guide.fill(expected, i)
        assert (view[slots] == expected).all(), f"step {step}"
        picks = [int(rng.choice(allowed_tokens(expected[i]))) for i in range(len(chosen))]
        if step % 2:
            assert all(accept_tokens(chosen, picks))
        else:
            assert all(guide.accept(token) for guide, token in zip(chosen, picks))
        for i in rows:  # an ended request's guide goes, and a new one takes its place
            if guides[i].finished or rng.random() < 0.05:
                guides[i] = _new_guide(default_model, rng)
                replaced += 1
    assert pool.fills >= 20 and replaced > 0
    # Every mirror dropped, and every grammar forgotten, with the next order.
    del guides, chosen, guide
    assert pool.fill([_new_guide(default_model, rng)], 0, SLOTS, [0])
    assert sum(worker.mirrors for worker in pool._workers) == 1


def test_tokens_sent_ahead_are_followed_before_the_fill(default_model: Path, pool_of) -> None:
    """`begin` with the tokens the scheduler's matchers accept while the workers fill (as the
    overlapped step does): the rows equal the matchers' after those accepts, a grammar the
    token ends allows every token, and no token reaches a mirror twice."""
    vocab = ModelConfig.from_folder(default_model).vocab_size
    masks = MaskBuffer(SLOTS, mask_words(vocab))
    pool = pool_of(2, masks)
    rng = random.Random(1)
    regex = SamplingParams(regex=REGEXES[1])  # short: some end within the walk
    fresh = lambda: Guide(compile_guide(default_model, regex), set(), guide_of(regex),  # noqa: E731
                          mirrored=True)
    guides = [fresh() for _ in range(6)]
    ended = 0
    for step in range(30):
        now = np.zeros((len(guides), masks.words), dtype=np.int32)
        for i, guide in enumerate(guides):
            guide.fill(now, i)
        picks = [int(rng.choice(allowed_tokens(now[i]))) for i in range(len(guides))]
        late = rng.randrange(len(guides))  # one row's token follows after the fill instead
        ahead = [None if i == late else token for i, token in enumerate(picks)]
        half, slots = step % 2, rng.sample(range(SLOTS), len(guides))
        assert pool.begin(guides, half, SLOTS, slots, ahead)
        early = [i for i in range(len(guides)) if i != late]
        assert all(accept_tokens([guides[i] for i in early], [picks[i] for i in early]))
        assert pool.finish()
        view = masks.view(half, SLOTS)
        for i, guide in enumerate(guides):
            if i == late:
                continue
            assert guide.unsynced == [] and guide.sent_ahead is None
            if guide.finished:
                assert (view[slots[i]] == -1).all()
            else:
                row = np.zeros((1, masks.words), dtype=np.int32)
                guide.fill(row, 0)
                assert (view[slots[i]] == row[0]).all(), f"step {step}, row {i}"
        assert guides[late].accept(picks[late]) and guides[late].unsynced == [picks[late]]
        for i, guide in enumerate(guides):
            if guide.finished:
                guides[i] = fresh()
                ended += 1
    assert ended > 0 and pool.fills == 30


def test_a_dead_worker_leaves_the_fills_to_the_scheduler(default_model: Path,
                                                         pool_of) -> None:
    vocab = ModelConfig.from_folder(default_model).vocab_size
    masks = MaskBuffer(SLOTS, mask_words(vocab))
    pool = pool_of(2, masks)
    guides = [_new_guide(default_model, random.Random(i)) for i in range(4)]
    assert pool.fill(guides, 0, SLOTS, [0, 1, 2, 3])
    pool._workers[1].proc.kill()
    pool._workers[1].proc.join()
    assert not pool.fill(guides, 1, SLOTS, [0, 1, 2, 3])
    assert not pool.fill(guides, 1, SLOTS, [0, 1, 2, 3])  # closed for good
    assert not pool._workers


def test_too_few_rows_or_unmirrored_guides_stay_on_the_scheduler(default_model: Path,
                                                                 pool_of) -> None:
    vocab = ModelConfig.from_folder(default_model).vocab_size
    pool = pool_of(1, MaskBuffer(SLOTS, mask_words(vocab)))
    params = SamplingParams(regex=REGEXES[1])
    compiled = compile_guide(default_model, params)
    assert not pool.fill([Guide(compiled, set())], 0, SLOTS, [0])  # not mirrored
    pool.min_rows = 3
    assert not pool.fill([Guide(compiled, set(), mirrored=True)] * 2, 0, SLOTS, [0, 1])
    assert pool.fills == 0


@pytest.mark.parametrize("settings", [{}, {"overlap": False},
                                      {"speculative": "ngram", "num_speculative_tokens": 3},
                                      {"page_size": 16, "chunked_prefill_size": 16},
                                      {"tp_size": 2}],
                         ids=["overlap", "no-overlap", "ngram", "page16-chunked", "tp2"])
def test_generation_with_fill_workers_is_identical(tiny_models: dict[str, Path],
                                                   settings: dict) -> None:
    prompts, cases = _mix()
    with LLM(tiny_models["llama"], device="cpu", max_total_tokens=KV_TOKENS,
             grammar_workers=0, **settings) as engine:
        assert engine.scheduler.fill_pool is None
        baseline = engine.generate(prompts, cases)
    with LLM(tiny_models["llama"], device="cpu", max_total_tokens=KV_TOKENS,
             grammar_workers=2, **settings) as engine:
        pool = engine.scheduler.fill_pool
        pool.min_rows = 1
        first = engine.generate(prompts, cases)  # starts the workers
        assert pool.wait_ready(READY_S)
        again = engine.generate(prompts, cases)
        fills = pool.fills
    assert [o.token_ids for o in first] == [o.token_ids for o in baseline]
    assert [o.token_ids for o in again] == [o.token_ids for o in baseline]
    assert fills > 0


def test_grammar_workers_setting_is_checked(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="grammar_workers must be an integer >= 0"):
        LLM(tiny_models["llama"], device="cpu", grammar_workers=-1)


def test_workers_start_only_for_a_step_of_min_rows(tiny_models: dict[str, Path]) -> None:
    """An engine whose steps never hold 16 guided rows never starts a worker."""
    with LLM(tiny_models["llama"], device="cpu", max_total_tokens=KV_TOKENS,
             grammar_workers=2) as engine:
        engine.generate(*_mix())
        pool = engine.scheduler.fill_pool
        assert pool.min_rows == 16 and not pool.wait_ready(0) and pool.fills == 0
