"""Speculative decoding (`ngram`, `suffix`) and jump-forward on CPU.

Oracle: the same requests without speculation. Each verify slot samples with the seed of its
position, so greedy and seeded outputs (and their log-probabilities) must be equal token for
token, whatever the drafts; under overlap on and off, page size 16, chunked prefill, prefix-cache
hits, scarce KV and tensor parallel 2, next to requests that use the other controls.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from minisgl_backend import LLM, SamplingParams
from minisgl_backend.settings import EngineHooks, split_settings
from minisgl_backend.speculative import SpeculativeConfig, accepted_drafts
from minisgl_backend.speculative.ngram import NgramIndex
from minisgl_backend.speculative.suffix import SuffixProposer
from minisgl_backend.testing.tiny_models import TINY_ARCHITECTURES, build_tiny_model
from minisgl_backend.tokenizer import encode_chat
from tests.conftest import CHECKED, hf_greedy, mixed_prompts

KV_TOKENS = 2048


def _requests() -> tuple[list[list[int]], list[SamplingParams]]:
    loop = [5, 6, 7, 8, 9] * 6  # repetitive prompts: n-gram drafts get accepted
    prompts = [loop, [11, 12, 13, 11, 12, 13, 11, 12] * 2, list(range(30, 62)),
               loop[:17] + [40, 41], [50, 51, 52] * 7, loop[3:], [70, 71] * 9]
    params = [
        SamplingParams(max_tokens=40),
        SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=3),
        SamplingParams(max_tokens=24, temperature=1.0, seed=1, logprobs=2),
        SamplingParams(max_tokens=20, repetition_penalty=1.3, presence_penalty=0.2),
        SamplingParams(max_tokens=24, min_tokens=10, temperature=0.7, seed=4, n=2),
        SamplingParams(max_tokens=30, logit_bias={6: 2.0}, bad_token_ids=[[8, 9]]),
        SamplingParams(max_tokens=28, regex=r"[0-9a-z ]{4,40}"),
    ]
    return prompts, params


def _run(model: Path, **settings: object) -> tuple[list, tuple[int, int, int]]:
    settings = {"max_total_tokens": KV_TOKENS, **settings}
    with LLM(model, device="cpu", **settings) as llm:
        outs = llm.generate(*_requests())
        again = llm.generate(*_requests())  # prefix-cache hits, the suffix history in use
        spec = llm.scheduler.speculator
        stats = (spec.verified_rows, spec.drafted, spec.accepted)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    return outs, stats


def _summary(outs: list) -> list:
    return [(o.token_ids, o.finish_reason) for o in outs]


def _logprobs(outs: list) -> list:
    return [o.logprobs for o in outs if o.logprobs is not None]


@pytest.fixture(scope="module")
def baseline(tiny_models: dict[str, Path]) -> list:
    outs, stats = _run(tiny_models["llama"], jump_forward=False)
    assert stats == (0, 0, 0)
    return outs


@pytest.mark.parametrize("settings", [
    {"speculative": "ngram"},
    {"speculative": "suffix", "num_speculative_tokens": 6},
    {"speculative": "ngram", "overlap": False},
    {"speculative": "ngram", "page_size": 16, "chunked_prefill_size": 16},
    {"speculative": "suffix", "max_total_tokens": 256, "num_speculative_tokens": 8},
    {"speculative": "ngram", "tp_size": 2},
], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_speculative_outputs_equal_the_non_speculative_ones(tiny_models: dict[str, Path],
                                                            baseline: list,
                                                            settings: dict) -> None:
    outs, (steps, drafted, accepted) = _run(tiny_models["llama"], **settings)
    assert _summary(outs) == _summary(baseline)
    # Verify steps compute a position's logits in an extend, not a decode: equal to rounding.
    for got, want in zip(_logprobs(outs), _logprobs(baseline)):
        assert got == pytest.approx(want, abs=1e-4)
    assert steps > 0 and 0 < accepted < drafted  # drafts were kept and rejected


SPEC_ARCHS = [*TINY_ARCHITECTURES, "mistral", "mixtral", "phi3", "gemma3"]  # one per architecture


@pytest.mark.parametrize("arch", SPEC_ARCHS)
def test_greedy_ngram_equals_hf_on_every_architecture(tmp_path: Path, arch: str) -> None:
    """Prompts that repeat themselves (drafts to keep), with page accounting after every
    step; `suffix` on the same engine settings for the fixture's architectures."""
    model = build_tiny_model(arch, tmp_path / arch)
    prompts = [p + p[:12] + p[:12] for p in mixed_prompts(6, vocab=200)]
    want = hf_greedy(model, prompts, 16)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    with LLM(model, device="cpu", max_total_tokens=KV_TOKENS, hooks=CHECKED,
             speculative="ngram", speculative_ngram_min=1, page_size=16) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        assert llm.scheduler.speculator.drafted > 0


