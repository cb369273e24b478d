"""Sampling controls (penalties, logit_bias, min_p, bad words, logprobs, n samples) against HF
transformers float32 on CPU.

The oracles are HF's own `generate` (repetition_penalty, bad_words_ids) and, for the controls HF
has no equivalent of, a reference built from HF logits here: the controls' formulas applied to the
last-position float32 logits of a forward over the whole sequence. Every generate call mixes
requests that use controls with requests that use none; those must stay plain greedy (= HF).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Iterator, Sequence

import pytest
import torch

from minisgl_backend import LLM, SamplingParams
from minisgl_backend.core import sample_seed
from tests.conftest import CHECKED, _hf_model, mixed_prompts

MAX_TOKENS = 10
LP_TOL = 1e-4  # log-probabilities: engine vs HF (float32)
PLAIN = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)

Bans = tuple[tuple[int, ...], ...]


def params(**kw) -> SamplingParams:  # noqa: ANN003
    kw.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(ignore_eos=True, **kw)


# ----- engines (one per module where possible: starting one costs seconds) ------------------


@pytest.fixture(scope="module")
def llama(tiny_models: dict[str, Path]) -> Iterator[LLM]:
    with LLM(tiny_models["llama"], device="cpu", hooks=CHECKED) as engine:
        yield engine


@pytest.fixture(scope="module")
def smol(default_model: Path) -> Iterator[LLM]:
    with LLM(default_model, device="cpu", hooks=CHECKED) as engine:
        yield engine


SMOL_TEXTS = ["The capital of France is", "Once upon a time, there was a little",
              "My favourite colours are red, green and"]


@pytest.fixture(scope="module")
def smol_prompts(smol: LLM) -> list[list[int]]:
    return [smol.tokenizer.encode(t, add_special_tokens=False) for t in SMOL_TEXTS]


# ----- HF references ---------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _hf_generate(model_dir: str, prompt: tuple[int, ...], max_tokens: int,
                 options: tuple = ()) -> tuple[int, ...]:
    model = _hf_model(model_dir)
    kwargs = dict(options)
    if "bad_words_ids" in kwargs:
        kwargs["bad_words_ids"] = [list(s) for s in kwargs["bad_words_ids"]]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=0, eos_token_id=None, **kwargs)
    return tuple(out[0, len(prompt):].tolist())


def hf_generate(model_dir: Path, prompt: Sequence[int], max_tokens: int = MAX_TOKENS,
                **options) -> list[int]:  # noqa: ANN003
    """HF transformers' greedy `generate` (float32, EOS ignored) with extra options."""
    return list(_hf_generate(str(model_dir), tuple(prompt), max_tokens,
                             tuple(sorted(options.items()))))


@lru_cache(maxsize=4096)
def _hf_logits(model_dir: str, seq: tuple[int, ...]) -> torch.Tensor:
    model = _hf_model(model_dir)
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0].float()


def hf_logits(model_dir: Path, seq: Sequence[int]) -> torch.Tensor:
    """[len(seq), vocab] float32 logits of one HF forward over the whole sequence."""
    return _hf_logits(str(model_dir), tuple(seq))


