"""Whole outputs (`Scheduler.submit(stream=False)`: `LLM.generate`, non-streaming Triton
requests): one output per sample at its end, equal to its streamed deltas joined
(`GenerationOutput`)."""

from __future__ import annotations

import dataclasses
import gc
import threading
from pathlib import Path

import numpy as np
import pytest

from minisgl_backend import LLM, SamplingParams
from minisgl_backend.core import Req
from minisgl_backend.scheduler.output import GenerationOutput, OutputTracker, RequestOutput
from tests.conftest import CHECKED, mixed_prompts
from tests.test_output_deltas import joined

# Fields that differ between two runs of one request: when, its prefix-cache hits.
PER_RUN = ("first_token_ns", "last_token_ns", "admitted_ns", "cached_tokens", "reused_pages")


@pytest.fixture(scope="module")
def llm(tiny_models: dict[str, Path]):  # noqa: ANN201
    with LLM(tiny_models["llama"], device="cpu", hooks=CHECKED) as engine:
        yield engine


def _outputs(llm: LLM, prompt: list[int], params: SamplingParams,
             stream: bool) -> list[RequestOutput]:
    """Every output of one request, in order."""
    outputs: list[RequestOutput] = []
    done = threading.Event()
    ended = []

    def on_output(out: RequestOutput) -> None:
        outputs.append(out)
        if out.finished:
            ended.append(out.index)
            if len(ended) == params.n:
                done.set()

    llm.scheduler.submit(prompt, params, on_output, stream=stream)
    assert done.wait(120)
    return outputs


def _by_sample(outputs: list[RequestOutput]) -> dict[int, list[RequestOutput]]:
    samples: dict[int, list[RequestOutput]] = {}
    for out in outputs:
        samples.setdefault(out.index, []).append(out)
    return samples


def _same(whole: list[RequestOutput], streamed: list[RequestOutput]) -> None:
    """The two runs' deltas joined are the same output."""
    a_run, b_run = joined(*whole), joined(*streamed)
    names = [f.name for f in dataclasses.fields(GenerationOutput) if not f.name.startswith("_")]
    for name in [*names, "generation_logits"]:
        a, b = getattr(a_run, name), getattr(b_run, name)
        if name in PER_RUN:
            continue
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            assert a is not None and b is not None and np.array_equal(a, b), name
        else:
            assert a == b, name


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=14, ignore_eos=True),
    SamplingParams(max_tokens=14, ignore_eos=True, logprobs=3, return_context_logits=True,
                   return_generation_logits=True),
    SamplingParams(max_tokens=12, temperature=0.8, seed=7, n=3, ignore_eos=True),
], ids=["greedy", "logprobs+logits", "n=3"])
def test_a_whole_output_equals_its_streamed_deltas_joined(llm: LLM,
                                                         params: SamplingParams) -> None:
    prompt = mixed_prompts(1, seed=11)[0]
    streamed = _by_sample(_outputs(llm, prompt, params, stream=True))
    whole = _by_sample(_outputs(llm, prompt, params, stream=False))
    assert sorted(whole) == sorted(streamed) == list(range(params.n))
    for index, outs in whole.items():
        assert len(outs) == 1 and outs[0].finished  # one output, at the end
        assert len(streamed[index]) == params.max_tokens  # one a token
        _same(outs, streamed[index])
        assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == params.max_tokens
        assert 0 < outs[0].first_token_ns <= outs[0].emitted_ns
        # The text decoded in one go is the tokenizer's text of the tokens.
        assert outs[0].text == llm.tokenizer.decode(outs[0].token_ids, skip_special_tokens=True)


def test_a_whole_output_ends_at_a_stop_token_or_string_as_a_stream_does(llm: LLM) -> None:
    prompt = mixed_prompts(1, seed=3)[0]
    free = _outputs(llm, prompt, SamplingParams(max_tokens=16, ignore_eos=True), stream=False)[0]
    stop_id = free.token_ids[5]
    stop_text = llm.tokenizer.decode(free.token_ids[6:8], skip_special_tokens=True).strip()
    for params in (SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=[stop_id]),
                   SamplingParams(max_tokens=16, ignore_eos=True, stop=[stop_text])):
        streamed = _outputs(llm, prompt, params, stream=True)
        (whole,) = _outputs(llm, prompt, params, stream=False)
        _same([whole], streamed)
        assert whole.finish_reason == "stop"
        assert len(whole.token_ids) < 16 and stop_text not in whole.text


def _tracker(llm: LLM, outputs: list[RequestOutput], stream: bool) -> OutputTracker:
    prompt = mixed_prompts(1, seed=5)[0]
    req = Req(uid=1, input_ids=list(prompt), prompt_len=len(prompt),
              sampling_params=SamplingParams(max_tokens=10, ignore_eos=True), seed=0)
    return OutputTracker(req, llm.tokenizer, frozenset(), outputs.append, stream=stream)


def test_a_whole_output_waits_for_the_end_and_an_abort_sends_the_tokens_before_it(
        llm: LLM) -> None:
    tokens = [int(t) for t in mixed_prompts(1, seed=9)[0][:4]]
    runs = {}
    for stream in (True, False):
        outputs: list[RequestOutput] = []
        tracker = _tracker(llm, outputs, stream)
        for token in tokens:
            assert not tracker.add_token(token)
            tracker.flush()
        assert len(outputs) == (len(tokens) if stream else 0)  # nothing before the end
        tracker.fail("abort", "the request was cancelled")
        runs[stream] = outputs
    whole, streamed = runs[False], runs[True]
    assert [(o.token_ids, o.finished, o.error) for o in whole] == [
        (tokens, False, None), ([], True, "the request was cancelled")]
    assert [o.finish_reason for o in whole] == [None, "abort"]
    _same(whole, streamed)


def test_the_tokens_a_whole_output_holds_stay_out_of_the_garbage_collectors_way(
        llm: LLM) -> None:
    """A request without streaming keeps every token's delta until its end (tens of thousands
    in an offline batch): once collections have seen them (one a level of nested tuples),
    later ones do not walk them again, log-probabilities and logits included."""
    outputs: list[RequestOutput] = []
    tracker = _tracker(llm, outputs, stream=False)
    logits = np.zeros((3, 8), np.float32)
    for i, token in enumerate([11, 12, 13]):
        tracker.add_token(token, (-0.5, (token, 7), (-0.5, -1.0)), logits[i])
        tracker.flush()
    assert not outputs
    for _ in range(3):
        gc.collect()
    assert tracker.has_pending and not any(gc.is_tracked(delta) for delta in tracker._pending)
