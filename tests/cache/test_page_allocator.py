"""Tests of the host-side page allocator: hand-worked unit cases plus a stateful model check."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from infer.cache.page_allocator import OutOfPages, PageAllocator, SequencePages, page_tables


def snapshot(alloc: PageAllocator) -> tuple:
    return alloc.num_free(), [alloc.refcount(p) for p in range(alloc.num_pages)]


def seq_with(alloc: PageAllocator, num_tokens: int) -> SequencePages:
    seq = alloc.new_sequence()
    alloc.reserve(seq, num_tokens)
    seq.num_tokens = num_tokens
    return seq


# -- page level -----------------------------------------------------------------------------------

def test_allocate_is_deterministic_and_counts():
    alloc = PageAllocator(num_pages=8, page_size=4)
    assert (alloc.num_free(), alloc.num_used()) == (8, 0)
    assert alloc.allocate(3) == [0, 1, 2]
    assert alloc.allocate(0) == []
    assert (alloc.num_free(), alloc.num_used()) == (5, 3)
    assert [alloc.refcount(p) for p in range(4)] == [1, 1, 1, 0]
    assert alloc.can_allocate(5) and not alloc.can_allocate(6)
    alloc.check_invariants()


def test_released_pages_come_back_first_in_order():
    alloc = PageAllocator(8, 4)
    pages = alloc.allocate(3)
    alloc.allocate(2)
    alloc.decref(pages)
    assert alloc.allocate(3) == pages


def test_out_of_pages_changes_nothing():
    alloc = PageAllocator(4, 2)
    alloc.allocate(3)
    before = snapshot(alloc)
    with pytest.raises(OutOfPages) as err:
        alloc.allocate(2)
    assert (err.value.needed, err.value.free) == (2, 1)
    assert isinstance(err.value, RuntimeError)
    assert snapshot(alloc) == before
    alloc.check_invariants()


def test_allocate_negative():
    with pytest.raises(ValueError):
        PageAllocator(4, 2).allocate(-1)


def test_incref_decref_refcounts():
    alloc = PageAllocator(4, 2)
    (p,) = alloc.allocate(1)
    alloc.incref([p, p])
    assert alloc.refcount(p) == 3
    alloc.decref([p])
    alloc.decref([p])
    assert alloc.refcount(p) == 1 and alloc.num_free() == 3
    alloc.decref([p])
    assert alloc.refcount(p) == 0 and alloc.num_free() == 4
    alloc.check_invariants()


def test_decref_free_page_raises_and_changes_nothing():
    alloc = PageAllocator(4, 2)
    a, b = alloc.allocate(2)
    with pytest.raises(ValueError, match="free page 3"):
        alloc.decref([3])
    before = snapshot(alloc)
    # One reference but two decrefs: rejected as a whole, `a` is not touched either.
    with pytest.raises(ValueError):
        alloc.decref([a, b, b])
    assert snapshot(alloc) == before
    alloc.check_invariants()


def test_incref_free_page_raises():
    alloc = PageAllocator(4, 2)
    with pytest.raises(ValueError, match="free page 0"):
        alloc.incref([0])
    assert alloc.refcount(0) == 0


@pytest.mark.parametrize("bad", [-1, 4, 100, 1.0, True])
def test_bad_page_ids(bad):
    alloc = PageAllocator(4, 2)
    alloc.allocate(4)
    for call in (alloc.incref, alloc.decref):
        with pytest.raises(ValueError, match=r"page id .* num_pages=4"):
            call([0, bad])
    with pytest.raises(ValueError, match="num_pages=4"):
        alloc.refcount(bad)
    assert [alloc.refcount(p) for p in range(4)] == [1, 1, 1, 1]


def test_bad_constructor():
    with pytest.raises(ValueError):
        PageAllocator(0, 4)
    with pytest.raises(ValueError):
        PageAllocator(4, 0)


def test_reclaimer_is_asked_for_the_shortfall_then_retried():
    alloc = PageAllocator(4, 2)
    cached = alloc.allocate(3)  # pretend a prefix cache holds these
    calls = []

    def reclaim(shortfall: int) -> int:
        calls.append(shortfall)
        alloc.decref(cached[:shortfall])
        return shortfall

    alloc.set_reclaimer(reclaim)
    assert len(alloc.allocate(1)) == 1 and calls == []  # enough free: not called
    assert len(alloc.allocate(2)) == 2 and calls == [2]
    alloc.check_invariants()


def test_reclaimer_that_cannot_free_enough():
    alloc = PageAllocator(4, 2)
    alloc.allocate(4)
    alloc.set_reclaimer(lambda shortfall: 0)
    with pytest.raises(OutOfPages):
        alloc.allocate(1)
    alloc.set_reclaimer(None)
    with pytest.raises(OutOfPages):
        alloc.allocate(1)


def test_check_invariants_catches_corruption():
    alloc = PageAllocator(4, 2)
    alloc.allocate(2)
    alloc._refcount[1] = 0  # leaked: refcount 0 but not on the free list
    with pytest.raises(AssertionError):
        alloc.check_invariants()
    alloc = PageAllocator(4, 2)
    alloc._free.append(0)  # on the free list twice
    with pytest.raises(AssertionError):
        alloc.check_invariants()


# -- sequence level -------------------------------------------------------------------------------

def test_sequence_slots_and_capacity():
    seq = SequencePages(page_size=4, pages=[5, 2], num_tokens=6)
    assert seq.capacity == 8
    assert [seq.slot(i) for i in range(8)] == [20, 21, 22, 23, 8, 9, 10, 11]
    assert seq.slots(2, 6).tolist() == [22, 23, 8, 9]
    assert seq.slots(3, 3).tolist() == []
    with pytest.raises(ValueError):
        seq.slot(8)
    with pytest.raises(ValueError):
        seq.slots(0, 9)
    assert [seq.pages_needed(n) for n in (0, 8, 9, 12, 13)] == [0, 0, 1, 1, 2]


def test_reserve():
    alloc = PageAllocator(6, 4)
    seq = alloc.new_sequence()
    alloc.reserve(seq, 5)
    assert seq.pages == [0, 1] and seq.num_tokens == 0  # reserving writes no tokens
    alloc.reserve(seq, 8)
    assert seq.pages == [0, 1]
    alloc.reserve(seq, 9)
    assert seq.pages == [0, 1, 2]
    before = snapshot(alloc)
    with pytest.raises(OutOfPages):
        alloc.reserve(seq, 4 * 7)
    assert seq.pages == [0, 1, 2] and snapshot(alloc) == before


def test_reserve_rejects_other_page_size():
    with pytest.raises(ValueError, match="page_size"):
        PageAllocator(4, 4).reserve(SequencePages(page_size=8), 1)


def test_fork_shares_and_release_frees():
    alloc = PageAllocator(6, 4)
    a = seq_with(alloc, 6)
    b = alloc.fork(a)
    assert b.pages == a.pages and b.pages is not a.pages and b.num_tokens == 6
    assert [alloc.refcount(p) for p in a.pages] == [2, 2]
    alloc.release(a)
    assert a.pages == [] and a.num_tokens == 0
    assert [alloc.refcount(p) for p in b.pages] == [1, 1] and alloc.num_free() == 4
    alloc.release(b)
    assert alloc.num_free() == 6
    alloc.check_invariants()


def test_prepare_write_copies_only_shared_pages_in_range():
    alloc = PageAllocator(8, 4)
    a = seq_with(alloc, 10)  # pages [0, 1, 2]
    b = alloc.fork(a)
    assert alloc.prepare_write(b, 10, 10) == []
    # Appending at 10 touches only the last, shared, page: one copy.
    assert alloc.prepare_write(b, 10, 12) == [(2, 3)]
    assert a.pages == [0, 1, 2] and b.pages == [0, 1, 3]
    assert [alloc.refcount(p) for p in range(4)] == [2, 2, 1, 1]
    # The page is private now: writing again copies nothing.
    assert alloc.prepare_write(b, 11, 12) == []
    # Partially covered shared page 0 needs a copy; fully covered page 1 is overwritten whole.
    assert alloc.prepare_write(b, 2, 8) == [(0, 4)]
    assert b.pages == [4, 5, 3] and a.pages == [0, 1, 2]
    assert [alloc.refcount(p) for p in a.pages] == [1, 1, 1]
    alloc.check_invariants()


def test_prepare_write_out_of_pages_is_all_or_nothing():
    alloc = PageAllocator(5, 2)
    a = seq_with(alloc, 6)  # 3 pages
    b = alloc.fork(a)
    alloc.allocate(1)  # 1 free left, the write below needs 2
    before = snapshot(alloc)
    with pytest.raises(OutOfPages):
        alloc.prepare_write(b, 1, 3)
    assert b.pages == a.pages == [0, 1, 2] and snapshot(alloc) == before


def test_prepare_write_bad_range():
    alloc = PageAllocator(4, 4)
    seq = seq_with(alloc, 4)
    for start, end in [(-1, 2), (3, 2), (0, 5)]:
        with pytest.raises(ValueError):
            alloc.prepare_write(seq, start, end)


def test_prepare_write_when_reclaim_unshares_the_page():
    # The reclaimer drops the other holder of the very page being copied: no copy is needed
    # any more and the page allocated for it must go back, not leak.
    alloc = PageAllocator(3, 2)
    seq = seq_with(alloc, 2)  # page 0
    cached = seq.pages + alloc.allocate(1)  # a prefix cache holds pages 0 and 1
    alloc.incref(seq.pages)
    alloc.allocate(1)  # the pool is full

    def reclaim(shortfall: int) -> int:
        alloc.decref(cached)
        return 1

    alloc.set_reclaimer(reclaim)
    assert alloc.prepare_write(seq, 1, 2) == []
    assert seq.pages == [0] and alloc.refcount(0) == 1 and alloc.num_free() == 1
    alloc.check_invariants()


def test_truncate():
    alloc = PageAllocator(8, 4)
    seq = seq_with(alloc, 11)  # pages [0, 1, 2]
    alloc.truncate(seq, 9)
    assert seq.pages == [0, 1, 2] and seq.num_tokens == 9
    alloc.truncate(seq, 8)
    assert seq.pages == [0, 1] and alloc.num_free() == 6
    with pytest.raises(ValueError):
        alloc.truncate(seq, 9)
    alloc.truncate(seq, 0)
    assert seq.pages == [] and alloc.num_free() == 8


def test_truncate_drops_reserved_but_unwritten_pages():
    alloc = PageAllocator(8, 4)
    seq = seq_with(alloc, 4)
    alloc.reserve(seq, 4 + 5)  # speculative slots; only 1 token accepted
    seq.num_tokens = 5
    alloc.truncate(seq, seq.num_tokens)
    assert seq.pages == [0, 1] and alloc.num_free() == 6


def test_page_tables():
    """Zero-padded rows; a sequence's pages past the width are left out (the metadata's write
    check refuses a write that needs them); `row_of` places sequence i in row row_of[i]."""
    alloc = PageAllocator(8, 2)
    a, b, c = seq_with(alloc, 5), seq_with(alloc, 1), alloc.new_sequence()
    table = page_tables([a, b, c], 3, 4)
    assert table.dtype == np.int32 and table.shape == (3, 4)
    assert table.tolist() == [[0, 1, 2, 0], [3, 0, 0, 0], [0, 0, 0, 0]]
    assert page_tables([], 2, 4).tolist() == [[0] * 4] * 2
    assert page_tables([a], 1, 2).tolist() == [[0, 1]]
    assert page_tables([a, b], 4, 3, row_of=[3, 1]).tolist() == [
        [0, 0, 0], [3, 0, 0], [0, 0, 0], [0, 1, 2]]
    with pytest.raises(ValueError, match="row_of has 1 rows for 2 sequences"):
        page_tables([a, b], 4, 3, row_of=[0])


def test_mark_computed_moves_forward_within_the_pages_held():
    alloc = PageAllocator(8, 4)
    seq = seq_with(alloc, 3)
    alloc.reserve(seq, 6)
    seq.mark_computed(6)
    assert seq.num_tokens == 6
    with pytest.raises(ValueError, match=r"must be in \[6, 8\]"):
        seq.mark_computed(9)  # past the two pages held
    with pytest.raises(ValueError, match=r"must be in \[6, 8\]"):
        seq.mark_computed(5)  # backwards: truncate's job
    assert seq.num_tokens == 6


# -- stateful model check -------------------------------------------------------------------------

class AllocatorMachine(RuleBasedStateMachine):
    """Several sequences sharing a small pool, checked against a NumPy model of the device.

    Every written token gets a unique value, so a copy-on-write that leaks into another sequence,
    or a page handed to two owners, shows up as a wrong value read back through a page table.
    External holders stand in for a prefix cache; the reclaimer drops them when pages run short.
    """

    # Small enough that the pool runs dry often, exercising OutOfPages and the reclaimer.
    NUM_PAGES = 4
    PAGE_SIZE = 2

    def __init__(self):
        super().__init__()
        self.alloc = PageAllocator(self.NUM_PAGES, self.PAGE_SIZE)
        self.device = np.full((self.NUM_PAGES, self.PAGE_SIZE), -1, dtype=np.int64)
        self.seqs: list[SequencePages] = []
        self.shadows: list[list[int]] = []  # logical token values per sequence
        self.external: list[int] = []  # pages held by the fake prefix cache, oldest first
        self.next_value = 0
        self.alloc.set_reclaimer(self._reclaim)

    def _reclaim(self, shortfall: int) -> int:
        # Drop the oldest external holds until enough pages are free (some may still be shared
        # by sequences and free nothing).
        released = 0
        while self.external and released < shortfall:
            page = self.external.pop(0)
            was_free = self.alloc.num_free()
            self.alloc.decref([page])
            released += self.alloc.num_free() - was_free
        return released

    def _write(self, i: int, start: int, end: int) -> bool:
        """Write fresh values at positions [start, end) of sequence i, as the runner would."""
        seq = self.seqs[i]
        before = (list(seq.pages), snapshot(self.alloc))
        try:
            copies = self.alloc.prepare_write(seq, start, end)
        except OutOfPages:
            # The reclaimer may have released external holds, but the sequence is untouched.
            assert seq.pages == before[0]
            return False
        for src, dst in copies:
            self.device[dst] = self.device[src]
        values = list(range(self.next_value, self.next_value + end - start))
        self.next_value += end - start
        self.device.reshape(-1)[seq.slots(start, end)] = values
        self.shadows[i][start:end] = values
        return True

    @precondition(lambda self: len(self.seqs) < 4)
    @rule()
    def new_sequence(self):
        self.seqs.append(self.alloc.new_sequence())
        self.shadows.append([])

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 3), k=st.integers(1, 5))
    def extend(self, i, k):
        i %= len(self.seqs)
        seq = self.seqs[i]
        new = seq.num_tokens + k
        pages = list(seq.pages)
        try:
            self.alloc.reserve(seq, new)
        except OutOfPages:
            assert seq.pages == pages
            return
        assert seq.capacity >= new and seq.pages[:len(pages)] == pages
        if self._write(i, seq.num_tokens, new):
            seq.num_tokens = new

    @precondition(lambda self: any(s.num_tokens for s in self.seqs))
    @rule(i=st.integers(0, 3), pos=st.integers(0, 30), k=st.integers(1, 5))
    def overwrite(self, i, pos, k):
        live = [j for j, s in enumerate(self.seqs) if s.num_tokens]
        i = live[i % len(live)]
        n = self.seqs[i].num_tokens
        pos %= n
        self._write(i, pos, min(pos + k, n))

    @precondition(lambda self: self.seqs and len(self.seqs) < 6)
    @rule(i=st.integers(0, 3))
    def fork(self, i):
        i %= len(self.seqs)
        self.seqs.append(self.alloc.fork(self.seqs[i]))
        self.shadows.append(list(self.shadows[i]))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 5), n=st.integers(0, 30))
    def truncate(self, i, n):
        i %= len(self.seqs)
        n %= self.seqs[i].num_tokens + 1
        self.alloc.truncate(self.seqs[i], n)
        del self.shadows[i][n:]

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 5))
    def release(self, i):
        i %= len(self.seqs)
        seq = self.seqs.pop(i)
        self.shadows.pop(i)
        self.alloc.release(seq)
        assert seq.pages == [] and seq.num_tokens == 0

    @precondition(lambda self: any(s.pages for s in self.seqs))
    @rule(i=st.integers(0, 5), j=st.integers(1, 10))
    def hold_prefix(self, i, j):
        # Like a prefix cache: it keeps the leading pages of a sequence.
        held = [s for s in self.seqs if s.pages]
        seq = held[i % len(held)]
        pages = seq.pages[:1 + j % len(seq.pages)]
        self.alloc.incref(pages)
        self.external += pages

    @rule(n=st.integers(1, 4))
    def hold_fresh(self, n):
        # Fills the pool with pages only the fake prefix cache holds, so the next write has to
        # reclaim, possibly dropping the hold that made the page it is writing shared.
        self.external += self.alloc.allocate(min(n, self.alloc.num_free()))

    @precondition(lambda self: self.external)
    @rule(j=st.integers(0, 10))
    def drop_external(self, j):
        self.alloc.decref([self.external.pop(j % len(self.external))])

    @invariant()
    def pages_accounted_for(self):
        self.alloc.check_invariants()
        assert self.alloc.num_free() + self.alloc.num_used() == self.NUM_PAGES
        holders = np.zeros(self.NUM_PAGES, dtype=np.int64)
        for seq in self.seqs:
            assert len(set(seq.pages)) == len(seq.pages)
            np.add.at(holders, np.asarray(seq.pages, dtype=np.intp), 1)
        np.add.at(holders, np.asarray(self.external, dtype=np.intp), 1)
        assert holders.tolist() == [self.alloc.refcount(p) for p in range(self.NUM_PAGES)]

    @invariant()
    def data_matches_shadows(self):
        flat = self.device.reshape(-1)
        for seq, shadow in zip(self.seqs, self.shadows):
            assert seq.num_tokens == len(shadow) and seq.capacity >= seq.num_tokens
            assert flat[seq.slots(0, seq.num_tokens)].tolist() == shadow

    def teardown(self):
        for seq in self.seqs:
            self.alloc.release(seq)
        self.alloc.decref(self.external)
        assert self.alloc.num_free() == self.NUM_PAGES
        self.alloc.check_invariants()


AllocatorMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase
