"""What a request reports back: per-step deltas of tokens and text, and its end; and each
sample's deltas joined."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import numpy as np

from minisgl_backend.core import Req
from minisgl_backend.engine.protocol import Logprobs
from minisgl_backend.grammar.guide import accept_tokens
from minisgl_backend.tokenizer import IncrementalDetokenizer, StopStringMatcher


@dataclass
class RequestOutput:
    """A delta: the tokens and text produced since the previous output of the same request."""

    uid: int
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    index: int = 0  # the sample number, among the request's `n`
    # With SamplingParams.logprobs: per token of `token_ids`, its log-probability and the most
    # likely tokens with theirs.
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    # KV pages the request holds, those of them it took from the prefix cache, when it was
    # admitted and when this output was made (time.time_ns()).
    pages: int = 0
    reused_pages: int = 0
    admitted_ns: int = 0
    emitted_ns: int = 0
    # When the first of `token_ids` was taken, if long before `emitted_ns` (an output that
    # waited for the request's end: `Scheduler.submit(stream=False)`); else 0.
    first_token_ns: int = 0
    # With SamplingParams.return_context_logits: the prompt's logits [prompt tokens, vocab]
    # (float32), on the request's first output; with return_generation_logits: the raw logits
    # of each token of `token_ids` [tokens, vocab].
    context_logits: np.ndarray | None = None
    generation_logits: np.ndarray | None = None
    # Speculative decoding, so far in the request: draft tokens verified, and of them kept.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


OutputCallback = Callable[[RequestOutput], None]


# What a sample takes from each delta as it is (its latest state).
_LATEST = ("prompt_tokens", "cached_tokens", "index", "finished", "finish_reason", "error",
           "pages", "reused_pages", "admitted_ns", "draft_tokens", "accepted_draft_tokens")


@dataclass
class GenerationOutput:
    """One sample of a request, its deltas joined (`add`): what `LLM.generate` returns for it,
    and what the Triton model sends, whole or (streaming) in parts (`take`)."""

    prompt_tokens: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # generated tokens only
    finish_reason: str | None = None  # "stop" or "length" ("abort" or "error" with `error`)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    index: int = 0  # the sample number, 0 .. n - 1
    # With SamplingParams.logprobs set, per generated token: its log-probability (log-softmax
    # of the raw logits) and the `logprobs` most likely tokens with theirs; and the sum over
    # every token of the sample (a part's too).
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    # With return_context_logits: the prompt's logits [prompt tokens, vocab] (sample 0 only);
    # with return_generation_logits, `generation_logits`: each token's raw logits.
    context_logits: np.ndarray | None = None
    # Speculative decoding: draft tokens verified for this sample, and of them kept.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    finished: bool = False
    error: str | None = None
    # The latest delta's; and when the sample's first and latest tokens were taken.
    pages: int = 0
    reused_pages: int = 0
    admitted_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0
    # Joined when read: a sample's streamed deltas each bring [tokens, vocab].
    _logits: list[np.ndarray] = field(default_factory=list, repr=False)

    @property
    def generation_logits(self) -> np.ndarray | None:
        """Each generated token's raw logits [tokens, vocab] (with return_generation_logits)."""
        if len(self._logits) > 1:
            self._logits[:] = [np.concatenate(self._logits)]
        return self._logits[0] if self._logits else None

    def add(self, delta: RequestOutput) -> None:
        """Join the sample's next delta."""
        for name in _LATEST:
            setattr(self, name, getattr(delta, name))
        self.text += delta.text
        if delta.token_ids:
            self.token_ids += delta.token_ids
            self.first_token_ns = self.first_token_ns or delta.first_token_ns or delta.emitted_ns
            self.last_token_ns = delta.emitted_ns
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs, self.top_logprobs = [], []
            self.logprobs += delta.logprobs
            self.top_logprobs += delta.top_logprobs or ()  # type: ignore[operator]
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + sum(delta.logprobs)
        if delta.context_logits is not None:
            self.context_logits = delta.context_logits
        if delta.generation_logits is not None:
            self._logits.append(delta.generation_logits)

    def take(self) -> GenerationOutput:
        """The part added since the last `take` (text, tokens, their log-probabilities and
        logits, the prompt's logits) with the sample's totals and latest state: a streamed
        response. This output keeps only the totals."""
        part = copy.copy(self)
        self.text, self.token_ids, self.context_logits, self._logits = "", [], None, []
        if self.logprobs is not None:
            self.logprobs, self.top_logprobs = [], []
        return part


