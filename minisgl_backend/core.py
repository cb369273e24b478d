"""Shared data model: sampling settings, requests, batches and the per-process forward context.

The scheduler (in the caller's process) owns `Req` objects; engine processes receive compact step
messages and rebuild a `Batch` of plain tensors, which layers read from the process-global
`Context` so that model code (and later a CUDA-graph replay) needs no extra arguments.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Literal

from minisgl_backend.fields import Spec, is_int, is_number, spec_field, specs_of, validate

if TYPE_CHECKING:
    import numpy as np
    import torch

    from minisgl_backend.attention.base import AttentionBackend
    from minisgl_backend.kvcache.pool import PagedKVPool

Phase = Literal["prefill", "decode"]


GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily
MAX_LOGPROBS = 20  # alternatives reported per token at most
MAX_LOGIT_BIAS = 1024  # logit_bias entries per request at most
MAX_SAMPLES = 64  # n at most


def _nonempty_strings(values: object) -> tuple[str, ...]:
    if values is None:
        return ()
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, str) and v for v in values):
        raise ValueError
    return tuple(values)


def _normalize_stop(stop: object) -> tuple[str, ...]:
    return _nonempty_strings([stop] if isinstance(stop, str) else stop)


def _normalize_token_ids(ids: object) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, (list, tuple)) or not all(is_int(i) and i >= 0 for i in ids):
        raise ValueError
    return tuple(ids)


def _normalize_bad_token_ids(seqs: object) -> tuple[tuple[int, ...], ...]:
    if seqs is None:
        return ()
    if not isinstance(seqs, (list, tuple)) or not all(seq for seq in seqs):
        raise ValueError
    return tuple(_normalize_token_ids(seq) for seq in seqs)


def _normalize_logit_bias(bias: object) -> dict[int, float]:
    if bias is None:
        return {}
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS or not all(
            is_int(k) and k >= 0 and is_number(v) and math.isfinite(v) and -100 <= v <= 100
            for k, v in bias.items()):
        raise ValueError
    return {int(k): float(v) for k, v in bias.items()}


def _normalize_json_schema(schema: object) -> str | None:
    """A schema as a dict or as JSON text; kept as JSON text (what xgrammar compiles)."""
    if schema is None:
        return None
    if isinstance(schema, dict):
        return json.dumps(schema)
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except (json.JSONDecodeError, RecursionError):
            raise ValueError from None
        if isinstance(parsed, (dict, bool)):
            return schema
    raise ValueError


def _optional_text(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples, when it stops, and what it reports.

    `temperature == 0` (or `top_k == 1`) means greedy decoding. `seed` makes sampling
    reproducible: the same seed and prompt give the same output whatever else is batched with it.
    `stop` strings end the request when its decoded text contains one (the text is cut before it);
    `stop_token_ids` end it when such a token is sampled, like EOS; neither is sampled before
    `min_tokens` tokens have been generated.

    The logits of a step go through, in this order: repetition penalty, presence and frequency
    penalties, `logit_bias`, the bad-word mask, the min_tokens mask, then temperature, `min_p`,
    top-k and top-p. `logprobs` are taken from the raw logits, before all of them.

    Every field is declared once with its range (`minisgl_backend.fields`); invalid values raise
    ValueError naming the field.
    """

    max_tokens: int = spec_field(16, "int", "tokens to generate at most", low=1)
    temperature: float = spec_field(0.0, "float", "0: greedy", low=0, row_dtype="float32")
    top_k: int = spec_field(-1, "int", "sample among the k most likely tokens (-1: off)", low=1,
                            also=(-1,), row_dtype="int32")
    top_p: float = spec_field(1.0, "float", "nucleus: the smallest set of most likely tokens "
                              "with this much probability", low=0, high=1, low_open=True,
                              row_dtype="float32")
    min_p: float = spec_field(0.0, "float", "drop tokens less likely than min_p times the most "
                              "likely one (after temperature)", low=0, high=1,
                              row_dtype="float32")
    seed: int | None = spec_field(None, "int", "makes sampling reproducible", low=0,
                                  high=2**64, high_open=True, nullable=True)
    repetition_penalty: float = spec_field(
        1.0, "float", "divides positive logits (multiplies negative ones) of tokens in the "
        "prompt or the output (HF / CTRL)", low=0, low_open=True, row_dtype="float32")
    presence_penalty: float = spec_field(
        0.0, "float", "subtracted from the logits of tokens in the output (OpenAI)", low=-2,
        high=2, row_dtype="float32")
    frequency_penalty: float = spec_field(
        0.0, "float", "times its count in the output, subtracted from a token's logit (OpenAI)",
        low=-2, high=2, row_dtype="float32")
    logit_bias: dict[int, float] | None = spec_field(
        None, "custom", "token id -> value added to its logit", normalize=_normalize_logit_bias,
        accepts=f"a dict of at most {MAX_LOGIT_BIAS} token ids to numbers in [-100, 100]")
    bad_words: tuple[str, ...] | list[str] | None = spec_field(
        None, "custom", "strings whose tokens are never completed (also with a leading space)",
        normalize=_nonempty_strings,
        accepts="a list of non-empty strings")
    bad_token_ids: tuple[tuple[int, ...], ...] | list[list[int]] | None = spec_field(
        None, "custom", "token sequences whose last token is never sampled after the others",
        normalize=_normalize_bad_token_ids,
        accepts="a list of non-empty lists of token ids")
    ignore_eos: bool = spec_field(False, "bool", "keep generating after EOS")
    stop: tuple[str, ...] | list[str] | str | None = spec_field(
        None, "custom", "stop strings (the text is cut before them)", normalize=_normalize_stop,
        accepts="a non-empty string or a list of them")
    stop_token_ids: tuple[int, ...] | list[int] | None = spec_field(
        None, "custom", "token ids that end the request like EOS",
        normalize=_normalize_token_ids,
        accepts="a list of token ids")
    min_tokens: int = spec_field(0, "int", "EOS and stop token ids cannot end the request "
                                 "before this many tokens", low=0, high="max_tokens")
    logprobs: int | None = spec_field(
        None, "int", "report each token's log-probability and this many most likely "
        "alternatives (0: the token's only)", low=0, high=MAX_LOGPROBS, nullable=True,
        row_dtype="int32")
    n: int = spec_field(1, "int", "samples of the prompt (prefilled once, seeds derived from "
                        "`seed`)", low=1, high=MAX_SAMPLES)
    return_context_logits: bool = spec_field(
        False, "bool", "return the prompt's logits, [prompt tokens, vocabulary] float32 (with "
        "sample 0 of `n`; the prompt is then computed in full, not taken from the prefix "
        "cache)")
    return_generation_logits: bool = spec_field(
        False, "bool", "return each generated token's raw logits, [tokens, vocabulary] "
        "float32", row_dtype="int32")
    # Structured output (at most one): every sampled token keeps the text in the language.
    json_schema: str | dict | None = spec_field(
        None, "custom", "the output is JSON valid under this schema", nullable=True,
        normalize=_normalize_json_schema, accepts="a JSON schema (a dict or its JSON text)")
    regex: str | None = spec_field(
        None, "custom", "the output matches this regular expression", nullable=True,
        normalize=_optional_text, accepts="a non-empty string")
    grammar: str | None = spec_field(
        None, "custom", "the output is in this EBNF grammar's language (xgrammar's dialect, "
        "rule `root`)", nullable=True, normalize=_optional_text, accepts="a non-empty string")
    json_object: bool = spec_field(False, "bool", "the output is a JSON object (any)")

    def __post_init__(self) -> None:
        validate(self)
        guides = [name for name in ("json_schema", "regex", "grammar", "json_object")
                  if getattr(self, name) not in (None, False)]
        if len(guides) > 1:
            raise ValueError(f"{guides[1]} cannot be combined with {guides[0]}: give at most "
                             f"one of json_schema, regex, grammar and json_object")

    @property
    def is_greedy(self) -> bool:
        # Below GREEDY_TEMPERATURE, logits / temperature would overflow float32: act greedy.
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return bool(penalties_active(self.repetition_penalty, self.presence_penalty,
                                     self.frequency_penalty))

    def row_values(self, seed: int) -> dict[str, float | int]:
        """The per-row engine controls (fields with a `row_dtype`) as the engine reads them:
        greedy rows at temperature 0, `logprobs` None as -1, and the request's resolved seed."""
        values: dict[str, float | int] = {}
        for name, (spec, _) in ROW_CONTROLS.items():
            value = getattr(self, name)
            values[name] = -1 if value is None else value
        values["temperature"] = 0.0 if self.is_greedy else self.temperature
        values["seed"] = seed
        return values


