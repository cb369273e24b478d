"""Worker processes that fill the guided rows' token masks beside the scheduler's thread.

xgrammar keeps the GIL through a fill, so on the scheduler's thread a step's fills add to
everything else the thread does for the step: at 64 rows of a JSON schema on the H200 host,
1.9 ms a step against 0.5 unguided, past a decode step's device time, so the GPU waits. Each
worker here holds mirrors of some guided requests' matchers and fills their rows straight into
the engine's shared mask buffer, the workers in parallel. The scheduler's own matchers stay the
reference (accepting, ending, jump-forward, drafts); a mirror follows its matcher by accepting
the same tokens, which travel with the next fill order. Rows with drafts, small batches, and
every step before the workers are up are filled on the scheduler's thread as before.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

from minisgl_backend.engine.mask_buffer import MaskBuffer
from minisgl_backend.grammar.guide import Guide, batch_accept, new_matcher

logger = logging.getLogger(__name__)

# Below this many rows a step's fills stay on the scheduler's thread: an order's round trip
# (about 0.1 ms) costs more than the fills it moves.
POOL_MIN_ROWS = 16
SERIALIZED_GRAMMARS_KEPT = 16  # compiled grammars' serialized forms kept for new mirrors
REPLY_TIMEOUT_S = 60.0


@dataclass
class FillOrder:
    """The scheduler's order to one worker for one step (a worker answers the seconds its work
    took, or an error's text)."""

    half: int  # the mask buffer's half of the step
    slots: int  # rows of that half the step uses
    # (grammar id, xgrammar's serialized form) of grammars new to the worker
    grammars: list[tuple[int, str]] = field(default_factory=list)
    # (mirror id, grammar id, stop ids) of new mirrors
    opens: list[tuple[int, int, list[int]]] = field(default_factory=list)
    drops: list[int] = field(default_factory=list)  # mirrors whose requests ended
    forgets: list[int] = field(default_factory=list)  # grammars no mirror of it uses any more
    # (mirror id, its matcher's tokens to accept first, the row to fill)
    rows: list[tuple[int, list[int], int]] = field(default_factory=list)


@dataclass
class _Mirror:
    worker: int
    ident: int


class _Worker:
    def __init__(self, conn: Connection, proc: mp.process.BaseProcess) -> None:
        self.conn = conn
        self.proc = proc
        self.users: dict[int, int] = {}  # grammar id -> its live mirrors on this worker
        self.mirrors = 0


