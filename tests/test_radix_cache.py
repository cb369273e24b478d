"""Tests for the prefix caches in `minisgl_backend.kvcache` (pure Python, no torch)."""

from __future__ import annotations

import random

import pytest

from minisgl_backend.kvcache import (
    BasePrefixCache,
    CacheHandle,
    InsertResult,
    MatchResult,
    NaivePrefixCache,
    RadixPrefixCache,
    create_prefix_cache,
)

PAGE_SIZES = [1, 16]


@pytest.fixture(params=PAGE_SIZES, ids=lambda ps: f"page{ps}")
def page_size(request: pytest.FixtureRequest) -> int:
    """The page size under test."""
    return request.param


@pytest.fixture
def cache(page_size: int) -> RadixPrefixCache:
    """An empty radix cache with the page size under test."""
    return RadixPrefixCache(page_size)


def tokens(page_size: int, *page_tags: int) -> list[int]:
    """A token sequence with one full page per tag; pages with different tags differ."""
    out: list[int] = []
    for tag in page_tags:
        out.extend(tag * 1000 + i for i in range(page_size))
    return out


def check(cache: BasePrefixCache) -> None:
    """Assert the cache's invariants and the page accounting identity."""
    cache.check_invariants()
    pages = cache.all_pages()
    assert len(pages) == len(set(pages))
    assert cache.evictable_pages + cache.protected_pages == cache.cached_pages == len(pages)


# --------------------------------------------------------------------------------- matching
def test_match_on_empty_tree_returns_nothing(cache: RadixPrefixCache, page_size: int) -> None:
    for query in ([], tokens(page_size, 1, 2)):
        result = cache.match(query)
        assert isinstance(result, MatchResult)
        assert result.cached_len == 0
        assert result.pages == []
        assert result.handle.cached_len == 0
    assert cache.cached_pages == 0
    check(cache)


def test_lock_and_unlock_of_root_handle_are_noops(cache: RadixPrefixCache, page_size: int) -> None:
    cache.insert(tokens(page_size, 1), [5])
    root = cache.match([]).handle
    cache.lock(root)
    assert cache.protected_pages == 0 and cache.evictable_pages == 1
    cache.unlock(root)
    cache.unlock(root)
    assert cache.protected_pages == 0 and cache.evictable_pages == 1
    check(cache)


def test_match_shorter_than_a_page_returns_nothing() -> None:
    cache = RadixPrefixCache(16)
    seq = tokens(16, 1, 2)
    cache.insert(seq, [3, 4])
    result = cache.match(seq[:15])
    assert (result.cached_len, result.pages) == (0, [])
    assert cache.match(seq[:16]).pages == [3]
    check(cache)


def test_insert_then_exact_match_returns_same_pages(
    cache: RadixPrefixCache, page_size: int
) -> None:
    seq = tokens(page_size, 1, 2, 3)
    inserted = cache.insert(seq, [10, 11, 12])
    assert isinstance(inserted, InsertResult)
    assert inserted.already_cached_len == 0
    assert inserted.handle.cached_len == len(seq)
    result = cache.match(seq)
    assert result.cached_len == len(seq)
    assert result.pages == [10, 11, 12]
    assert result.handle.cached_len == len(seq)
    assert cache.evictable_pages == 3 and cache.protected_pages == 0
    check(cache)


def test_match_accepts_tuples_and_longer_queries(cache: RadixPrefixCache, page_size: int) -> None:
    seq = tokens(page_size, 1, 2)
    cache.insert(tuple(seq), (7, 8))
    result = cache.match(tuple(seq + tokens(page_size, 9)))
    assert result.cached_len == 2 * page_size
    assert result.pages == [7, 8]
    check(cache)


