"""Structured output (JSON schemas, regexes, EBNF grammars, any JSON object) on CPU.

Oracles: greedy guided output equals a reference loop that applies xgrammar's token mask to HF
transformers' float32 logits token by token (tiny random model and the default model); finished
outputs of the default model are valid (jsonschema, re.fullmatch, a fresh matcher accepting the
text); unguided requests batched with guided ones give exactly their unguided outputs; all of
it under overlap on and off, page size 16, chunked prefill, tensor parallel 2 and n > 1.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from minisgl_backend import LLM, SamplingParams
from minisgl_backend.grammar.guide import (
    PARALLEL_FILL_ROWS,
    Guide,
    accept_tokens,
    apply_token_masks,
    fill_masks,
    mask_words,
)
from minisgl_backend.models import ModelConfig
from minisgl_backend.tokenizer import encode_chat
from tests.conftest import CHECKED, _hf_model, hf_greedy

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 10},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                     "maxItems": 3}},
            "required": ["name", "tags"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["user", "score"]},
    "enum_and_bool": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Rome", "Berlin"]}, "capital": {"type": "boolean"}},
        "required": ["city", "capital"]},
    "array_of_numbers": {"type": "array", "items": {"type": "number"}, "minItems": 1,
                         "maxItems": 4},
    "string_formats": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
        "day": {"type": "string", "format": "date"}},
        "required": ["code", "day"]},
}
REGEXES = [r"(yes|no), because [a-z ]{1,30}\.", r"[0-9]{3}-[0-9]{4}", r"#[0-9a-f]{6}"]
GRAMMAR = """root ::= "The answer is " answer "."
answer ::= "yes" | "no" | number
number ::= [1-9] [0-9]*"""


# ----- the reference ------------------------------------------------------------------------


@cache
def _compiler(model_dir: str) -> tuple[xgr.GrammarCompiler, frozenset[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = ModelConfig.from_folder(model_dir)
    eos = frozenset(config.eos_token_ids) | (
        {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=config.vocab_size,
                                              stop_token_ids=sorted(eos))
    return xgr.GrammarCompiler(info), eos


def compile_guide(model_dir: Path, p: SamplingParams) -> xgr.CompiledGrammar:
    compiler, _ = _compiler(str(model_dir))
    if p.json_schema is not None:
        return compiler.compile_json_schema(p.json_schema)
    if p.regex is not None:
        return compiler.compile_regex(p.regex)
    if p.grammar is not None:
        return compiler.compile_grammar(p.grammar)
    return compiler.compile_json_schema('{"type": "object"}')


def reference(model_dir: Path, prompt: list[int], p: SamplingParams) -> list[int]:
    """Greedy decoding of HF float32 logits under xgrammar's mask, one full forward a token;
    stops at a stop token (allowed only where the grammar may end) or max_tokens."""
    _, eos = _compiler(str(model_dir))
    matcher = xgr.GrammarMatcher(compile_guide(model_dir, p))
    model = _hf_model(str(model_dir))
    seq, out = list(prompt), []
    for _ in range(p.max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, -1:].float()
        mask = xgr.allocate_token_bitmask(1, logits.shape[-1])
        matcher.fill_next_token_bitmask(mask, 0)
        xgr.apply_token_bitmask_inplace(logits, mask)
        token = int(torch.argmax(logits[0]))
        out.append(token)
        if token in eos:
            break
        assert matcher.accept_token(token)
        seq.append(token)
    return out


def guided_cases() -> list[SamplingParams]:
    cases = [SamplingParams(max_tokens=40, json_schema=s) for s in SCHEMAS.values()]
    cases += [SamplingParams(max_tokens=24, regex=r) for r in REGEXES]
    cases += [SamplingParams(max_tokens=16, grammar=GRAMMAR),
              SamplingParams(max_tokens=32, json_object=True)]
    return cases


def plain_cases() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, ignore_eos=True)]


# ----- engines -------------------------------------------------------------------------------


KV_TOKENS = 8192  # debug_checks walks every page after each step: keep the pool small


@pytest.fixture(scope="module")
def smol(default_model: Path) -> Iterator[LLM]:
    with LLM(default_model, device="cpu", hooks=CHECKED, max_total_tokens=KV_TOKENS) as llm:
        yield llm


def smol_prompt(engine: LLM, i: int) -> list[int]:
    questions = ["Describe a user as JSON.", "Which city is the capital of France?",
                 "Give me some numbers.", "Give a product code and a date.", "Answer:",
                 "Phone number:", "A colour:", "Is the sky blue?", "Any JSON object:"]
    return encode_chat(engine.tokenizer,
                       [{"role": "user", "content": questions[i % len(questions)]}])


def check_valid(text: str, p: SamplingParams) -> None:
    """A finished guided output is in its language."""
    if p.json_schema is not None:
        jsonschema.validate(json.loads(text), json.loads(p.json_schema))
    elif p.json_object:
        assert isinstance(json.loads(text), dict), text
    elif p.regex is not None:
        assert re.fullmatch(p.regex, text), (p.regex, text)
    else:
        assert re.fullmatch(r"The answer is (yes|no|[1-9][0-9]*)\.", text), text


# ----- the tests ------------------------------------------------------------------------------


def test_default_model_outputs_are_valid_and_equal_the_reference(smol: LLM,
                                                                 default_model: Path) -> None:
    cases = guided_cases() + plain_cases()
    prompts = [smol_prompt(smol, i) for i in range(len(cases))]
    outputs = smol.generate(prompts, cases)
    plain = smol.generate(prompts[-2:], plain_cases())
    finished = 0
    for prompt, p, out in zip(prompts, cases, outputs):
        if p.json_schema or p.regex or p.grammar or p.json_object:
            assert out.token_ids == reference(default_model, prompt, p), (p, out.text)
            if out.finish_reason == "stop":
                check_valid(out.text, p)
                finished += 1
    assert finished >= len(guided_cases()) - 2  # nearly all end inside their budget
    # unguided requests batched with guided ones are untouched
    assert [o.token_ids for o in outputs[-2:]] == [o.token_ids for o in plain]


def test_tiny_model_guided_greedy_equals_the_reference(tiny_models: dict[str, Path]) -> None:
    model = tiny_models["llama"]
    cases = guided_cases()
    prompts = [[5 + i, 17, 99, 3 * i + 1, 42] for i in range(len(cases))]
    with LLM(model, device="cpu", hooks=CHECKED, max_total_tokens=KV_TOKENS) as engine:
        outputs = engine.generate(prompts, cases)
    for prompt, p, out in zip(prompts, cases, outputs):
        assert out.token_ids == reference(model, prompt, p), p


# The mix runs on the tiny model (its heads split over 2 ranks; its outputs, random but
# inside their grammars, rarely end before max_tokens).
@pytest.fixture(scope="module")
def tiny(tiny_models: dict[str, Path]) -> Iterator[LLM]:
    with LLM(tiny_models["llama"], device="cpu", hooks=CHECKED,
             max_total_tokens=KV_TOKENS) as llm:
        yield llm


@pytest.fixture(scope="module")
def mix_baseline(tiny: LLM) -> list:
    return tiny.generate(*_mix())


def _mix() -> tuple[list[list[int]], list[SamplingParams]]:
    """Guided and unguided requests together, prompts sharing a prefix; sampled ones seeded;
    one with n = 2."""
    cases = [SamplingParams(max_tokens=40, json_schema=SCHEMAS["enum_and_bool"]),
             SamplingParams(max_tokens=12),
             SamplingParams(max_tokens=24, regex=REGEXES[0], temperature=0.8, seed=5),
             SamplingParams(max_tokens=40, json_schema=SCHEMAS["nested"], temperature=0.7,
                            seed=9, n=2),
             SamplingParams(max_tokens=16, grammar=GRAMMAR),
             SamplingParams(max_tokens=12, temperature=0.9, seed=2)]
    shared = list(range(40, 60))  # longer than a page of 16 and a chunk of 16
    prompts = [shared + [i + 1, 2 * i + 3] for i in range(len(cases))]
    return prompts, cases


@pytest.mark.parametrize("settings", [
    {"jump_forward": False},
    {"speculative": "ngram", "num_speculative_tokens": 3},
    {"overlap": False},
    {"page_size": 16},
    {"chunked_prefill_size": 16},
    {"tp_size": 2},
], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_guided_mix_identical_under_engine_settings(tiny_models: dict[str, Path],
                                                    mix_baseline: list, settings: dict) -> None:
    with LLM(tiny_models["llama"], device="cpu", max_total_tokens=KV_TOKENS,
             **settings) as engine:
        outputs = engine.generate(*_mix())
    assert [o.token_ids for o in outputs] == [o.token_ids for o in mix_baseline]


def test_overlapped_guided_steps_advance_grammars_before_the_rest_of_the_output(
        tiny_models: dict[str, Path], mix_baseline: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """With overlap and masks that follow their step, the scheduler moves the grammars on with
    the step's tokens, sends the next masks, and only then detokenizes and emits: the same
    tokens, and the early path really ran."""
    from minisgl_backend.scheduler.output import OutputTracker

    advanced = []
    original = OutputTracker.advance_guides
    monkeypatch.setattr(OutputTracker, "advance_guides", staticmethod(
        lambda pairs: advanced.extend(token for _, token in pairs) or original(pairs)))
    with LLM(tiny_models["llama"], device="cpu", max_total_tokens=KV_TOKENS,
             jump_forward=False) as engine:
        outputs = engine.generate(*_mix())
    assert [o.token_ids for o in outputs] == [o.token_ids for o in mix_baseline]
    per_output = [p for p in _mix()[1] for _ in range(p.n)]  # outputs: n per prompt
    guided_tokens = sum(len(o.token_ids) for o, p in zip(outputs, per_output, strict=True)
                        if p.json_schema or p.regex or p.grammar)
    assert 0 < len(advanced) <= guided_tokens


def test_guided_mix_equals_the_reference_and_prefix_hits(tiny: LLM, mix_baseline: list,
                                                         tiny_models: dict[str, Path]) -> None:
    prompts, cases = _mix()
    model = tiny_models["llama"]
    guided, plain = mix_baseline[0], mix_baseline[1]  # both greedy
    assert guided.token_ids == reference(model, prompts[0], cases[0])
    assert plain.token_ids == hf_greedy(model, [prompts[1]], cases[1].max_tokens,
                                        stop_at_eos=True)[0]
    again = tiny.generate(prompts, cases)
    assert [o.token_ids for o in again] == [o.token_ids for o in mix_baseline]
    assert all(o.cached_tokens > 0 for o in again)
    assert again[3].token_ids != again[4].token_ids  # the two samples of one request differ


def test_jump_forward_verifies_forced_tokens_with_the_same_text(default_model: Path,
                                                                smol: LLM) -> None:
    """The default engine verifies what the grammar forces (the fixed keys and punctuation
    of a schema) as drafts: fewer steps, the same tokens as without jump-forward."""
    schema = {"type": "object", "properties": {
        "first_name": {"type": "string", "maxLength": 8},
        "home_city": {"enum": ["Paris", "Rome"]}, "is_active": {"type": "boolean"}},
        "required": ["first_name", "home_city", "is_active"]}
    cases = [SamplingParams(max_tokens=48, json_schema=schema),
             SamplingParams(max_tokens=48, json_schema=schema, temperature=0.8, seed=7)]
    prompts = [smol_prompt(smol, 0), smol_prompt(smol, 8)]
    spec = smol.scheduler.speculator
    before = (spec.verified_rows, spec.accepted)
    with_jumps = smol.generate(prompts, cases)
    assert spec.verified_rows > before[0] and spec.accepted > before[1]
    with LLM(default_model, device="cpu", max_total_tokens=KV_TOKENS,
             jump_forward=False) as plain:
        without = plain.generate(prompts, cases)
        assert plain.scheduler.speculator.verified_rows == 0
    assert [o.token_ids for o in with_jumps] == [o.token_ids for o in without]
    for out, p in zip(with_jumps, cases):
        check_valid(out.text, p)


def test_max_tokens_mid_structure_ends_with_length(smol: LLM) -> None:
    out = smol.generate([smol_prompt(smol, 0)],
                        SamplingParams(max_tokens=5, json_schema=SCHEMAS["nested"]))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text.startswith("{")


def test_grammar_ends_the_request_without_a_stop_token(smol: LLM) -> None:
    """ignore_eos leaves no stop token: the grammar's end ends the request."""
    out = smol.generate([smol_prompt(smol, 5)], SamplingParams(
        max_tokens=24, regex=REGEXES[1], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and re.fullmatch(REGEXES[1], out.text), out.text


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": 7}, "json_schema"),
    ({"json_schema": {"type": "objec"}}, "json_schema"),
    ({"regex": "a(b"}, "regex"),
    ({"regex": ""}, "regex"),
    ({"grammar": "root ::= undefined_rule"}, "grammar"),
    ({"regex": "a", "json_object": True}, "json_object"),
    ({"json_schema": {"type": "object"}, "grammar": GRAMMAR}, "grammar"),
])
def test_invalid_guides_name_the_field_and_the_engine_keeps_serving(smol: LLM, kwargs: dict,
                                                                    field: str) -> None:
    with pytest.raises(ValueError, match=field):
        smol.generate(["Hello"], SamplingParams(max_tokens=4, **kwargs))
    assert len(smol.generate(["Hello"], SamplingParams(max_tokens=3))[0].token_ids) == 3


def test_same_schema_compiles_once(smol: LLM) -> None:
    """xgrammar's compiler cache: the second compile of a schema returns at once."""
    import time

    grammars = smol.scheduler.grammars
    schema = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 77}}}
    first = time.perf_counter()
    grammars.compile(SamplingParams(json_schema=schema))
    first = time.perf_counter() - first
    again = time.perf_counter()
    grammars.compile(SamplingParams(json_schema=schema))
    again = time.perf_counter() - again
    assert again < first


def test_batched_mask_fill_equals_each_matcher_filling_its_row(default_model: Path) -> None:
    """fill_masks (xgrammar's BatchGrammarMatcher, one thread or several) writes exactly the
    rows each matcher fills alone, at batch sizes on both sides of PARALLEL_FILL_ROWS, with
    guides at different points of their grammars."""
    compiled = compile_guide(default_model, SamplingParams(json_schema=SCHEMAS["nested"]))
    words = mask_words(ModelConfig.from_folder(default_model).vocab_size)
    text_ids = AutoTokenizer.from_pretrained(default_model).encode(
        '{"user": {"name": "Ann", "tags": ["red"]}, "score": 7}', add_special_tokens=False)
    for rows in (3, PARALLEL_FILL_ROWS + 2):
        guides = [Guide(compiled, set()) for _ in range(rows)]
        for i, guide in enumerate(guides):
            for token in text_ids[: i % len(text_ids)]:
                assert guide.accept(token)
        alone = np.zeros((rows, words), dtype=np.int32)
        for i, guide in enumerate(guides):
            guide.fill(alone, i)
        batched = np.zeros((rows + 1, words), dtype=np.int32)  # rows 1.. : indices honoured
        fill_masks(guides, batched, list(range(1, rows + 1)))
        assert (batched[1:] == alone).all() and not batched[0].any()
        assert len({alone[i].tobytes() for i in range(rows)}) > 1  # the rows differ