class MaskFillPool:
    """`workers` processes filling guided rows into `masks`, started by `start`."""

    def __init__(self, workers: int, masks: MaskBuffer, min_rows: int = POOL_MIN_ROWS) -> None:
        self.size = workers
        self.min_rows = min_rows
        self.fills = 0  # steps the workers filled
        self.wait_seconds = 0.0  # of those steps: waiting for the workers' answers
        self.work_seconds = 0.0  # of those steps: the slowest worker's work
        self._masks = masks
        self._workers: list[_Worker] = []  # set once every worker is up
        self._starting: threading.Thread | None = None
        self._failed = False
        # (worker, mirror, grammar) of guides gone (appended by their finalizers, on any thread)
        self._ended: deque[tuple[int, int, int]] = deque()
        self._serialized: OrderedDict[Hashable, tuple[int, str]] = OrderedDict()
        self._next_id = 0

    def start(self, tokenizer_info: Any) -> None:
        """Start the workers in the background (xgrammar's TokenizerInfo of the grammars they
        will mirror), if not yet; until they are up, `fill` leaves the rows to the caller. The
        first step of `min_rows` guided rows starts them (a process of xgrammar and torch
        each, about 2 s of a CPU and 0.3 GB; engines that never guide that many pay nothing)."""
        if self._starting is None and self.size > 0:
            self._starting = threading.Thread(target=self._spawn, args=(tokenizer_info,),
                                              name="minisgl-fill-pool-start", daemon=True)
            self._starting.start()

    def wait_ready(self, timeout: float) -> bool:
        """Whether the workers are up, waiting at most `timeout` seconds (tests)."""
        if self._starting is not None:
            self._starting.join(timeout)
        return bool(self._workers)

    def _spawn(self, tokenizer_info: Any) -> None:
        ctx = mp.get_context("spawn")
        info = tokenizer_info.serialize_json()
        workers = []
        try:
            for i in range(self.size):
                ours, theirs = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=_serve, name=f"minisgl-mask-fill-{i}",
                                   args=(theirs, self._masks.slots, self._masks.words),
                                   daemon=True)
                proc.start()
                theirs.close()
                self._masks.share(ours, proc.pid)  # type: ignore[arg-type]
                ours.send(info)
                workers.append(_Worker(ours, proc))
            for worker in workers:
                _reply(worker.conn, "starting")
        except Exception:  # the scheduler fills every row itself instead
            logger.exception("mask-fill workers did not start; guided masks stay on the "
                             "scheduler's thread")
            self._failed = True
            _stop(workers)
            return
        self._workers = workers

    def fill(self, guides: list[Guide], half: int, slots: int, indices: list[int]) -> bool:
        """Row `indices[i]` of half `half` of the mask buffer (a step using `slots` rows) for
        `guides[i]`, by the workers; False (nothing written) when they cannot: too few rows,
        not up yet, a guide without a mirror's record, or the pool failed."""
        return self.begin(guides, half, slots, indices) and self.finish()

    def begin(self, guides: list[Guide], half: int, slots: int, indices: list[int],
              ahead: list[int | None] | None = None) -> bool:
        """Send `fill`'s orders without waiting for them (`finish` waits). `ahead[i]`: a token
        `guides[i]` will accept before `finish` (its mirror accepts it first; a mirror whose
        grammar it ends allows every token, as the scheduler's rule for an ended request
        does), so that the scheduler's own accepts run while the workers fill."""
        if (len(guides) < self.min_rows or self._failed
                or any(guide.unsynced is None for guide in guides)):
            return False
        if not self._workers:  # started by the first step that needs them
            self.start(guides[0].compiled.tokenizer_info)
            return False
        orders = [FillOrder(half, slots) for _ in self._workers]
        self._take_ended(orders)
        for i, (guide, index) in enumerate(zip(guides, indices)):
            mirror = guide.mirror or self._open(guide, orders)
            tokens, guide.unsynced = guide.unsynced, []
            token = ahead[i] if ahead is not None else None
            if token is not None:
                tokens = [*tokens, token]
                guide.sent_ahead = token
            orders[mirror.worker].rows.append((mirror.ident, tokens, index))
        try:
            for worker, order in zip(self._workers, orders):
                worker.conn.send(order)
        except Exception as exc:  # noqa: BLE001 - the scheduler's matchers are the reference
            self._give_up(exc)
            return False
        return True

    def finish(self) -> bool:
        """Wait for the orders `begin` sent; False when the workers failed (their rows are
        then the caller's to fill)."""
        try:
            start = time.perf_counter()
            work = max(_reply(worker.conn, "fill") for worker in self._workers)
            self.wait_seconds += time.perf_counter() - start
            self.work_seconds += work
        except Exception as exc:  # noqa: BLE001 - the scheduler's matchers are the reference
            self._give_up(exc)
            return False
        self.fills += 1
        return True

    def _give_up(self, exc: Exception) -> None:
        logger.error("mask-fill workers failed (%s); guided masks stay on the scheduler's "
                     "thread", exc)
        self.close()

    def _open(self, guide: Guide, orders: list[FillOrder]) -> _Mirror:
        """A mirror of `guide` on the worker with the fewest (its tokens so far follow)."""
        index = min(range(len(self._workers)), key=lambda i: self._workers[i].mirrors)
        worker, order = self._workers[index], orders[index]
        grammar, serialized = self._grammar(guide)
        if grammar not in worker.users:
            order.grammars.append((grammar, serialized))
            worker.users[grammar] = 0
        worker.users[grammar] += 1
        worker.mirrors += 1
        self._next_id += 1
        mirror = _Mirror(index, self._next_id)
        order.opens.append((mirror.ident, grammar, guide.stop_ids))
        guide.mirror = mirror
        # The request's end drops the mirror (with the next order).
        weakref.finalize(guide, self._ended.append, (index, mirror.ident, grammar))
        return mirror

    def _grammar(self, guide: Guide) -> tuple[int, str]:
        """The id and serialized form of `guide`'s grammar (serialized once per key while kept;
        without a key, once per guide)."""
        key = guide.key if guide.key is not None else ("guide", id(guide))
        found = self._serialized.get(key)
        if found is None:
            self._next_id += 1
            found = (self._next_id, guide.compiled.serialize_json())
            if guide.key is not None:
                self._serialized[key] = found
                if len(self._serialized) > SERIALIZED_GRAMMARS_KEPT:
                    self._serialized.popitem(last=False)
        else:
            self._serialized.move_to_end(key)
        return found

    def _take_ended(self, orders: list[FillOrder]) -> None:
        while self._ended:
            index, ident, grammar = self._ended.popleft()
            worker, order = self._workers[index], orders[index]
            order.drops.append(ident)
            worker.mirrors -= 1
            worker.users[grammar] -= 1
            if not worker.users[grammar]:
                del worker.users[grammar]
                order.forgets.append(grammar)

    def close(self) -> None:
        """Stop the workers (the scheduler fills every row itself from then on)."""
        self._failed = True
        if self._starting is not None:
            self._starting.join()
        workers, self._workers = self._workers, []
        _stop(workers)