def controlled_logits(raw: torch.Tensor, context: Sequence[int], prompt_len: int,
                      p: SamplingParams, bans: Bans) -> torch.Tensor:
    """The controls' formulas on one step's raw logits: repetition penalty (HF/CTRL, prompt +
    output), presence / frequency penalties (OpenAI, output only), logit_bias, bad sequences
    (the last token is masked where the others end `context`)."""
    logits = raw.clone()
    if p.repetition_penalty != 1.0:
        ids = torch.tensor(sorted(set(context)))
        vals = logits[ids]
        logits[ids] = torch.where(vals > 0, vals / p.repetition_penalty,
                                  vals * p.repetition_penalty)
    for token, count in Counter(context[prompt_len:]).items():
        logits[token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    for token, bias in (p.logit_bias or {}).items():
        logits[token] += bias
    for seq in bans:
        prefix = tuple(seq[:-1])
        if not prefix or (len(context) >= len(prefix)
                          and tuple(context[len(context) - len(prefix):]) == prefix):
            logits[seq[-1]] = float("-inf")
    return logits


def reference_greedy(model_dir: Path, prompt: Sequence[int], p: SamplingParams,
                     bans: Bans = ()) -> list[int]:
    """Greedy decoding with the controls: an HF forward over the whole sequence per step."""
    seq = list(prompt)
    for _ in range(p.max_tokens):
        logits = controlled_logits(hf_logits(model_dir, seq)[-1], seq, len(prompt), p, bans)
        seq.append(int(torch.argmax(logits)))
    return seq[len(prompt):]


def step_logits(model_dir: Path, prompt: Sequence[int], output: Sequence[int]) -> torch.Tensor:
    """[len(output), vocab] raw float32 logits that produced each output token (teacher forcing:
    one HF forward over prompt + output)."""
    logits = hf_logits(model_dir, list(prompt) + list(output))
    return logits[len(prompt) - 1 : len(prompt) + len(output) - 1]


def check_sampled(model_dir: Path, prompt: Sequence[int], p: SamplingParams, output: list[int],
                  bans: Bans = ()) -> None:
    """Every sampled token is allowed by the controls at its step: not masked by a ban, within
    min_p at the row's temperature (from HF logits after penalties and bias), within top_k."""
    raw = step_logits(model_dir, prompt, output)
    context = list(prompt)
    for step, token in enumerate(output):
        logits = controlled_logits(raw[step], context, len(prompt), p, bans)
        assert math.isfinite(logits[token]), f"step {step}: token {token} is masked"
        if p.min_p > 0:
            ratio = float(logits[token] - logits.max()) / p.temperature  # log(p_tok / p_max)
            assert ratio >= math.log(p.min_p) - 1e-4, (
                f"step {step}: token {token} has p/p_max = {math.exp(ratio):.4f} < min_p "
                f"{p.min_p}")
        if p.top_k > 0:
            assert int((logits > logits[token] + 1e-5).sum()) < p.top_k
        context.append(token)


def violates_min_p(model_dir: Path, prompt: Sequence[int], p: SamplingParams, output: list[int],
                   min_p: float) -> bool:
    """True if some token of `output` (sampled without min_p) would have been dropped by it."""
    raw = step_logits(model_dir, prompt, output)
    context = list(prompt)
    for step, token in enumerate(output):
        logits = controlled_logits(raw[step], context, len(prompt), p, ())
        if float(logits[token] - logits.max()) / p.temperature < math.log(min_p) - 1e-3:
            return True
        context.append(token)
    return False


def assert_top_close(got: dict[int, float], ref: torch.Tensor, k: int, tol: float = LP_TOL,
                     where: str = "") -> None:
    """`got` holds the k most likely tokens of `ref` (log-probabilities) with their values:
    ids equal up to ties within `tol`, values within `tol`."""
    assert len(got) == k, f"{where}: {len(got)} alternatives, expected {k}"
    for token, value in got.items():
        assert abs(value - float(ref[token])) <= tol, (
            f"{where}: token {token} logprob {value} vs HF {float(ref[token])}")
    if k:
        want = ref.topk(k).values.tolist()
        have = sorted(got.values(), reverse=True)
        assert all(abs(a - b) <= tol for a, b in zip(have, want)), (
            f"{where}: alternatives {got} are not the top {k}: HF {ref.topk(k)}")


def check_logprobs(model_dir: Path, prompt: Sequence[int], out, k: int) -> None:  # noqa: ANN001
    """Each reported log-probability is HF's log-softmax of the raw logits of its step."""
    assert out.logprobs is not None and out.top_logprobs is not None
    assert len(out.logprobs) == len(out.top_logprobs) == len(out.token_ids)
    ref = torch.log_softmax(step_logits(model_dir, prompt, out.token_ids), dim=-1)
    for step, token in enumerate(out.token_ids):
        where = f"step {step}"
        assert abs(out.logprobs[step] - float(ref[step, token])) <= LP_TOL, (
            f"{where}: token {token} logprob {out.logprobs[step]} vs HF {float(ref[step, token])}")
        assert_top_close(out.top_logprobs[step], ref[step], k, where=where)
    assert out.cumulative_logprob == pytest.approx(sum(out.logprobs), abs=1e-9)


def word_bans(tokenizer, words: Sequence[str]) -> Bans:  # noqa: ANN001
    """What `bad_words` stands for: each word tokenized as-is and with a leading space."""
    seqs: list[tuple[int, ...]] = []
    for word in words:
        for text in (word, " " + word):
            seqs.append(tuple(tokenizer.encode(text, add_special_tokens=False)))
    return tuple(dict.fromkeys(seqs))


def completes(seq: Sequence[int], tokens: Sequence[int], prompt_len: int) -> bool:
    """True if `seq` occurs in `tokens` ending at a generated position."""
    n = len(seq)
    return any(tuple(tokens[end - n + 1 : end + 1]) == tuple(seq)
               for end in range(max(prompt_len, n - 1), len(tokens)))


def assert_plain(model_dir: Path, prompts: Sequence[Sequence[int]], outputs: Sequence,
                 which: Sequence[int], max_tokens: int = MAX_TOKENS) -> None:
    """The control-free requests `which` are plain greedy, as HF generates them."""
    for i in which:
        assert outputs[i].token_ids == hf_generate(model_dir, prompts[i], max_tokens), i
        assert outputs[i].logprobs is None and outputs[i].top_logprobs is None


# ----- 1. repetition penalty = HF generate ---------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_repetition_penalty_equals_hf(tiny_models: dict[str, Path], llama: LLM,
                                      arch: str) -> None:
    model = tiny_models[arch]
    prompts = mixed_prompts(5)
    settings = [None, 1.3, 0.8, None, 2.0]
    sp = [PLAIN if r is None else params(repetition_penalty=r) for r in settings]
    if arch == "llama":
        outputs = llama.generate(prompts, sp)
    else:
        with LLM(model, device="cpu", hooks=CHECKED) as engine:
            outputs = engine.generate(prompts, sp)
    assert_plain(model, prompts, outputs, [0, 3])
    bites = 0
    for i, r in enumerate(settings):
        if r is not None:
            expected = hf_generate(model, prompts[i], repetition_penalty=r)
            assert outputs[i].token_ids == expected, (i, r)
            bites += expected != hf_generate(model, prompts[i])
    assert bites, "the penalty changed no output: the test proves nothing"


