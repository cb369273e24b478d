"""Shared data model: sampling settings, requests, batches and the per-process forward context.

The scheduler (in the caller's process) owns `Req` objects; engine processes receive compact step
messages and rebuild a `Batch` of plain tensors, which layers read from the process-global
`Context` so that model code (and later a CUDA-graph replay) needs no extra arguments.
"""

from __future__ import annotations

import dataclasses
import json
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Literal

import numpy as np

from minisgl_backend.fields import is_int, is_number, spec_field, specs_of, validate

if TYPE_CHECKING:
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

    def is_filtered(self, vocab_size: int) -> bool:
        """Sampling (not greedy) whose top-k or top-p removes tokens of a `vocab_size`
        vocabulary: the sampler's sorted path."""
        return not self.is_greedy and (0 < self.top_k < vocab_size or self.top_p < 1.0)

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def uses_min_p(self) -> bool:
        return self.min_p > 0 and not self.is_greedy

    @property
    def reports_raw_logits(self) -> bool:
        """Log-probabilities or generation logits: the engine reads the logits unedited."""
        return self.logprobs is not None or self.return_generation_logits


def wants_context_logits(req: Req) -> bool:
    """The one rule for "this request's prompt logits are returned": sample 0 of its `n`
    (the others share that prompt through the prefix cache)."""
    return req.index == 0 and req.sampling_params.return_context_logits


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
Values = Any  # a list while the scheduler appends rows; a numpy array on the wire and in a table


@dataclass
class RowSampling:
    """Per-row sampling controls, decided once per request (`append`): the scheduler appends
    the rows a step admits (lists), `StepMessage` carries them, the engine keeps one entry per
    table row (`table`: numpy arrays, floats in float64 for its host arithmetic).

    The values are the `SamplingParams` fields with a `row_dtype` (their wire dtype), greedy
    rows at temperature 0 (how the kernels read the flag) and `logprobs` None as -1, then the
    request's resolved seed (int64 bits); the flags are `SamplingParams`' rules."""

    temperature: Values
    top_k: Values
    top_p: Values
    min_p: Values
    repetition_penalty: Values
    presence_penalty: Values
    frequency_penalty: Values
    logprobs: Values
    return_generation_logits: Values
    seed: Values
    greedy: Values  # `SamplingParams.is_greedy`
    filtered: Values  # `SamplingParams.is_filtered`
    uses_penalties: Values
    uses_min_p: Values
    reports: Values  # `SamplingParams.reports_raw_logits`

    @classmethod
    def of(cls, requests: Iterable[tuple[SamplingParams, int]], vocab_size: int) -> RowSampling:
        """The rows of `requests` (params and int64 seed each) as lists, to `append` to."""
        rows = cls(*([] for _ in _ROW_DTYPES))
        for params, seed in requests:
            rows.append(params, seed, vocab_size)
        return rows

    def append(self, params: SamplingParams, seed: int, vocab_size: int) -> None:
        """One request's row (rows as lists), its rules decided for a `vocab_size` model."""
        for name in _PARAM_VALUES:
            value = getattr(params, name)
            getattr(self, name).append(-1 if value is None else value)
        greedy = params.is_greedy
        if greedy:
            self.temperature[-1] = 0.0
        self.seed.append(seed)
        self.greedy.append(greedy)
        self.filtered.append(params.is_filtered(vocab_size))
        self.uses_penalties.append(params.uses_penalties)
        self.uses_min_p.append(params.uses_min_p)
        self.reports.append(params.reports_raw_logits)

    @classmethod
    def table(cls, num_rows: int) -> RowSampling:
        """One entry per table row, each a plain request's (`SamplingParams()`) until `put`."""
        plain = cls.of([(SamplingParams(), 0)], vocab_size=1)
        return cls(*(np.repeat(np.asarray(getattr(plain, name), _host_dtype(dtype)), num_rows)
                     for name, dtype in _ROW_DTYPES.items()))

    def put(self, rows: np.ndarray, admitted: RowSampling) -> None:
        """Table rows `rows` take the admitted rows' values, as the wire carries them."""
        for name, dtype in _ROW_DTYPES.items():
            getattr(self, name)[rows] = np.asarray(getattr(admitted, name), dtype=dtype)

    def to_arrays(self, prefix: str) -> dict[str, np.ndarray]:
        """The rows as named arrays in their wire dtypes (`from_arrays` reads them back)."""
        return {prefix + name: np.asarray(getattr(self, name), dtype=dtype)
                for name, dtype in _ROW_DTYPES.items()}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], prefix: str) -> RowSampling:
        return cls(*(arrays[prefix + name] for name in _ROW_DTYPES))


# The per-row values: the fields declared with a `row_dtype`, each an attribute of RowSampling.
_PARAM_VALUES = {name: spec.row_dtype for name, (spec, _) in specs_of(SamplingParams).items()
                 if spec.row_dtype is not None}
_ROW_DTYPES = {f.name: {**_PARAM_VALUES, "seed": "int64"}.get(f.name, "bool")
               for f in dataclasses.fields(RowSampling)}
assert set(_PARAM_VALUES) < set(_ROW_DTYPES), "a row_dtype field without its RowSampling entry"


def _host_dtype(dtype: str) -> type:
    return {"float32": np.float64, "bool": np.bool_}.get(dtype, np.int64)


def check_token_ids(name: str, ids: Iterable[int], vocab_size: int | None) -> None:
    """The one rule for token ids a request gives (prompt, stop ids, bans, biases): each in
    [0, vocab_size), since the engine indexes its embedding and logits with them (a None
    vocab_size, not known yet: non-negative)."""
    ids = list(ids)
    if ids and (min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size)):
        raise ValueError(f"{name} has token ids outside [0, {vocab_size or 'vocab size'})")


def bad_word_sequences(tokenizer: Any, words: Iterable[str], spaced: bool) -> list[tuple[int, ...]]:
    """The one tokenization of bad words: each word's tokens without special tokens (with
    `spaced`, also with a leading space, how a word usually appears mid-text), empty ones left
    out."""
    texts = [t for w in words
             for t in dict.fromkeys([w, " " + w if spaced and not w.startswith(" ") else w])]
    return [tuple(ids) for t in texts if (ids := tokenizer.encode(t, add_special_tokens=False))]


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
    # LoRA: the adapter (0: the base model), its device slot once admitted (-1: none), and
    # whether the engine must copy the adapter into that slot with the admitting step.
    lora_id: int = 0
    lora_slot: int = -1
    lora_load: bool = False
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
    # The tokens that take a LoRA adapter, grouped by slot (`lora.ops.LoraRows`); None: none.
    lora: Any = None

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
