"""Shared data model: sampling settings, requests, batches and the per-process forward context.

The scheduler (in the caller's process) owns `Req` objects; engine processes receive compact step
messages and rebuild a `Batch` of plain tensors, which layers read from the process-global
`Context` so that model code (and later a CUDA-graph replay) needs no extra arguments.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Literal

if TYPE_CHECKING:
    import torch

    from minisgl_backend.attention.base import AttentionBackend
    from minisgl_backend.kvcache.pool import PagedKVPool

Phase = Literal["prefill", "decode"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    `temperature == 0` (or `top_k == 1`) means greedy decoding. `seed` makes sampling
    reproducible: the same seed and prompt give the same output whatever else is batched with it.
    `stop` strings end the request when its decoded text contains one (the text is cut before it);
    `stop_token_ids` end it when such a token is sampled, like EOS; neither is sampled before
    `min_tokens` tokens have been generated.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    min_tokens: int = 0  # EOS and stop token ids cannot end the request before this many tokens

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], "
                             f"got {self.min_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        object.__setattr__(self, "stop", _normalize_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalize_stop_ids(self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        # Below GREEDY_TEMPERATURE, logits / temperature would overflow float32: act greedy.
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def _normalize_stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(s == "" for s in stop):
        raise ValueError("stop must not contain empty strings")
    return tuple(stop)


def _normalize_stop_ids(ids: object) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
        raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {ids!r}")
    return tuple(ids)


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
    cache_handle: Any = None
    pages: list[int] = field(default_factory=list)
    pages_sent: int = 0  # how many of `pages` the engine already has in its row
    owned_pages: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.max_device_len == 0:
            self.max_device_len = self.prompt_len + self.sampling_params.max_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.input_ids[self.prompt_len :]

    @property
    def extend_len(self) -> int:
        """Tokens the step being scheduled computes."""
        return self.device_len - self.cached_len

    @property
    def prompt_done(self) -> bool:
        """True once the step being scheduled (or an earlier one) covers the whole prompt."""
        return self.device_len >= self.prompt_len


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
    attn_metadata: Any = None

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
