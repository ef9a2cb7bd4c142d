"""Tests of the prefix cache: hand-worked cases plus a stateful check against a brute-force model
(a dict of cached page-aligned prefixes with its own LRU) over a small page pool."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from infer.cache.page_allocator import OutOfPages, PageAllocator, SequencePages
from infer.cache.prefix_cache import PrefixCache




def prefill(alloc: PageAllocator, cache: PrefixCache, tokens: list[int]) -> SequencePages:
    """One request as an engine runs it: match, take the pages, compute the rest, insert."""
    pages = cache.lookup(tokens)
    alloc.incref(pages)
    seq = SequencePages(alloc.page_size, list(pages), len(pages) * alloc.page_size)
    alloc.reserve(seq, len(tokens))
    seq.num_tokens = len(tokens)
    cache.insert(tokens, seq.pages)
    return seq


def cached(cache: PrefixCache) -> dict[tuple[int, ...], int]:
    """{page-aligned token prefix: page} of everything in the tree."""
    out, stack = {}, [((), cache._root)]
    while stack:
        prefix, node = stack.pop()
        for key, child in node.children.items():
            out[prefix + key] = child.page
            stack.append((prefix + key, child))
    return out


# -- hand-worked cases ----------------------------------------------------------------------------

def test_match_partial_prefixes():
    alloc = PageAllocator(8, 4)
    cache = PrefixCache(alloc)
    tokens = list(range(10))  # pages [0:4], [4:8], and a partial [8:10] that is not cached
    seq = prefill(alloc, cache, tokens)
    assert seq.pages == [0, 1, 2] and len(cache) == 2
    assert cache.match(tokens) == [0, 1]
    assert cache.match(tokens[:7]) == [0]  # the second page is not whole: rounded down
    assert cache.match(tokens[:8] + [99]) == [0, 1]
    assert cache.match([0, 1, 2, 99, 4, 5, 6, 7]) == []  # differs inside the first page
    assert cache.match(list(range(4)) + [99] * 4) == [0]
    assert cache.match([]) == []
    assert alloc.refcount(0) == 2  # match takes no reference
    cache.check_invariants()


def test_insert_counts_only_new_whole_pages():
    alloc = PageAllocator(8, 2)
    cache = PrefixCache(alloc)
    seq = alloc.new_sequence()
    alloc.reserve(seq, 5)
    assert cache.insert([1, 2, 3, 4, 5], seq.pages) == 2
    assert cache.insert([1, 2, 3, 4, 5], seq.pages) == 0  # already there
    assert [alloc.refcount(p) for p in seq.pages] == [2, 2, 1]
    assert cache.insert([1], seq.pages) == 0 and cache.insert([], []) == 0
    # The sequence grows: the next insert adds only the page that filled up.
    alloc.reserve(seq, 7)
    assert cache.insert([1, 2, 3, 4, 5, 6, 7], seq.pages) == 1
    assert cache.match([1, 2, 3, 4, 5, 6, 7]) == seq.pages[:3]
    cache.check_invariants()


def test_duplicate_pages_keep_the_cached_one():
    alloc = PageAllocator(8, 2)
    cache = PrefixCache(alloc)
    a = alloc.new_sequence()
    alloc.reserve(a, 4)
    b = alloc.new_sequence()
    alloc.reserve(b, 6)  # computed the same first 4 tokens on its own pages, then 2 more
    assert cache.insert([1, 2, 3, 4], a.pages) == 2
    assert cache.insert([1, 2, 3, 4, 5, 6], b.pages) == 1  # only its third page is new
    assert cache.match([1, 2, 3, 4, 5, 6]) == a.pages + b.pages[2:]
    alloc.release(b)  # b's duplicates were never cached: they go back to the pool
    assert [alloc.refcount(p) for p in b.pages] == [] and alloc.num_free() == 8 - 3
    alloc.release(a)
    assert alloc.num_free() == 8 - 3 and len(cache) == 3
    cache.check_invariants()
    alloc.check_invariants()


def test_cached_pages_outlive_their_sequence():
    alloc = PageAllocator(8, 2)
    cache = PrefixCache(alloc)
    alloc.release(prefill(alloc, cache, [1, 2, 3, 4, 5]))
    assert alloc.num_used() == 2 and cache.match([1, 2, 3, 4]) == [0, 1]
    seq = prefill(alloc, cache, [1, 2, 3, 4, 7])
    assert seq.pages[:2] == [0, 1] and [alloc.refcount(p) for p in seq.pages] == [2, 2, 1]


def test_eviction_is_lru_over_leaves():
    alloc = PageAllocator(16, 2)
    cache = PrefixCache(alloc)
    for tokens in ([1, 1, 1, 1], [2, 2], [3, 3]):  # pages [0, 1], [2], [3]
        alloc.release(prefill(alloc, cache, tokens))
    cache.match([2, 2])
    cache.match([1, 1])  # touches page 0 only: page 1 stays as old as its insert
    # Least recently used leaf first: page 1 (inserted first, never matched), then 3, then 2;
    # page 0, matched last, goes last, once its child is gone.
    order = []
    for _ in range(4):
        before = set(cached(cache).values())
        assert cache.evict(1) == 1
        order += sorted(before - set(cached(cache).values()))
        cache.check_invariants()
    assert order == [1, 3, 2, 0]
    assert cache.evict(1) == 0 and alloc.num_free() == 16
    assert cache.stats()["evicted_pages"] == 4


def test_parent_evicted_after_its_children():
    alloc = PageAllocator(8, 2)
    cache = PrefixCache(alloc)
    alloc.release(prefill(alloc, cache, [1, 2, 3, 4, 5, 6]))
    cache.match([1, 2])  # the root page is the most recent, but its children must go first
    assert cache.evict(1) == 1 and cache.match([1, 2, 3, 4, 5, 6]) == [0, 1]
    assert cache.evict(10) == 2 and len(cache) == 0 and alloc.num_free() == 8


def test_pages_in_use_are_never_evicted():
    alloc = PageAllocator(8, 2)
    cache = PrefixCache(alloc)
    seq = prefill(alloc, cache, [1, 2, 3, 4])
    other = prefill(alloc, cache, [1, 2, 9, 9])  # shares page 0, owns page 2
    alloc.release(other)
    assert cache.num_evictable() == 1
    assert cache.evict(10) == 1  # only page 2: pages 0 and 1 are held by `seq`
    assert sorted(cached(cache).values()) == [0, 1] and alloc.refcount(0) == 2
    alloc.release(seq)
    assert cache.num_evictable() == 2 and cache.evict(10) == 2


def test_page_in_use_below_blocks_its_ancestors():
    # A sequence rewrote inside its first (cached) page: copy-on-write gave it a private copy,
    # but it still holds the cached second page. Neither cached page can go: the second is in
    # use, the first is not a leaf.
    alloc = PageAllocator(8, 2)
    cache = PrefixCache(alloc)
    seq = prefill(alloc, cache, [1, 2, 3, 4])
    assert alloc.prepare_write(seq, 1, 2) == [(0, 2)]
    assert seq.pages == [2, 1] and alloc.refcount(0) == 1
    assert cache.num_evictable() == 0 and cache.evict(5) == 0
    alloc.release(seq)
    assert cache.num_evictable() == 2


def test_cap_evicts_lru_before_insert():
    alloc = PageAllocator(16, 2)
    cache = PrefixCache(alloc, max_pages=3)
    alloc.release(prefill(alloc, cache, [1, 1, 1, 1]))  # pages 0, 1
    alloc.release(prefill(alloc, cache, [2, 2]))  # page 2
    cache.match([2, 2])
    seq = prefill(alloc, cache, [3, 3, 3, 3])  # two new pages: the LRU leaves 1 then 0 go
    seq_pages = list(seq.pages)
    assert cached(cache) == {(2, 2): 2, (3, 3): seq_pages[0], (3, 3, 3, 3): seq_pages[1]}
    assert alloc.num_used() == 3 and cache.stats()["evicted_pages"] == 2
    # Everything cached is in use now: an insert caches only what fits, here nothing more.
    held = prefill(alloc, cache, [2, 2, 4, 4])
    assert held.pages[0] == 2 and cache.stats()["inserted_pages"] == 1 + 2 + 2
    alloc.release(seq)
    assert cached(cache) == {(2, 2): 2, (3, 3): seq_pages[0], (3, 3, 3, 3): seq_pages[1]}
    cache.check_invariants()


def test_cap_never_evicts_the_path_being_extended():
    alloc = PageAllocator(16, 2)
    cache = PrefixCache(alloc, max_pages=2)
    alloc.release(prefill(alloc, cache, [1, 1, 2, 2]))  # pages 0, 1, both unreferenced
    # Extending that path by one page would need to evict page 1, the page it hangs from.
    seq = alloc.new_sequence()
    alloc.reserve(seq, 6)
    assert cache.insert([1, 1, 2, 2, 3, 3], seq.pages) == 0
    assert cached(cache) == {(1, 1): 0, (1, 1, 2, 2): 1}
    cache.check_invariants()


def test_zero_cap_caches_nothing():
    alloc = PageAllocator(4, 2)
    cache = PrefixCache(alloc, max_pages=0)
    alloc.release(prefill(alloc, cache, [1, 2, 3, 4]))
    assert len(cache) == 0 and alloc.num_free() == 4
    with pytest.raises(ValueError):
        PrefixCache(alloc, max_pages=-1)


def test_reclaimer_evicts_cached_pages_when_the_pool_is_full():
    alloc = PageAllocator(4, 2)
    cache = PrefixCache(alloc)
    alloc.set_reclaimer(cache.evict)
    alloc.release(prefill(alloc, cache, [1, 1, 2, 2]))  # pages 0, 1
    alloc.release(prefill(alloc, cache, [5, 5, 6, 6]))  # pages 2, 3: the pool is all cache
    cache.match([1, 1, 2, 2])
    assert alloc.num_free() == 0
    taken = alloc.allocate(2)
    assert sorted(taken) == [2, 3]  # path [5, 5, 6, 6] was least recently used
    assert cached(cache) == {(1, 1): 0, (1, 1, 2, 2): 1}
    alloc.decref(taken[:1])
    # A request reusing the cached prefix takes the free page; its cached pages are protected
    # once incref'd, so the next allocation finds nothing to reclaim.
    seq = prefill(alloc, cache, [1, 1, 2, 2, 7])
    assert seq.pages[:2] == [0, 1]
    with pytest.raises(OutOfPages):
        alloc.allocate(1)
    assert cached(cache) == {(1, 1): 0, (1, 1, 2, 2): 1}
    alloc.check_invariants()
    cache.check_invariants()


def test_stats():
    alloc = PageAllocator(8, 4)
    cache = PrefixCache(alloc)
    seq = prefill(alloc, cache, list(range(10)))  # lookup: miss, 10 tokens
    seq_pages = seq.pages[:2]
    alloc.release(seq)
    assert cache.match(list(range(9))) == seq_pages  # counts nothing by itself
    cache.lookup(list(range(9)))  # 2 pages: 8 of 9 tokens
    cache.lookup([9] * 5)  # miss
    cache.evict(1)
    s = cache.stats()
    assert {k: s[k] for k in ("lookups", "hits", "lookup_tokens", "hit_tokens", "inserts",
                              "inserted_pages", "evicted_pages", "cached_pages")} == {
        "lookups": 3, "hits": 1, "lookup_tokens": 24, "hit_tokens": 8, "inserts": 1,
        "inserted_pages": 2, "evicted_pages": 1, "cached_pages": 1}
    assert s["request_hit_rate"] == pytest.approx(1 / 3)
    assert s["token_hit_rate"] == pytest.approx(8 / 24)
    cache.reset_stats()
    s = cache.stats()
    assert s["lookups"] == s["hits"] == s["evicted_pages"] == 0 and s["cached_pages"] == 1
    assert s["request_hit_rate"] == s["token_hit_rate"] == 0.0


def test_insert_rejects_bad_pages_and_changes_nothing():
    alloc = PageAllocator(8, 2)
    cache = PrefixCache(alloc)
    seq = prefill(alloc, cache, [1, 2, 3, 4])  # pages 0, 1 cached
    before = (cached(cache), [alloc.refcount(p) for p in range(8)])
    stats_before = cache.stats()
    with pytest.raises(ValueError, match="only 1 pages"):
        cache.insert([5, 6, 7, 8], [2])
    with pytest.raises(ValueError, match="free"):
        cache.insert([5, 6], [5])
    with pytest.raises(ValueError, match="already cached"):
        cache.insert([5, 6], [1])
    (p,) = alloc.allocate(1)
    with pytest.raises(ValueError, match="repeat"):
        cache.insert([5, 6, 7, 8], [p, p])
    alloc.decref([p])
    assert (cached(cache), [alloc.refcount(p) for p in range(8)]) == before
    assert cache.stats() == stats_before
    cache.check_invariants()
    alloc.release(seq)


def test_a_refused_insert_leaves_recency_alone():
    """A refused insert along a cached path must not make that path the most recently used:
    eviction still takes the least recently used leaf."""
    alloc = PageAllocator(8, 2)
    cache = PrefixCache(alloc)
    old, recent = prefill(alloc, cache, [1, 2]), prefill(alloc, cache, [3, 4])
    old_pages, recent_pages = list(old.pages), list(recent.pages)
    alloc.release(old)
    alloc.release(recent)
    with pytest.raises(ValueError, match="free"):
        cache.insert([1, 2, 5, 6], old_pages + [7])  # walks [1, 2], then refuses page 7
    assert cache.evict(1) == 1
    assert cache.match([1, 2]) == [] and cache.match([3, 4]) == recent_pages


def test_numpy_token_ids():
    alloc = PageAllocator(8, 2)
    cache = PrefixCache(alloc)
    alloc.release(prefill(alloc, cache, np.array([1, 2, 3, 4], dtype=np.int32)))
    assert cache.match([1, 2, 3, 4]) == cache.match(np.array([1, 2, 3], dtype=np.int64)) + [1]


def test_check_invariants_catches_corruption():
    alloc = PageAllocator(8, 2)
    cache = PrefixCache(alloc)
    seq = prefill(alloc, cache, [1, 2, 3, 4])
    alloc.decref([0])  # the cache's reference is gone, the sequence's remains
    alloc.decref([0])  # now it is free while still cached
    with pytest.raises(AssertionError, match="free"):
        cache.check_invariants()
    alloc = PageAllocator(8, 2)
    cache = PrefixCache(alloc)
    seq = prefill(alloc, cache, [1, 2, 3, 4])
    cache._root.children[(1, 2)].children[(3, 4)].page = 0  # page 0 twice
    with pytest.raises(AssertionError):
        cache.check_invariants()
    del seq


def test_cache_alone_experiment_small():
    from experiments.prefix_cache import run_cache_alone
    kw = dict(num_requests=200, shared_fraction=0.6, num_prefixes=5, prefix_tokens=(64, 128),
              suffix_tokens=(16, 64), page_size=16, seed=0)
    rows = {r["cache"]: r for r in run_cache_alone(max_pages=[30, 500], **kw)}
    assert rows == {r["cache"]: r for r in run_cache_alone(max_pages=[30, 500], **kw)}
    unlimited = rows["unlimited"]
    # Every shared request but the first of each prefix hits; unique ones never do.
    assert unlimited["hits"] == 120 - 5 and unlimited["requests"] == 200
    assert rows["lru_500"]["request_hit_rate"] == unlimited["request_hit_rate"]
    assert rows["lru_30"]["cached_pages"] <= 30
    assert 0 < rows["lru_30"]["request_hit_rate"] <= unlimited["request_hit_rate"]
    assert rows["lru_30"]["token_hit_rate"] <= unlimited["token_hit_rate"]


# -- stateful check against a brute-force model ---------------------------------------------------

class ModelCache:
    """Brute force: {page-aligned prefix: [page, last used]}, an LRU over prefixes that no other
    cached prefix extends, written independently of the tree."""

    def __init__(self, alloc: PageAllocator, max_pages: int | None):
        self.alloc, self.g, self.max_pages = alloc, alloc.page_size, max_pages
        self.entries: dict[tuple[int, ...], list[int]] = {}
        self.clock = 0

    def prefixes(self, tokens: list[int]) -> list[tuple[int, ...]]:
        return [tuple(tokens[:k * self.g]) for k in range(1, len(tokens) // self.g + 1)]

    def match(self, tokens: list[int]) -> list[int]:
        self.clock += 1
        pages = []
        for prefix in self.prefixes(tokens):
            if prefix not in self.entries:
                break
            self.entries[prefix][1] = self.clock
            pages.append(self.entries[prefix][0])
        return pages

    def evict(self, n: int, keep: tuple[int, ...] | None = None) -> list[int]:
        """Pages the cache must evict, in order (refcounts read, not changed)."""
        out = []
        while len(out) < n:
            leaves = [p for p in self.entries if p != keep
                      and not any(len(q) == len(p) + self.g and q[:len(p)] == p
                                  for q in self.entries)
                      and self.alloc.refcount(self.entries[p][0]) == 1]
            if not leaves:
                break
            victim = min(leaves, key=lambda p: (self.entries[p][1], self.entries[p][0]))
            out.append(self.entries.pop(victim)[0])
        return out

    def insert(self, tokens: list[int], pages: list[int]) -> int:
        self.clock += 1
        prefixes = self.prefixes(tokens)
        i = 0
        while i < len(prefixes) and prefixes[i] in self.entries:
            self.entries[prefixes[i]][1] = self.clock
            i += 1
        new = list(pages[i:len(prefixes)])
        if self.max_pages is not None:
            over = len(self.entries) + len(new) - self.max_pages
            if over > 0:
                self.evict(over, keep=prefixes[i - 1] if i else None)
            new = new[:max(0, self.max_pages - len(self.entries))]
        for prefix, page in zip(prefixes[i:], new):
            self.entries[prefix] = [page, self.clock]
        return len(new)


class PrefixCacheMachine(RuleBasedStateMachine):
    """Requests over a tiny pool (6 pages of 2 tokens, tokens 0/1 so prefixes collide often)
    with the cache as the allocator's reclaimer. A NumPy "device" holds the token id written in
    each slot: a cached page must always hold its own tokens, a sequence its own."""

    NUM_PAGES = 6
    G = 2
    tokens = st.lists(st.integers(0, 1), max_size=9)

    def __init__(self):
        super().__init__()
        self.alloc = PageAllocator(self.NUM_PAGES, self.G)
        self.device = np.full((self.NUM_PAGES, self.G), -1, dtype=np.int64)
        self.seqs: list[tuple[SequencePages, list[int]]] = []

    @initialize(max_pages=st.one_of(st.none(), st.integers(0, 5)))
    def setup(self, max_pages):
        self.cache = PrefixCache(self.alloc, max_pages)
        self.model = ModelCache(self.alloc, max_pages)
        self.alloc.set_reclaimer(self._reclaim)

    def _reclaim(self, shortfall: int) -> int:
        expected = self.model.evict(shortfall)
        freed = self.cache.evict(shortfall)
        assert freed == len(expected) <= shortfall
        assert all(self.alloc.refcount(p) == 0 for p in expected)
        return freed

    def _write(self, seq: SequencePages, start: int, values: list[int]) -> bool:
        end = start + len(values)
        try:
            copies = self.alloc.prepare_write(seq, start, end)
        except OutOfPages:
            return False
        for src, dst in copies:
            self.device[dst] = self.device[src]
        if start < end:  # every page written is private now: cached pages stay untouched
            assert all(self.alloc.refcount(seq.pages[i]) == 1
                       for i in range(start // self.G, (end - 1) // self.G + 1))
        self.device.reshape(-1)[seq.slots(start, end)] = values
        return True

    @precondition(lambda self: len(self.seqs) < 3)
    @rule(tokens=tokens, short=st.booleans(), reuse=st.booleans())
    def request(self, tokens, short, reuse):
        # `short` matches all but the last token, as an engine does; otherwise a fully cached
        # prompt recomputes its last token in place, through copy-on-write of the shared page.
        # Without `reuse` the request computes every page itself (two identical prompts admitted
        # in the same step): its inserts meet pages already cached that nobody holds.
        query = tokens[:-1] if short else tokens
        pages = self.cache.match(query) if reuse else []
        assert pages == (self.model.match(query) if reuse else [])
        self.alloc.incref(pages)
        seq = SequencePages(self.G, list(pages), len(pages) * self.G)
        start = min(seq.num_tokens, max(0, len(tokens) - 1))
        try:
            self.alloc.reserve(seq, len(tokens))
        except OutOfPages:
            self.alloc.release(seq)
            return
        assert seq.pages[:len(pages)] == pages
        if not self._write(seq, start, tokens[start:]):
            self.alloc.release(seq)
            return
        seq.num_tokens = len(tokens)
        self.seqs.append((seq, list(tokens)))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 2), cut=st.integers(0, 9), more=tokens)
    def rewrite(self, i, cut, more):
        # Roll back and write other tokens (speculative decoding, or a new turn): writes that
        # land in cached pages must copy them first.
        seq, toks = self.seqs[i % len(self.seqs)]
        cut %= seq.num_tokens + 1
        self.alloc.truncate(seq, cut)
        del toks[cut:]
        try:
            self.alloc.reserve(seq, cut + len(more))
        except OutOfPages:
            return
        if self._write(seq, cut, more):
            seq.num_tokens += len(more)
            toks += more

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 2))
    def insert(self, i):
        seq, toks = self.seqs[i % len(self.seqs)]
        expected = self.model.insert(toks, seq.pages)
        assert self.cache.insert(toks, seq.pages) == expected

    @rule(tokens=tokens)
    def lookup(self, tokens):
        assert self.cache.match(tokens) == self.model.match(tokens)

    @rule(n=st.integers(0, 6))
    def evict(self, n):
        free = self.alloc.num_free()
        expected = self.model.evict(n)
        assert self.cache.evict(n) == len(expected) == self.alloc.num_free() - free

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 2))
    def release(self, i):
        seq, _ = self.seqs.pop(i % len(self.seqs))
        self.alloc.release(seq)

    @invariant()
    def trees_agree(self):
        self.cache.check_invariants()
        assert cached(self.cache) == {k: v[0] for k, v in self.model.entries.items()}
        assert len(self.cache) == self.cache.stats()["cached_pages"] == len(self.model.entries)

    @invariant()
    def refcounts_exact(self):
        # One reference per holder: no page a live sequence holds is ever freed, and none leaks.
        self.alloc.check_invariants()
        holders = np.zeros(self.NUM_PAGES, dtype=np.int64)
        for seq, _ in self.seqs:
            np.add.at(holders, np.asarray(seq.pages, dtype=np.intp), 1)
        for page, _ in self.model.entries.values():
            holders[page] += 1
        assert holders.tolist() == [self.alloc.refcount(p) for p in range(self.NUM_PAGES)]

    @invariant()
    def data_intact(self):
        for prefix, (page, _) in self.model.entries.items():
            assert self.device[page].tolist() == list(prefix[-self.G:]), (prefix, page)
        flat = self.device.reshape(-1)
        for seq, toks in self.seqs:
            assert seq.num_tokens == len(toks)
            assert flat[seq.slots(0, len(toks))].tolist() == toks

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for seq, _ in self.seqs:
            self.alloc.release(seq)
        self.cache.evict(self.NUM_PAGES)  # nothing is in use: everything goes
        assert len(self.cache) == 0 and self.alloc.num_free() == self.NUM_PAGES
        self.alloc.check_invariants()


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None)
TestPrefixCacheMachine = PrefixCacheMachine.TestCase