def _reply(conn: Connection, what: str) -> float:
    """A worker's answer: the seconds its work took."""
    if not conn.poll(REPLY_TIMEOUT_S):
        raise TimeoutError(f"a mask-fill worker did not answer its {what} order")
    answer = conn.recv()
    if isinstance(answer, str):  # the worker's error
        raise RuntimeError(f"a mask-fill worker failed: {answer}")  # noqa: TRY004
    return float(answer)


def _stop(workers: list[_Worker]) -> None:
    for worker in workers:
        try:
            worker.conn.send(None)
        except OSError:
            pass
    for worker in workers:
        worker.proc.join(5.0)
        if worker.proc.is_alive():
            worker.proc.kill()
        worker.conn.close()


def _serve(conn: Connection, slots: int, words: int) -> None:
    """A worker's loop: mirrors made, followed and dropped, and their rows filled, as each
    order says."""
    import xgrammar as xgr

    masks = MaskBuffer(slots, words, reduction.recv_handle(conn))
    info = xgr.TokenizerInfo.deserialize_json(conn.recv())
    fill = xgr.BatchGrammarMatcher(1)
    grammars: dict[int, Any] = {}
    mirrors: dict[int, Any] = {}
    conn.send(0.0)
    while True:
        try:
            order: FillOrder | None = conn.recv()
        except EOFError:
            return
        if order is None:
            return
        start = time.perf_counter()
        try:
            for grammar, serialized in order.grammars:
                grammars[grammar] = xgr.CompiledGrammar.deserialize_json(serialized, info)
            for ident, grammar, stop_ids in order.opens:
                mirrors[ident] = new_matcher(grammars[grammar], stop_ids)
            for ident in order.drops:
                del mirrors[ident]
            for grammar in order.forgets:
                del grammars[grammar]
            matchers = [mirrors[ident] for ident, _, _ in order.rows]
            _follow(matchers, [tokens for _, tokens, _ in order.rows])
            view = masks.view(order.half, order.slots)
            live, rows = [], []
            for matcher, (_, _, index) in zip(matchers, order.rows):
                if matcher.is_terminated():  # its request ended: every token allowed
                    view[index] = -1
                else:
                    live.append(matcher)
                    rows.append(index)
            if live:
                fill.batch_fill_next_token_bitmask(live, view, indices=rows)
            conn.send(time.perf_counter() - start)
        except Exception as exc:  # noqa: BLE001 - the scheduler stops using the pool
            conn.send(f"{type(exc).__name__}: {exc}")


def _follow(matchers: list[Any], tokens: list[list[int]]) -> None:
    """Each mirror accepts its matcher's tokens since the last order: one batch call for the
    usual single token, one call a token otherwise."""
    single = [i for i, toks in enumerate(tokens) if len(toks) == 1]
    if single and not all(batch_accept([matchers[i] for i in single],
                                       [tokens[i][0] for i in single])):
        raise RuntimeError("a mirror refused its matcher's token")
    for matcher, toks in zip(matchers, tokens):
        if len(toks) > 1 and not all(matcher.accept_token(token) for token in toks):
            raise RuntimeError("a mirror refused its matcher's token")
