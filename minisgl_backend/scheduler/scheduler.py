"""The scheduler: a thread in the caller's process that drives the engine processes.

Each loop iteration takes new requests and aborts, picks one batch (prefill first, with chunked
prefill; otherwise every running request decodes one token), allocates its pages, sends the engine a
compact step message, and turns the sampled tokens into outputs.

With overlap on, the tokens handled in an iteration are those of the step sent in the previous
iteration: step N+1 is built and sent before step N's tokens are read, so the engine computes
while the scheduler works. A request that finished in step N (EOS, stop string) may then run
one extra step, whose token is dropped; its pages and row are given back only when step N's
tokens are read, and any later step that reuses them runs after step N+1 on the device.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minisgl_backend.core import (Req, RowSampling, SamplingParams, bad_word_sequences,
                                  check_token_ids, sample_seed, wants_context_logits)
from minisgl_backend.engine.config import EngineConfig
from minisgl_backend.engine.protocol import StepMessage, StepReply, masks_ready
from minisgl_backend.engine.sampler import seed_to_int64
from minisgl_backend.grammar import GrammarCompilerCache, Guide, fill_masks, guide_of
from minisgl_backend.kv_events import kv_event_publisher
from minisgl_backend.kvcache import create_prefix_cache
from minisgl_backend.profiling import profiled
from minisgl_backend.scheduler.cache import CacheManager, pages_for
from minisgl_backend.scheduler.decode import DecodeManager
from minisgl_backend.scheduler.engine_client import EngineClient, EngineDeadError
from minisgl_backend.scheduler.lora import AdapterSlots
from minisgl_backend.scheduler.output import OutputCallback, OutputTracker, RequestOutput
from minisgl_backend.scheduler.prefill import PrefillManager
from minisgl_backend.scheduler.speculation import Speculator
from minisgl_backend.scheduler.table import RowAllocator
from minisgl_backend.settings import EngineHooks
from minisgl_backend.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    engine: EngineConfig
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    hooks: EngineHooks = field(default_factory=EngineHooks)


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot for metrics, refreshed by the scheduler thread after every iteration."""

    kv_pages_total: int
    kv_pages_in_use: int  # held by admitted requests (their own or locked cached prefixes)
    kv_pages_cached: int  # unlocked prefix-cache pages (reusable, evictable)
    running: int
    waiting: int
    steps: int
    # Speculative decoding so far: rows that verified drafts (summed over steps), draft
    # tokens verified, and of them kept.
    verified_rows: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    # LoRA (where it is on): requests per adapter name, running and waiting, and the adapters
    # on the device.
    lora_running: tuple[tuple[str, int], ...] = ()
    lora_waiting: tuple[tuple[str, int], ...] = ()
    lora_resident: tuple[str, ...] = ()


@dataclass
class _SentStep:
    """A step sent to the engine whose tokens were not read yet."""

    batch: list[Req]
    counts: list[bool]  # per request: does its sampled token count (see `complete_step`)
    masks_follow: list[int]  # batch indices of the guided rows whose masks are still to send
    verifies: bool  # some row verifies drafts (or sends its start after rejected ones)
    mask_half: int  # the mask buffer's half of this step's guided rows
    mask_seq: int = 0  # with masks_follow: its `StepMessage.mask_seq`
    guided: list[int] = field(default_factory=list)  # batch indices: `_guided_rows`


@dataclass(frozen=True)
class CheckedRequest:
    """What `check_request` derives from a valid request."""

    bans: tuple[tuple[int, ...], ...]  # bad_token_ids + the tokenized bad_words
    grammar: Any  # the compiled structured-output grammar, or None


@dataclass
class _Submit:
    reqs: list[Req]  # the request's samples (`n` of them)
    callback: OutputCallback
    stream: bool  # outputs as the tokens come, else each sample's whole output at its end


@dataclass
class _Abort:
    uid: int


@dataclass
class _Reset:
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False


