"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024): model-free drafts from suffix tries over
the request's own tokens and over the outputs of recently finished requests.

Each source is a suffix trie cut at `depth` tokens: a node is one substring of length <= depth
of the sequences it was built from, with `count`, its occurrences, and `total`, the occurrences
followed by another token (the sum of its children's counts). A proposal:

  1. match: the suffixes of the request's tokens (at most `max_match` long) whose node has a
     continuation (`total > 0`); a suffix of a matching string matches too, so the lengths that
     match are 1..m for the longest match m.
  2. draft: from a matched node, follow the most frequent child (ties: the smaller token id)
     while the path's empirical probability, the product of child.count / node.total along it,
     stays >= `min_prob`, for at most min(limit, ceil(spec_factor * match length)) tokens: a
     long match has seen more context, so its continuation is trusted further.
  3. choose: the draft with the highest score (the sum of its path probabilities: its expected
     accepted length were they calibrated) over both sources and every matched length, then
     the longer match, then the request's own trie. The longest match is drafted first and
     shorter ones only while they could still win (a score is at most the draft's length):
     usually the longest match's draft is already as long as allowed. Shorter matches matter
     where the longest has one earlier occurrence just before the end (a run of one token, a
     passage being repeated): it continues for a token, a shorter one for many.

Proposals are deterministic (drafts are point masses for the verifier), cost no model call, and
depend only on the tokens the sources hold, so the output stays exactly the target's.

Costs (D = depth = max_match + max_draft, n = tokens a trie holds):
  per-request trie  appending a token is O(D) (it extends the nodes of the sequence's current
                    suffixes, kept in a list); the match reads that list, O(max_match).
  corpus trie       adding or evicting a sequence of n tokens is O(n D); the longest match
                    walks from the root by binary search over the length, O(max_match log
                    max_match), and each shorter one walks again, O(max_match).
  draft             O(limit) steps per matched length tried (at most max_match of them,
                    usually one); each reads the node's best child, kept on insertion (a
                    removal that lowers the best child marks it stale; the next read rescans
                    that node's children once).
  memory            O(n D) nodes at worst (text that never repeats), fewer when it repeats:
                    about 160 bytes per node in CPython, so a 1,000-token prompt at D = 24 is at
                    most ~4 MB, and the default 16,384-token corpus at most ~60 MB.

Defaults, chosen by replaying the greedy outputs of the 16 repetitive prompts of
`experiments.speculation` (`--prompt_kind=repetitive`, SmolLM2, batch 1, requests in order)
through the proposer under the cost model with this CPU's measured verify cost (1.1 + 0.07 per
draft, in decode steps): spec_factor 2 (predicted 1.62x at k = 4, 1.68x at k = 8; 4 gives
1.63x and 1.61x: at k = 8 its short matches draft too far), min_prob 0.5 (0.3 to 0.7 are within
0.02x; 0.9 cuts templated continuations short, 0.1 spends verify positions on guesses),
max_match 16 (8, 16 and 24 predicted the same: past 8 tokens a match in such text is nearly
always unique; 16 leaves margin at a third less trie than 24), a corpus of outputs only (with
prompts too: within 0.03x, and the prompts would take most of the budget). n-gram lookup,
replayed the same way: 1.28x and 1.17x; these tries without the corpus: 1.24x and 1.20x.
"""

from __future__ import annotations

import array
import collections
import math
from typing import Callable, Iterator, Sequence

import jax
import numpy as np

from infer.engine.plan import PrefillChunk, SeqState
from infer.engine.request import Request
from infer.sampling_params import is_integer, is_real
from infer.spec.proposer import index_for, observe_chunks, pack_drafts

_NONE, _STALE = -1, -2  # a node's best child when it has none / when it must be rescanned


class SuffixTrie:
    """Every substring of length <= `depth` of a multiset of sequences, counted: `add` and
    `remove` a sequence in O(len * depth), `longest_match` in O(max_match log max_match).

    Nodes are ids into flat arrays and one dict of edges, (parent << 32 | token) -> child
    (token ids are in [0, 2^32)), with no Python object per node: millions of small objects
    would cost the garbage collector more than the trie's own work (with an object per node a
    1,000-token prompt took 6x as long). A node's children are a doubly linked list."""

    def __init__(self, depth: int) -> None:
        if depth < 2:
            raise ValueError(f"a suffix trie needs depth >= 2 (a match and a draft), got {depth}")
        self.depth = depth
        self._edges: dict[int, int] = {}
        # Per node (the root is 0): occurrences of its string, those followed by a token (the
        # sum of its children's counts), its most frequent child (ties: the smaller token) or
        # a marker, the token into it, and its first child and siblings.
        self._count = array.array("q", [0])
        self._total = array.array("q", [0])
        self._best = array.array("q", [_NONE])
        self._token = array.array("q", [-1])
        self._first = array.array("q", [-1])
        self._next = array.array("q", [-1])
        self._prev = array.array("q", [-1])
        self._free: list[int] = []  # ids of removed nodes, reused first

    @property
    def num_nodes(self) -> int:
        return len(self._count) - 1 - len(self._free)

    def _new(self, parent: int, token: int) -> int:
        first = self._first[parent]
        if self._free:
            node = self._free.pop()
            self._count[node] = self._total[node] = 0
            self._best[node], self._token[node] = _NONE, token
            self._first[node], self._next[node], self._prev[node] = -1, first, -1
        else:
            node = len(self._count)
            self._count.append(0)
            self._total.append(0)
            self._best.append(_NONE)
            self._token.append(token)
            self._first.append(-1)
            self._next.append(first)
            self._prev.append(-1)
        if first >= 0:
            self._prev[first] = node
        self._first[parent] = node
        self._edges[parent << 32 | token] = node
        return node

    def _bump(self, parent: int, token: int) -> int:
        """One more occurrence of parent's string followed by `token`; returns that child."""
        child = self._edges.get(parent << 32 | token)
        if child is None:
            child = self._new(parent, token)
        count = self._count
        count[child] += 1
        self._total[parent] += 1
        best = self._best[parent]
        # Only this child's count rose, so the best is the old best or this child.
        if best != child and best != _STALE and (
                best == _NONE or count[child] > count[best]
                or (count[child] == count[best] and token < self._token[best])):
            self._best[parent] = child
        return child

    def _drop(self, parent: int, token: int) -> int:
        """One occurrence fewer of parent's string followed by `token`; a child at 0 goes (its
        subtree reaches 0 in the same removal walk: its counts are at most the child's)."""
        key = parent << 32 | token
        child = self._edges[key]
        self._count[child] -= 1
        self._total[parent] -= 1
        if self._count[child] == 0:
            del self._edges[key]
            before, after = self._prev[child], self._next[child]
            if before >= 0:
                self._next[before] = after
            else:
                self._first[parent] = after
            if after >= 0:
                self._prev[after] = before
            self._free.append(child)  # not reused before this walk ends: a removal adds none
        if self._best[parent] == child:
            self._best[parent] = _STALE  # another child may be ahead now: rescan when read
        return child

    def _best_child(self, node: int) -> int:
        best = self._best[node]
        if best == _STALE:
            best, best_count, best_token = _NONE, 0, -1
            child = self._first[node]
            while child >= 0:
                count, token = self._count[child], self._token[child]
                if count > best_count or (count == best_count and token < best_token):
                    best, best_count, best_token = child, count, token
                child = self._next[child]
            self._best[node] = best
        return best

    def add(self, tokens: Sequence[int]) -> None:
        self._walk(tokens, self._bump)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undoes an `add` of the same tokens (the caller must have added them)."""
        self._walk(tokens, self._drop)

    def _walk(self, tokens: Sequence[int], step: Callable[[int, int], int]) -> None:
        """`step(parent, token)` along every substring of at most `depth` tokens, from the
        root: one occurrence more (`_bump`) or fewer (`_drop`) of each."""
        tokens = [int(t) for t in tokens]
        for start in range(len(tokens)):
            node = 0
            for token in tokens[start:start + self.depth]:
                node = step(node, token)

    def find(self, tokens: Sequence[int]) -> int | None:
        """The node of the string `tokens`, None when it does not occur."""
        node: int | None = 0
        edges = self._edges
        for token in tokens:
            node = edges.get(node << 32 | token)
            if node is None:
                return None
        return node

    def count(self, node: int) -> int:
        return self._count[node]

    def total(self, node: int) -> int:
        return self._total[node]

    def longest_match(self, tokens: Sequence[int], max_match: int) -> tuple[int, int | None]:
        """(m, node): the longest suffix of `tokens`, m <= min(max_match, depth - 1) tokens,
        that occurs followed by a token; (0, None) when not even the last token does."""
        lo, hi, found = 0, min(max_match, self.depth - 1, len(tokens)), None
        while lo < hi:  # invariant: length lo matches (0 trivially), lengths > hi do not
            mid = (lo + hi + 1) // 2
            node = self.find(tokens[len(tokens) - mid:])
            if node is not None and self._total[node] > 0:
                lo, found = mid, node
            else:
                hi = mid - 1
        return lo, found

    def matches(self, tokens: Sequence[int], max_match: int) -> Iterator[tuple[int, int]]:
        """(m, node) for every suffix of `tokens` that occurs followed by a token, the longest
        first: O(max_match log max_match) to the first, O(m) each after."""
        longest, node = self.longest_match(tokens, max_match)
        if node is None:
            return
        yield longest, node
        end = len(tokens)
        for m in range(longest - 1, 0, -1):
            node = self.find(tokens[end - m:])
            if node is None:  # never: a suffix of a string that occurs occurs too
                raise AssertionError(f"suffix of length {m} missing from the trie")
            yield m, node

    def draft(self, node: int, match: int, limit: int, spec_factor: float, min_prob: float
              ) -> tuple[list[int], float]:
        """The draft from a matched node (its string `match` tokens long): the most frequent
        child while the path probability stays >= min_prob, at most min(limit, ceil(spec_factor
        * match)) tokens and never past the trie's depth. Returns (tokens, score = the sum of
        the path probabilities)."""
        steps = min(limit, math.ceil(spec_factor * match), self.depth - match)
        out: list[int] = []
        prob, score = 1.0, 0.0
        while len(out) < steps and self._total[node] > 0:
            child = self._best_child(node)
            prob *= self._count[child] / self._total[node]
            if prob < min_prob:
                break
            out.append(self._token[child])
            score += prob
            node = child
        return out, score

    def strings(self) -> dict[tuple[int, ...], int]:
        """Every string the trie holds with its count (tests: O(nodes))."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[int, tuple[int, ...]]] = [(0, ())]
        while stack:
            node, prefix = stack.pop()
            child = self._first[node]
            while child >= 0:
                string = prefix + (self._token[child],)
                out[string] = self._count[child]
                stack.append((child, string))
                child = self._next[child]
        return out


