"""Prompt-lookup (n-gram) proposals for speculative decoding: host side, plain Python.

The proposer looks for the most recent earlier occurrence of the sequence's last n tokens,
longest n first, and proposes the tokens that followed it. Its proposals are deterministic:
verify them with `verify_greedy`, or with `verify_sampled` and `draft_probs = one_hot(drafts)`.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from infer.engine.plan import PrefillChunk, SeqState
from infer.spec.proposer import index_for, observe_chunks, pack_drafts


def propose_ngram(tokens: Sequence[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the last n tokens, for
    the largest n in [min_n, max_n] that occurs earlier (an occurrence may overlap the suffix,
    not be it); [] when none does. One backward scan: O(len(tokens)) comparisons (times max_n at
    worst), about a millisecond for a few thousand tokens; `NgramIndex` answers in O(max_n^2 + k).
    """
    _check(k, max_n, min_n)
    t = list(tokens)
    size = len(t)
    best_n, best_end = 0, -1
    for end in range(size - 2, -1, -1):  # the occurrence ends at `end`; the suffix ends at size-1
        if t[end] != t[-1]:
            continue
        n = 1
        while n < max_n and n <= end and t[end - n] == t[size - 1 - n]:
            n += 1
        if n > best_n:  # strictly longer: among equals, the most recent (first seen) stays
            best_n, best_end = n, end
            if n == max_n:
                break
    if best_n < min_n or k == 0:
        return []
    return t[best_end + 1:best_end + 1 + k]


class NgramIndex:
    """The same query as `propose_ngram`, incrementally: append tokens as they are accepted,
    then `propose(k)`. Keeps, for every n-gram (min_n <= n <= max_n) ending before the last
    token, where it last ended: O(max_n^2) per appended token, O(max_n^2 + k) per query, memory
    O(len * (max_n - min_n + 1)). Tokens are never removed (rejected drafts are never appended).
    """

    def __init__(self, tokens: Sequence[int] = (), max_n: int = 4, min_n: int = 1) -> None:
        _check(0, max_n, min_n)
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def append(self, token: int) -> None:
        t = self.tokens
        if t:  # the former last token's n-grams become "earlier occurrences"
            end = len(t) - 1
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self._last_end[tuple(t[end + 1 - n:end + 1])] = end
        t.append(int(token))

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.append(token)

    def propose(self, k: int) -> list[int]:
        _check(k, self.max_n, self.min_n)
        t = self.tokens
        for n in range(min(self.max_n, len(t)), self.min_n - 1, -1):
            end = self._last_end.get(tuple(t[-n:]))
            if end is not None:
                return t[end + 1:end + 1 + k]
        return []


def _check(k: int, max_n: int, min_n: int) -> None:
    if not (k >= 0 and 1 <= min_n <= max_n):
        raise ValueError(f"need k >= 0 and 1 <= min_n <= max_n, got k={k}, "
                         f"max_n={max_n}, min_n={min_n}")


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's
    last n tokens (n from max_n down to min_n), from an index kept per request."""

    samples_drafts = False
    feature_layers: tuple[int, ...] = ()
    state_from_tokens = True

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        _check(0, max_n, min_n)  # here, not at a request's first step
        self.max_n, self.min_n = max_n, min_n
        self._indexes: dict[str, NgramIndex] = {}

    def _new_index(self) -> NgramIndex:
        return NgramIndex(max_n=self.max_n, min_n=self.min_n)

    def _index(self, seq: SeqState) -> NgramIndex:
        return index_for(self._indexes, self._new_index, seq.request)

    def propose(self, seqs: Sequence[SeqState], limits: Sequence[int], rows: int, k: int
                ) -> tuple[np.ndarray, np.ndarray, None]:
        proposals = [self._index(seq).propose(limit) if limit else []
                     for seq, limit in zip(seqs, limits)]
        return (*pack_drafts(proposals, rows, k), None)

    def commit(self, seqs: Sequence[SeqState], emitted: Sequence[Sequence[int]],
               hidden: jax.Array) -> None:
        pass  # the index catches up from the request's tokens at the next proposal

    def observe_prefill(self, chunks: Sequence[PrefillChunk], hidden: jax.Array) -> None:
        observe_chunks(self._indexes, self._new_index, chunks)

    def warmup(self) -> int:
        return 0

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
