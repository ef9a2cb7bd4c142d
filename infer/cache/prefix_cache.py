"""Prefix cache: a radix tree over full KV pages, with LRU eviction (SGLang's RadixAttention idea,
vLLM's automatic prefix caching granularity).

Every edge of the tree is labelled with the token ids of one whole page (a tuple of `page_size`
ids), and every node holds the id of a page whose KV was computed for exactly those tokens after
the tokens of the path above it. A prompt's cached prefix is found by walking the tree one page
of tokens at a time, so a prompt that shares 1,500 of its first 2,000 tokens with a cached one
reuses the pages covering the first 1,500 rounded down to whole pages. Partial pages are never
cached: their KV is still being written.

The cache holds one allocator reference per cached page (incref on insert, decref on eviction),
so a page outlives the sequence that wrote it. A page is evictable when that reference is its
only one (refcount 1) and no cached page below it is still in use; leaves go first, least
recently used first (a logical clock ticked by every match and insert, not wall time). Cached
pages are never written in place: anyone who writes into a page they share goes through
`PageAllocator.prepare_write`, which copies it first, so a cached page's KV never changes.

Typical use by an engine (see `match` for why the match stops one token short):

    cache = PrefixCache(allocator)
    allocator.set_reclaimer(cache.evict)      # allocations evict cached pages when short
    pages = cache.lookup(prompt[:-1])         # match, counted as one lookup taking its pages
    allocator.incref(pages)                   # before any allocation: protects them from evict
    seq = SequencePages(G, list(pages), len(pages) * G)
    allocator.reserve(seq, len(prompt)); ...prefill positions [seq.num_tokens, len(prompt))...
    cache.insert(tokens[:seq.num_tokens], seq.pages)   # after the KV is written
    allocator.release(seq)                    # the cached pages stay alive, held by the cache

Plain Python, no JAX.
"""

from __future__ import annotations

import heapq
from typing import Iterable, Sequence

from infer.cache.page_allocator import PageAllocator


class _Node:
    __slots__ = ("key", "page", "parent", "children", "last_used")

    def __init__(self, key: tuple[int, ...] | None, page: int | None, parent: _Node | None,
                 last_used: int):
        self.key = key  # the page's token ids; None at the root
        self.page = page  # page id holding their KV; None at the root
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_used = last_used