class SuffixIndex:
    """A growing sequence's suffix trie (a request's prompt and accepted output): `append` is
    O(depth), keeping the nodes of the sequence's suffixes of length 1..depth, so that the
    longest match is read off them in O(max_match)."""

    def __init__(self, depth: int, tokens: Sequence[int] = ()) -> None:
        self.trie = SuffixTrie(depth)
        self.tokens: list[int] = []
        self._suffixes: list[int] = []  # [l - 1]: the node of tokens[-l:]
        self.extend(tokens)

    def append(self, token: int) -> None:
        token = int(token)
        self.tokens.append(token)
        bump, suffixes = self.trie._bump, self._suffixes
        self._suffixes = [bump(0, token)]
        self._suffixes.extend(bump(node, token) for node in suffixes[:self.trie.depth - 1])

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.append(token)

    def longest_match(self, max_match: int) -> tuple[int, int | None]:
        """As `SuffixTrie.longest_match` of the index's own tokens: the longest suffix that
        also occurs earlier (an occurrence may overlap it), followed by a token."""
        suffixes, total = self._suffixes, self.trie.total
        for m in range(min(max_match, self.trie.depth - 1, len(suffixes)), 0, -1):
            if total(suffixes[m - 1]) > 0:
                return m, suffixes[m - 1]
        return 0, None

    def matches(self, max_match: int) -> Iterator[tuple[int, int]]:
        """As `SuffixTrie.matches` of the index's own tokens: O(1) each, after the first."""
        longest, _ = self.longest_match(max_match)
        for m in range(longest, 0, -1):
            yield m, self._suffixes[m - 1]


