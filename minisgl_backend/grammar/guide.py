"""A guided request's matcher: it fills the request's row of a step's token mask (1 bit per
vocabulary entry: may be sampled) and follows the tokens the request samples."""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

from minisgl_backend.device_copy import host_to_device
from minisgl_backend.host_cpus import usable_cpus


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's token mask."""
    return (vocab_size + 31) // 32


def allowed_tokens(mask: np.ndarray) -> np.ndarray:
    """The token ids one row's mask ([words] int32) allows, ascending."""
    return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))


class Guide:
    def __init__(self, compiled: Any, stop_ids: set[int], key: Hashable | None = None) -> None:
        """`key`: what the grammar was compiled from (equal keys, the same grammar)."""
        self.compiled = compiled
        self.key = key
        self.stop_ids = sorted(stop_ids)
        self._stops = frozenset(stop_ids)
        self.matcher = new_matcher(compiled, self.stop_ids)
        # `finished` as of the last token followed (None: not asked since): a step asks it of
        # every guided row twice (the request's end, the next mask), one FFI call each.
        self._finished: bool | None = False if stop_ids else None

    def fill(self, masks: np.ndarray, index: int) -> None:
        """Row `index` of `masks` ([rows, words] int32): the tokens the grammar allows next."""
        self.matcher.fill_next_token_bitmask(masks, index)

    def accept(self, token: int) -> bool:
        """Follow a sampled token; False if the grammar does not allow it."""
        accepted = bool(self.matcher.accept_token(token))
        if accepted:
            self.followed(token)
        return accepted

    def followed(self, token: int) -> None:
        """The matcher accepted `token` (the only way its state moves for good: drafts are
        rolled back)."""
        # A matcher with stop ids ends only by accepting one (`new_matcher`): no FFI call is
        # needed to know that any other token leaves it open.
        self._finished = None if token in self._stops or not self._stops else False

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (jump-forward), as xgrammar splits the forced text
        (which may differ from how the model would tokenize it: they are drafts to verify)."""
        return list(self.matcher.find_jump_forward_tokens())

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar accepts from here (the state is kept)."""
        count = 0
        for token in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            count += 1
        if count:
            self.matcher.rollback(count)
        return count

    def fill_with_drafts(self, masks: np.ndarray, index: int, drafts: list[int]) -> None:
        """Rows `index ..= index + len(drafts)` of `masks`: the tokens allowed now and after
        each draft in turn (the drafts are valid: `valid_prefix`); the state is kept."""
        self.fill(masks, index)
        for j, token in enumerate(drafts):
            self.matcher.accept_token(token)
            if self.matcher.is_terminated():
                masks[index + j + 1 : index + len(drafts) + 1] = -1  # past the grammar's end
                self.matcher.rollback(j + 1)
                return
            self.fill(masks, index + j + 1)
        if drafts:
            self.matcher.rollback(len(drafts))

    @property
    def finished(self) -> bool:
        """The grammar is complete and ended (by a stop token, or by itself)."""
        if self._finished is None:
            self._finished = bool(self.matcher.is_terminated())
        return self._finished


def accept_tokens(guides: list[Guide], tokens: list[int]) -> list[bool]:
    """`Guide.accept` of `tokens[i]` by `guides[i]` for every i, in one call of xgrammar."""
    if not guides:
        return []
    accepted = batch_accept([g.matcher for g in guides], tokens)
    for guide, token, ok in zip(guides, tokens, accepted):
        if ok:
            guide.followed(token)
    return accepted


def batch_accept(matchers: list[Any], tokens: list[int]) -> list[bool]:
    """xgrammar's batch accept, without its wrapper's per-element reads of the result (as
    costly as the accepts): a masked row cannot sample a rejected token, so one containment
    test (the elements are ints: tvm_ffi's equality does not take False for 0) usually answers."""
    from xgrammar.base import _core  # the wrapper's own entry point (xgrammar is pinned)

    result = _core.BatchGrammarMatcher.batch_accept_token([m._handle for m in matchers],
                                                          tokens, False)
    if 0 not in result:
        return [True] * len(matchers)
    return [bool(ok) for ok in result]


def new_matcher(compiled: Any, stop_ids: list[int]) -> Any:
    """xgrammar's matcher of a guided request ending at `stop_ids` (sorted)."""
    import xgrammar as xgr

    # Without stop ids (ignore_eos and none given) the grammar ends the request itself.
    return xgr.GrammarMatcher(compiled, override_stop_tokens=stop_ids or None,
                              terminate_without_stop_token=not stop_ids)


_per_thread = threading.local()  # BatchGrammarMatchers of a scheduler thread
FILL_THREADS_MAX = 4
PARALLEL_FILL_ROWS = 128


def fill_threads(rows: int) -> int:
    """Threads of a mask fill of `rows` rows: one below PARALLEL_FILL_ROWS (threads cost more
    than they save), else half the CPUs this process may use, at most FILL_THREADS_MAX
    (xgrammar's default, half of the host's cores, may be dozens in a container)."""
    if rows < PARALLEL_FILL_ROWS:
        return 1
    return max(1, min(FILL_THREADS_MAX, usable_cpus() // 2))


def fill_masks(guides: list[Guide], masks: np.ndarray, indices: list[int]) -> None:
    """Row `indices[i]` of `masks` for `guides[i]`, as `Guide.fill` does, in one call of
    xgrammar's BatchGrammarMatcher on `fill_threads` threads."""
    if not guides:
        return
    # One matcher per side of PARALLEL_FILL_ROWS, made on first use (fill_threads reads the
    # cgroup's files: once, not every step).
    parallel = len(guides) >= PARALLEL_FILL_ROWS
    matchers = _per_thread.__dict__.setdefault("batch_matchers", {})
    if parallel not in matchers:
        import xgrammar as xgr

        matchers[parallel] = xgr.BatchGrammarMatcher(fill_threads(len(guides)))
    matchers[parallel].batch_fill_next_token_bitmask([g.matcher for g in guides], masks,
                                                     indices=indices)


def apply_token_masks(logits: torch.Tensor, batch_rows: np.ndarray, masks: np.ndarray,
                      page_locked: bool = False) -> None:
    """Disallowed tokens of the guided rows (`batch_rows` of `logits`, their masks row-major
    in `masks`) to -inf, in place; the other rows are left alone. `page_locked`: `masks` lies in
    memory registered with CUDA (the engine's mask buffer), copied to the device as it is."""
    masks = masks.reshape(len(batch_rows), mask_words(logits.shape[-1]))
    in_order = len(batch_rows) == logits.shape[0] and bool(
        (batch_rows == np.arange(len(batch_rows))).all())
    if logits.device.type == "cuda":
        from kernels.token_masks import apply_bitmask

        # Never from ordinary memory: such a copy waits for the forward to end.
        device_masks = (torch.from_numpy(masks).to(logits.device, non_blocking=True)
                        if page_locked else host_to_device(masks, logits.device))
        apply_bitmask(logits, device_masks,
                      None if in_order else host_to_device(batch_rows, logits.device,
                                                           torch.int32))
        return
    import xgrammar as xgr

    full, indices = masks, None
    if not in_order:  # xgrammar's rows with indices are the logits' rows
        full = np.full((logits.shape[0], masks.shape[1]), -1, dtype=np.int32)  # all allowed
        full[batch_rows] = masks
        indices = [int(r) for r in batch_rows]
    xgr.apply_token_bitmask_inplace(logits, torch.from_numpy(full), vocab_size=logits.shape[-1],
                                    indices=indices)