def test_repetition_penalty_default_model_equals_hf(smol: LLM, default_model: Path,
                                                    smol_prompts: list[list[int]]) -> None:
    prompts = smol_prompts + [smol_prompts[0]]
    settings = [1.3, None, 0.8, 1.6]
    sp = [params(max_tokens=8) if r is None else params(repetition_penalty=r, max_tokens=8)
          for r in settings]
    outputs = smol.generate(prompts, sp)
    assert_plain(default_model, prompts, outputs, [1], max_tokens=8)
    bites = 0
    for i, r in enumerate(settings):
        if r is not None:
            expected = hf_generate(default_model, prompts[i], 8, repetition_penalty=r)
            assert outputs[i].token_ids == expected, (i, r)
            bites += expected != hf_generate(default_model, prompts[i], 8)
    assert bites


# ----- 2. presence / frequency penalties, logit_bias, min_p -------------------------------------


def test_openai_penalties_bias_and_greedy_min_p_equal_reference(llama: LLM,
                                                                tiny_models: dict[str, Path]
                                                                ) -> None:
    model = tiny_models["llama"]
    # Penalties on the output bite where plain greedy repeats itself: prompts 1, 2, 5 and 7 do.
    others = mixed_prompts(8, seed=11)
    repeating = [mixed_prompts(1, seed=0)[0], mixed_prompts(8, seed=1)[4],
                 mixed_prompts(1, seed=2)[0], mixed_prompts(8, seed=1)[7]]
    prompts = [others[0], repeating[0], repeating[1], others[3], others[4], repeating[2],
               others[6], repeating[3]]
    plain = [hf_generate(model, p) for p in prompts]
    assert all(len(set(plain[i])) < MAX_TOKENS for i in (1, 2, 5, 7))
    # Bias against tokens plain greedy picks, and for another one.
    bias = {plain[3][0]: -100.0, plain[3][4]: -2.5, 7: 4.0}
    sp = [
        PLAIN,
        params(presence_penalty=1.5),
        params(frequency_penalty=1.0, presence_penalty=0.5),
        params(logit_bias=bias),
        PLAIN,
        params(frequency_penalty=-2.0, presence_penalty=2.0),
        params(min_p=0.9),  # greedy: min_p changes nothing
        params(repetition_penalty=1.2, frequency_penalty=0.7, presence_penalty=-0.4,
               logit_bias={plain[7][1]: -1.0, 100: 0.5}, min_p=0.5),
    ]
    outputs = llama.generate(prompts, sp)
    assert_plain(model, prompts, outputs, [0, 4, 6])
    for i in (1, 2, 3, 5, 7):
        expected = reference_greedy(model, prompts[i], sp[i])
        assert outputs[i].token_ids == expected, i
        assert expected != plain[i], f"request {i}: its controls changed nothing"
    assert plain[3][0] not in outputs[3].token_ids


def test_min_p_sampling_keeps_only_likely_tokens(llama: LLM,
                                                 tiny_models: dict[str, Path]) -> None:
    model = tiny_models["llama"]
    prompts = mixed_prompts(4, seed=12)
    controls = [dict(temperature=1.0, seed=1),
                dict(temperature=0.7, seed=2, presence_penalty=1.0, logit_bias={5: 3.0, 9: -3.0}),
                dict(temperature=1.5, seed=3, repetition_penalty=1.3, top_k=40)]
    with_min_p = [params(min_p=m, **c) for m, c in zip([0.5, 0.3, 0.8], controls)]
    # The same requests without min_p: their samples show that min_p has something to drop.
    without = [params(**c) for c in controls]
    sampled_prompts = [prompts[0], prompts[2], prompts[3]]
    batch = [prompts[0], prompts[1], prompts[2], prompts[3], *sampled_prompts]
    sp = [with_min_p[0], PLAIN, with_min_p[1], with_min_p[2], *without]
    outputs = llama.generate(batch, sp)
    assert_plain(model, batch, outputs, [1])
    filtered, unfiltered = [outputs[0], outputs[2], outputs[3]], outputs[4:]
    for prompt, p, out in zip(sampled_prompts, with_min_p, filtered):
        check_sampled(model, prompt, p, out.token_ids)
    assert any(violates_min_p(model, prompt, p, out.token_ids, m.min_p)
               for prompt, p, out, m in zip(sampled_prompts, without, unfiltered, with_min_p)), (
        "min_p would drop nothing here: the test proves nothing")


# ----- 3. bad_token_ids and bad_words ---------------------------------------------------------


def test_bad_token_ids_equal_hf_and_never_complete(llama: LLM,
                                                   tiny_models: dict[str, Path]) -> None:
    model = tiny_models["llama"]
    prompts = mixed_prompts(6, seed=13) + [[41, 42]]
    plain = [hf_generate(model, p) for p in prompts]
    bans: list[Bans] = [
        (),
        ((plain[1][2],),),  # a token plain greedy picks
        ((plain[2][3], plain[2][4]),),  # a bigram it produces
        ((prompts[3][-1], plain[3][0]),  # prefix in the prompt: the first token is banned
         (prompts[3][-3], prompts[3][-2], prompts[3][-1], 77)),
        (),
        ((plain[5][0],), (plain[5][1], plain[5][2]),  # single, bigram, trigram at once
         (plain[5][4], plain[5][5], plain[5][6])),
        # Its prefix reaches before the 2-token prompt's start: it bans nothing there (even
        # though the prompt's first token repeated would match it), then bites later.
        ((41, 41, 42, plain[6][0]), (plain[6][1], plain[6][2])),
    ]
    sp = [PLAIN if not b else params(bad_token_ids=[list(s) for s in b]) for b in bans]
    outputs = llama.generate(prompts, sp)
    assert_plain(model, prompts, outputs, [0, 4])
    for i, b in enumerate(bans):
        if not b:
            continue
        out = outputs[i].token_ids
        assert out == hf_generate(model, prompts[i], bad_words_ids=b), i
        assert out == reference_greedy(model, prompts[i], sp[i], b), i
        assert out != plain[i], f"request {i}: the bans changed nothing"
        for seq in b:
            assert not completes(seq, prompts[i] + out, len(prompts[i])), (i, seq)
    assert outputs[3].token_ids[0] != plain[3][0]
    assert outputs[6].token_ids[0] == plain[6][0]


def test_bad_words_default_model_equal_hf(smol: LLM, default_model: Path) -> None:
    tok = smol.tokenizer
    # Each prompt's plain continuation completes its bad word (checked below), two of them
    # through a multi-token sequence whose prefix ends in the prompt.
    cases = [("The capital of France is", None), ("The sequence is called Fib", "Fibonacci"),
             ("I live in New York City. New", "New York"), ("The capital of France is", "Paris")]
    prompts = [tok.encode(t, add_special_tokens=False) for t, _ in cases]
    sp = [params(max_tokens=8) if w is None else params(max_tokens=8, bad_words=[w])
          for _, w in cases]
    outputs = smol.generate(prompts, sp)
    assert_plain(default_model, prompts, outputs, [0], max_tokens=8)
    for i, (_, word) in enumerate(cases):
        if word is None:
            continue
        seqs = word_bans(tok, [word])
        plain = hf_generate(default_model, prompts[i], 8)
        assert any(completes(s, prompts[i] + plain, len(prompts[i])) for s in seqs), (
            f"{word!r} does not appear in the plain output: the test proves nothing")
        out = outputs[i].token_ids
        assert out == hf_generate(default_model, prompts[i], 8, bad_words_ids=seqs), word
        for seq in seqs:
            assert not completes(seq, prompts[i] + out, len(prompts[i])), (word, seq)
    assert "Paris" not in outputs[3].text


def test_bans_survive_a_later_admission_with_longer_sequences(tiny_models: dict[str, Path]
                                                             ) -> None:
    """A request banning one token is admitted first (its 17-token prompt takes two 16-token
    prefill chunks), one banning a bigram is admitted a step later: the first request's ban
    must still hold. (The engine's ban table keeps sequences right-aligned, banned token in
    the last column; widening it for the longer sequence must move the running rows' entries
    to the new last column, not leave them in the leading corner.)"""
    model = tiny_models["llama"]
    first, second = mixed_prompts(3)[2], mixed_prompts(1, seed=5)[0]
    assert len(first) == 17
    plain_first, plain_second = hf_generate(model, first), hf_generate(model, second)
    bans = [((plain_first[0],),), ((plain_second[0], plain_second[1]),)]
    sp = [params(bad_token_ids=[list(s) for s in b]) for b in bans]
    with LLM(model, device="cpu", hooks=CHECKED, chunked_prefill_size=16) as engine:
        outputs = engine.generate([first, second], sp)
    for i, (prompt, b, plain) in enumerate(zip([first, second], bans,
                                               [plain_first, plain_second])):
        expected = hf_generate(model, prompt, bad_words_ids=b)
        assert expected != plain
        assert outputs[i].token_ids == expected, i


def test_controls_do_not_leak_into_reused_rows(llama: LLM, tiny_models: dict[str, Path]
                                               ) -> None:
    """Rows freed by requests with every control are reused by the next call's requests
    (plain ones among them): nothing of the old bans, biases or penalty counts stays."""
    model = tiny_models["llama"]
    prompts = mixed_prompts(4, seed=16)
    plain = [hf_generate(model, p) for p in prompts]
    everything = dict(repetition_penalty=1.5, presence_penalty=2.0, frequency_penalty=2.0,
                      logit_bias={300: 50.0, plain[0][0]: -100.0}, logprobs=4,
                      bad_token_ids=[[t] for p in plain for t in p[:3]]
                      + [[plain[1][3], plain[1][4], plain[1][5], plain[1][6]]])
    first = llama.generate(prompts, [params(**everything)] * 4)
    assert all(o.token_ids == [300] * MAX_TOKENS for o in first)  # the +50 bias wins
    sp = [PLAIN, params(bad_token_ids=[[plain[1][2]]], logprobs=0), PLAIN,
          params(logit_bias={plain[3][0]: -5.0}, frequency_penalty=0.5)]
    second = llama.generate(prompts, sp)
    assert_plain(model, prompts, second, [0, 2])
    for i in (1, 3):
        assert second[i].token_ids == reference_greedy(model, prompts[i], sp[i],
                                                      tuple(map(tuple, sp[i].bad_token_ids)))
    check_logprobs(model, prompts[1], second[1], 0)


# ----- 4. logprobs ---------------------------------------------------------------------------