class SuffixCorpus:
    """The token sequences of recently finished requests in one suffix trie, at most
    `max_tokens` tokens in all: adding past the budget evicts the oldest sequences first; a
    sequence longer than the whole budget keeps its last `max_tokens` tokens."""

    def __init__(self, max_tokens: int, depth: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"corpus budget must be >= 0 tokens, got {max_tokens}")
        self.max_tokens = max_tokens
        self.trie = SuffixTrie(depth)
        self.sequences: collections.deque[list[int]] = collections.deque()
        self.num_tokens = 0

    def add(self, tokens: Sequence[int]) -> None:
        tokens = [int(t) for t in tokens][max(len(tokens) - self.max_tokens, 0):]
        if not tokens:
            return
        while self.sequences and self.num_tokens + len(tokens) > self.max_tokens:
            old = self.sequences.popleft()
            self.trie.remove(old)
            self.num_tokens -= len(old)
        self.trie.add(tokens)
        self.sequences.append(tokens)
        self.num_tokens += len(tokens)

    def clear(self) -> None:
        self.trie = SuffixTrie(self.trie.depth)
        self.sequences.clear()
        self.num_tokens = 0


def propose_suffix(index: SuffixIndex, corpus: SuffixCorpus | None, limit: int, max_match: int,
                   spec_factor: float, min_prob: float) -> list[int]:
    """The best draft over both sources and every matching suffix length (see the module
    docstring), searched longest match first and cut off once no shorter match could win."""
    if limit <= 0:
        return []
    best: tuple[float, int, int] = (0.0, 0, 0)  # (score, match, own first) of the draft kept
    draft: list[int] = []
    sources = [(index.trie, index.matches(max_match), 1)]
    if corpus is not None and corpus.sequences:
        sources.append((corpus.trie, corpus.trie.matches(index.tokens, max_match), 0))
    for trie, matches, own in sources:
        for match, node in matches:
            # A draft's score is at most its length, which a shorter match can only lower;
            # the tuple's later fields break ties the same way as the comparison below.
            if (min(limit, math.ceil(spec_factor * match)), match, own) < best:
                break
            tokens, score = trie.draft(node, match, limit, spec_factor, min_prob)
            if tokens and (score, match, own) > best:
                best, draft = (score, match, own), tokens
    return draft


