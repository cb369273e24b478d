"""The per-request sampling controls on a GPU, with CUDA graphs and overlap on and off.

In float32 every control is checked against HF transformers on the same tiny model (head dim
128, as `test_gpu_engine.py`'s): greedy with `repetition_penalty` equals HF `generate`, presence
and frequency penalties, `logit_bias` and `min_p` equal a reference loop over HF's logits,
`bad_token_ids` equal HF's `bad_words_ids`, `logprobs` equal HF's log-softmax of the raw logits
within 1e-4, the `n` samples of a request equal single requests with the derived seeds, and a
mixed batch gives the CPU engine's tokens (greedy strictly, sampled all but one), returned
context and generation logits equal HF's. A bf16 run
(the GPU's default dtype) checks only the controls' invariants. Skipped without CUDA.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from minisgl_backend import LLM, SamplingParams
from minisgl_backend.core import sample_seed
from minisgl_backend.llm import GenerationOutput
from minisgl_backend.testing.tiny_models import build_tiny_model
from tests.conftest import CHECKED, mixed_prompts
from tests.test_gpu_engine import GPU_SHAPES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = "cuda"
ARCH = "qwen3"
MAX_TOKENS = 10
LOGPROB_TOL = 1e-4
# A small KV pool: debug_checks walks every page after every step (the default pool of a GPU
# holds millions).
KV_TOKENS = 16384
# attention backend, largest CUDA-graph batch (None: the default, 256), overlap
FLOAT32_CASES = [
    ("triton", None, True),
    ("triton", 16, False),
    ("triton", 0, True),
    ("torch", 0, False),
]


# A test's prompts, their sampling settings and the tokens expected of each.
Case = tuple[list[list[int]], list[SamplingParams], list[list[int]]]


def case_id(case: tuple[str, int | None, bool]) -> str:
    backend, graphs, overlap = case
    return (f"{backend}-graphs{'default' if graphs is None else graphs}-"
            f"overlap{'on' if overlap else 'off'}")


# ----- the model, HF's reference and the engines ------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(ARCH, tmp_path_factory.mktemp("controls-model") / ARCH,
                            **GPU_SHAPES[ARCH])


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> torch.nn.Module:
    """HF transformers on the CPU in float32: the reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=FLOAT32_CASES, ids=case_id)
