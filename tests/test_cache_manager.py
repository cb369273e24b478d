"""Page accounting, admission, chunked prefill and prefix reuse on the scheduler side.

No engine runs here. `Sim` drives `PrefillManager`, `DecodeManager`, `CacheManager` and
`RowAllocator` the way `Scheduler._step` / `_process` / `_finish` / `_abort` do, and stands in
for the engine with two small models:

* a page table (row -> page ids, appended from `pages[pages_sent:]` as the step message would),
* a KV store (flat slot -> fingerprint of the token prefix whose K/V the slot holds): a step
  writes the slots of the tokens it computes, then "attends" over every slot of its rows and
  checks that each still holds the right prefix. A page handed to someone else while a running
  request still points at it shows up as a wrong fingerprint.

Sampled tokens are a deterministic hash of the prefix, so equal prompts produce equal outputs
(as greedy decoding would) and the radix cache sees shared continuations too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from minisgl_backend.core import Req, SamplingParams
from minisgl_backend.kvcache import create_prefix_cache
from minisgl_backend.scheduler.cache import CacheManager, pages_for
from minisgl_backend.scheduler.decode import DecodeManager
from minisgl_backend.scheduler.prefill import PrefillManager
from minisgl_backend.scheduler.scheduler import complete_step
from minisgl_backend.scheduler.table import RowAllocator

PAGE_SIZES = [1, 16]
EOS = 0
VOCAB = 101
_MASK64 = (1 << 64) - 1
_FP_START = 0xCBF29CE484222325


def _mix(h: int, token: int) -> int:
    return ((h ^ (token + 0x9E3779B97F4A7C15)) * 0x100000001B3) & _MASK64


@pytest.fixture(params=PAGE_SIZES, ids=lambda ps: f"page{ps}")
def page_size(request: pytest.FixtureRequest) -> int:
    return request.param


# ------------------------------------------------------------------------------------ simulator
@dataclass
class StepRecord:
    is_prefill: bool
    uids: list[int]
    starts: list[int]
    extend_lens: list[int]
    admitted: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(self.extend_lens) if self.is_prefill else 0


@dataclass
class Sim:
    """A scheduler without engine processes (see the module docstring)."""

    num_pages: int
    page_size: int
    cache_kind: str = "radix"
    chunk_size: int = 8192
    max_running: int = 8
    check_every_step: bool = True
    live: dict[int, Req] = field(default_factory=dict)  # submitted, neither finished nor aborted
    finished: list[Req] = field(default_factory=list)
    aborted: list[Req] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    table: dict[int, list[int]] = field(default_factory=dict)  # the engine's page table rows
    kv: dict[int, int] = field(default_factory=dict)  # slot -> prefix fingerprint
    _fps: dict[int, list[int]] = field(default_factory=dict)
    _next_uid: int = 0

    def __post_init__(self) -> None:
        self.cache = CacheManager(self.num_pages, self.page_size,
                                  create_prefix_cache(self.cache_kind, self.page_size))
        self.rows = RowAllocator(self.max_running)
        self.prefill = PrefillManager(self.cache, self.rows, self.chunk_size, self.max_running)
        self.decode = DecodeManager()

    # ----- requests
    def submit(self, prompt: list[int], max_tokens: int, ignore_eos: bool = False) -> Req:
        uid, self._next_uid = self._next_uid, self._next_uid + 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
        req = Req(uid=uid, input_ids=list(prompt), prompt_len=len(prompt),
                  sampling_params=params, seed=uid)
        assert pages_for(req.max_device_len, self.page_size) <= self.num_pages, "cannot ever fit"
        self.live[uid] = req
        self.prefill.add(req)
        return req

    def abort(self, req: Req) -> None:
        """As `Scheduler._abort`."""
        if self.live.pop(req.uid, None) is None:
            return
        self.prefill.remove(req)
        if req.table_idx >= 0:
            self.decode.remove(req)
            self.cache.release(req, cache=False)
            self._free_row(req)
        self.aborted.append(req)
        if self.check_every_step:
            self.check()

    @property
    def has_work(self) -> bool:
        return self.prefill.has_work or self.decode.has_work

    def running(self) -> list[Req]:
        """Requests holding a row and pages (as `Scheduler._running`)."""
        running = list(self.decode.running.values())
        if self.prefill.chunked is not None:
            running.append(self.prefill.chunked)
        return running

    # ----- one scheduler step
    def step(self) -> StepRecord | None:
        batch, admitted = self.prefill.schedule(list(self.decode.running.values()))
        is_prefill = bool(batch)
        if not is_prefill:
            batch = self.decode.schedule()
            if not batch:
                return None
        for req in admitted:
            assert req.table_idx not in self.table, "a row was handed out twice"
            self.table[req.table_idx] = []
        record = StepRecord(is_prefill, [r.uid for r in batch], [r.cached_len for r in batch],
                            [r.extend_len for r in batch], [r.uid for r in admitted])
        for req in batch:  # pages, and the step message's page-table update
            self.cache.grow(req)
            self.table[req.table_idx].extend(req.pages[req.pages_sent:])
            req.pages_sent = len(req.pages)
        tokens = self._forward(batch)
        self.steps.append(record)
        self._process(batch, tokens)
        if self.check_every_step:
            self.check()
        return record

    def run(self, max_steps: int = 10_000) -> None:
        """Step until nothing is left; a step that schedules nothing while requests wait fails."""
        for _ in range(max_steps):
            if not self.has_work:
                return
            assert self.step() is not None, "requests are waiting but nothing could be scheduled"
        raise AssertionError("the workload did not finish")

    def _forward(self, batch: list[Req]) -> list[int]:
        """The engine: write the new tokens' KV, check every slot attended, sample a token."""
        for req in batch:
            row, fps = self.table[req.table_idx], self._fingerprints(req)
            assert row == req.pages, f"req {req.uid}: engine row differs from req.pages"
            for pos in range(req.cached_len, req.device_len):
                self.kv[self._slot(row, pos)] = fps[pos]
        tokens = []
        for req in batch:
            row, fps = self.table[req.table_idx], self._fingerprints(req)
            for pos in range(req.device_len):
                assert self.kv.get(self._slot(row, pos)) == fps[pos], (
                    f"req {req.uid}: KV of position {pos} (page {row[pos // self.page_size]}) "
                    "was overwritten or never computed"
                )
            tokens.append(_mix(fps[req.device_len - 1], 7) % VOCAB)
        return tokens

    def _process(self, batch: list[Req], tokens: list[int]) -> None:
        """As `Scheduler._process`."""
        for req, token in zip(batch, tokens):
            if not complete_step(req, self.cache, self.decode):
                continue  # a chunk of the prompt
            req.input_ids.append(token)
            params = req.sampling_params
            if (token == EOS and not params.ignore_eos) or len(req.output_ids) >= params.max_tokens:
                self._finish(req)

    def _finish(self, req: Req) -> None:
        """As `Scheduler._finish`."""
        del self.live[req.uid]
        self.decode.remove(req)
        self.cache.release(req, cache=True)
        self._free_row(req)
        self.finished.append(req)

    def _free_row(self, req: Req) -> None:
        del self.table[req.table_idx]
        self.rows.free(req.table_idx)
        req.table_idx = -1

    def _slot(self, row: list[int], pos: int) -> int:
        return row[pos // self.page_size] * self.page_size + pos % self.page_size

    def _fingerprints(self, req: Req) -> list[int]:
        fps = self._fps.setdefault(req.uid, [])
        h = fps[-1] if fps else _FP_START
        for token in req.input_ids[len(fps):]:
            h = _mix(h, token)
            fps.append(h)
        return fps

    # ----- invariants
    def reserved_pages(self) -> int:
        """Pages the running requests may still allocate (up to their max_device_len)."""
        return sum(pages_for(r.max_device_len, self.page_size) - len(r.pages)
                   for r in self.running())

    def check(self) -> None:
        running = self.running()
        cache = self.cache
        cache.check_accounting(running)
        assert len(running) == self.rows.num_rows - self.rows.num_free == len(self.table)
        assert {r.uid for r in running} == {r.uid for r in self.live.values() if r.table_idx >= 0}
        free = set(cache.free_pages)
        cached = set(cache.prefix_cache.all_pages())
        for req in running:
            assert not free & set(req.pages), f"req {req.uid} points at free pages"
            assert req.owned_pages <= set(req.pages)
            assert set(req.pages) - req.owned_pages <= cached, (
                f"req {req.uid} points at pages that are neither its own nor cached")
        assert self.reserved_pages() <= cache.available_pages, (
            f"admission reservation broken: running requests may still need "
            f"{self.reserved_pages()} pages but only {cache.available_pages} can be handed out "
            f"(free {len(cache.free_pages)}, evictable {cache.prefix_cache.evictable_pages}, "
            f"protected {cache.prefix_cache.protected_pages})"
        )

    def check_idle(self) -> None:
        """Everything ended: nothing in use, every page free or cached, nothing locked."""
        assert not self.live and not self.has_work and not self.running()
        assert self.rows.num_free == self.rows.num_rows and not self.table
        cache = self.cache
        cache.check_accounting([])
        assert len(cache.free_pages) + cache.prefix_cache.cached_pages == cache.num_pages
        assert cache.prefix_cache.protected_pages == 0
        assert cache.available_pages == cache.num_pages
        for req in [*self.finished, *self.aborted]:
            assert req.table_idx == -1 and not req.owned_pages and req.cache_handle is None


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def _prompt(tag: int, n: int) -> list[int]:
    """A deterministic prompt of `n` tokens; different tags give different first tokens."""
    rng = random.Random(tag)
    return [1 + tag % (VOCAB - 1)] + _tokens(rng, n - 1)


# ------------------------------------------------------------------ random workload accounting
@pytest.mark.parametrize("cache_kind", ["radix", "naive"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_page_accounting_holds_after_every_step_of_a_random_workload(
    page_size: int, cache_kind: str, seed: int
) -> None:
    rng = random.Random(seed * 100 + page_size)
    sim = Sim(num_pages=128 // page_size, page_size=page_size, cache_kind=cache_kind,
              chunk_size=40, max_running=8)
    system_prompts = [_tokens(rng, n) for n in (0, 5, 17, 32, 40)]
    prompts: list[list[int]] = []
    to_submit = 70
    while to_submit or sim.has_work:
        for _ in range(min(to_submit, rng.choice([0, 0, 1, 2, 4]))):
            if prompts and rng.random() < 0.25:
                prompt = list(rng.choice(prompts))  # the same prompt again
            else:
                prompt = rng.choice(system_prompts) + _tokens(rng, rng.randint(1, 24))
            prompts.append(prompt)
            sim.submit(prompt, max_tokens=rng.randint(1, 24))
            to_submit -= 1
        if sim.live and rng.random() < 0.1:
            sim.abort(rng.choice(list(sim.live.values())))
        if sim.has_work:
            assert sim.step() is not None, "requests wait but nothing could be scheduled"
    sim.check_idle()
    # The workload exercised what it is meant to.
    assert len(sim.finished) + len(sim.aborted) == 70
    assert sim.aborted, "no request was aborted"
    assert max(s.prompt_tokens for s in sim.steps) <= 40
    assert any(len(set(s.uids)) > 1 for s in sim.steps if not s.is_prefill)
    if cache_kind == "radix":
        assert sim.cache.evicted_pages > 0, "the pool was never short: no eviction happened"
        assert any(r.prefix_hit_len > 0 for r in sim.finished)
    else:
        assert all(r.prefix_hit_len == 0 for r in [*sim.finished, *sim.aborted])
        assert sim.cache.evicted_pages == 0


# ---------------------------------------------------------------- duplicate prefix (upstream bug)
def _compute_prefill(batch: list[Req]) -> None:
    for req in batch:
        req.cached_len = req.device_len


@pytest.mark.parametrize("prompt_len", [5, 33, 48])
def test_duplicate_prefix_pages_stay_with_the_request_until_release(
    page_size: int, prompt_len: int
) -> None:
    prompt = _prompt(1, prompt_len)
    num_pages = 2 * pages_for(prompt_len + 4 * page_size, page_size) + 4
    cm = CacheManager(num_pages, page_size, create_prefix_cache("radix", page_size))
    pm = PrefillManager(cm, RowAllocator(4), chunk_size=4096, max_running=4)
    a = Req(0, list(prompt), prompt_len, SamplingParams(max_tokens=4), seed=0)
    b = Req(1, list(prompt), prompt_len, SamplingParams(max_tokens=4 * page_size), seed=1)
    pm.add(a)
    pm.add(b)
    batch, admitted = pm.schedule([])
    assert batch == admitted == [a, b]  # both admitted before either is in the cache
    assert a.cached_len == b.cached_len == 0
    for req in batch:
        cm.grow(req)
    _compute_prefill(batch)
    cm.cache_prefix(a)
    cm.cache_prefix(b)
    cm.check_accounting([a, b])

    aligned = prompt_len - prompt_len % page_size
    duplicates = b.pages[: aligned // page_size]
    assert not set(duplicates) & set(a.pages)
    assert set(duplicates) <= b.owned_pages, "b's duplicate pages must stay owned by b"
    assert not set(b.pages) & set(cm.free_pages)

    cm.release(a, cache=True)  # the first copy ends; b is still running
    cm.check_accounting([b])
    assert not set(b.pages) & set(cm.free_pages)
    # Hand out every page that can be handed out (evicting all unlocked cached prefixes).
    grabbed = cm.allocate(cm.available_pages)
    assert not set(grabbed) & set(b.pages), "pages b's row still points at were handed out"
    cm.free(grabbed)
    cm.check_accounting([b])

    b.input_ids.extend(range(1, 1 + b.sampling_params.max_tokens))  # b decodes to the end
    b.device_len = b.max_device_len - 1  # the last sampled token never gets KV
    cm.grow(b)
    assert not set(b.pages) & set(cm.free_pages)
    b.cached_len = b.device_len
    cm.release(b, cache=True)
    # When b ends, its copies are freed, or cached if the first copy was evicted meanwhile.
    assert set(duplicates) <= set(cm.free_pages) | set(cm.prefix_cache.all_pages())
    assert not b.owned_pages
    cm.check_accounting([])
    assert cm.prefix_cache.protected_pages == 0


def test_duplicate_prefix_computed_while_the_first_copy_ends_keeps_kv_intact(
    page_size: int,
) -> None:
    # b's prompt is chunked, so a (same prompt, one token) is cached and finished before b's
    # prompt is done; b's cache_prefix then finds the whole prefix already cached.
    prompt = _prompt(2, 4 * page_size)
    sim = Sim(num_pages=32, page_size=page_size, chunk_size=5 * page_size)
    a = sim.submit(prompt, max_tokens=1, ignore_eos=True)
    b = sim.submit(prompt, max_tokens=3 * page_size, ignore_eos=True)
    first = sim.step()
    assert first is not None and first.admitted == [a.uid, b.uid]
    assert a in sim.finished and sim.prefill.chunked is b
    sim.step()  # b's prompt completes; its prefix duplicates a's cached one
    assert b.cached_len == b.prompt_len and b.uid in sim.decode.running
    duplicates = b.pages[: len(prompt) // page_size]
    assert set(duplicates) <= b.owned_pages
    grabbed = sim.cache.allocate(sim.cache.available_pages)
    assert not set(grabbed) & set(b.pages)
    sim.cache.free(grabbed)
    sim.run()  # every step checks b's KV is intact
    assert b in sim.finished and len(b.output_ids) == 3 * page_size
    # b's copies end up free, or cached in place of a's evicted copy; never still owned.
    assert set(duplicates) <= set(sim.cache.free_pages) | set(sim.cache.prefix_cache.all_pages())
    sim.check_idle()


# ------------------------------------------------------------------------ admission reservation
def test_second_request_waits_until_the_first_finishes_when_the_pool_fits_one(
    page_size: int,
) -> None:
    prompt_len, max_tokens = 2 * page_size + 3, page_size + 2
    pages = pages_for(prompt_len + max_tokens, page_size)
    sim = Sim(num_pages=pages, page_size=page_size)
    a = sim.submit(_prompt(1, prompt_len), max_tokens, ignore_eos=True)
    b = sim.submit(_prompt(2, prompt_len), max_tokens, ignore_eos=True)
    first = sim.step()
    assert first is not None and first.admitted == [a.uid]
    while a.uid in sim.live:
        assert list(sim.prefill.waiting) == [b], "b must wait (not be dropped or failed)"
        assert b.table_idx == -1 and not b.pages
        sim.step()
    assert len(a.output_ids) == max_tokens
    admitted = sim.step()
    assert admitted is not None and admitted.admitted == [b.uid]
    sim.run()
    assert len(b.output_ids) == max_tokens and b in sim.finished
    sim.check_idle()


def test_admission_counts_pages_reserved_by_running_requests(page_size: int) -> None:
    # Right after a's admission the free list could hold b's prompt, but not both requests'
    # prompt + max_tokens: b waits for a.
    sim = Sim(num_pages=3, page_size=page_size)
    a = sim.submit(_prompt(1, 1), max_tokens=2 * page_size, ignore_eos=True)
    b = sim.submit(_prompt(2, 1), max_tokens=page_size, ignore_eos=True)
    step = sim.step()
    assert step is not None and step.admitted == [a.uid]
    assert len(sim.cache.free_pages) >= 1 and b.table_idx == -1
    sim.run()
    assert [r.uid for r in sim.finished] == [a.uid, b.uid]
    sim.check_idle()


def test_admitted_request_grows_to_max_device_len_by_evicting_cached_prefixes(
    page_size: int,
) -> None:
    num_pages = 12
    sim = Sim(num_pages=num_pages, page_size=page_size)
    for tag in range(4):  # leave unlocked cached prefixes all over the pool
        sim.submit(_prompt(10 + tag, 2 * page_size), max_tokens=page_size, ignore_eos=True)
    sim.run()
    assert sim.cache.prefix_cache.evictable_pages > 0
    assert len(sim.cache.free_pages) < num_pages
    evicted_before = sim.cache.evicted_pages

    total = num_pages * page_size  # the whole pool
    big = sim.submit(_prompt(99, page_size + 1), max_tokens=total - page_size - 1,
                     ignore_eos=True)
    step = sim.step()
    assert step is not None and step.admitted == [big.uid]
    sim.run()  # grows one token a step up to max_device_len, checking accounting each step
    assert big in sim.finished and len(big.output_ids) == big.sampling_params.max_tokens
    assert big.device_len == big.max_device_len - 1  # the last sampled token has no KV
    assert sim.cache.evicted_pages > evicted_before
    sim.check_idle()


def test_admitted_request_can_grow_directly_to_max_device_len(page_size: int) -> None:
    sim = Sim(num_pages=8, page_size=page_size)
    for tag in range(3):
        sim.submit(_prompt(20 + tag, 2 * page_size + 1), max_tokens=1, ignore_eos=True)
    sim.run()
    req = sim.submit(_prompt(30, 3), max_tokens=8 * page_size - 3)
    batch, admitted = sim.prefill.schedule([])
    assert admitted == [req]
    req.device_len = req.max_device_len
    sim.cache.grow(req)  # must not raise: the reservation covered it
    assert len(req.pages) == pages_for(req.max_device_len, page_size) == 8
    sim.cache.check_accounting([req])


def test_admitted_request_can_grow_after_its_duplicate_prefix_locks_cached_pages(
    page_size: int,
) -> None:
    """a and b share a prompt and are admitted together; b's prompt is chunked.

    a finishes on its first token, so its cached prompt becomes evictable and is counted as
    available when c is admitted. b's cache_prefix then finds that prompt already cached, keeps
    its own duplicate pages (its row points at them) and also locks the cached copy, so the
    cached copy is no longer available, though c's admission counted on it. b and c together
    may then need more pages than exist (without the per-step check, `CacheManager.grow` raises
    RuntimeError "cannot evict" a few decode steps later; in the scheduler that kills every
    request).
    """
    prompt = _prompt(3, 4 * page_size)
    a_pages = pages_for(len(prompt) + 1, page_size)
    b_pages = pages_for(len(prompt) + 4 * page_size, page_size)
    sim = Sim(num_pages=a_pages + b_pages, page_size=page_size, chunk_size=5 * page_size)
    a = sim.submit(prompt, max_tokens=1, ignore_eos=True)
    b = sim.submit(prompt, max_tokens=4 * page_size, ignore_eos=True)
    first = sim.step()
    assert first is not None and first.admitted == [a.uid, b.uid]
    assert a in sim.finished and sim.prefill.chunked is b
    c = sim.submit(_prompt(4, 1), max_tokens=5 * page_size - 1, ignore_eos=True)
    second = sim.step()  # b's prompt completes; c is admitted on a's evictable pages
    assert second is not None and second.admitted == [c.uid]
    sim.run()  # every step checks reserved <= available; grow must never run dry
    assert b in sim.finished and c in sim.finished
    sim.check_idle()


# ------------------------------------------------------------------------------ chunked prefill
@pytest.mark.parametrize("chunk_size", [24, 37])
def test_long_prompt_is_split_across_steps_and_continues_first(
    page_size: int, chunk_size: int
) -> None:
    sim = Sim(num_pages=256 // page_size, page_size=page_size, chunk_size=chunk_size)
    long = sim.submit(_prompt(1, 100), max_tokens=3, ignore_eos=True)
    short = sim.submit(_prompt(2, 30), max_tokens=3, ignore_eos=True)
    sim.step()
    late = sim.submit(_prompt(3, 50), max_tokens=3, ignore_eos=True)
    sim.run()
    sim.check_idle()

    prefill_steps = [s for s in sim.steps if s.is_prefill]
    for step in sim.steps:
        assert step.prompt_tokens <= chunk_size
    # The long prompt is computed in ceil(100 / chunk) steps, contiguous, each leading its batch.
    chunks = [(s, s.uids.index(long.uid)) for s in prefill_steps if long.uid in s.uids]
    assert len(chunks) == -(-100 // chunk_size)
    position = 0
    for step, index in chunks:
        assert index == 0, "the chunked request must continue first"
        assert step.starts[0] == position
        position += step.extend_lens[0]
    assert position == 100
    for step, _ in chunks[:-1]:
        assert step.prompt_tokens == chunk_size, "a chunk uses the whole budget"
    # While a request is chunked, steps are prefill steps and it continues in the next one.
    for prev, nxt in zip(sim.steps, sim.steps[1:]):
        if prev.is_prefill and sum(prev.extend_lens) == chunk_size:
            last = prev.uids[-1]
            req = next(r for r in [long, short, late] if r.uid == last)
            if prev.starts[-1] + prev.extend_lens[-1] < req.prompt_len:
                assert nxt.is_prefill and nxt.uids[0] == last
    # Each prompt is computed exactly once, in total.
    for req in (long, short, late):
        computed = sum(s.extend_lens[s.uids.index(req.uid)] for s in prefill_steps
                       if req.uid in s.uids)
        assert computed == req.prompt_len - req.prefix_hit_len
        assert len(req.output_ids) == 3


def test_chunked_request_produces_no_token_until_its_prompt_is_done(page_size: int) -> None:
    sim = Sim(num_pages=64, page_size=page_size, chunk_size=10)
    req = sim.submit(_prompt(1, 35), max_tokens=2, ignore_eos=True)
    for expected_cached in (10, 20, 30):
        sim.step()
        assert sim.prefill.chunked is req and req.cached_len == expected_cached
        assert req.output_ids == [] and req.uid not in sim.decode.running
    sim.step()
    assert sim.prefill.chunked is None and req.cached_len == 35
    assert len(req.output_ids) == 1 and req.uid in sim.decode.running
    sim.run()
    sim.check_idle()


# --------------------------------------------------------------------------------- prefix hits
@pytest.mark.parametrize("first_finished", [True, False], ids=["first-done", "first-running"])
@pytest.mark.parametrize("extra", [0, 1, 5], ids=lambda e: f"len2p+{e}")
def test_same_prompt_hits_the_page_aligned_prefix_and_computes_at_least_one_token(
    page_size: int, first_finished: bool, extra: int
) -> None:
    prompt_len = 2 * page_size + extra
    prompt = _prompt(5, prompt_len)
    sim = Sim(num_pages=64, page_size=page_size)
    first = sim.submit(prompt, max_tokens=4, ignore_eos=True)
    if first_finished:
        sim.run()
    else:
        sim.step()
        assert first.uid in sim.decode.running
    second = sim.submit(prompt, max_tokens=4, ignore_eos=True)
    step = sim.step()
    expected = (prompt_len - 1) // page_size * page_size
    assert step is not None and step.admitted == [second.uid]
    assert second.prefix_hit_len == expected
    assert step.starts[step.uids.index(second.uid)] == expected
    assert step.extend_lens[step.uids.index(second.uid)] == prompt_len - expected >= 1
    # Both rows point at the same cached pages for the shared prefix.
    assert second.pages[: expected // page_size] == first.pages[: expected // page_size]
    sim.run()
    assert second.output_ids == first.output_ids  # the shared KV was intact
    sim.check_idle()


@pytest.mark.parametrize("first_finished", [True, False], ids=["first-done", "first-running"])
def test_naive_cache_never_hits(page_size: int, first_finished: bool) -> None:
    prompt = _prompt(6, 3 * page_size + 1)
    sim = Sim(num_pages=64, page_size=page_size, cache_kind="naive")
    first = sim.submit(prompt, max_tokens=3, ignore_eos=True)
    if first_finished:
        sim.run()
    else:
        sim.step()
    second = sim.submit(prompt, max_tokens=3, ignore_eos=True)
    step = sim.step()
    assert step is not None and step.admitted == [second.uid]
    assert second.prefix_hit_len == 0 and step.starts[step.uids.index(second.uid)] == 0
    assert step.extend_lens[step.uids.index(second.uid)] == len(prompt)
    assert sim.cache.prefix_cache.cached_pages == 0
    sim.run()
    assert second.output_ids == first.output_ids
    sim.check_idle()


# ------------------------------------------------------------------------------------ eviction
def test_evicted_pages_counts_pages_taken_back_from_the_prefix_cache(page_size: int) -> None:
    sim = Sim(num_pages=10, page_size=page_size)
    for tag in range(3):
        sim.submit(_prompt(40 + tag, 2 * page_size), max_tokens=1, ignore_eos=True)
    sim.run()
    cache = sim.cache
    cached = cache.prefix_cache.cached_pages
    assert cached == 6 and cache.evicted_pages == 0

    free = len(cache.free_pages)
    pages = cache.allocate(free)  # fits in the free list: no eviction
    assert len(pages) == free and cache.evicted_pages == 0
    more = cache.allocate(3)  # needs eviction
    assert len(more) == 3
    evicted = cached - cache.prefix_cache.cached_pages
    assert evicted >= 3 and cache.evicted_pages == evicted
    cache.free(pages + more)
    cache.check_accounting([])

    # Through the scheduler path: a request whose pages only fit by evicting.
    before = cache.evicted_pages
    sim.submit(_prompt(50, 8 * page_size), max_tokens=2 * page_size, ignore_eos=True)
    sim.run()
    assert cache.evicted_pages > before
    sim.check_idle()


def test_no_eviction_when_the_pool_is_large_enough(page_size: int) -> None:
    sim = Sim(num_pages=200, page_size=page_size)
    for tag in range(5):
        sim.submit(_prompt(tag, 20), max_tokens=5, ignore_eos=True)
    sim.run()
    assert sim.cache.evicted_pages == 0
    sim.check_idle()