def _smol_requests(tokenizer: object) -> tuple[list[list[int]], list[SamplingParams]]:
    """16 chat requests, half asking to repeat a passage (drafts are kept), half free-form;
    some end at stop strings."""
    passage = ("The meeting moved to Thursday at 3 pm in room 204. Bring the report and the "
               "budget draft, and send your slides to Maria before noon.")
    chats = ["Why is the sky blue?", "Name three fruits.", "Say hello.", "What is 2 + 2?"]
    texts = [f"Repeat this text exactly:\n\n{passage}" if i % 2 == 0 else chats[i // 2 % 4]
             for i in range(16)]
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    params = [SamplingParams(max_tokens=40, stop=["Maria"] if i % 4 == 2 else None)
              for i in range(16)]
    return prompts, params


def test_default_model_16_prompts_equal_without_speculation(default_model: Path) -> None:
    results = {}
    for name, settings in (("off", {}), ("ngram", {"speculative": "ngram"}),
                           ("suffix", {"speculative": "suffix"})):
        with LLM(default_model, device="cpu", max_total_tokens=4096, hooks=CHECKED,
                 **settings) as llm:
            outs = llm.generate(*_smol_requests(llm.tokenizer))
            results[name] = [(o.token_ids, o.text, o.finish_reason) for o in outs]
            if name != "off":
                assert llm.scheduler.speculator.accepted > 0
    assert results["ngram"] == results["off"] and results["suffix"] == results["off"]
    assert any(reason == "stop" for _, _, reason in results["off"])


def test_sampled_tokens_keep_the_target_distribution(tiny_models: dict[str, Path]) -> None:
    """Token frequencies at every position over 256 seeded samples, speculation off and on:
    each verified position samples with its own seed from the target's distribution, so
    the frequencies agree exactly (and drafts were kept and rejected on the way)."""
    prompt = [5, 6, 7, 8, 9] * 4
    params = [SamplingParams(max_tokens=8, temperature=0.7, top_k=4, ignore_eos=True, seed=i)
              for i in range(256)]
    counts, stats = [], None
    for settings in ({}, {"speculative": "ngram", "speculative_max_batch_size": 256}):
        with LLM(tiny_models["llama"], device="cpu", max_total_tokens=KV_TOKENS,
                 **settings) as llm:
            outs = llm.generate([prompt] * 256, params)
            spec = llm.scheduler.speculator
            stats = (spec.drafted, spec.accepted)
        counts.append([Counter(o.token_ids[pos] for o in outs) for pos in range(8)])
    assert counts[0] == counts[1]
    assert 0 < stats[1] < stats[0]


def test_a_stop_token_inside_kept_drafts_ends_the_request_there(tiny_models: dict[str, Path],
                                                                baseline: list) -> None:
    tokens = baseline[0].token_ids
    stop = tokens[len(tokens) // 2]
    params = SamplingParams(max_tokens=40, stop_token_ids=[stop])
    prompt = _requests()[0][0]
    results = []
    for settings in ({}, {"speculative": "ngram"}):
        with LLM(tiny_models["llama"], device="cpu", max_total_tokens=KV_TOKENS,
                 **settings) as llm:
            results.append(llm.generate([prompt], params)[0])
    assert results[0].token_ids == results[1].token_ids == tokens[: tokens.index(stop) + 1]
    assert results[1].finish_reason == "stop"


def test_synthetic_acceptance_keeps_every_draft(tiny_models: dict[str, Path]) -> None:
    """The benchmark-only hook: drafts are kept with the given probability (here all), so
    requests run to max_tokens in about max_tokens / (k + 1) steps."""
    with LLM(tiny_models["llama"], device="cpu", max_total_tokens=KV_TOKENS,
             speculative="ngram", num_speculative_tokens=3,
             hooks=EngineHooks(synthetic_acceptance=1.0)) as llm:
        out = llm.generate([list(range(40, 50))], SamplingParams(max_tokens=33, ignore_eos=True))
        spec = llm.scheduler.speculator
        assert len(out[0].token_ids) == 33
        assert spec.accepted == spec.drafted > 0 and spec.verified_rows <= 33 // 4 + 1
        assert out[0].draft_tokens == out[0].accepted_draft_tokens == spec.drafted


def test_ngram_index_proposes_what_followed_the_longest_match() -> None:
    index = NgramIndex(max_n=3)
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3]
    index.extend(tokens)
    assert index.continuation(tokens, 2) == [5, 7]  # "2 3" last seen before "5 7"
    tokens += [5]
    index.extend(tokens)
    assert index.continuation(tokens, 4) == [7, 2, 3, 5]  # "2 3 5" -> "7 2 3 5"
    assert index.continuation([8, 8, 6], 3) == []
    short = NgramIndex(max_n=3, min_n=2)
    short.extend([1, 2, 9, 2])
    assert short.continuation([1, 2, 9, 2], 1) == []  # only "2" recurs: too short


def test_suffix_history_is_bounded_and_forgets_completely() -> None:
    proposer = SuffixProposer(max_tokens=50)
    for uid in range(20):
        seq = [uid % 3, 7, 8, 9, uid % 5] * 4
        proposer.propose(uid, seq, 4)
        proposer.finish(uid, seq)
        assert proposer.stored_tokens <= 50
    assert proposer.propose(99, [1, 7, 8], 3) == [9, 4, 1]  # the most frequent continuation
    proposer.max_tokens = 0
    proposer.finish(100, [])
    for uid in list(proposer.stored):
        proposer.history.add(proposer.stored.pop(uid), sign=-1)
    assert proposer.history.table == {}


def test_accepted_drafts_is_the_longest_equal_prefix() -> None:
    assert accepted_drafts([4, 5, 6], [4, 5, 9, 1]) == 2
    assert accepted_drafts([4, 5], [4, 5, 6]) == 2
    assert accepted_drafts([4], [3, 4]) == 0
    assert accepted_drafts([], [3]) == 0


@pytest.mark.parametrize(("settings", "field"), [
    ({"speculative": "eagle"}, "speculative"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"speculative_max_batch_size": 0}, "speculative_max_batch_size"),
    ({"speculative_min_acceptance": 1.5}, "speculative_min_acceptance"),
    ({"num_draft_tokens": 3}, "num_draft_tokens"),
])
def test_invalid_settings_name_the_setting(settings: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        split_settings(settings)


def test_invalid_synthetic_acceptance_names_the_hook() -> None:
    with pytest.raises(ValueError, match="synthetic_acceptance"):
        EngineHooks(synthetic_acceptance=-0.1)


def test_speculation_is_off_by_default() -> None:
    assert not SpeculativeConfig().enabled


def _verify_row(speculator, req, drafts: list[int], sampled: list[int]) -> list[int]:
    """One verify step of `req` with these drafts and slot samples, as the scheduler runs it."""
    req.drafts = list(drafts)
    req.cached_len = req.device_len = len(req.input_ids) + len(drafts)
    return speculator.settle(req, sampled)


def test_acceptance_is_judged_on_the_drafts_that_met_a_verdict() -> None:
    from minisgl_backend.core import Req
    from minisgl_backend.scheduler.speculation import Speculator, acceptance_rate

    config = SpeculativeConfig(speculative="ngram", num_speculative_tokens=4,
                               speculative_min_acceptance=0.3)
    spec = Speculator(config, jump_forward=False, max_drafts=4)
    req = Req(uid=0, input_ids=[1, 2, 3], prompt_len=3,
              sampling_params=SamplingParams(max_tokens=100), seed=0)
    # The first draft kept, the second rejected: the last two were never compared.
    assert _verify_row(spec, req, [4, 5, 6, 7], [4, 9, 6, 7, 8]) == [4, 9]
    assert (req.drafted, req.accepted, req.judged) == (4, 1, 2)
    assert _verify_row(spec, req, [4, 5], [4, 5, 6]) == [4, 5, 6]  # all kept: no rejection
    assert (req.drafted, req.accepted, req.judged) == (6, 3, 4)
    # Steps that keep one draft of four, then reject: 1 kept of 2 judged, though 1 of 4 sent.
    req = Req(uid=1, input_ids=[1, 2, 3], prompt_len=3,
              sampling_params=SamplingParams(max_tokens=100), seed=0)
    for _ in range(8):
        _verify_row(spec, req, [4, 5, 6, 7], [4, 9, 9, 9, 9])
    assert (req.accepted, req.judged, req.drafted) == (8, 16, 32)
    assert acceptance_rate(req) == 10 / 18  # the sent drafts' rate, 0.25, would stop it
    assert spec.draft_length(req) == 2  # chances 0.56 and 0.31, then 0.17
    for _ in range(11):  # rejected at once
        _verify_row(spec, req, [4], [9, 9])
    assert acceptance_rate(req) == 10 / 29 and spec.draft_length(req) == 1
    for _ in range(15):
        _verify_row(spec, req, [4], [9, 9])
    assert acceptance_rate(req) < 0.3 and spec.draft_length(req) == 0  # it stops speculating
    # A new request drafts in full; rejected at once every time, it stops after 5 steps.
    req = Req(uid=2, input_ids=[1, 2, 3], prompt_len=3,
              sampling_params=SamplingParams(max_tokens=100), seed=0)
    lengths = []
    while (length := spec.draft_length(req)) and len(lengths) < 10:
        lengths.append(length)
        _verify_row(spec, req, [4] * length, [9] * (length + 1))
    assert lengths == [4, 2, 1, 1, 1]


def test_draft_length_follows_the_acceptance_rate() -> None:
    from minisgl_backend.core import Req
    from minisgl_backend.scheduler.speculation import Speculator

    def length(accepted: int, judged: int, floor: float = 0.3, k: int = 4) -> int:
        config = SpeculativeConfig(speculative="ngram", num_speculative_tokens=k,
                                   speculative_min_acceptance=floor)
        req = Req(uid=0, input_ids=[1], prompt_len=1,
                  sampling_params=SamplingParams(max_tokens=100), seed=0)
        req.accepted, req.judged = accepted, judged
        return Speculator(config, jump_forward=False, max_drafts=k).draft_length(req)

    # The rate is (accepted + 2) / (judged + 2).
    assert length(0, 0) == 4  # nothing judged yet
    assert length(78, 98) == 4  # 0.8: 0.8, 0.64, 0.51, 0.41 all reach 0.3
    assert length(58, 98) == 2  # 0.6: 0.6, 0.36, then 0.216
    assert length(33, 98) == 1  # 0.35: its second draft has a 0.12 chance
    assert length(27, 98) == 0  # 0.29: no drafts
    assert length(58, 98, floor=0.1) == 4 and length(0, 1000, floor=0.0) == 4
    assert length(98, 98, k=2) == 2  # never past num_speculative_tokens
    # The default floor follows the device: a GPU verifies extra tokens almost for free.
    assert SpeculativeConfig().min_acceptance("cuda") == 0.1
    assert SpeculativeConfig().min_acceptance("cpu") == 0.4
    assert SpeculativeConfig(speculative_min_acceptance=0.5).min_acceptance("cuda") == 0.5
    gpu = Speculator(SpeculativeConfig(speculative="ngram"), jump_forward=False, max_drafts=4,
                     device_type="cuda")
    req = Req(uid=0, input_ids=[1], prompt_len=1, sampling_params=SamplingParams(max_tokens=9),
              seed=0)
    req.accepted, req.judged = 58, 98
    assert gpu.draft_length(req) == 4  # 0.6: 0.6, 0.36, 0.216, 0.13 all reach 0.1


def test_synthetic_acceptance_at_0_6_keeps_drafting() -> None:
    """The benchmark's synthetic acceptance keeps each draft with its probability, in turn: at
    0.6 the requests keep speculating, most with two drafts a step after a while (a rate of
    all drafts sent, about 0.33 at four drafts, would stop many of them now and then)."""
    from minisgl_backend.core import Req
    from minisgl_backend.scheduler.speculation import Speculator

    config = SpeculativeConfig(speculative="ngram", num_speculative_tokens=4,
                               speculative_min_acceptance=0.3)
    spec = Speculator(config, jump_forward=False, max_drafts=4, synthetic_acceptance=0.6)
    reqs = [Req(uid=i, input_ids=[1, 2, 3], prompt_len=3,
                sampling_params=SamplingParams(max_tokens=1000), seed=0) for i in range(32)]
    full = []  # drafts kept per verify step of 4 drafts
    for step in range(64):  # 64 verify steps per request
        for req in reqs:
            length = spec.draft_length(req)
            if length:
                kept = len(_verify_row(spec, req, [7] * length, [7] * (length + 1))) - 1
                if length == 4:
                    full.append(kept)
    lengths = [spec.draft_length(req) for req in reqs]
    assert sum(n == 0 for n in lengths) <= 1  # rare bad luck
    # 0.6 and 0.36 reach 0.3, 0.216 not (a rate judged under 0.548 sends one draft).
    assert sum(n == 2 for n in lengths) > len(reqs) // 2 and max(lengths) <= 3
    assert 1.1 < sum(full) / len(full) < 1.5  # 0.6 + 0.36 + 0.216 + 0.13 = 1.31 expected
