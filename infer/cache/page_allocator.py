"""Host-side page allocator for the paged KV cache.

The device KV cache is a pool of `num_pages` fixed-size pages of `page_size` token slots each.
This module only does the bookkeeping: which pages are free, how many holders each used page has
(sequences, forks, the prefix cache), and which page a token position of a sequence lives in.
Nothing here touches the device: copy-on-write returns the page copies the runner must perform.

Plain Python + NumPy on purpose (no JAX), so the scheduler and prefix cache built on top of it
test in milliseconds.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Sequence

import numpy as np


class OutOfPages(RuntimeError):
    """Raised when an allocation needs more pages than are free (after any reclaim)."""

    def __init__(self, needed: int, free: int):
        super().__init__(f"out of KV-cache pages: needed {needed}, only {free} free")
        self.needed = needed
        self.free = free


@dataclasses.dataclass
class SequencePages:
    """The page table of one sequence.

    `num_tokens` counts the tokens whose KV is actually in the cache: the one count of them (the
    engine's `SeqState.num_computed` reads it). The allocator never advances it: the caller
    reserves and writes slots for new positions, then moves it forward after the device step
    (`mark_computed`), so slots can be reserved ahead (speculative tokens) without claiming they
    hold data. `PageAllocator.truncate` moves it back, `release` to 0.
    """

    page_size: int
    pages: list[int] = dataclasses.field(default_factory=list)
    num_tokens: int = 0
    # (slot, tag) of the sequence's window in a cache that keeps one (`infer.cache.kivi`):
    # given by the allocator at the first reserve, returned at release. The tag is unique to
    # this sequence, so a window slot that another sequence held is never read as its own.
    window: tuple[int, int] | None = None

    @property
    def capacity(self) -> int:
        return len(self.pages) * self.page_size

    def mark_computed(self, num_tokens: int) -> None:
        """Records that positions [0, num_tokens) hold KV: forward only (`truncate` rolls back),
        and never past the pages held."""
        if not self.num_tokens <= num_tokens <= self.capacity:
            raise ValueError(f"{num_tokens} computed tokens: must be in [{self.num_tokens}, "
                             f"{self.capacity}] (computed so far, capacity)")
        self.num_tokens = num_tokens

    def slot(self, position: int) -> int:
        """Flat index of `position` in a `[P * G]` view of the cache."""
        if not 0 <= position < self.capacity:
            raise ValueError(f"position {position} outside the sequence's capacity {self.capacity}")
        page, offset = divmod(position, self.page_size)
        return self.pages[page] * self.page_size + offset

    def slots(self, start: int, end: int) -> np.ndarray:
        """Slots of positions [start, end) as int32: the runner's slot mapping."""
        if not 0 <= start <= end <= self.capacity:
            raise ValueError(
                f"positions [{start}, {end}) outside the sequence's capacity {self.capacity}")
        pos = np.arange(start, end)
        pages = np.asarray(self.pages, dtype=np.int64)[pos // self.page_size]
        return (pages * self.page_size + pos % self.page_size).astype(np.int32)

    def pages_needed(self, new_num_tokens: int) -> int:
        """Extra pages (beyond those held) for the capacity to reach `new_num_tokens`."""
        total = -(-new_num_tokens // self.page_size)
        return max(0, total - len(self.pages))


def page_tables(pages: Sequence[SequencePages], rows: int, width: int,
                row_of: Sequence[int] | None = None) -> np.ndarray:
    """[rows, width] int32 page ids, sequence i in row `row_of[i]` (default i), zero-padded
    (padding rows and slots past a sequence's pages are never read: lengths mask them, and
    padding rows write nothing). Pages past `width` are left out: the caller checks that no
    write needs them (`infer.cache.metadata.paged_metadata`)."""
    if row_of is not None and len(row_of) != len(pages):
        raise ValueError(f"row_of has {len(row_of)} rows for {len(pages)} sequences")
    tables = np.zeros((rows, width), np.int32)
    for i, seq in zip(range(len(pages)) if row_of is None else row_of, pages):
        held = seq.pages[:width]
        tables[i, :len(held)] = held
    return tables


class OutOfWindows(RuntimeError):
    """Raised when a sequence needs a window slot and every one is held."""


class PageAllocator:
    """Free list plus a refcount per page; with `num_windows`, a free list of window slots too,
    one per sequence holding pages (caches that keep each sequence's filling page apart).

    The free list is a stack (LIFO) so allocation order is deterministic and freshly released
    pages, likely still warm in caches, are handed out first.
    """

    def __init__(self, num_pages: int, page_size: int, num_windows: int = 0):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be >= 1")
        if num_windows < 0:
            raise ValueError(f"num_windows must be >= 0, got {num_windows}")
        self.num_windows = num_windows
        self._free_windows: list[int] = list(range(num_windows - 1, -1, -1))
        self._next_tag = 0
        self.num_pages = num_pages
        self.page_size = page_size
        self._refcount = np.zeros(num_pages, dtype=np.int32)
        # Reversed so that pop() hands out 0, 1, 2, ... on a fresh allocator.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._reclaimer: Callable[[int], int] | None = None

    # -- page level -----------------------------------------------------------------------------

    def num_free(self) -> int:
        return len(self._free)

    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, n: int) -> bool:
        """Whether `n` pages are free right now (pages a reclaimer could release do not count)."""
        return n <= len(self._free)

    def refcount(self, page: int) -> int:
        self._check_id(page)
        return int(self._refcount[page])

    def set_reclaimer(self, fn: Callable[[int], int] | None) -> None:
        """Install a hook called as `fn(shortfall)` when allocate() runs short.

        Meant for the prefix cache: it evicts cached pages (decref'ing them) and returns how many
        it released. It must not call allocate() itself.
        """
        self._reclaimer = fn

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages (refcount 1 each), all or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n == 0:  # every row of every decode step asks; most need nothing
            return []
        if n > len(self._free) and self._reclaimer is not None:
            # Its return value is informational: the free list is the truth.
            self._reclaimer(n - len(self._free))
        if n > len(self._free):
            raise OutOfPages(n, len(self._free))
        pages = [self._free.pop() for _ in range(n)]
        self._refcount[np.asarray(pages, dtype=np.intp)] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        for p in pages:
            self._check_id(p)
            # A free page has no holder to share it with; increfing one would hand a page that
            # is still on the free list to someone.
            if self._refcount[p] == 0:
                raise ValueError(f"incref of free page {p}")
        np.add.at(self._refcount, np.asarray(pages, dtype=np.intp), 1)

    def decref(self, pages: Iterable[int]) -> None:
        """Drop one reference per listed page; pages reaching zero go back on the free list.

        Validated up front (counting repeats) so a bad call changes nothing.
        """
        pages = list(pages)
        for p in pages:
            self._check_id(p)
        ids, counts = np.unique(np.asarray(pages, dtype=np.int64), return_counts=True)
        for p, c in zip(ids.tolist(), counts.tolist()):
            if c > self._refcount[p]:
                what = "free page" if self._refcount[p] == 0 else "page"
                raise ValueError(
                    f"decref of {what} {p}: refcount {self._refcount[p]}, {c} decref(s)")
        # Reversed so a sequence's pages come back out of allocate() in their original order.
        for p in reversed(pages):
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                self._free.append(p)

    # -- sequence level -------------------------------------------------------------------------

    def new_sequence(self) -> SequencePages:
        return SequencePages(self.page_size)

    def reserve(self, seq: SequencePages, new_num_tokens: int) -> None:
        """Grow `seq` so its capacity is >= `new_num_tokens`, all or nothing."""
        self._check_seq(seq)
        if self.num_windows and seq.window is None and new_num_tokens > 0:
            if not self._free_windows:
                raise OutOfWindows(f"all {self.num_windows} window slots are held: at most that "
                                   "many sequences can hold pages at once")
            seq.pages.extend(self.allocate(seq.pages_needed(new_num_tokens)))
            seq.window = (self._free_windows.pop(), self._next_tag)
            self._next_tag = (self._next_tag + 1) % (1 << 31)
            return
        seq.pages.extend(self.allocate(seq.pages_needed(new_num_tokens)))

    def fork(self, seq: SequencePages) -> SequencePages:
        """A new sequence sharing every page of `seq` (beam search, parallel sampling). It gets
        a window of its own at its first reserve: the pages it shares are then read quantized
        (the newest ones too, which its parent reads exact) until it writes them again."""
        self._check_seq(seq)
        self.incref(seq.pages)
        return SequencePages(seq.page_size, list(seq.pages), seq.num_tokens)

    def prepare_write(self, seq: SequencePages, start: int, end: int) -> list[tuple[int, int]]:
        """Copy-on-write before the device writes positions [start, end) of `seq`.

        Every shared page (refcount > 1) in the range is replaced in `seq.pages` by a private one.
        Returns the (src_page, dst_page) copies the device must do before the write; a page the
        write covers entirely needs no copy. All or nothing on OutOfPages.
        """
        self._check_seq(seq)
        if not 0 <= start <= end <= seq.capacity:
            raise ValueError(
                f"write range [{start}, {end}) outside the sequence's capacity {seq.capacity}")
        if start == end:
            return []
        g = self.page_size
        shared = [i for i in range(start // g, (end - 1) // g + 1)
                  if self._refcount[seq.pages[i]] > 1]
        fresh = self.allocate(len(shared))
        copies, unused = [], []
        for i, dst in zip(shared, fresh):
            src = seq.pages[i]
            if self._refcount[src] == 1:
                # A reclaimer run inside allocate() dropped the other holder: already private.
                unused.append(dst)
                continue
            self.decref([src])
            seq.pages[i] = dst
            if not (start <= i * g and (i + 1) * g <= end):
                copies.append((src, dst))
        self.decref(unused)
        return copies

    def truncate(self, seq: SequencePages, num_tokens: int) -> None:
        """Shrink `seq` to `num_tokens` tokens, freeing whole pages past the end (spec-decode
        rollback, or dropping slots reserved for rejected tokens)."""
        self._check_seq(seq)
        if not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(
                f"truncate to {num_tokens} tokens: must be in [0, {seq.num_tokens}]")
        keep = -(-num_tokens // self.page_size)
        self.decref(seq.pages[keep:])
        del seq.pages[keep:]
        seq.num_tokens = num_tokens

    def release(self, seq: SequencePages) -> None:
        """Drop all of the sequence's pages and leave it empty."""
        self._check_seq(seq)
        self.decref(seq.pages)
        seq.pages.clear()
        seq.num_tokens = 0
        if seq.window is not None:
            self._free_windows.append(seq.window[0])
            seq.window = None

    # -- checks ---------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError unless every page is exactly one of free or used."""
        free = self._free
        if len(set(free)) != len(free):
            raise AssertionError(f"free list has duplicates: {sorted(free)}")
        if (self._refcount < 0).any():
            bad = np.flatnonzero(self._refcount < 0).tolist()
            raise AssertionError(f"negative refcounts at pages {bad}")
        if len(set(self._free_windows)) != len(self._free_windows) or not set(
                self._free_windows) <= set(range(self.num_windows)):
            raise AssertionError(f"bad window free list {sorted(self._free_windows)}")
        zero = set(np.flatnonzero(self._refcount == 0).tolist())
        if zero != set(free):
            raise AssertionError(
                f"free list {sorted(free)} != pages with refcount 0 {sorted(zero)}")

    def _check_id(self, page: int) -> None:
        if isinstance(page, bool) or not isinstance(page, (int, np.integer)) \
                or not 0 <= page < self.num_pages:
            raise ValueError(f"page id {page!r} out of range for num_pages={self.num_pages}")

    def _check_seq(self, seq: SequencePages) -> None:
        if seq.page_size != self.page_size:
            raise ValueError(
                f"sequence page_size {seq.page_size} != allocator page_size {self.page_size}")