def test_logprobs_match_hf_log_softmax(smol: LLM, default_model: Path,
                                       smol_prompts: list[list[int]]) -> None:
    prompts = [smol_prompts[0], smol_prompts[1], smol_prompts[2], smol_prompts[0],
               smol_prompts[2]]
    sp = [
        params(max_tokens=8, logprobs=5),
        params(max_tokens=8),
        params(max_tokens=8, logprobs=0),
        params(max_tokens=8, logprobs=3, repetition_penalty=1.3, frequency_penalty=0.5,
               logit_bias={11: 2.0}),
        params(max_tokens=8, logprobs=2, temperature=0.8, seed=7),
    ]
    outputs = smol.generate(prompts, sp)
    assert_plain(default_model, prompts, outputs, [1], max_tokens=8)
    for i, p in enumerate(sp):
        if p.logprobs is None:
            continue
        check_logprobs(default_model, prompts[i], outputs[i], p.logprobs)
    assert outputs[0].token_ids == hf_generate(default_model, prompts[0], 8)
    # Greedy without controls: the token is the most likely one.
    assert all(next(iter(top)) == t for top, t in zip(outputs[0].top_logprobs,
                                                      outputs[0].token_ids))
    assert all(top == {} for top in outputs[2].top_logprobs)
    assert outputs[2].token_ids == hf_generate(default_model, prompts[2], 8)
    # Penalized: the sequence follows the penalties, the logprobs the raw logits.
    assert outputs[3].token_ids == reference_greedy(default_model, prompts[3], sp[3])
    assert outputs[3].token_ids != hf_generate(default_model, prompts[3], 8)
    check_sampled(default_model, prompts[4], sp[4], outputs[4].token_ids)


# ----- 5. n samples -----------------------------------------------------------------------------


def test_n_samples_equal_single_requests_with_derived_seeds(llama: LLM,
                                                            tiny_models: dict[str, Path]
                                                            ) -> None:
    model = tiny_models["llama"]
    # Prompts this engine has not seen and sharing no prefix (leading tokens 500..503: no
    # other prompt here has them; see the next test for prompts sharing a prefix).
    fresh = [[500 + i] + p for i, p in enumerate(mixed_prompts(4, seed=14))]
    seed = 4242
    sp = [
        params(temperature=0.8, seed=seed, n=4),
        PLAIN,
        params(temperature=1.0, seed=99, n=2, logprobs=2),
        params(n=3),  # greedy: three equal samples
    ]
    outputs = llama.generate(fresh, sp)
    assert len(outputs) == 4 + 1 + 2 + 3
    groups = [outputs[0:4], outputs[4:5], outputs[5:7], outputs[7:10]]
    assert [[o.index for o in g] for g in groups] == [[0, 1, 2, 3], [0], [0, 1], [0, 1, 2]]
    assert_plain(model, fresh, [g[0] for g in groups], [1])
    for prompt, group in zip(fresh, groups):
        assert all(o.prompt_tokens == len(prompt) for o in group)
        assert group[0].cached_tokens == 0
        # The prompt is prefilled once: later samples reuse all of it but the last token.
        assert [o.cached_tokens for o in group[1:]] == [len(prompt) - 1] * (len(group) - 1)
    samples = [o.token_ids for o in groups[0]]
    assert len({tuple(s) for s in samples}) >= 2
    singles = llama.generate([fresh[0]] * 4 + [fresh[2]] * 2, [
        params(temperature=0.8, seed=sample_seed(seed, i)) for i in range(4)] + [
        params(temperature=1.0, seed=sample_seed(99, i), logprobs=2) for i in range(2)])
    assert [o.token_ids for o in singles[:4]] == samples
    assert [o.token_ids for o in singles[4:]] == [o.token_ids for o in groups[2]]
    for out in groups[2]:
        check_logprobs(model, fresh[2], out, 2)
        check_sampled(model, fresh[2], sp[2], out.token_ids)
    for out in groups[0]:
        check_sampled(model, fresh[0], sp[0], out.token_ids)
    assert all(o.token_ids == hf_generate(model, fresh[3]) for o in groups[3])


def test_n_samples_reuse_the_prompt_when_batched_prompts_share_a_prefix(
        tiny_models: dict[str, Path]) -> None:
    """Prompts of one batch often share a prefix (a BOS token, a chat template). A request
    with n samples whose prompt shares even one token with another prompt of its step must
    still compute that prompt once: samples 1.. reuse all of it but the last token."""
    model = tiny_models["llama"]
    other, prompt = [7, 8, 9, 10, 11, 12], [7, 20, 21, 22, 23, 24, 25, 26]
    sp = [PLAIN, params(temperature=0.8, seed=1, n=3)]
    with LLM(model, device="cpu", hooks=CHECKED) as engine:  # a cold cache
        outputs = engine.generate([other, prompt], sp)
    assert [o.index for o in outputs] == [0, 0, 1, 2]
    assert outputs[1].cached_tokens == 0
    assert [o.cached_tokens for o in outputs[2:]] == [len(prompt) - 1] * 2