def engine(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[LLM]:
    backend, graphs, overlap = request.param
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("needs triton")
    settings = {} if graphs is None else {"cuda_graph_max_bs": graphs}
    with LLM(model_dir, device=DEVICE, dtype="float32", attention_backend=backend,
             overlap=overlap, max_total_tokens=KV_TOKENS, hooks=CHECKED, **settings) as llm:
        yield llm


@pytest.fixture(scope="module")
def cpu_engine(model_dir: Path) -> Iterator[LLM]:
    with LLM(model_dir, device="cpu", dtype="float32", max_total_tokens=KV_TOKENS) as llm:
        yield llm


def params(**kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


def hf_generate(hf: torch.nn.Module, prompt: list[int], **kwargs: object) -> list[int]:
    """HF `generate`, greedy, exactly MAX_TOKENS new tokens (no EOS)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                          pad_token_id=0, eos_token_id=None, **kwargs)
    return out[0, len(prompt):].tolist()


def reference_greedy(hf: torch.nn.Module, prompt: list[int], p: SamplingParams) -> list[int]:
    """The engine's controls written out over HF's float32 logits, one full forward a token:
    repetition penalty (prompt and output), presence and frequency penalties (output),
    logit_bias, bad_token_ids; then argmax (`min_p` only matters when sampling, and min_p 1.0
    with any temperature keeps only the argmax)."""
    ids, out = list(prompt), []
    for _ in range(p.max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        vocab = logits.shape[0]
        rep = p.repetition_penalty
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[ids] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=vocab).float()
        logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        for token, value in (p.logit_bias or {}).items():
            logits[token] += value
        for seq in p.bad_token_ids:
            if len(seq) == 1 or ids[len(ids) - len(seq) + 1:] == list(seq[:-1]):
                logits[seq[-1]] = float("-inf")
        token = int(torch.argmax(logits))
        ids.append(token)
        out.append(token)
    return out


def hf_log_softmax(hf: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab]: HF's log-softmax of the raw logits each token was sampled from."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)], dim=-1)


def check_logprobs(out: GenerationOutput, reference: torch.Tensor, top: int) -> None:
    """An output's log-probabilities against the reference log-softmax, within LOGPROB_TOL."""
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    assert len(out.top_logprobs) == len(out.token_ids)
    for j, (token, lp, alternatives) in enumerate(zip(out.token_ids, out.logprobs,
                                                      out.top_logprobs)):
        assert abs(lp - float(reference[j, token])) <= LOGPROB_TOL, (j, lp)
        assert len(alternatives) == top
        expected = reference[j].topk(top).values.tolist() if top else []
        values = list(alternatives.values())
        assert values == sorted(values, reverse=True)
        assert all(abs(a - b) <= LOGPROB_TOL for a, b in zip(values, expected)), (j, values)
        for token_id, value in alternatives.items():  # ties may order ids either way
            assert abs(value - float(reference[j, token_id])) <= LOGPROB_TOL
    assert out.cumulative_logprob == pytest.approx(sum(out.logprobs))


# ----- float32 against HF -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def penalty_case(hf: torch.nn.Module) -> Case:
    prompts = mixed_prompts(6)
    penalties = [1.3, 0.7, 1.0, 2.0, 1.15, 1.3]
    ps = [params(repetition_penalty=r) for r in penalties]
    expected = [hf_generate(hf, prompt, repetition_penalty=r)
                for prompt, r in zip(prompts, penalties)]
    plain = [hf_generate(hf, prompt) for prompt in prompts]
    assert sum(e != g for e, g in zip(expected, plain)) >= 2  # the penalty really acts
    return prompts, ps, expected


@pytest.fixture(scope="module")
def penalty_bias_case(hf: torch.nn.Module) -> Case:
    prompts = mixed_prompts(7, seed=1)
    plain = [hf_generate(hf, prompt) for prompt in prompts]
    # Bias against each prompt's own greedy tokens and towards an arbitrary one.
    bias = {plain[3][0]: -100.0, plain[3][1]: -3.5, 123: 2.5, 7: 0.25}
    ps = [
        params(presence_penalty=1.5),
        params(frequency_penalty=0.8),
        params(presence_penalty=-0.5, frequency_penalty=0.6),
        params(logit_bias=bias),
        params(repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.3,
               logit_bias={plain[4][0]: -1.0, 300: 1.5}),
        # min_p 1.0 keeps only the most likely token: sampling at any temperature is greedy.
        params(temperature=0.9, seed=5, min_p=1.0, frequency_penalty=1.0,
               logit_bias={plain[5][0]: -2.0}),
        params(),  # no control beside the others
    ]
    expected = [reference_greedy(hf, prompt, p) for prompt, p in zip(prompts, ps)]
    assert expected[-1] == plain[-1]  # the reference loop is HF's greedy without controls
    assert sum(e != g for e, g in zip(expected, plain)) >= 4
    return prompts, ps, expected


@pytest.fixture(scope="module")
def ban_case(hf: torch.nn.Module) -> Case:
    prompts = mixed_prompts(5, seed=2)
    plain = [hf_generate(hf, prompt) for prompt in prompts]
    bans = [
        [plain[0][0]],  # one token, banned everywhere
        [prompts[1][-1], plain[1][0]],  # the prefix is the prompt's last token
        plain[2][1:4],  # three tokens, prefix in the output
        [plain[3][2], plain[3][3]],
    ]
    expected = [hf_generate(hf, prompt, bad_words_ids=bans) for prompt in prompts]
    assert sum(e != g for e, g in zip(expected, plain)) >= 3
    ps = [params(bad_token_ids=bans)] * (len(prompts) - 1) + [params()]
    expected[-1] = plain[-1]  # a row without bans in the same batch
    return prompts, ps, expected


@pytest.mark.parametrize("case", ["penalty_case", "penalty_bias_case", "ban_case"])
def test_greedy_controls_equal_hf(engine: LLM, case: str, request: pytest.FixtureRequest) -> None:
    """Each case's rows (different controls, and none, in one batch) equal HF's references:
    `generate(repetition_penalty=...)`, the reference loop over HF logits for presence /
    frequency / logit_bias / min_p, `generate(bad_words_ids=...)`."""
    prompts, ps, expected = request.getfixturevalue(case)
    assert [o.token_ids for o in engine.generate(prompts, ps)] == expected


def test_logprobs_equal_hf_log_softmax(engine: LLM, hf: torch.nn.Module) -> None:
    """Reported log-probabilities are those of the raw logits (before the controls), for
    greedy and sampled rows, next to rows that ask for none."""
    prompts = mixed_prompts(6, seed=3)
    ps = [
        params(logprobs=5),
        params(logprobs=0),
        params(),
        params(logprobs=20, temperature=0.8, seed=3, repetition_penalty=1.3,
               logit_bias={11: 4.0}),
        params(logprobs=3, temperature=1.0, seed=4, min_p=0.1, presence_penalty=0.5),
        params(logprobs=1, bad_token_ids=[[17], [40, 41]]),
    ]
    outs = engine.generate(prompts, ps)
    assert outs[2].logprobs is None and outs[2].top_logprobs is None
    assert outs[2].cumulative_logprob is None
    for prompt, p, out in zip(prompts, ps, outs):
        assert len(out.token_ids) == MAX_TOKENS
        if p.logprobs is not None:
            check_logprobs(out, hf_log_softmax(hf, prompt, out.token_ids), p.logprobs)


@pytest.mark.parametrize("edits", ["none", "masks", "bias", "penalty"])
def test_logprobs_of_every_row_equal_hf(engine: LLM, hf: torch.nn.Module, edits: str) -> None:
    """Every row of the batch asks: the sampled tokens' log-probabilities are read from the
    step's logits after sampling, which must then be a copy of the raw ones when a control
    changes a logit's value in place (a bias, a penalty), and need not be when controls only
    mask tokens that cannot be sampled (bans, min_tokens). Without any, every
    log-probability is taken after sampling (`LogitControls.sampled_logprobs`)."""
    prompts = mixed_prompts(3, seed=5)
    extra = {"none": {},
             "masks": {"min_tokens": MAX_TOKENS, "stop_token_ids": [3, 4],
                       "bad_token_ids": [[9]]},
             "bias": {"logit_bias": {7: 6.0}},
             "penalty": {"repetition_penalty": 0.5}}[edits]
    ps = [params(logprobs=2), params(logprobs=0, temperature=0.9, seed=8),
          params(logprobs=4, **extra)]
    outs = engine.generate(prompts, ps)
    for prompt, p, out in zip(prompts, ps, outs):
        check_logprobs(out, hf_log_softmax(hf, prompt, out.token_ids), p.logprobs)


def test_n_samples_equal_single_requests_with_derived_seeds(engine: LLM) -> None:
    prompts = mixed_prompts(2, seed=4)
    ps = [params(n=4, temperature=0.9, seed=123, presence_penalty=0.5, logprobs=2,
                 bad_token_ids=[[9]]),
          params(n=3, temperature=1.1, seed=7, min_p=0.05, repetition_penalty=1.1)]
    outs = engine.generate(prompts, ps)
    assert [o.index for o in outs] == [0, 1, 2, 3, 0, 1, 2]
    singles = engine.generate(
        [prompt for prompt, p in zip(prompts, ps) for _ in range(p.n)],
        [dataclasses.replace(p, n=1, seed=sample_seed(p.seed, i))
         for p in ps for i in range(p.n)])
    assert [o.token_ids for o in outs] == [o.token_ids for o in singles]
    assert len({tuple(o.token_ids) for o in outs[:4]}) > 1  # the samples really differ
    for many, one in zip(outs[:4], singles[:4]):
        assert many.logprobs == pytest.approx(one.logprobs, abs=LOGPROB_TOL)


def mixed_batch() -> tuple[list[list[int]], list[SamplingParams]]:
    """Every control, greedy and sampled, in one batch."""
    prompts = mixed_prompts(6, seed=5)
    bias = {i * 7: (i % 5) - 2.0 for i in range(50)}
    bans = [[3], [8], [100, 101], [5, 6, 7]]
    ps = [
        params(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2,
               logit_bias=bias, bad_token_ids=bans, logprobs=5),
        params(presence_penalty=1.0, frequency_penalty=0.5, logprobs=0),
        params(),
        params(temperature=0.7, seed=1, repetition_penalty=1.1, presence_penalty=0.3,
               frequency_penalty=0.2, min_p=0.05, logit_bias=bias, bad_token_ids=bans,
               logprobs=5),
        params(temperature=1.0, seed=2, min_p=0.2, n=2),
        params(temperature=0.8, seed=3, top_k=20, top_p=0.9, frequency_penalty=0.4),
    ]
    return prompts, ps


def test_gpu_equals_cpu_engine(engine: LLM, cpu_engine: LLM) -> None:
    prompts, ps = mixed_batch()
    gpu, cpu = engine.generate(prompts, ps), cpu_engine.generate(prompts, ps)
    assert len(gpu) == len(cpu) == sum(p.n for p in ps)
    samples = [p for p in ps for _ in range(p.n)]
    greedy = [(g, c) for g, c, p in zip(gpu, cpu, samples) if p.is_greedy]
    sampled = [(g, c) for g, c, p in zip(gpu, cpu, samples) if not p.is_greedy]
    assert [g.token_ids for g, _ in greedy] == [c.token_ids for _, c in greedy]
    # Sampled tokens agree but for a rounding at a CDF boundary (one request may differ).
    assert sum(g.token_ids == c.token_ids for g, c in sampled) >= len(sampled) - 1
    for g, c in greedy:
        if g.logprobs is not None:
            assert g.logprobs == pytest.approx(c.logprobs, abs=LOGPROB_TOL)


# ----- bf16: invariants only ----------------------------------------------------------------------


def completes_a_ban(context: Sequence[int], token: int, bans: Sequence[Sequence[int]]) -> bool:
    return any(seq[-1] == token and (len(seq) == 1 or list(context[-(len(seq) - 1):])
                                     == list(seq[:-1])) for seq in bans)


@pytest.mark.parametrize("graphs", [None, 0], ids=["graphs-default", "graphs-off"])
def test_bfloat16_controls_keep_their_invariants(model_dir: Path, graphs: int | None) -> None:
    """The GPU's default dtype: banned ids never sampled, n outputs per prompt, a +100 bias
    wins greedy, log-probabilities finite, <= 0 and sorted."""
    prompts = mixed_prompts(8, seed=6)
    settings = {} if graphs is None else {"cuda_graph_max_bs": graphs}
    with LLM(model_dir, device=DEVICE, max_total_tokens=KV_TOKENS, hooks=CHECKED,
             **settings) as llm:
        plain = llm.generate(prompts, params())
        # Ban the tokens greedy decoding likes most, and a two-token continuation.
        counts: dict[int, int] = {}
        for out in plain:
            for token in out.token_ids:
                counts[token] = counts.get(token, 0) + 1
        favourites = sorted(counts, key=counts.get, reverse=True)[:4]
        bans = [[t] for t in favourites] + [[plain[0].token_ids[0], plain[0].token_ids[1]]]
        favoured = 200 if 200 not in favourites else 201
        ps = [
            params(bad_token_ids=bans, logprobs=4),
            params(bad_token_ids=bans, temperature=0.8, seed=1, n=3, logprobs=2,
                   repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5),
            params(bad_token_ids=bans, temperature=1.0, seed=2, min_p=0.1, logprobs=20),
            params(logit_bias={favoured: 100.0}, logprobs=1),
            params(bad_token_ids=bans, temperature=0.7, seed=3, n=2, top_k=30,
                   logit_bias={i: 1.0 for i in range(0, 512, 3)}),
            params(repetition_penalty=1.5, logprobs=0),
            params(bad_token_ids=bans, n=2, temperature=1.2, seed=4),
            params(),
        ]
        outs = llm.generate(prompts, ps)
    assert len(outs) == sum(p.n for p in ps)
    assert [o.index for o in outs] == [i for p in ps for i in range(p.n)]
    for prompt, p, out in zip([q for q, p in zip(prompts, ps) for _ in range(p.n)],
                              [p for p in ps for _ in range(p.n)], outs):
        assert len(out.token_ids) == MAX_TOKENS
        context = list(prompt)
        for token in out.token_ids:
            assert not completes_a_ban(context, token, p.bad_token_ids), (context, token)
            context.append(token)
        if p.logprobs is None:
            assert out.logprobs is None
            continue
        assert len(out.logprobs) == len(out.top_logprobs) == MAX_TOKENS
        for token, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
            values = list(top.values())
            assert math.isfinite(lp) and lp <= 1e-6
            assert len(top) == p.logprobs and all(math.isfinite(v) and v <= 1e-6
                                                  for v in values)
            assert values == sorted(values, reverse=True)
            if values:
                assert lp <= values[0] + 1e-6
            if token in top:
                assert top[token] == pytest.approx(lp, abs=1e-6)
    assert outs[5].token_ids == [favoured] * MAX_TOKENS  # ps[3], after 1 + 3 + 1 outputs


def test_returned_logits_equal_hf(engine: LLM, hf: torch.nn.Module) -> None:
    """Context and generation logits (float32) equal HF's, with graphs and overlap as the
    engine fixture sets them, next to requests that return none."""
    prompts = mixed_prompts(3, seed=21)
    wants = params(return_context_logits=True, return_generation_logits=True)
    outputs = engine.generate(prompts, [wants, params(), params(return_generation_logits=True,
                                                                repetition_penalty=1.3)])
    for prompt, out, asked in zip(prompts, outputs, (True, False, True)):
        with torch.no_grad():
            full = hf(torch.tensor([prompt + out.token_ids])).logits[0].float().numpy()
        if asked:
            assert abs(out.generation_logits - full[len(prompt) - 1: -1]).max() < LOGPROB_TOL
        else:
            assert out.generation_logits is None
    first = outputs[0]
    with torch.no_grad():
        full = hf(torch.tensor([prompts[0]])).logits[0].float().numpy()
    assert first.context_logits.shape == full.shape
    assert abs(first.context_logits - full).max() < LOGPROB_TOL
    assert outputs[1].token_ids == hf_generate(hf, prompts[1])


def test_structured_output_equals_the_cpu_engine(engine: LLM, cpu_engine: LLM) -> None:
    """Guided greedy decoding (a JSON schema, a regex) with graphs and overlap as the engine
    fixture sets them gives the CPU engine's tokens, next to an unguided request."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"]}
    prompts = mixed_prompts(3, seed=33)
    cases = [params(json_schema=schema), params(regex="[0-9]{2}-[a-z]{3}"), params()]
    got = engine.generate(prompts, cases)
    want = cpu_engine.generate(prompts, cases)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