def complete_step(req: Req, cache: CacheManager, decode: DecodeManager) -> bool:
    """Record that a step computed `req`'s scheduled tokens; True if its sampled token counts.

    A request that just finished its prompt (or its LongRoPE restart, `prefill_len`) shares it
    through the prefix cache and starts decoding; a chunk of a longer prompt samples a
    meaningless token.
    """
    was_prefilling = req.cached_len < req.prefill_len
    req.cached_len = req.device_len
    if req.cached_len < req.prefill_len:
        return False
    if was_prefilling:
        cache.cache_prefix(req)
        decode.add(req)
    return True


def _slots_of(batch: list[Req], rows: list[int]) -> list[int]:
    """The samples (see `StepMessage`) of batch rows `rows`: a row's last sampled
    token and each of its drafts sample one."""
    if not any(req.drafts for req in batch):  # one sample a row (a guided step: twice a step)
        return list(rows)
    starts = np.cumsum([0] + [1 + len(req.drafts) for req in batch])
    return [int(s) for i in rows for s in range(starts[i], starts[i + 1])]


class Scheduler:
    """Runs requests to completion on the engine processes; thread-safe `submit` / `abort`."""

    def __init__(self, config: SchedulerConfig, tokenizer: Any, eos_ids: frozenset[int],
                 vocab_size: int, engine: EngineClient | None = None) -> None:
        """`engine`: the engine processes' client; by default started from config.engine
        (tests and the scheduler benchmark pass a stand-in)."""
        self.config = config
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.vocab_size = vocab_size  # token ids must be below it
        self.grammars = GrammarCompilerCache(tokenizer, vocab_size, sorted(eos_ids))
        # Guided requests admitted and not ended: their rows' token masks go with each step
        # (with overlap, in a MASKS message once the tokens of the step before are read).
        self.guided_uids: set[int] = set()
        self.engine = engine or EngineClient(config.engine)
        page_size = config.engine.page_size
        self.cache = CacheManager(self.engine.num_pages, page_size,
                                  create_prefix_cache(config.engine.cache, page_size),
                                  self.engine.long_rope_from)
        self.rows = RowAllocator(config.engine.max_running_requests)
        self.loras = AdapterSlots(config.engine.lora_adapters, config.engine.max_loras,
                                  config.engine.max_cpu_loras)
        try:
            self.kv_events = kv_event_publisher(config.engine, config.engine.device_type,
                                                self.loras.names.get)
        except ValueError:
            self.engine.shutdown()
            raise
        self.cache.prefix_cache.events = self.kv_events
        self.prefill = PrefillManager(self.cache, self.rows, config.engine.chunked_prefill_size,
                                      config.engine.max_running_requests, self.loras)
        self.decode = DecodeManager()
        self.speculator = Speculator(
            config.speculative, config.engine.jump_forward, config.engine.samples_per_row - 1,
            self.cache.short_rope_room if self.engine.long_rope_from else None,
            config.engine.device_type, config.hooks.synthetic_acceptance)
        # Rows whose KV restarts in the long frequencies with the next step (LongRoPE), and
        # how many tokens that restart computes.
        self._long_rope_rows: list[tuple[int, int]] = []
        self.overlap = config.engine.overlap
        self.in_flight: _SentStep | None = None
        # The in-flight step's masks, to write once the next step's message is out, and the
        # count of steps sent with masks_follow.
        self._masks_due: _SentStep | None = None
        self._mask_seq = 0
        self.trackers: dict[int, OutputTracker] = {}
        # Trackers holding deltas not yet emitted: emitted once the next step is sent.
        self._unflushed: list[OutputTracker] = []
        self.group_size: dict[int, int] = {}  # uid of sample 0 -> n, for requests with n > 1
        self.num_steps = 0
        self.peak_running = 0  # most requests admitted at once so far
        self._dead: str | None = None
        self._shut_down = False
        self._next_uid = 0
        self._uid_lock = threading.Lock()
        self._inbox: queue.SimpleQueue[_Submit | _Abort | _Reset | None] = queue.SimpleQueue()
        self.stats = self._snapshot()
        self._thread = threading.Thread(target=self._run, name="minisgl-scheduler", daemon=True)
        self._thread.start()

    # ----- public, thread-safe -------------------------------------------------------------

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + max_tokens) one request may hold (the engine's limit:
        the model's context, capped by the KV pool)."""
        return self.engine.max_seq_len

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> CheckedRequest:
        """Raise ValueError (naming the field) if the request can never run; else return its
        banned token sequences (`bad_token_ids` and the tokenized `bad_words`) and its
        compiled grammar (compiled here, in the caller's thread; cached)."""
        prompt_len = len(prompt_ids)
        if prompt_len < 1:
            raise ValueError("prompt must contain at least one token")
        limit = self.max_request_tokens
        if prompt_len >= limit:
            raise ValueError(f"prompt has {prompt_len} tokens; the limit is {limit - 1}")
        if prompt_len + params.max_tokens > limit:
            raise ValueError(
                f"max_tokens ({params.max_tokens}) + prompt tokens ({prompt_len}) exceeds the "
                f"limit of {limit} tokens per request"
            )
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer in the model folder")
        words = bad_word_sequences(self.tokenizer, params.bad_words, spaced=True)
        bans = tuple(dict.fromkeys([*params.bad_token_ids, *words]))
        # The engine indexes its embedding and logits with these: a bad id would fail it.
        check_token_ids("prompt", prompt_ids, self.vocab_size)
        check_token_ids("stop_token_ids", params.stop_token_ids, self.vocab_size)
        check_token_ids("bad_token_ids", (t for seq in bans for t in seq), self.vocab_size)
        check_token_ids("logit_bias", params.logit_bias or {}, self.vocab_size)
        return CheckedRequest(bans, self.grammars.compile(params))

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               callback: OutputCallback, checked: CheckedRequest | None = None,
               stream: bool = True, lora: str | None = None) -> int:
        """Queue a request; `callback` gets its outputs on the scheduler thread. Returns its uid.

        Its `params.n` samples run as requests `uid .. uid + n - 1` (`RequestOutput.index`;
        seeds `sample_seed(seed, i)`); samples after the first wait until the prompt is in the
        prefix cache. An invalid request, a dead engine or a shut-down scheduler ends every
        sample with an error. `checked`: `check_request`'s answer, if the caller already has
        it. `stream` False: each sample's whole output comes at its end (`OutputTracker`).
        `lora`: the name of the LoRA adapter it runs under (None: the base model).
        """
        seed = params.seed if params.seed is not None else random.getrandbits(64)
        error = None
        lora_id = 0
        try:
            lora_id = self.loras.id_of(lora)
            if checked is None:
                checked = self.check_request(prompt_ids, params)
        except ValueError as exc:
            error, checked = str(exc), CheckedRequest((), None)
        with self._uid_lock:  # queued under the lock: nothing is queued after shutdown's None
            uid, self._next_uid = self._next_uid, self._next_uid + params.n
            reqs = [Req(uid=uid + i, input_ids=list(prompt_ids), prompt_len=len(prompt_ids),
                        sampling_params=params, seed=sample_seed(seed, i), index=i)
                    for i in range(params.n)]
            if error is None and (self._shut_down or not self._thread.is_alive()):
                error = "the engine was shut down" if self._shut_down else self.failure
            if error is None:
                for req in reqs:
                    req.bans, req.wait_for = checked.bans, (reqs[0] if req.index else None)
                    req.grammar, req.lora_id = checked.grammar, lora_id
                self._inbox.put(_Submit(reqs, callback, stream))
                return uid
        for req in reqs:
            callback(RequestOutput(req.uid, [], "", True, "error", req.prompt_len, 0, error,
                                   index=req.index))
        return uid

    def abort(self, uid: int) -> None:
        self._inbox.put(_Abort(uid))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix (the KV-cache events report it); False, dropping nothing,
        while any request is queued or running, or once the scheduler has stopped."""
        reset = _Reset()
        with self._uid_lock:  # queued under the lock: nothing is queued after shutdown's None
            if self._shut_down or not self._thread.is_alive():
                return False
            self._inbox.put(reset)
        reset.done.wait()
        return reset.ok

    @property
    def alive(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    @property
    def failure(self) -> str | None:
        """Why the engine stopped serving (None while it serves, or after `shutdown`)."""
        if self._shut_down:
            return None
        if self._dead is None and not self._thread.is_alive():
            return "the scheduler thread stopped"
        return self._dead

    def shutdown(self) -> None:
        with self._uid_lock:  # a request queued after this would never end
            self._shut_down = True
        if self._thread.is_alive():
            self._inbox.put(None)
            self._thread.join()
        self.engine.shutdown()
        if self.kv_events is not None:
            self.kv_events.shutdown()

    # ----- scheduler thread -----------------------------------------------------------------

    @property
    def _busy(self) -> bool:
        return self.prefill.has_work or self.decode.has_work or self.in_flight is not None

    def _run(self) -> None:
        with profiled("scheduler"):
            self._loop()
        self._fail_all("abort", "the engine is shutting down")

    def _loop(self) -> None:
        while True:
            if not self._drain_inbox(block=not self._busy):
                break
            if self._dead is None and self._busy:
                try:
                    self._step()
                except EngineDeadError as exc:
                    self._die(str(exc))
                except Exception as exc:  # a bug: fail every request rather than hang them
                    logger.exception("scheduler step failed")
                    self._die(f"scheduler error: {exc!r}")
            self.stats = self._snapshot()

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued submissions and aborts; False when asked to stop."""
        items = []
        if block:
            while True:
                try:
                    items.append(self._inbox.get(timeout=1.0))
                    break
                except queue.Empty:
                    if self._dead is None and not self.engine.alive:
                        self._die("an engine process died while idle")
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for item in items:
            if item is None:
                return False
            try:
                if isinstance(item, _Abort):
                    self._abort(item.uid)
                elif isinstance(item, _Reset):
                    self._reset_cache(item)
                else:
                    self._accept(item)
            except Exception as exc:  # a bug: fail every request rather than hang them
                logger.exception("scheduler failed to take a request")
                self._die(f"scheduler error: {exc!r}")
        return True

    def _accept(self, item: _Submit) -> None:
        trackers = [OutputTracker(req, self.tokenizer, self.eos_ids, item.callback, item.stream)
                    for req in item.reqs]
        if self._dead is not None:
            for tracker in trackers:
                tracker.fail("error", f"the engine is not running: {self._dead}")
            return
        if len(item.reqs) > 1:
            self.group_size[item.reqs[0].uid] = len(item.reqs)
        for req, tracker in zip(item.reqs, trackers):
            if req.grammar is not None:
                req.guide = Guide(req.grammar, tracker.stop_ids, guide_of(req.sampling_params))
            self.trackers[req.uid] = tracker
            self.prefill.add(req)

    def _reset_cache(self, reset: _Reset) -> None:
        try:
            if not self.trackers and not self._busy and self._dead is None:
                self.cache.free(self.cache.prefix_cache.reset())
                reset.ok = True
        finally:
            reset.done.set()

    def _abort(self, uid: int) -> None:
        for member in range(uid, uid + self.group_size.pop(uid, 1)):
            self._abort_one(member)

    def _abort_one(self, uid: int) -> None:
        tracker = self.trackers.pop(uid, None)
        if tracker is None:
            return  # already finished
        req = tracker.req
        self.guided_uids.discard(uid)
        self.prefill.remove(req)
        if req.table_idx >= 0:  # admitted: give back its row and pages
            self.decode.remove(req)
            self.cache.release(req, cache=False)
            self._free_row(req)
        self.speculator.finish(req)
        tracker.fail("abort", "the request was cancelled")

    def _step(self) -> None:
        crossing = self.engine.long_rope_from > 0 and self._crossing()
        if self.in_flight is not None and (crossing or self.speculator.may_draft(
                len(self.decode.running), bool(self.guided_uids), self.num_steps)):
            # Drafts, and a LongRoPE restart's tokens, follow from the tokens of the step in
            # flight.
            self._read_tokens(self.in_flight)
            self.in_flight = None
        if crossing:
            for req in self._crossing():
                self._restart_long(req)
        sent = self._send_next_step()
        self._send_due_masks()  # the step in flight's, now that the engine has the next step
        self._flush_outputs()  # the step before's outputs, now that the engine has work
        if not self.overlap:
            self._read_tokens(sent)
            self._flush_if_idle()
            return
        if self.in_flight is not None:
            if sent is not None and sent.masks_follow and not any(
                    req.drafts for req in self.in_flight.batch):
                # The masks wait on the engine (on its device, on a GPU): only the grammars
                # follow the tokens first. The tokens are read next, and the next step's
                # message goes out before the masks, so that the engine prepares and queues that
                # step meanwhile.
                reply = self.engine.receive_step()
                OutputTracker.advance_guides(self._guided_tokens(self.in_flight, reply))
                self._read_tokens(self.in_flight, reply)
                self._masks_due = sent
            else:
                self._read_tokens(self.in_flight)
        if sent is not None and sent.masks_follow and self._masks_due is None:
            self._send_masks(sent)
        if sent is not None and sent.verifies:  # the next step's drafts need its tokens
            self._read_tokens(sent)
            sent = None
        self.in_flight = sent
        self._flush_if_idle()

    def _flush_outputs(self) -> None:
        """Emit every delta the steps read so far decided."""
        for tracker in self._unflushed:
            tracker.flush()
        self._unflushed.clear()

    def _flush_if_idle(self) -> None:
        """Emit the outputs now when no next step will be sent (the loop is about to wait)."""
        if not self._busy:
            self._flush_outputs()

    def _crossing(self) -> list[Req]:
        """Running requests whose next token is past LongRoPE's pretraining length while their
        KV is in the short frequencies."""
        return [req for req in self.decode.running.values()
                if self.cache.short_rope_room(req) <= 0]

    def _restart_long(self, req: Req) -> None:
        """HF computes a sequence crossing LongRoPE's pretraining length whole again in the
        long frequencies: so does the next prefill step, for every token of `req` so far
        (its sampled token comes from there, and counts)."""
        self.decode.remove(req)
        req.drafts, req.explicit = [], False
        self.cache.restart_long(req)
        self._long_rope_rows.append((req.table_idx, req.prefill_len))
        self.prefill.restart(req)

    def _send_masks(self, sent: _SentStep) -> None:
        """Write the masks that follow step `sent` and tell the engine they are there."""
        self._write_masks(sent.batch, sent.masks_follow, sent.mask_half)
        self.engine.masks.mark_ready(sent.mask_seq)
        self.engine.send(masks_ready(sent.mask_seq))
        sent.masks_follow = []

    def _send_due_masks(self) -> None:
        """The masks of the step in flight, if they wait for the next step's message."""
        if self._masks_due is not None:
            due, self._masks_due = self._masks_due, None
            self._send_masks(due)

    def _send_next_step(self) -> _SentStep | None:
        """Schedule, send and account one step (its computed tokens become cached)."""
        batch, admitted = self.prefill.schedule(list(self.decode.running.values()))
        now = time.time_ns()
        if admitted:
            self.speculator.new_requests()
        for req in admitted:
            req.admitted_step, req.admitted_ns = self.num_steps, now
            if req.guide is not None:
                self.guided_uids.add(req.uid)
        decode = []
        if not batch:
            decode = self.decode.schedule()
            if not batch and not decode:
                return None  # overlap: every running request may be done; else cannot happen
            if not batch and self.in_flight is None and self.speculator.may_draft(
                    len(decode), bool(self.guided_uids), self.num_steps):
                self.speculator.draft(decode, {r.uid for r in decode
                                               if r.sampling_params.uses_penalties},
                                      self.num_steps)
        # Rows that send their tokens (prompt chunks; verify rows; rows after rejected drafts)
        # come first, then those that decode from the engine's own row length.
        explicit = [r for r in decode if r.drafts or r.explicit]
        is_prefill = bool(batch)
        batch = batch + explicit + [r for r in decode if not (r.drafts or r.explicit)]
        num_given = len(batch) - len(decode) + len(explicit)
        rows_in_use = self.rows.num_rows - self.rows.num_free
        self.peak_running = max(self.peak_running, rows_in_use)
        guided = self._guided_rows(batch) if self.guided_uids else []
        message = self._step_message(batch, admitted, is_prefill, num_given, guided)
        self.engine.send(message.to_bytes())
        mask_half = self._mask_half()
        self.num_steps += 1
        return _SentStep(batch, [complete_step(req, self.cache, self.decode) for req in batch],
                         guided if message.masks_follow else [],
                         verifies=bool(explicit), mask_half=mask_half,
                         mask_seq=int(message.mask_seq[0]) if message.masks_follow else 0,
                         guided=guided)

    def _read_tokens(self, sent: _SentStep | None, reply: StepReply | None = None) -> None:
        """Process the tokens of `sent` (`reply`, when already received)."""
        if sent is None:
            return
        if reply is None:
            self._send_due_masks()  # the engine needs them for these tokens
            reply = self.engine.receive_step()
        self._process(sent, reply)
        if self.config.hooks.debug_checks:
            self.cache.check_accounting(self._running())

    def _snapshot(self) -> SchedulerStats:
        cache = self.cache
        free, cached = len(cache.free_pages), cache.prefix_cache.evictable_pages
        waiting = len(self.prefill.waiting)
        return SchedulerStats(
            kv_pages_total=cache.num_pages, kv_pages_in_use=cache.num_pages - free - cached,
            kv_pages_cached=cached, running=self.rows.num_rows - self.rows.num_free,
            waiting=waiting, steps=self.num_steps,
            verified_rows=self.speculator.verified_rows, draft_tokens=self.speculator.drafted,
            accepted_draft_tokens=self.speculator.accepted,
            **(self.loras.stats(self._running(), self.prefill.waiting)
               if self.config.engine.lora_enabled else {}),
        )

    def _running(self) -> list[Req]:
        running = list(self.decode.running.values())
        if self.prefill.chunked is not None:
            running.append(self.prefill.chunked)
        return running + list(self.prefill.restarting)

    def _step_message(self, batch: list[Req], admitted: list[Req], is_prefill: bool,
                      num_given: int, guided: list[int]) -> StepMessage:
        """The step's message; the first `num_given` requests send the tokens they compute
        (prompt chunks, or a last token and its drafts), the others decode one token; `guided`:
        the batch's `_guided_rows`."""
        msg = StepMessage(is_prefill=is_prefill, rows=[r.table_idx for r in batch])
        for i, req in enumerate(batch):
            self.cache.grow(req)
            if len(req.pages) > req.pages_sent:
                msg.page_rows.append(req.table_idx)
                msg.page_counts.append(len(req.pages) - req.pages_sent)
                msg.new_pages.extend(req.pages[req.pages_sent :])
                req.pages_sent = len(req.pages)
            if i < num_given:
                if req.cached_len < req.prompt_len == req.prefill_len and \
                        wants_context_logits(req):
                    msg.context_rows.append(i)
                msg.starts.append(req.cached_len)
                msg.extend_lens.append(req.extend_len)
                msg.tokens.extend(req.step_tokens)
        for req in admitted:
            self._admission(msg, req)
        msg.long_rope_rows += [row for row, _ in self._long_rope_rows]
        msg.long_rope_lens += [length for _, length in self._long_rope_rows]
        self._long_rope_rows.clear()
        if self.guided_uids:
            msg.guide_rows = _slots_of(batch, guided)
            if guided:
                msg.mask_half = [self._mask_half()]
            # A step in flight holds tokens these masks depend on: they follow once it is read.
            msg.masks_follow = bool(guided) and self.in_flight is not None
            if msg.masks_follow:
                self._mask_seq += 1
                msg.mask_seq = [self._mask_seq]
            if guided and not msg.masks_follow:
                self._write_masks(batch, guided, self._mask_half())
        return msg

    def _mask_half(self) -> int:
        """The mask buffer's half of the step being built (its number's parity; see
        `mask_buffer` for why two halves suffice)."""
        return self.num_steps % 2

    @staticmethod
    def _guided_rows(batch: list[Req]) -> list[int]:
        """Batch indices of the guided rows that sample a token this step."""
        return [i for i, req in enumerate(batch) if req.guide is not None and req.prompt_done]

    def _write_masks(self, batch: list[Req], guided: list[int], half: int) -> None:
        """The grammar masks of the slots of the guided rows `guided` (batch indices), into
        half `half` of the mask buffer; a row whose request has ended since (it runs one extra
        step, whose token is dropped) allows every token."""
        masks = self.engine.masks.view(half, len(_slots_of(batch, guided)))
        plain: list[Guide] = []  # rows without drafts: one parallel fill
        plain_slots: list[int] = []
        for i, slot in zip(guided, self._mask_starts(batch, guided)):
            req = batch[i]
            if req.uid not in self.trackers or req.guide.finished:  # ended: allow every token
                masks[slot:slot + 1 + len(req.drafts)] = -1
            elif req.drafts:
                req.guide.fill_with_drafts(masks, slot, req.drafts)
            else:
                plain.append(req.guide)
                plain_slots.append(slot)
        fill_masks(plain, masks, plain_slots)

    @staticmethod
    def _mask_starts(batch: list[Req], guided: list[int]) -> list[int]:
        """The first mask slot of each guided row (a row with drafts takes one slot more
        each)."""
        if not any(batch[i].drafts for i in guided):
            return list(range(len(guided)))
        starts = np.cumsum([0] + [1 + len(batch[i].drafts) for i in guided])
        return [int(s) for s in starts[:-1]]

    def _admission(self, msg: StepMessage, req: Req) -> None:
        stop_ids = (sorted(self.trackers[req.uid].stop_ids)
                    if req.sampling_params.min_tokens > 0 else [])
        add_admission(msg, req, stop_ids, self.vocab_size)
        self.loras.admit(msg, req)

    def _guided_tokens(self, sent: _SentStep, reply: StepReply
                       ) -> list[tuple[OutputTracker, int]]:
        """(tracker, sampled token) of the guided rows of `sent` (a step without drafts) whose
        tokens `_process` will take."""
        rows = [(self.trackers.get(sent.batch[i].uid), i) for i in sent.guided
                if sent.counts[i] and sent.batch[i].table_idx >= 0]
        return [(tracker, int(reply.tokens[i])) for tracker, i in rows if tracker is not None]

    def _process(self, sent: _SentStep, reply: StepReply) -> None:
        logprobs = reply.logprobs_of() if len(reply.lp_rows) else {}
        generation_logits = reply.generation_logits_of()
        for i, logits in reply.context_logits_of().items():
            tracker = self.trackers.get(sent.batch[i].uid)
            if tracker is not None:
                tracker.add_context_logits(logits)
        sampled, slot = reply.tokens.tolist(), 0
        for req, counts in zip(sent.batch, sent.counts):
            first, slot = slot, slot + 1 + len(req.drafts)
            tracker = self.trackers.get(req.uid)
            if not counts or tracker is None or req.table_idx < 0:
                req.drafts = []
                continue  # a prompt chunk, or a request that ended after this step was sent
            tokens = (self.speculator.settle(req, sampled[first:slot])
                      if req.drafts or req.explicit else [sampled[first]])
            if tokens and tracker.stream and not tracker.has_pending:
                self._unflushed.append(tracker)
            for j, token in enumerate(tokens):
                if tracker.add_token(token, logprobs.get(first + j),
                                     generation_logits.get(first + j)):
                    if not tracker.stream:  # its one output, with the next flush
                        self._unflushed.append(tracker)
                    # Ended inside kept drafts: its KV holds every token it keeps.
                    req.cached_len = min(req.cached_len, len(req.input_ids))
                    self._finish(req)
                    break

    def _finish(self, req: Req) -> None:
        del self.trackers[req.uid]
        self.speculator.finish(req)
        self.guided_uids.discard(req.uid)
        first = req.uid - req.index
        if first in self.group_size and not any(
                u in self.trackers for u in range(first, first + self.group_size[first])):
            del self.group_size[first]
        self.decode.remove(req)
        self.cache.release(req, cache=True)
        self._free_row(req)
        req.table_idx = -1

    def _free_row(self, req: Req) -> None:
        """Give back an admitted request's table row and adapter slot."""
        self.rows.free(req.table_idx)
        if req.lora_slot >= 0:
            self.loras.release(req.lora_slot)
            req.lora_slot = -1

    def _die(self, reason: str) -> None:
        logger.error("engine failed: %s", reason)
        self._dead = reason
        self._fail_all("error", f"the engine failed: {reason}")

    def _fail_all(self, reason: str, message: str) -> None:
        self._flush_outputs()
        for tracker in list(self.trackers.values()):
            tracker.fail(reason, message)
        self.trackers.clear()
        self.guided_uids.clear()
        self.prefill.waiting.clear()
        self.prefill.chunked = None
        self.prefill.restarting.clear()
        self.decode.running.clear()
        self.in_flight = None
        self._masks_due = None