class _Delta(NamedTuple):
    """A sampled token whose output is decided but not yet emitted (`OutputTracker.flush`).

    Trackers hold these as plain tuples: the garbage collector stops tracking a plain tuple of
    untracked values, not a NamedTuple, and a whole output holds every token's until its end."""

    token: int
    reason: str | None  # the request's end, if this token ends it
    error: str | None
    counted: bool  # its text is part of the output (not an EOS or stop token, not an error)
    logprobs: Logprobs | None
    logits: np.ndarray | None
    text: str | None  # None: to be detokenized at flush
    # The request's state when the token was taken (a later step may change it before flush).
    pages: int
    reused_pages: int
    drafted: int
    accepted: int


# Where a held tuple keeps `_Delta.reason` (a whole output's flush checks only the last one).
_REASON = _Delta._fields.index("reason")


def _deltas(held: list[tuple[Any, ...]]) -> list[_Delta]:
    """A tracker's held tuples as `_Delta`s, at the flush that emits them."""
    return [_Delta._make(delta) for delta in held]


class OutputTracker:
    """Turns sampled tokens of one request into deltas and decides when it stops.

    `add_token` decides at once what a token does to the request (the scheduler needs it before
    the next step); the delta's text and output wait for `flush`, called once that next step is
    sent, off the path between two steps. A request with stop strings detokenizes at once (the
    text decides its end). `stream` False (`LLM.generate`, a non-streaming Triton request): the
    deltas wait for the request's end and leave as one output, its text decoded in one go."""

    def __init__(self, req: Req, tokenizer: Any, eos_ids: frozenset[int],
                 callback: OutputCallback, stream: bool = True) -> None:
        params = req.sampling_params
        self.req = req
        self.callback = callback
        self.stream = stream
        self.stop_ids = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else eos_ids)
        self.detokenizer = (IncrementalDetokenizer(tokenizer, req.input_ids[: req.prompt_len])
                            if tokenizer is not None else None)
        self.matcher = StopStringMatcher(params.stop or ())
        self._text_decides = bool(params.stop) and self.detokenizer is not None
        self._pending: list[tuple[Any, ...]] = []  # `_Delta`s as plain tuples
        self._context: list[np.ndarray] = []  # prompt logits, chunk by chunk
        self._context_sent = False
        self._guide_took: tuple[int, bool] | None = None  # (token, accepted) ahead of add_token
        self._first_token_ns = 0  # without `stream`: when the first token was taken

    @staticmethod
    def advance_guides(pairs: list[tuple[OutputTracker, int]]) -> None:
        """For each (tracker, token): follow `token` with the grammar of the tracker's request
        now (all in one xgrammar call), ahead of `add_token` (which then does not again): the
        next step's token masks need the grammars' new states, and everything else `add_token`
        does can wait until those masks are sent. Stop tokens, and requests without a grammar,
        are left to `add_token`."""
        pairs = [(tracker, token) for tracker, token in pairs
                 if tracker.guide_follows_early(token)]
        accepted = accept_tokens([tracker.req.guide for tracker, _ in pairs],
                                 [token for _, token in pairs])
        for (tracker, token), ok in zip(pairs, accepted):
            tracker._guide_took = (token, ok)

    def guide_follows_early(self, token: int) -> bool:
        """Whether `advance_guides` has the request's grammar follow `token` (a stop token is
        left to `add_token`, which ends the request)."""
        return self.req.guide is not None and token not in self.stop_ids

    def _guide_accepts(self, token: int) -> bool:
        took, self._guide_took = self._guide_took, None
        if took is not None and took[0] == token:
            return took[1]
        assert self.req.guide is not None
        return self.req.guide.accept(token)

    def add_context_logits(self, logits: np.ndarray) -> None:
        """The logits of the prompt tokens one prefill step computed (in order)."""
        self._context.append(logits)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def add_token(self, token: int, logprobs: Logprobs | None = None,
                  logits: np.ndarray | None = None) -> bool:
        """Record a sampled token (with its log-probability, top ids and theirs, and its raw
        logits, when the request asked); return True if the request is finished. Its delta is
        emitted by `flush`."""
        req = self.req
        req.input_ids.append(token)
        if not self.stream and not self._first_token_ns:
            self._first_token_ns = time.time_ns()
        reason, error, counted, text = None, None, True, None
        if token in self.stop_ids:  # EOS or a stop token: its text is not part of the output
            reason, counted = "stop", False
        elif req.guide is not None and not self._guide_accepts(token):  # masked: a bug
            reason, counted = "error", False
            error = f"token {token} is outside the request's grammar"
        else:
            stopped = False
            if self._text_decides:
                text, stopped = self._text_of([token])
            # A grammar without stop tokens to end it (ignore_eos) ends the request itself.
            if stopped or (req.guide is not None and req.guide.finished):
                reason = "stop"
            elif len(req.input_ids) - req.prompt_len >= req.sampling_params.max_tokens:
                reason = "length"
                if text is not None:
                    text += self._flush()
        # A `_Delta`, held as a plain tuple (in its fields' order).
        self._pending.append((token, reason, error, counted, logprobs, logits, text,
                              len(req.pages), req.reused_pages, req.drafted, req.accepted))
        return reason is not None

    def flush(self, ending: bool = False) -> None:
        """Emit the deltas of the tokens added since the last flush, in order: each as an output
        of its own, or without `stream` all as one output once the request has ended (or is
        `ending`: aborted, failed)."""
        if not self.stream:
            if self._pending and (ending or self._pending[-1][_REASON] is not None):
                pending, self._pending = _deltas(self._pending), []
                # An abort's text is a stream's: the same held-back text is left out.
                text_of = self._stream_text if ending else self._whole_text
                if pending[-1].error is not None and len(pending) > 1:
                    # The tokens, then the error end on its own (as a stream sends them).
                    self._emit(pending[:-1], text_of(pending[:-1]))
                    pending = pending[-1:]
                self._emit(pending, text_of(pending))
            return
        pending, self._pending = _deltas(self._pending), []
        for delta in pending:
            self._emit([delta], self._delta_text(delta))

    def _delta_text(self, delta: _Delta) -> str:
        """The text one delta adds, as a stream sends it: detokenized at `add_token`, or now;
        the request's end lets out what the detokenizer holds back."""
        text = delta.text
        if text is None:
            text = self._text_of([delta.token])[0] if delta.counted else ""
            if delta.reason is not None:
                text += self._flush()
        return text

    def _stream_text(self, deltas: list[_Delta]) -> str:
        return "".join(self._delta_text(delta) for delta in deltas)

    def _whole_text(self, deltas: list[_Delta]) -> str:
        """The text of consecutive deltas, their tokens pushed to the detokenizer together
        (but where `add_token` detokenized them: stop strings). Only the request's last
        delta may leave tokens out (an EOS, a stop token, an error)."""
        if self._text_decides:
            return self._stream_text(deltas)
        tokens = [delta.token for delta in deltas if delta.counted]
        text = self._text_of(tokens)[0] if tokens else ""
        if deltas[-1].reason is not None:
            text += self._flush()
        return text

    def _text_of(self, tokens: list[int]) -> tuple[str, bool]:
        """The text `tokens` add (stop strings cut), and whether a stop string matched."""
        if self.detokenizer is None:
            return "", False
        return self.matcher.feed(self.detokenizer.push(tokens))

    def _flush(self) -> str:
        if self.detokenizer is None:
            return ""
        text, _ = self.matcher.feed(self.detokenizer.flush())
        return text + self.matcher.flush()

    def _emit(self, deltas: list[_Delta], text: str, reason: str | None = None,
              error: str | None = None) -> None:
        """The output of consecutive deltas (none: the end without a token, `reason` and
        `error`)."""
        req, tokens = self.req, [delta.token for delta in deltas]
        pages, reused, drafted, accepted = (len(req.pages), req.reused_pages, req.drafted,
                                            req.accepted)
        if deltas:
            last = deltas[-1]
            reason, error = last.reason, last.error
            pages, reused, drafted, accepted = last[-4:]  # the state when it was taken
        out = RequestOutput(
            uid=req.uid, token_ids=tokens, text=text, finished=reason is not None,
            finish_reason=reason, prompt_tokens=req.prompt_len, cached_tokens=req.prefix_hit_len,
            error=error, index=req.index, pages=pages, reused_pages=reused,
            admitted_ns=req.admitted_ns, emitted_ns=time.time_ns(),
            draft_tokens=drafted, accepted_draft_tokens=accepted,
            first_token_ns=self._first_token_ns if tokens else 0,
        )
        logits = [delta.logits for delta in deltas if delta.logits is not None]
        if logits:
            out.generation_logits = np.stack(logits)
        if self._context and not self._context_sent:
            out.context_logits = np.concatenate(self._context)
            self._context, self._context_sent = [], True
        top = req.sampling_params.logprobs
        if top is not None:
            out.logprobs, out.top_logprobs = [], []
            for delta in deltas:
                if delta.logprobs is not None:
                    token_lp, ids, values = delta.logprobs
                    out.logprobs.append(token_lp)
                    out.top_logprobs.append(dict(zip(ids[:top], values[:top])))
        self.callback(out)

    def fail(self, reason: str, message: str) -> None:
        """End the request without more tokens (aborted, or the engine failed), after the
        deltas still pending."""
        self.flush(ending=True)
        self._emit([], "", reason, error=message)