def wants_context_logits(req: Req) -> bool:
    """The one rule for "this request's prompt logits are returned": sample 0 of its `n`
    (the others share that prompt through the prefix cache)."""
    return req.index == 0 and req.sampling_params.return_context_logits


def penalties_active(repetition: Any, presence: Any, frequency: Any) -> Any:
    """The one rule for "this request is penalized", on numbers or on numpy arrays of rows."""
    return (repetition != 1.0) | (presence != 0.0) | (frequency != 0.0)


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request with `n` samples: `seed` itself for sample 0,
    a 64-bit mix of (seed, index) for the others, so each sample equals a single request with
    its derived seed."""
    if index == 0:
        return seed
    x = (seed ^ (index * 0x9E3779B97F4A7C15)) & _UINT64
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):  # splitmix64
        x = ((x ^ (x >> shift)) * mult) & _UINT64
    return x ^ (x >> 31)


_UINT64 = (1 << 64) - 1
# The per-row scalars the engine keeps for every table row (sent when a request is admitted),
# and their dtypes; `seed` is the request's resolved seed, also sent per row.
ROW_CONTROLS: dict[str, tuple[Spec, Any]] = {
    name: entry for name, entry in specs_of(SamplingParams).items()
    if entry[0].row_dtype is not None}
ROW_DTYPES: dict[str, str] = {**{name: spec.row_dtype for name, (spec, _) in ROW_CONTROLS.items()},
                              "seed": "int64"}


def check_token_ids(name: str, ids: Iterable[int], vocab_size: int | None) -> None:
    """The one rule for token ids a request gives (prompt, stop ids, bans, biases): each in
    [0, vocab_size), since the engine indexes its embedding and logits with them (a None
    vocab_size, not known yet: non-negative)."""
    ids = list(ids)
    if ids and (min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size)):
        raise ValueError(f"{name} has token ids outside [0, {vocab_size or 'vocab size'})")


@dataclass(eq=False)
class Req:
    """A request as the scheduler sees it (all state on cpu).

    Token positions, as in the seed::

        [0 ....... cached_len ....... device_len ....... max_device_len)
         KV computed        | KV computed by the step |  room reserved for later tokens
                            | being scheduled         |

    `input_ids` holds the prompt followed by the generated tokens. `pages` mirrors the request's
    page-table row in the engine; `owned_pages` are the pages this request must free when it
    ends (the others belong to the prefix cache, locked through `cache_handle`).
    """

    uid: int
    input_ids: list[int]
    prompt_len: int
    sampling_params: SamplingParams
    seed: int  # resolved per-request seed (random when the params have none)
    table_idx: int = -1
    cached_len: int = 0
    device_len: int = 0
    max_device_len: int = 0
    prefix_hit_len: int = 0  # prompt tokens served from the prefix cache on admission
    admitted_step: int = -1  # the scheduler step that admitted it (-1: not admitted yet)
    admitted_ns: int = 0  # when (time.time_ns())
    reused_pages: int = 0  # pages of the prefix cache it took on admission
    cache_handle: Any = None
    pages: list[int] = field(default_factory=list)
    pages_sent: int = 0  # how many of `pages` the engine already has in its row
    owned_pages: set[int] = field(default_factory=set)
    index: int = 0  # its sample number among the request's `n`
    wait_for: Req | None = None  # sample 0, whose cached prompt this sample waits for
    bans: tuple[tuple[int, ...], ...] = ()  # bad_token_ids + the tokenized bad_words
    grammar: Any = None  # structured output: the compiled grammar, and the request's matcher
    guide: Any = None
    # Speculative decoding: the draft tokens the step being scheduled verifies after the last
    # sampled token; `explicit`: the engine's row length is past the request's (drafts were
    # rejected), so its next step sends its start and last token; drafts and accepted so far,
    # and the drafts that met a verdict (the kept ones, and the first rejected one per step).
    drafts: list[int] = field(default_factory=list)
    explicit: bool = False
    drafted: int = 0
    accepted: int = 0
    judged: int = 0
    # LongRoPE: whether its KV takes the long frequencies (its prompt is past the pretraining
    # length, or it crossed that length and was computed again), and where its prefill ends:
    # the prompt, or after such a crossing every token so far.
    long_rope: bool = False
    prefill_len: int = 0

    def __post_init__(self) -> None:
        if self.max_device_len == 0:
            self.max_device_len = self.prompt_len + self.sampling_params.max_tokens
        if self.prefill_len == 0:
            self.prefill_len = self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.input_ids[self.prompt_len :]

    @property
    def extend_len(self) -> int:
        """Tokens the step being scheduled computes."""
        return self.device_len - self.cached_len

    @property
    def step_tokens(self) -> list[int]:
        """The tokens the step being scheduled computes: prompt tokens, or the last sampled
        token followed by the drafts."""
        tokens = self.input_ids[self.cached_len : self.device_len]
        return tokens + self.drafts if self.drafts else tokens

    @property
    def prompt_done(self) -> bool:
        """True once the step being scheduled (or an earlier one) covers the whole prompt
        (the whole prefill: after a LongRoPE crossing, every token so far)."""
        return self.device_len >= self.prefill_len


@dataclass
class Batch:
    """One forward step as an engine process sees it (all tensors on the engine's device)."""

    phase: Phase
    rows: torch.Tensor  # [bs] table rows
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    out_slots: torch.Tensor  # [num_tokens] flat KV slot each new token's K/V is written to
    extend_lens: list[int]  # tokens computed per request (on cpu)
    seq_lens: list[int]  # total tokens per request after this step (on cpu)
    # Decode steps: seq_lens on the device (int64), which is also the position of the token
    # each entry samples. None where the engine did not upload it.
    seq_lens_device: torch.Tensor | None = None
    attn_metadata: Any = None
    # Prefill steps of requests that return their prompt's logits: the indices (into this
    # step's tokens) whose logits the model also computes, and those logits once it has.
    logit_tokens: torch.Tensor | None = None
    token_logits: torch.Tensor | None = None
    # Prefill steps: per request, whether its KV takes LongRoPE's long frequencies (on cpu;
    # `Req.long_rope`). None in decode steps, where a token's position tells.
    long_rope: np.ndarray | None = None

    @property
    def size(self) -> int:
        return len(self.extend_lens)

    @property
    def is_prefill(self) -> bool:
        return self.phase == "prefill"

    @property
    def is_decode(self) -> bool:
        return self.phase == "decode"


@dataclass
class Context:
    """Process-global state of an engine process that layers read during a forward."""

    page_size: int
    kv_pool: PagedKVPool
    attn_backend: AttentionBackend
    # Decode batches of at most this many rows run each layer's projections as fused few-rows
    # GEMVs (kernels/gemv.py); 0: never. The engine sets it where the kernel applies.
    fused_gemv_max_rows: int = 0
    _batch: Batch | None = None

    @property
    def batch(self) -> Batch:
        assert self._batch is not None, "no batch is being forwarded"
        return self._batch

    @contextmanager
    def forward_batch(self, batch: Batch) -> Iterator[None]:
        previous, self._batch = self._batch, batch
        try:
            yield
        finally:
            self._batch = previous


_GLOBAL_CTX: Context | None = None


def set_global_ctx(ctx: Context | None) -> None:
    global _GLOBAL_CTX
    _GLOBAL_CTX = ctx


def get_global_ctx() -> Context:
    assert _GLOBAL_CTX is not None, "the engine context is not set in this process"
    return _GLOBAL_CTX