def test_batched_accepts_report_each_rejection_and_finished_follows(default_model: Path) -> None:
    """accept_tokens answers per row, also when one token of the batch is rejected (its matcher
    stays put, the others move on), and `Guide.finished`, kept between tokens, follows the
    matcher: after the token that ends the grammar, and not before."""
    compiled = compile_guide(default_model, SamplingParams(json_schema=SCHEMAS["nested"]))
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    text_ids = tokenizer.encode('{"user": {"name": "Ann", "tags": ["red"]}, "score": 7}',
                                add_special_tokens=False)
    stop = tokenizer.eos_token_id
    guides = [Guide(compiled, {stop}) for _ in range(3)]
    outside = tokenizer.encode("hello", add_special_tokens=False)[0]
    assert accept_tokens(guides, [text_ids[0]] * 3) == [True, True, True]
    assert accept_tokens(guides, [text_ids[1], outside, text_ids[1]]) == [True, False, True]
    assert accept_tokens(guides[1:2], [text_ids[1]]) == [True]  # the rejected one stayed put
    for token in text_ids[2:]:
        assert not any(g.finished for g in guides)
        assert accept_tokens(guides, [token] * 3) == [True, True, True]
    assert not any(g.finished for g in guides)  # complete, not ended: the stop token is next
    assert accept_tokens(guides[:2], [stop, stop]) == [True, True]
    assert [g.finished for g in guides] == [True, True, False]
    assert guides[2].accept(stop) and guides[2].finished


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.parametrize("rows", [[0, 1, 2], [2, 0], [1]])
def test_token_masks_reach_only_the_guided_rows(device: str, rows: list[int]) -> None:
    """Every row guided in order, some rows out of order, one row: each guided row keeps the
    tokens its mask allows, the other rows are untouched (a vocabulary not a multiple of 32)."""
    vocab = 70
    masks = np.random.default_rng(0).integers(-2**31, 2**31 - 1, size=(len(rows), 3)).astype(
        np.int32)
    logits = torch.zeros(3, vocab, device=device)
    apply_token_masks(logits, np.asarray(rows), masks)
    allowed = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    expected = torch.zeros(3, vocab)
    for mask, row in zip(allowed, rows):
        expected[row, torch.from_numpy(mask == 0)] = float("-inf")
    assert torch.equal(logits.cpu(), expected)