class PrefixCache:
    """Radix tree of full pages over a `PageAllocator`, holding one reference per cached page.

    max_pages caps the number of cached pages (None: bounded only by the allocator's pool, pages
    being reclaimed through `evict` when allocations run short).
    """

    def __init__(self, allocator: PageAllocator, max_pages: int | None = None):
        if max_pages is not None and max_pages < 0:
            raise ValueError(f"max_pages must be >= 0 or None, got {max_pages}")
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.max_pages = max_pages
        self._root = _Node(None, None, None, 0)
        self._nodes: dict[int, _Node] = {}  # page id -> its node
        self._clock = 0
        self.reset_stats()

    def __len__(self) -> int:
        """Pages cached now."""
        return len(self._nodes)

    # -- lookups and inserts --------------------------------------------------------------------

    def _keys(self, token_ids: Sequence[int]) -> list[tuple[int, ...]]:
        """The token tuples of the whole pages of `token_ids` (a trailing partial page dropped)."""
        ids = [int(t) for t in token_ids]
        g = self.page_size
        return [tuple(ids[i:i + g]) for i in range(0, len(ids) - g + 1, g)]

    def match(self, token_ids: Sequence[int]) -> list[int]:
        """Page ids holding the KV of the longest cached page-aligned prefix of `token_ids`.

        Marks the matched pages as used now. Does NOT incref: a caller that keeps the pages must
        `allocator.incref` them itself, and before its next allocation (an allocation may call
        `evict`, which frees unreferenced cached pages).

        The model must still run at least one prompt token to get the next token's logits. Match
        `prompt[:-1]` so that token is never inside a matched page (the alternative, matching the
        whole prompt, needs `prepare_write` to copy the last shared page before recomputing it).
        """
        nodes = self._matched(token_ids)
        self._clock += 1
        for node in nodes:
            node.last_used = self._clock
        return [node.page for node in nodes]

    def lookup(self, token_ids: Sequence[int]) -> list[int]:
        """`match`, counted in the stats as one lookup whose caller takes every matched page:
        for callers that look up a sequence once (a scheduler looking again before each chunk
        counts with `record` instead)."""
        pages = self.match(token_ids)
        self.record(lookups=1, lookup_tokens=len(token_ids), hits=int(bool(pages)),
                    hit_tokens=len(pages) * self.page_size)
        return pages

    def record(self, *, lookups: int = 0, lookup_tokens: int = 0, hits: int = 0,
               hit_tokens: int = 0) -> None:
        """Counts lookups and what they took. `match` counts nothing: a scheduler looks again
        for the same request before each chunk, and only it knows which pages were new."""
        self._stats["lookups"] += lookups
        self._stats["lookup_tokens"] += lookup_tokens
        self._stats["hits"] += hits
        self._stats["hit_tokens"] += hit_tokens

    def cached_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of `token_ids` `match` would find cached, changing nothing
        (no stats, no recency): for routing a request to the replica that holds its prefix."""
        return len(self._matched(token_ids)) * self.page_size

    def _matched(self, token_ids: Sequence[int]) -> list[_Node]:
        """The nodes of the longest cached page-aligned prefix of `token_ids`, root excluded."""
        return self._path(self._keys(token_ids))

    def _path(self, keys: Sequence[tuple[int, ...]]) -> list[_Node]:
        """The nodes along `keys` (pages of tokens) from the root, as far as the tree has them."""
        node, nodes = self._root, []
        for key in keys:
            node = node.children.get(key)
            if node is None:
                break
            nodes.append(node)
        return nodes

    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> int:
        """Cache the full pages of a sequence: `pages[i]` holds the KV of tokens
        `token_ids[i*G:(i+1)*G]` (pass only tokens whose KV is written). Returns how many pages
        were newly cached (each gets an incref).

        Where the tree already caches a page for the same tokens it is kept and the caller's
        duplicate is not cached. Over `max_pages`, least recently used unreferenced pages are
        evicted first; if that is not enough only the leading new pages that fit are cached.
        """
        keys = self._keys(token_ids)
        if len(pages) < len(keys):
            raise ValueError(f"{len(keys)} full pages of tokens but only {len(pages)} pages")
        path = self._path(keys)
        node, i = (path[-1] if path else self._root), len(path)
        new = [int(p) for p in pages[i:len(keys)]]
        # Checked before anything changes: a refused insert leaves stats and recency alone.
        for p in new:
            if self.allocator.refcount(p) < 1:
                raise ValueError(f"page {p} is free: only pages the caller holds can be cached")
            if p in self._nodes:
                raise ValueError(f"page {p} is already cached under other tokens")
        if len(set(new)) != len(new):
            raise ValueError(f"pages {new} repeat")
        self._clock += 1
        self._stats["inserts"] += 1
        for matched in path:
            matched.last_used = self._clock
        if self.max_pages is not None:
            over = len(self._nodes) + len(new) - self.max_pages
            if over > 0:
                self._evict(over, keep=node)
            new = new[:max(0, self.max_pages - len(self._nodes))]
        self.allocator.incref(new)
        for key, page in zip(keys[i:], new):
            child = _Node(key, page, node, self._clock)
            node.children[key] = child
            self._nodes[page] = child
            node = child
        self._stats["inserted_pages"] += len(new)
        return len(new)

    # -- eviction -------------------------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` pages, least recently used unreferenced leaves first (a
        parent left childless becomes a candidate in turn). Pages a sequence still holds are
        never evicted. Returns how many pages were freed. Usable as the allocator's reclaimer."""
        return self._evict(num_pages, keep=None)

    def _evict(self, num_pages: int, keep: _Node | None) -> int:
        def evictable(node: _Node) -> bool:
            return (node is not self._root and node is not keep and not node.children
                    and self.allocator.refcount(node.page) == 1)

        heap = [(n.last_used, n.page) for n in self._nodes.values() if evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, page = heapq.heappop(heap)
            node = self._nodes.pop(page)
            parent = node.parent
            del parent.children[node.key]
            self.allocator.decref([page])
            freed += 1
            if evictable(parent):
                heapq.heappush(heap, (parent.last_used, parent.page))
        self._stats["evicted_pages"] += freed
        return freed

    def num_evictable(self, pinned: Iterable[int] = ()) -> int:
        """Pages `evict` could free now: cached pages only the cache holds, with no page in use
        below them. Free pages + this = what an allocation can get (for admission control).
        `pinned` pages count as in use: pages a caller is about to take a reference to."""
        pinned = set(pinned)
        blocked: set[int] = set()  # pages with an in-use page at or below them
        for node in self._nodes.values():
            if self.allocator.refcount(node.page) > 1 or node.page in pinned:
                while node is not self._root and node.page not in blocked:
                    blocked.add(node.page)
                    node = node.parent
        return len(self._nodes) - len(blocked)

    # -- stats and checks -----------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Counters since the last `reset_stats`, as `record`ed (the scheduler: lookups =
        admissions, hits = admissions that took >= 1 page, *_tokens = tokens asked for / taken
        from the cache), the hit rates, and the pages cached now."""
        s = dict(self._stats)
        s["request_hit_rate"] = s["hits"] / s["lookups"] if s["lookups"] else 0.0
        s["token_hit_rate"] = s["hit_tokens"] / s["lookup_tokens"] if s["lookup_tokens"] else 0.0
        s["cached_pages"] = len(self._nodes)
        return s

    def reset_stats(self) -> None:
        self._stats = {"lookups": 0, "hits": 0, "lookup_tokens": 0, "hit_tokens": 0,
                       "inserts": 0, "inserted_pages": 0, "evicted_pages": 0}

    def check_invariants(self) -> None:
        """Raise AssertionError unless the tree and its page index agree, each cached page is
        held (refcount >= 1), appears once, sits under the key of its tokens, is used no later
        than its parent, and the cap holds."""
        seen: dict[int, _Node] = {}
        stack = [self._root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.key == key and len(key) == self.page_size, (key, child.key)
                assert child.parent is node, f"page {child.page}: wrong parent"
                assert child.page not in seen, f"page {child.page} cached twice"
                assert self.allocator.refcount(child.page) >= 1, f"cached page {child.page} free"
                assert node is self._root or child.last_used <= node.last_used, \
                    f"page {child.page} used after its parent {node.page}"
                seen[child.page] = child
                stack.append(child)
        assert seen.keys() == self._nodes.keys(), (sorted(seen), sorted(self._nodes))
        assert all(seen[p] is self._nodes[p] for p in seen)
        assert self.max_pages is None or len(self._nodes) <= self.max_pages, \
            f"{len(self._nodes)} pages cached, cap {self.max_pages}"
