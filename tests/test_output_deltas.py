"""merge_deltas: a request's queued deltas sent as one streaming response."""

from __future__ import annotations

from minisgl_backend.scheduler.output import RequestOutput, merge_deltas


def _delta(tokens: list[int], text: str, reason: str | None = None,
           error: str | None = None) -> RequestOutput:
    return RequestOutput(uid=3, token_ids=tokens, text=text, finished=reason is not None,
                         finish_reason=reason, prompt_tokens=5, cached_tokens=2, error=error)


def test_one_delta_is_kept_as_it_is() -> None:
    delta = _delta([1], "a")
    assert merge_deltas([delta]) == [delta]


def test_token_deltas_join_and_the_end_is_the_last_ones() -> None:
    merged = merge_deltas([_delta([1], "a"), _delta([2, 3], "bc"), _delta([4], "", "length")])
    assert merged == [RequestOutput(uid=3, token_ids=[1, 2, 3, 4], text="abc", finished=True,
                                    finish_reason="length", prompt_tokens=5, cached_tokens=2)]


def test_an_error_end_stays_separate_after_the_joined_tokens() -> None:
    error = _delta([], "", "abort", error="the request was cancelled")
    merged = merge_deltas([_delta([1], "a"), _delta([2], "b"), error])
    assert [m.token_ids for m in merged] == [[1, 2], []]
    assert merged[0].text == "ab" and not merged[0].finished
    assert merged[1] is error