def test_partial_match_is_aligned_down_to_page_size(
    cache: RadixPrefixCache, page_size: int
) -> None:
    seq = tokens(page_size, 1, 2, 3)
    cache.insert(seq, [10, 11, 12])
    # Mismatch on the last token of the second page: only the first page matches.
    query = list(seq)
    query[2 * page_size - 1] = -1
    result = cache.match(query)
    assert result.cached_len == page_size
    assert result.pages == [10]
    # A query that stops in the middle of the third page matches two whole pages.
    truncated = seq[: 2 * page_size + page_size // 2]
    result = cache.match(truncated)
    assert result.cached_len == 2 * page_size
    assert result.pages == [10, 11]
    check(cache)


def test_partial_match_inside_a_page_discards_the_partial_page() -> None:
    cache = RadixPrefixCache(16)
    seq = tokens(16, 1, 2, 3)
    cache.insert(seq, [10, 11, 12])
    query = list(seq)
    query[20] = -1  # 4 tokens into the second page
    result = cache.match(query)
    assert result.cached_len == 16
    assert result.pages == [10]
    check(cache)


def test_match_ending_inside_edge_splits_node_and_both_halves_keep_pages(
    cache: RadixPrefixCache, page_size: int
) -> None:
    seq = tokens(page_size, 1, 2, 3, 4)
    cache.insert(seq, [10, 11, 12, 13])
    prefix = cache.match(seq[: 2 * page_size])
    assert prefix.cached_len == 2 * page_size
    assert prefix.pages == [10, 11]
    check(cache)
    # Both halves still serve their pages.
    assert cache.match(seq).pages == [10, 11, 12, 13]
    assert cache.match(seq[:page_size]).pages == [10]
    check(cache)
    # The split node is a real node: locking it protects exactly the upper half.
    cache.lock(prefix.handle)
    assert cache.protected_pages == 2 and cache.evictable_pages == 2
    assert sorted(cache.evict(2)) == [12, 13]
    with pytest.raises(RuntimeError):
        cache.evict(1)
    assert cache.match(seq).pages == [10, 11]
    check(cache)


def test_split_of_a_locked_node_keeps_locks_consistent(
    cache: RadixPrefixCache, page_size: int
) -> None:
    seq = tokens(page_size, 1, 2, 3, 4)
    handle = cache.insert(seq, [10, 11, 12, 13]).handle
    cache.lock(handle)
    cache.match(seq[: 2 * page_size])  # splits the locked edge
    assert cache.protected_pages == 4 and cache.evictable_pages == 0
    check(cache)
    cache.unlock(handle)
    assert cache.protected_pages == 0 and cache.evictable_pages == 4
    check(cache)
    assert sorted(cache.evict(4)) == [10, 11, 12, 13]
    assert cache.cached_pages == 0
    check(cache)


# ---------------------------------------------------------------------------------- insert
def test_insert_with_shared_prefix_reports_already_cached_len_and_takes_only_new_pages(
    cache: RadixPrefixCache, page_size: int
) -> None:
    first = tokens(page_size, 1, 2, 3)
    cache.insert(first, [1, 2, 3])
    second = tokens(page_size, 1, 2, 4, 5)
    result = cache.insert(second, [7, 8, 9, 10])
    assert result.already_cached_len == 2 * page_size
    assert result.handle.cached_len == len(second)
    # The duplicates 7 and 8 stay with the caller; the cache keeps its own 1 and 2.
    assert sorted(cache.all_pages()) == [1, 2, 3, 9, 10]
    assert cache.match(second).pages == [1, 2, 9, 10]
    assert cache.match(first).pages == [1, 2, 3]
    check(cache)


def test_insert_of_cached_sequence_takes_nothing(cache: RadixPrefixCache, page_size: int) -> None:
    seq = tokens(page_size, 1, 2, 3)
    cache.insert(seq, [1, 2, 3])
    again = cache.insert(seq, [4, 5, 6])
    assert again.already_cached_len == len(seq)
    assert again.handle.cached_len == len(seq)
    # A cached prefix ending inside an edge is also fully cached (and splits the edge).
    prefix = cache.insert(seq[:page_size], [7])
    assert prefix.already_cached_len == page_size
    assert prefix.handle.cached_len == page_size
    assert sorted(cache.all_pages()) == [1, 2, 3]
    check(cache)


def test_insert_handle_locks_the_whole_inserted_sequence(
    cache: RadixPrefixCache, page_size: int
) -> None:
    cache.insert(tokens(page_size, 1, 2), [1, 2])
    result = cache.insert(tokens(page_size, 1, 2, 3), [5, 6, 3])
    cache.lock(result.handle)
    assert cache.protected_pages == 3 and cache.evictable_pages == 0
    cache.unlock(result.handle)
    assert cache.protected_pages == 0 and cache.evictable_pages == 3
    check(cache)


def test_insert_differing_inside_a_page_shares_only_whole_pages() -> None:
    cache = RadixPrefixCache(16)
    cache.insert(tokens(16, 1, 2), [1, 2])
    other = tokens(16, 1, 2)
    other[20] = -1
    result = cache.insert(other, [5, 6])
    assert result.already_cached_len == 16
    assert sorted(cache.all_pages()) == [1, 2, 6]
    assert cache.match(other).pages == [1, 6]
    check(cache)


@pytest.mark.parametrize(
    ("num_tokens", "num_pages"),
    [(15, 1), (17, 1), (32, 1), (32, 3), (16, 0), (0, 1)],
)
def test_insert_validation_errors_at_page16(num_tokens: int, num_pages: int) -> None:
    cache = RadixPrefixCache(16)
    with pytest.raises(ValueError):
        cache.insert(list(range(num_tokens)), list(range(num_pages)))
    assert cache.cached_pages == 0
    check(cache)


def test_insert_validation_errors_pages_mismatch(cache: RadixPrefixCache, page_size: int) -> None:
    seq = tokens(page_size, 1, 2)
    with pytest.raises(ValueError, match="len\\(pages\\)"):
        cache.insert(seq, [1])
    with pytest.raises(ValueError, match="len\\(pages\\)"):
        cache.insert(seq, [1, 2, 3])
    assert cache.cached_pages == 0
    empty = cache.insert([], [])
    assert empty.already_cached_len == 0 and empty.handle.cached_len == 0
    check(cache)


def test_invalid_page_size_is_rejected() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            RadixPrefixCache(bad)  # type: ignore[arg-type]


def test_page_size_64_insert_match_evict() -> None:
    cache = RadixPrefixCache(64)
    seq = tokens(64, 1, 2, 3)
    cache.insert(seq, [1, 2, 3])
    assert cache.insert(tokens(64, 1, 2, 4), [7, 8, 4]).already_cached_len == 128
    assert cache.match(seq[:150]).pages == [1, 2]
    assert cache.match(seq[:63]).cached_len == 0
    assert sorted(cache.evict(4)) == [1, 2, 3, 4]
    check(cache)


# ------------------------------------------------------------------------- locking/evict
def test_lock_protects_from_eviction(cache: RadixPrefixCache, page_size: int) -> None:
    seq = tokens(page_size, 1, 2)
    cache.insert(seq, [1, 2])
    handle = cache.match(seq).handle
    cache.lock(handle)
    assert cache.protected_pages == 2 and cache.evictable_pages == 0
    with pytest.raises(RuntimeError, match="short by 1"):
        cache.evict(1)
    assert sorted(cache.all_pages()) == [1, 2]
    check(cache)


def test_evict_more_than_evictable_raises_and_evicts_nothing(
    cache: RadixPrefixCache, page_size: int
) -> None:
    cache.insert(tokens(page_size, 1, 2), [1, 2])
    cache.insert(tokens(page_size, 3), [3])
    cache.lock(cache.match(tokens(page_size, 3)).handle)
    with pytest.raises(RuntimeError, match="short by 1"):
        cache.evict(3)
    assert sorted(cache.all_pages()) == [1, 2, 3]
    assert cache.evictable_pages == 2 and cache.protected_pages == 1
    check(cache)


def test_unlock_makes_it_evictable_again(cache: RadixPrefixCache, page_size: int) -> None:
    seq = tokens(page_size, 1, 2)
    cache.insert(seq, [1, 2])
    handle = cache.match(seq).handle
    cache.lock(handle)
    cache.unlock(handle)
    assert cache.protected_pages == 0 and cache.evictable_pages == 2
    assert sorted(cache.evict(2)) == [1, 2]
    assert cache.cached_pages == 0
    check(cache)


def test_nested_locks_need_as_many_unlocks(cache: RadixPrefixCache, page_size: int) -> None:
    seq = tokens(page_size, 1)
    cache.insert(seq, [1])
    handle = cache.match(seq).handle
    cache.lock(handle)
    cache.lock(handle)
    cache.unlock(handle)
    assert cache.protected_pages == 1
    cache.unlock(handle)
    assert cache.evictable_pages == 1
    check(cache)


def test_unlock_of_unlocked_handle_raises(cache: RadixPrefixCache, page_size: int) -> None:
    seq = tokens(page_size, 1)
    handle = cache.insert(seq, [1]).handle
    with pytest.raises(RuntimeError):
        cache.unlock(handle)
    assert cache.evictable_pages == 1
    check(cache)


def test_lock_rejects_foreign_and_stale_handles(cache: RadixPrefixCache, page_size: int) -> None:
    with pytest.raises(TypeError):
        cache.lock(CacheHandle(0))
    seq = tokens(page_size, 1)
    handle = cache.insert(seq, [1]).handle
    cache.evict(1)
    with pytest.raises(ValueError, match="stale"):
        cache.lock(handle)
    check(cache)


def test_locking_a_leaf_protects_its_ancestors(cache: RadixPrefixCache, page_size: int) -> None:
    leaf_a = tokens(page_size, 1, 2)
    leaf_b = tokens(page_size, 1, 3)
    cache.insert(leaf_a, [1, 2])
    cache.insert(leaf_b, [9, 3])  # splits: shared parent (page 1) with children 2 and 3
    cache.lock(cache.match(leaf_a).handle)
    assert cache.protected_pages == 2 and cache.evictable_pages == 1
    assert cache.evict(1) == [3]
    with pytest.raises(RuntimeError):
        cache.evict(1)  # the shared parent is protected through its locked child
    assert cache.match(leaf_a).pages == [1, 2]
    check(cache)


def test_lru_evicts_least_recently_matched_leaf_first(
    cache: RadixPrefixCache, page_size: int
) -> None:
    for tag in (1, 2, 3):
        cache.insert(tokens(page_size, tag), [tag])
    cache.match(tokens(page_size, 1))  # refresh the oldest entry
    assert cache.evict(1) == [2]
    assert cache.evict(1) == [3]
    assert cache.evict(1) == [1]
    assert cache.cached_pages == 0
    check(cache)


def test_lru_refresh_by_insert_and_partial_match(cache: RadixPrefixCache, page_size: int) -> None:
    cache.insert(tokens(page_size, 1, 2), [1, 2])
    cache.insert(tokens(page_size, 3), [3])
    cache.insert(tokens(page_size, 1, 2), [7, 8])  # re-insert refreshes the first leaf
    assert cache.evict(1) == [3]
    assert sorted(cache.evict(1)) == [1, 2]
    check(cache)


def test_evicting_leaf_makes_its_parent_a_candidate(
    cache: RadixPrefixCache, page_size: int
) -> None:
    cache.insert(tokens(page_size, 1, 2), [1, 2])
    cache.insert(tokens(page_size, 1, 3), [9, 3])  # parent page 1, children pages 2 and 3
    cache.insert(tokens(page_size, 4), [4])  # newest, unrelated leaf
    assert cache.evict(1) == [2]
    assert cache.evict(1) == [3]
    # The parent became a leaf and is older than the unrelated leaf.
    assert cache.evict(1) == [1]
    assert cache.all_pages() == [4]
    check(cache)


def test_evict_cascades_to_parent_within_one_call(cache: RadixPrefixCache, page_size: int) -> None:
    cache.insert(tokens(page_size, 1, 2), [1, 2])
    cache.insert(tokens(page_size, 1, 3), [9, 3])
    cache.insert(tokens(page_size, 4), [4])
    assert cache.evict(3) == [2, 3, 1]
    assert cache.match(tokens(page_size, 4)).pages == [4]
    check(cache)


def test_evict_returns_exactly_the_pages_of_evicted_nodes(
    cache: RadixPrefixCache, page_size: int
) -> None:
    cache.insert(tokens(page_size, 1, 2, 3), [1, 2, 3])
    cache.insert(tokens(page_size, 4), [4])
    assert cache.cached_pages == 4
    # Whole nodes are evicted: asking for one page frees the oldest 3-page leaf.
    assert cache.evict(1) == [1, 2, 3]
    assert cache.cached_pages == 1 and cache.evictable_pages == 1
    assert cache.match(tokens(page_size, 1)).cached_len == 0
    assert cache.evict(0) == []
    with pytest.raises(ValueError):
        cache.evict(-1)
    assert cache.evict(1) == [4]
    assert cache.cached_pages == 0 and cache.all_pages() == []
    check(cache)


# ------------------------------------------------------------------ randomised workload
def _oracle_len(oracle: dict[tuple[int, ...], int], seq: list[int], page_size: int) -> int:
    """Number of leading whole pages of `seq` present in the oracle."""
    count = 0
    while (count + 1) * page_size <= len(seq) and tuple(seq[: (count + 1) * page_size]) in oracle:
        count += 1
    return count


def _oracle_pages(oracle: dict[tuple[int, ...], int], seq: list[int], page_size: int) -> list[int]:
    """Page ids the oracle expects a match of `seq` to return."""
    count = _oracle_len(oracle, seq, page_size)
    return [oracle[tuple(seq[: (i + 1) * page_size])] for i in range(count)]


class _Workload:
    """A random scheduler-like driver with an independent model of what the cache holds."""

    def __init__(self, page_size: int, seed: int) -> None:
        self.ps = page_size
        self.rng = random.Random(seed)
        self.cache = RadixPrefixCache(page_size)
        self.total_pages = 20_000
        self.free: set[int] = set(range(self.total_pages))
        self.oracle: dict[tuple[int, ...], int] = {}  # page-aligned prefix -> page id
        self.prefix_of: dict[int, tuple[int, ...]] = {}
        self.seqs: list[list[int]] = []
        self.locked: list[tuple[list[int], CacheHandle]] = []

    def random_seq(self, aligned: bool) -> list[int]:
        rng, ps = self.rng, self.ps
        seq: list[int] = []
        if self.seqs and rng.random() < 0.7:
            base = rng.choice(self.seqs)
            seq = base[: rng.randint(0, len(base))]
        seq = seq + [rng.randrange(3) for _ in range(rng.randint(1, 4 * ps))]
        if aligned:
            seq = seq[: len(seq) - len(seq) % ps] or [rng.randrange(3) for _ in range(ps)]
        return seq

    def do_insert(self) -> None:
        seq = self.random_seq(aligned=True)
        pages = [self.free.pop() for _ in range(len(seq) // self.ps)]
        expected = _oracle_len(self.oracle, seq, self.ps)
        result = self.cache.insert(seq, pages)
        assert result.already_cached_len == expected * self.ps
        assert result.handle.cached_len == len(seq)
        self.free.update(pages[:expected])  # duplicates stay with (and are freed by) the caller
        for i in range(expected, len(pages)):
            prefix = tuple(seq[: (i + 1) * self.ps])
            self.oracle[prefix] = pages[i]
            self.prefix_of[pages[i]] = prefix
        self.seqs.append(seq)
        assert self.cache.match(seq).pages == _oracle_pages(self.oracle, seq, self.ps)

    def do_match(self) -> None:
        seq = self.random_seq(aligned=False)
        expected = _oracle_pages(self.oracle, seq, self.ps)
        result = self.cache.match(seq)
        assert result.pages == expected
        assert result.cached_len == len(expected) * self.ps == result.handle.cached_len

    def do_lock(self) -> None:
        seq = self.random_seq(aligned=False)
        result = self.cache.match(seq)
        before = self.cache.protected_pages
        self.cache.lock(result.handle)
        assert self.cache.protected_pages >= before
        self.locked.append((seq[: result.cached_len], result.handle))

    def do_unlock(self) -> None:
        if not self.locked:
            return
        _, handle = self.locked.pop(self.rng.randrange(len(self.locked)))
        self.cache.unlock(handle)

    def do_evict(self) -> None:
        evictable = self.cache.evictable_pages
        want = self.rng.randint(0, evictable + 2)
        if want > evictable:
            before = sorted(self.cache.all_pages())
            with pytest.raises(RuntimeError, match=f"short by {want - evictable}"):
                self.cache.evict(want)
            assert sorted(self.cache.all_pages()) == before
            return
        freed = self.cache.evict(want)
        assert len(freed) >= want and len(set(freed)) == len(freed)
        assert self.cache.evictable_pages == evictable - len(freed)
        for page in freed:
            assert page not in self.free
            del self.oracle[self.prefix_of.pop(page)]
        self.free.update(freed)
        for seq, handle in self.locked:  # locked prefixes survive eviction
            assert _oracle_len(self.oracle, seq, self.ps) * self.ps == handle.cached_len

    def check(self) -> None:
        check(self.cache)
        held = self.cache.all_pages()
        assert set(held) == set(self.oracle.values())
        assert self.free.isdisjoint(held)
        assert len(self.free) + len(held) == self.total_pages

    def run(self, steps: int) -> None:
        ops = [self.do_insert, self.do_match, self.do_lock, self.do_unlock, self.do_evict]
        for _ in range(steps):
            self.rng.choices(ops, weights=[4, 3, 2, 2, 2])[0]()
            self.check()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("ps", [1, 4, 16])
def test_random_workload_keeps_accounting_invariant_after_every_operation(
    ps: int, seed: int
) -> None:
    work = _Workload(ps, seed)
    work.run(400)
    while work.locked:
        work.do_unlock()
        work.check()
    assert work.cache.protected_pages == 0
    freed = work.cache.evict(work.cache.evictable_pages)
    assert len(set(freed)) == len(freed)
    work.free.update(freed)
    assert work.cache.cached_pages == 0 and work.cache.all_pages() == []
    assert len(work.free) == work.total_pages  # no page leaked or double-counted
    check(work.cache)


def test_check_invariants_detects_corrupted_accounting(
    cache: RadixPrefixCache, page_size: int
) -> None:
    cache.insert(tokens(page_size, 1, 2), [1, 2])
    cache._evictable += 1  # noqa: SLF001 - deliberate corruption
    with pytest.raises(AssertionError):
        cache.check_invariants()


def test_check_invariants_detects_duplicate_page_ids(
    cache: RadixPrefixCache, page_size: int
) -> None:
    cache.insert(tokens(page_size, 1), [1])
    cache.insert(tokens(page_size, 2), [1])  # caller bug: page 1 handed over twice
    with pytest.raises(AssertionError, match="twice"):
        cache.check_invariants()


# --------------------------------------------------------------------------- naive cache
def test_naive_cache_never_matches_and_takes_nothing(page_size: int) -> None:
    cache = NaivePrefixCache(page_size)
    seq = tokens(page_size, 1, 2)
    result = cache.insert(seq, [1, 2])
    assert result.already_cached_len == len(seq)
    match = cache.match(seq)
    assert (match.cached_len, match.pages) == (0, [])
    cache.lock(match.handle)
    cache.unlock(match.handle)
    assert cache.evictable_pages == cache.protected_pages == cache.cached_pages == 0
    assert cache.all_pages() == []
    assert cache.evict(0) == []
    with pytest.raises(RuntimeError, match="short by 3"):
        cache.evict(3)
    cache.check_invariants()


def test_naive_cache_validates_insert(page_size: int) -> None:
    cache = NaivePrefixCache(page_size)
    with pytest.raises(ValueError):
        cache.insert(tokens(page_size, 1), [1, 2])
    if page_size > 1:
        with pytest.raises(ValueError):
            cache.insert(list(range(page_size - 1)), [])


# -------------------------------------------------------------------------------- factory
@pytest.mark.parametrize(
    ("kind", "cls"), [("radix", RadixPrefixCache), ("naive", NaivePrefixCache)]
)
def test_create_prefix_cache_builds_the_requested_kind(
    kind: str, cls: type[BasePrefixCache], page_size: int
) -> None:
    cache = create_prefix_cache(kind, page_size)
    assert type(cache) is cls
    assert cache.page_size == page_size


def test_create_prefix_cache_rejects_unknown_kind_naming_allowed_values() -> None:
    with pytest.raises(ValueError, match="radix") as info:
        create_prefix_cache("lru", 1)
    assert "naive" in str(info.value) and "lru" in str(info.value)


def test_create_prefix_cache_rejects_bad_page_size() -> None:
    with pytest.raises(ValueError, match="page_size"):
        create_prefix_cache("radix", 0)