__all__ = ["RequestOutput", "Scheduler", "SchedulerConfig", "SchedulerStats", "pages_for"]


def add_admission(msg: StepMessage, req: Req, stop_ids: list[int], vocab_size: int) -> None:
    """What the engine needs of a newly admitted request: its per-row controls (decided for a
    `vocab_size` vocabulary), LongRoPE's long frequencies where its prompt takes them, and its
    prompt, bias entries, bad-word sequences and min_tokens' stop ids (`stop_ids`, sorted)
    where it uses them."""
    p, row = req.sampling_params, req.table_idx
    msg.admit_rows.append(row)
    if msg.admit is None:
        msg.admit = RowSampling.of((), vocab_size)
    msg.admit.append(p, seed_to_int64(req.seed), vocab_size)
    if req.long_rope:  # a prompt past LongRoPE's pretraining length
        msg.long_rope_rows.append(row)
        msg.long_rope_lens.append(req.prompt_len)
    if p.uses_penalties or any(len(seq) > 1 for seq in req.bans):
        msg.prompt_rows.append(row)
        msg.prompt_counts.append(req.prompt_len)
        msg.prompt_tokens.extend(req.input_ids[: req.prompt_len])
    if p.logit_bias:
        msg.bias_rows.append(row)
        msg.bias_counts.append(len(p.logit_bias))
        msg.bias_ids.extend(p.logit_bias)
        msg.bias_values.extend(p.logit_bias.values())
    for seq in req.bans:
        msg.ban_rows.append(row)
        msg.ban_lens.append(len(seq))
        msg.ban_tokens.extend(seq)
    if p.min_tokens > 0:
        msg.min_rows.append(row)
        msg.min_lens.append(req.prompt_len + p.min_tokens)
        msg.min_stop_counts.append(len(stop_ids))
        msg.min_stop_ids.extend(stop_ids)