# ----- 6. mechanisms: overlap, paging, chunked prefill, scarce KV, TP, prefix hits -------------


MIX_PROMPTS = mixed_prompts(8, seed=21)  # 5 to 80 tokens


def _mix(model: Path) -> tuple[list[SamplingParams], list[Bans]]:
    """A representative mix: penalties, bias, bans of 1 to 3 tokens (chosen from what each
    request generates without them, so that they bite), min_p, top-k, logprobs of 0 to 20
    alternatives, n samples, and plain requests. Returns its params and each request's bans.
    With chunked prefill the banning requests are admitted in different steps, shortest
    sequences first (see test_bans_survive_a_later_admission_with_longer_sequences)."""
    plain = [hf_generate(model, p) for p in MIX_PROMPTS]
    controls = [
        {},
        dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3, logprobs=2),
        dict(temperature=0.9, seed=5, n=3, logprobs=1, min_p=0.1, top_k=50),
        dict(logit_bias={plain[3][1]: -100.0, 17: 3.0}),
        {},
        dict(temperature=1.0, seed=6, repetition_penalty=0.9, logit_bias={40: 2.0}, logprobs=3),
        dict(presence_penalty=1.0, logprobs=0),
        dict(logprobs=20),
    ]
    base = {i: reference_greedy(model, MIX_PROMPTS[i], params(**controls[i])) for i in (1, 3, 6)}
    bans: list[Bans] = [()] * len(controls)
    bans[1] = ((base[1][1],),)
    bans[3] = ((MIX_PROMPTS[3][-1], base[3][0]), (base[3][2], base[3][3]))
    bans[6] = ((base[6][0],), (base[6][3], base[6][4], base[6][5]))
    sp = [params(**c, **({"bad_token_ids": [list(s) for s in b]} if b else {}))
          for c, b in zip(controls, bans)]
    return sp, bans


def _run_mix(engine: LLM, model: Path) -> list:
    sp, _ = _mix(model)
    return engine.generate(MIX_PROMPTS, sp)


@pytest.fixture(scope="module")
def mix_baseline(tiny_models: dict[str, Path]) -> tuple[list, list]:
    """The mix under the default settings (a fresh engine), run twice: cold, then all hits."""
    model = tiny_models["llama"]
    with LLM(model, device="cpu", hooks=CHECKED) as engine:
        cold = _run_mix(engine, model)
        warm = _run_mix(engine, model)
    return cold, warm


def _outputs_of_prompt(outputs: list, sp: list[SamplingParams]) -> list[list]:
    groups, start = [], 0
    for p in sp:
        groups.append(outputs[start : start + p.n])
        start += p.n
    assert start == len(outputs)
    return groups


def assert_same_results(got: list, want: list) -> None:
    assert [(o.index, o.token_ids) for o in got] == [(o.index, o.token_ids) for o in want]
    for g, w in zip(got, want):
        assert (g.logprobs is None) == (w.logprobs is None)
        if w.logprobs is None:
            continue
        assert all(abs(a - b) <= LP_TOL for a, b in zip(g.logprobs, w.logprobs))
        for a, b in zip(g.top_logprobs, w.top_logprobs):
            assert len(a) == len(b)
            have, want = sorted(a.values()), sorted(b.values())
            assert all(abs(x - y) <= LP_TOL for x, y in zip(have, want)), (a, b)
            for token in a.keys() ^ b.keys():  # only a tie at the k-th value may differ
                assert abs(a.get(token, b.get(token)) - want[0]) <= LP_TOL, (a, b)
            assert all(abs(a[t] - b[t]) <= LP_TOL for t in a.keys() & b.keys()), (a, b)


