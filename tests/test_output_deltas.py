"""GenerationOutput: a sample's deltas joined, whole or in streamed parts; and which responses
a Triton request's queued deltas send (`ActiveRequest.take_responses`)."""

from __future__ import annotations

import numpy as np

from minisgl_backend.core import SamplingParams
from minisgl_backend.scheduler.output import GenerationOutput, RequestOutput
from minisgl_backend.serving.inflight import ActiveRequest
from minisgl_backend.serving.request import EngineRequest


def _delta(tokens: list[int], text: str, reason: str | None = None, error: str | None = None,
           emitted_ns: int = 0, **fields: object) -> RequestOutput:
    return RequestOutput(uid=3, token_ids=tokens, text=text, finished=reason is not None,
                         finish_reason=reason, prompt_tokens=5, cached_tokens=2, error=error,
                         emitted_ns=emitted_ns, **fields)  # type: ignore[arg-type]


def joined(*deltas: RequestOutput) -> GenerationOutput:
    """A sample's deltas joined."""
    output = GenerationOutput()
    for delta in deltas:
        output.add(delta)
    return output


def test_deltas_join_and_the_end_is_the_last_ones() -> None:
    out = joined(_delta([1], "a", emitted_ns=10), _delta([2, 3], "bc", emitted_ns=20,
                                                          pages=4, draft_tokens=3),
                  _delta([4], "", "length", emitted_ns=30, pages=5, draft_tokens=6))
    assert (out.token_ids, out.text, out.finished, out.finish_reason) == ([1, 2, 3, 4], "abc",
                                                                          True, "length")
    assert (out.prompt_tokens, out.cached_tokens, out.pages, out.draft_tokens) == (5, 2, 5, 6)
    assert (out.first_token_ns, out.last_token_ns) == (10, 30)
    assert out.logprobs is None and out.cumulative_logprob is None
    assert out.generation_logits is None and out.context_logits is None


def test_log_probabilities_and_logits_join() -> None:
    context, logits = np.ones((4, 8), np.float32), np.arange(24, dtype=np.float32).reshape(3, 8)
    out = joined(_delta([1], "a", logprobs=[-0.5], top_logprobs=[{1: -0.5}],
                         context_logits=context, generation_logits=logits[:1]),
                  _delta([2, 3], "bc", "stop", logprobs=[-0.25, -1.0],
                         top_logprobs=[{2: -0.25}, {3: -1.0}], generation_logits=logits[1:]))
    assert out.logprobs == [-0.5, -0.25, -1.0] and out.cumulative_logprob == -1.75
    assert out.top_logprobs == [{1: -0.5}, {2: -0.25}, {3: -1.0}]
    assert out.context_logits is context and np.array_equal(out.generation_logits, logits)


def test_a_whole_output_sets_its_first_token_time() -> None:
    out = joined(_delta([1, 2], "ab", "length", emitted_ns=50, first_token_ns=20))
    assert (out.first_token_ns, out.last_token_ns) == (20, 50)


def test_take_returns_the_part_since_the_last_take_with_the_totals() -> None:
    sample = joined(_delta([1], "a", emitted_ns=10, logprobs=[-1.0], top_logprobs=[{}],
                            context_logits=np.zeros((2, 4))),
                     _delta([2], "b", emitted_ns=20, logprobs=[-2.0], top_logprobs=[{}]))
    first = sample.take()
    sample.add(_delta([3], "c", "length", emitted_ns=30, logprobs=[-4.0], top_logprobs=[{}]))
    second = sample.take()
    assert (first.token_ids, first.text, first.logprobs) == ([1, 2], "ab", [-1.0, -2.0])
    assert first.context_logits is not None and second.context_logits is None
    assert (second.token_ids, second.text, second.logprobs) == ([3], "c", [-4.0])
    assert (first.cumulative_logprob, second.cumulative_logprob) == (-3.0, -7.0)
    assert (second.first_token_ns, second.last_token_ns, second.finished) == (10, 30, True)
    assert sample.token_ids == [] and sample.text == "" and sample.finished


def _active(stream: bool, n: int = 1) -> ActiveRequest:
    parsed = EngineRequest([1, 2], SamplingParams(max_tokens=8, n=n), stream, True, False,
                           False, False, False)
    return ActiveRequest(None, None, parsed, 0.0, 0)


def test_streaming_sends_the_queued_deltasjoined() -> None:
    state = _active(stream=True)
    (part,) = state.take_responses([_delta([1], "a"), _delta([2], "b")])
    assert (part.token_ids, part.text, part.finished) == ([1, 2], "ab", False)
    (end,) = state.take_responses([_delta([3], "c", "stop")])
    assert (end.token_ids, end.text, end.finished) == ([3], "c", True) and state.all_finished


def test_a_whole_response_waits_for_the_samples_end() -> None:
    state = _active(stream=False, n=2)
    assert state.take_responses([_delta([1, 2], "ab", "length", index=1)])[0].finished
    assert not state.all_finished
    (whole,) = state.take_responses([_delta([3], "c", "stop")])
    assert (whole.token_ids, whole.index) == ([3], 0) and state.all_finished


def test_an_error_ends_the_request_after_the_streamed_tokens_before_it() -> None:
    error = _delta([], "", "abort", error="the request was cancelled")
    streamed = _active(stream=True).take_responses([_delta([1], "a"), _delta([2], "b"), error])
    assert [(r.token_ids, r.text, r.error) for r in streamed] == [
        ([1, 2], "ab", None), ([], "", "the request was cancelled")]
    (whole,) = _active(stream=False).take_responses([_delta([1, 2], "ab"), error])
    assert (whole.error, whole.finish_reason) == ("the request was cancelled", "abort")