def check_suffix_params(max_match: int, spec_factor: float, min_prob: float, max_draft: int,
                        corpus_tokens: int) -> None:
    """Raises ValueError for parameters `SuffixProposer` cannot use."""
    if not is_integer(max_match) or max_match < 1:
        raise ValueError(f"suffix max_match must be an int >= 1, got {max_match!r}")
    if not is_real(spec_factor) or not spec_factor > 0 or not math.isfinite(spec_factor):
        raise ValueError(f"suffix spec_factor must be a finite number > 0, got {spec_factor!r}")
    if not is_real(min_prob) or not 0.0 <= min_prob <= 1.0:
        raise ValueError(f"suffix min_prob must be in [0, 1], got {min_prob!r}")
    if not is_integer(max_draft) or max_draft < 1:
        raise ValueError(f"suffix max_draft must be an int >= 1, got {max_draft!r}")
    if not is_integer(corpus_tokens) or corpus_tokens < 0:
        raise ValueError(f"suffix corpus_tokens must be an int >= 0 (0: no corpus), got "
                         f"{corpus_tokens!r}")


class SuffixProposer:
    """Suffix decoding: drafts from a suffix trie per request (prompt and output, caught up
    from the request's tokens at each proposal) and from a shared corpus of finished requests'
    outputs (and prompts, with `corpus_prompts`), at most `corpus_tokens` tokens, oldest out
    first; 0 turns the corpus off. A request enters the corpus when the engine forgets it
    finished (or aborted); a preempted request's index is only dropped, and rebuilt when it
    runs again.
    """

    samples_drafts = False
    feature_layers: tuple[int, ...] = ()
    state_from_tokens = True

    def __init__(self, max_match: int = 16, spec_factor: float = 2.0, min_prob: float = 0.5,
                 max_draft: int = 16, corpus_tokens: int = 16384,
                 corpus_prompts: bool = False) -> None:
        check_suffix_params(max_match, spec_factor, min_prob, max_draft, corpus_tokens)
        self.max_match, self.spec_factor, self.min_prob = max_match, spec_factor, min_prob
        self.depth = max_match + max_draft
        self.corpus_prompts = corpus_prompts
        self.corpus = SuffixCorpus(corpus_tokens, self.depth) if corpus_tokens else None
        self._indexes: dict[str, SuffixIndex] = {}
        # Every request seen in a step (prefill, decode or verify) until the engine forgets it
        # finished, so that forget can add it to the corpus.
        self._requests: dict[str, Request] = {}

    def _new_index(self) -> SuffixIndex:
        return SuffixIndex(self.depth)

    def _index(self, seq: SeqState) -> SuffixIndex:
        return index_for(self._indexes, self._new_index, seq.request)

    def propose(self, seqs: Sequence[SeqState], limits: Sequence[int], rows: int, k: int
                ) -> tuple[np.ndarray, np.ndarray, None]:
        proposals = []
        for seq, limit in zip(seqs, limits):
            if limit:
                self._requests[seq.request.request_id] = seq.request
            proposals.append(propose_suffix(self._index(seq), self.corpus, min(limit, k),
                                            self.max_match, self.spec_factor, self.min_prob)
                             if limit else [])
        return (*pack_drafts(proposals, rows, k), None)

    def commit(self, seqs: Sequence[SeqState], emitted: Sequence[Sequence[int]],
               hidden: jax.Array) -> None:
        # The index catches up at the next proposal; a request that never gets one (only
        # plain steps) should still reach the corpus when it finishes.
        for seq in seqs:
            self._requests.setdefault(seq.request.request_id, seq.request)

    def observe_prefill(self, chunks: Sequence[PrefillChunk], hidden: jax.Array) -> None:
        # A request may finish in a prefill, never to reach a decode step: max_tokens=1, or a
        # preempted one whose recompute emits its last token. It should reach the corpus too.
        for chunk in chunks:
            self._requests.setdefault(chunk.seq.request.request_id, chunk.seq.request)
        observe_chunks(self._indexes, self._new_index, chunks)

    def warmup(self) -> int:
        return 0

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
        request = self._requests.get(request_id)
        if request is None or not request.finished:
            # Never seen, or preempted: it runs again (its index is rebuilt then) and the
            # engine forgets it once more when it finishes or is aborted, even from the queue;
            # its Request stays until then, so that its tokens reach the corpus.
            return
        del self._requests[request_id]
        if self.corpus is None:
            return
        tokens = request.output_ids
        self.corpus.add(request.prompt_token_ids + tokens if self.corpus_prompts else tokens)

    def clear(self) -> None:
        """Empties the corpus (experiments: each timed pass starts from none)."""
        if self.corpus is not None:
            self.corpus.clear()