def test_mix_default_settings_match_hf(mix_baseline: tuple[list, list],
                                       tiny_models: dict[str, Path]) -> None:
    model = tiny_models["llama"]
    sp, bans = _mix(model)
    groups = _outputs_of_prompt(mix_baseline[0], sp)
    for i, (p, b, group) in enumerate(zip(sp, bans, groups)):
        prompt = MIX_PROMPTS[i]
        for out in group:
            if p.is_greedy:
                assert out.token_ids == reference_greedy(model, prompt, p, b), i
            else:
                check_sampled(model, prompt, p, out.token_ids, b)
            if p.logprobs is not None:
                check_logprobs(model, prompt, out, p.logprobs)
            else:
                assert out.logprobs is None
            for seq in b:
                assert not completes(seq, prompt + out.token_ids, len(prompt)), (i, seq)
    assert_plain(model, MIX_PROMPTS, [g[0] for g in groups], [0, 4])
    assert len({tuple(o.token_ids) for o in groups[2]}) >= 2
    for i in (1, 3, 6):  # the bans bite
        unbanned = replace(sp[i], bad_token_ids=None)
        assert groups[i][0].token_ids != reference_greedy(model, MIX_PROMPTS[i], unbanned), i


def test_mix_prefix_cache_hits_identical(mix_baseline: tuple[list, list]) -> None:
    cold, warm = mix_baseline
    assert_same_results(warm, cold)
    assert all(o.cached_tokens == o.prompt_tokens - 1 for o in warm)


@pytest.mark.parametrize("settings", [
    {"overlap": False},
    {"page_size": 16},
    {"chunked_prefill_size": 16},
    {"chunked_prefill_size": 16, "page_size": 16, "overlap": False},
    {"max_total_tokens": 180},  # ~2x the largest prompt + max_tokens: requests queue
    {"chunked_prefill_size": 32, "max_running_requests": 3},
    {"tp_size": 2},
], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_mix_identical_under_engine_settings(mix_baseline: tuple[list, list],
                                             tiny_models: dict[str, Path], settings: dict
                                             ) -> None:
    model = tiny_models["llama"]
    with LLM(model, device="cpu", hooks=CHECKED, **settings) as engine:
        outputs = _run_mix(engine, model)
        peak = engine.scheduler.peak_running
    assert_same_results(outputs, mix_baseline[0])
    if "max_total_tokens" in settings:
        assert peak < len(outputs)  # some requests had to wait


# ----- 7. validation ------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", math.nan),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("frequency_penalty", 2.5),
    ("frequency_penalty", math.inf), ("min_p", 1.5), ("min_p", -0.1),
    ("logit_bias", {1: 200}), ("logit_bias", {1: -100.5}), ("logit_bias", {-1: 1.0}),
    ("logit_bias", {1: math.nan}), ("logit_bias", {"1": 1.0}), ("logit_bias", [1, 2]),
    ("logit_bias", {i: 1.0 for i in range(1025)}),
    ("bad_token_ids", [[]]), ("bad_token_ids", [[-1]]), ("bad_token_ids", [1, 2]),
    ("bad_token_ids", [[1.5]]), ("bad_words", [""]), ("bad_words", ["ok", 3]),
    ("bad_words", "word"),
    ("logprobs", 21), ("logprobs", -1), ("logprobs", 1.0),
    ("n", 0), ("n", 65), ("n", 2.0),
])
def test_invalid_controls_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_valid_edge_values_accepted() -> None:
    p = SamplingParams(repetition_penalty=1e-3, presence_penalty=-2, frequency_penalty=2,
                       min_p=1.0, logit_bias={0: -100, 3: 100.0}, bad_token_ids=[[1], [2, 3]],
                       bad_words=["x"], logprobs=20, n=64)
    assert p.logit_bias == {0: -100.0, 3: 100.0}
    assert SamplingParams(logprobs=0).logprobs == 0


def test_out_of_vocab_ids_raise_and_engine_keeps_serving(llama: LLM,
                                                         tiny_models: dict[str, Path]) -> None:
    prompts = mixed_prompts(2, seed=15)
    vocab = llama.vocab_size
    assert vocab == 512
    with pytest.raises(ValueError, match=r"prompts\[1\].*logit_bias"):
        llama.generate(prompts, [PLAIN, params(logit_bias={vocab: 1.0})])
    with pytest.raises(ValueError, match=r"prompts\[0\].*bad_token_ids"):
        llama.generate(prompts, [params(bad_token_ids=[[5, vocab + 3]]), PLAIN])
    with pytest.raises(ValueError, match="bad_token_ids"):
        llama.generate(prompts[:1], params(bad_token_ids=[[10**9]]))
    outputs = llama.generate(prompts, [PLAIN, params(logit_bias={vocab - 1: 100.0})])
    assert_plain(tiny_models["llama"], prompts, outputs, [0])
    assert outputs[1].token_ids == [vocab - 1] * MAX_TOKENS
