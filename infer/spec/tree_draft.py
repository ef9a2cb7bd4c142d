"""Tree geometry and EAGLE-2 tree drafting, batched: one tree per row over any cache (the batch-1
speculator's contiguous one, `infer.spec.tree`, or the engine's paged one,
`infer.spec.model_proposers`).

How the head expands a tree: each level is one head call over *all* tree rows so far (drafting
order, so they are a prefix of a fixed-size row block) with the same kind of tree mask the
target uses, written to scratch slots after the head's committed ones. Recomputing the upper
levels costs a few rows of one layer. Keeping them cached instead and adding one level per call
would not work with one cache: the attention shows every cached slot before a call's first new
row, siblings included, so each branch would need a cache of its own.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from infer.cache.metadata import AttentionMetadata
from infer.cache.protocol import CacheT
from infer.model.llama import Llama
from infer.sampling_params import is_integer
from infer.spec.draft_vocab import DraftVocab, draft_logits
from infer.spec.verify import tree_structure


def full_tree(branches: int, depth: int) -> np.ndarray:
    """parents [N] of the complete `branches`-ary tree of `depth` levels below the root, in BFS
    order: node i's children are branches*i + 1 .. branches*i + branches."""
    if branches < 1 or depth < 1:
        raise ValueError(f"need branches >= 1 and depth >= 1, got {branches}, {depth}")
    n = sum(branches ** d for d in range(depth + 1))
    return np.array([-1] + [(i - 1) // branches for i in range(1, n)], np.int32)


def _depths(parents: np.ndarray) -> np.ndarray:
    depth = np.zeros(len(parents), np.int32)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


def dynamic_tree_size(branches: int, depth: int, width: int) -> tuple[list[int], int]:
    """Of EAGLE-2's expansion (`TreeShape` with a budget): how many nodes are expanded at
    levels 1..depth-1, and the number of candidates drafted in all."""
    if branches < 1 or depth < 1 or width < 1:
        raise ValueError(f"need branches, depth and width >= 1, got {branches}, {depth}, {width}")
    expanded, level = [], branches
    for _ in range(depth - 1):
        expanded.append(min(width, level))
        level = expanded[-1] * branches
    return expanded, branches + branches * sum(expanded)


def select_nodes(scores: jax.Array, cand_parents: jax.Array, budget: int
                 ) -> tuple[jax.Array, jax.Array]:
    """EAGLE-2's reranking: the `budget` candidates of highest score, as a tree.

    scores [C] are cumulative log-probabilities (a child's is its parent's plus its own log p,
    so never above its parent's), candidates in drafting order (a parent before its children),
    cand_parents [C] the parent's candidate index (-1: the root). `lax.top_k` puts the lower
    index first among equal scores, so the chosen set holds every chosen node's parent.
    Returns the chosen candidates in drafting order, sel [budget], and the tree's parents
    [budget + 1] over nodes (0: the root, node i: candidate sel[i - 1])."""
    _, sel = jax.lax.top_k(scores, budget)
    sel = jnp.sort(sel).astype(jnp.int32)
    node_of = jnp.zeros(scores.shape[0], jnp.int32).at[sel].set(
        jnp.arange(1, budget + 1, dtype=jnp.int32))
    up = cand_parents[sel]
    parents = jnp.where(up < 0, 0, node_of[jnp.maximum(up, 0)])
    return sel, jnp.concatenate([jnp.full(1, -1, jnp.int32), parents])


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """Which tree a step drafts. `budget=None`: the full `branches`-ary tree of `depth` levels
    (`branches=1`: the chain). Otherwise EAGLE-2's dynamic tree: each level expands its `width`
    (default `branches`) nodes of highest cumulative draft log-probability into their
    top-`branches` children, `depth` levels deep, and the `budget` best of all the drafted
    candidates are verified, so the tree's shape follows the draft's confidence step by step."""

    branches: int
    depth: int
    budget: int | None = None
    width: int | None = None

    def __post_init__(self) -> None:
        if self.budget is None:
            full_tree(self.branches, self.depth)  # validates
            if self.width is not None:
                raise ValueError("width is the dynamic tree's: give a budget too")
            return
        _, drafted = dynamic_tree_size(self.branches, self.depth, self.expand_width)
        if not is_integer(self.budget) or not 1 <= self.budget <= drafted:
            raise ValueError(f"budget must be an integer in [1, {drafted}] (the candidates a "
                             f"{self.branches}-branch, {self.depth}-level expansion of width "
                             f"{self.expand_width} drafts), got {self.budget!r}")

    @property
    def expand_width(self) -> int:
        return self.branches if self.width is None else self.width

    @property
    def num_nodes(self) -> int:
        """Nodes verified per step, the root included."""
        if self.budget is None:
            return len(full_tree(self.branches, self.depth))
        return self.budget + 1

    @property
    def head_rows(self) -> int:
        """Rows the head writes after its committed slots while drafting: one per expanded
        node (the full tree's nodes above its last level)."""
        if self.budget is None:
            return int((_depths(full_tree(self.branches, self.depth))[1:] < self.depth).sum())
        return sum(dynamic_tree_size(self.branches, self.depth, self.expand_width)[0])

    @property
    def reserved_slots(self) -> int:
        """Cache slots past a sequence's last token that a step may write: the verified
        candidates, or the head's rows where they are more (`head_rows`)."""
        return max(self.num_nodes - 1, self.head_rows)

    def __str__(self) -> str:
        full = f"{self.branches}x{self.depth}"
        if self.budget is None:
            return full
        return full + ("" if self.width is None else f"w{self.width}") + f"/{self.budget}"

    @staticmethod
    def parse(text: str) -> "TreeShape":
        """The inverse of str: "BxD" (full tree), "BxD/N" or "BxDwW/N" (dynamic)."""
        match = re.fullmatch(r"(\d+)x(\d+)(?:w(\d+))?(?:/(\d+))?", text.strip())
        if match is None:
            raise ValueError(f"a tree shape is BxD, BxD/N or BxDwW/N, got {text!r}")
        branches, depth, width, budget = (None if g is None else int(g) for g in match.groups())
        return TreeShape(branches, depth, budget, width)


HeadCall = Callable[[jax.Array, jax.Array, AttentionMetadata, CacheT], tuple[jax.Array, CacheT]]
Children = Callable[[jax.Array, int], tuple[jax.Array, jax.Array]]


def _head_rows(call_head: HeadCall, cache: CacheT, length: jax.Array, writes: jax.Array,
               page_tables: jax.Array | None, h_root: jax.Array, out: jax.Array,
               parent_rows: jax.Array, tokens: jax.Array, valid: int, depth: int
               ) -> tuple[jax.Array, CacheT]:
    """One head call over each row's tree rows [B, R] in drafting order (a parent before its
    children), the first `valid` of them real (none where `writes` [B] is False). Row r holds
    a node's token and reads its parent's predicted feature, out[b, parent_rows[b, r]] from
    the previous call (ĥ_n, h_root [B, F], for a child of the root, parent_rows -1); it sits
    at the position after its parent's and sees its ancestors' rows. Returns the rows'
    predicted features [B, R, F] and the cache."""
    root = jnp.full((parent_rows.shape[0], 1), -1, jnp.int32)
    row_depth, ancestors = jax.vmap(tree_structure, (0, None))(
        jnp.concatenate([root, parent_rows + 1], axis=1), depth)
    features = jnp.where((parent_rows < 0)[..., None], h_root[:, None],
                         jnp.take_along_axis(out, jnp.maximum(parent_rows, 0)[..., None], axis=1))
    # A row of depth d is the head's row of the token at position length + d - 1.
    q_lens = jnp.where(writes, valid, 0).astype(jnp.int32)
    meta = AttentionMetadata.for_tree(length, q_lens, row_depth[:, 1:] - 1,
                                      ancestors[:, 1:, 1:], page_tables=page_tables)
    return call_head(features, jnp.maximum(tokens, 0), meta, cache)


def top_children(target: Llama, vocab: DraftVocab | None, hidden: jax.Array, k: int
                 ) -> tuple[jax.Array, jax.Array]:
    """The head's k likeliest next tokens after predicted features [..., F]: log-probabilities
    and target ids [..., k], over the whole vocabulary or the draft vocabulary's rows only
    (FR-Spec; any subset keeps verification exact, the candidates being point masses)."""
    score, index = jax.lax.top_k(jax.nn.log_softmax(draft_logits(target, hidden, vocab)), k)
    return score, (index if vocab is None else vocab[1][index]).astype(jnp.int32)


def draft_tree(shape: TreeShape, call_head: HeadCall, children: Children, cache: CacheT,
               h_root: jax.Array, root: jax.Array, length: jax.Array, writes: jax.Array,
               page_tables: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array, jax.Array, CacheT]:
    """Drafts one tree per row: after the head's catch-up, row b's root token root [B] and
    its predicted feature h_root [B, F]; the head has `length` [B] slots committed and writes
    its tree rows after them (nothing where `writes` [B] is False: that row's tree is
    discarded). `call_head(features [B, R, F], tokens [B, R], meta, cache)` runs the head
    over a paged or contiguous cache (`page_tables` for the former), `children(hidden, k)`
    gives the top-k ids after predicted features (`top_children`).

    Returns tokens [B, N] (node 0: the root), parents [B, N], scores [B, N] (each node's
    cumulative draft log-probability, 0 at the root), and the head's cache. Nodes are in
    drafting order, so their depth never decreases: any prefix of them is a tree."""
    draft = _full_draft if shape.budget is None else _dynamic_draft
    return draft(shape, call_head, children, cache, h_root, root, length, writes, page_tables)


def _full_draft(shape, call_head, children, cache, h_root, root, length, writes, page_tables):
    """Every node's top-`branches` children, level by level."""
    k, depth, n, b = shape.branches, shape.depth, shape.num_nodes, root.shape[0]
    parents = full_tree(k, depth)
    node_depth = _depths(parents)
    # Head rows: nodes of depth 1..depth-1 (nodes 1..rows), the ones that have children.
    rows = int((node_depth[1:] < depth).sum())
    parent_rows = jnp.broadcast_to(jnp.asarray(parents[1:rows + 1] - 1), (b, rows))
    tokens = jnp.full((b, n), -1, jnp.int32).at[:, 0].set(root)
    scores = jnp.zeros((b, n), jnp.float32)
    score, first = children(h_root, k)
    tokens, scores = tokens.at[:, 1:1 + k].set(first), scores.at[:, 1:1 + k].set(score)
    out = jnp.zeros((b, rows, h_root.shape[-1]), jnp.float32)
    for level in range(2, depth + 1):
        lo, hi = int((node_depth < level - 1).sum()), int((node_depth < level).sum())
        out, cache = _head_rows(call_head, cache, length, writes, page_tables, h_root, out,
                                parent_rows, tokens[:, 1:rows + 1], hi - 1, depth)
        score, kids = children(out[:, lo - 1:hi - 1], k)
        new = slice(k * lo + 1, k * hi + 1)
        tokens = tokens.at[:, new].set(kids.reshape(b, -1))
        scores = scores.at[:, new].set((scores[:, lo:hi, None] + score).reshape(b, -1))
    return tokens, jnp.broadcast_to(jnp.asarray(parents), (b, n)), scores, cache


def _dynamic_draft(shape, call_head, children, cache, h_root, root, length, writes, page_tables):
    """EAGLE-2: expand the best `width` candidates of each level (by cumulative log p), then
    keep the best `budget` of all candidates. Candidates are kept in drafting order, the
    head's rows (the expanded candidates) likewise."""
    k, depth, b = shape.branches, shape.depth, root.shape[0]
    expanded, drafted = dynamic_tree_size(k, depth, shape.expand_width)
    rows = sum(expanded)
    at = jnp.arange(b)[:, None]
    take = lambda x, i: jnp.take_along_axis(x, i, axis=1)
    score, token = children(h_root, k)
    cand_tokens = jnp.zeros((b, drafted), jnp.int32).at[:, :k].set(token)
    cand_scores = jnp.zeros((b, drafted), jnp.float32).at[:, :k].set(score)
    cand_parents = jnp.full((b, drafted), -1, jnp.int32)
    row_of = jnp.full((b, drafted), -1, jnp.int32)  # the head row expanding a candidate
    parent_rows = jnp.full((b, rows), -1, jnp.int32)
    row_tokens = jnp.zeros((b, rows), jnp.int32)
    out = jnp.zeros((b, rows, h_root.shape[-1]), jnp.float32)
    level_lo, level_size, row_lo, cand_end = 0, k, 0, k
    for m in expanded:
        _, pick = jax.lax.top_k(cand_scores[:, level_lo:level_lo + level_size], m)
        pick = (level_lo + pick).astype(jnp.int32)  # [B, m]
        here = jnp.arange(row_lo, row_lo + m, dtype=jnp.int32)
        row_of = row_of.at[at, pick].set(here[None])
        up = take(cand_parents, pick)
        parent_rows = parent_rows.at[:, here].set(
            jnp.where(up < 0, -1, take(row_of, jnp.maximum(up, 0))))
        row_tokens = row_tokens.at[:, here].set(take(cand_tokens, pick))
        out, cache = _head_rows(call_head, cache, length, writes, page_tables, h_root, out,
                                parent_rows, row_tokens, row_lo + m, depth)
        score, token = children(out[:, row_lo:row_lo + m], k)
        new = slice(cand_end, cand_end + m * k)
        cand_tokens = cand_tokens.at[:, new].set(token.reshape(b, -1))
        cand_scores = cand_scores.at[:, new].set(
            (take(cand_scores, pick)[:, :, None] + score).reshape(b, -1))
        cand_parents = cand_parents.at[:, new].set(jnp.repeat(pick, k, axis=1))
        level_lo, level_size = cand_end, m * k
        row_lo, cand_end = row_lo + m, cand_end + m * k
    sel, parents = jax.vmap(select_nodes, (0, 0, None))(cand_scores, cand_parents, shape.budget)
    tokens = jnp.concatenate([root[:, None], take(cand_tokens, sel)], axis=1)
    scores = jnp.concatenate([jnp.zeros((b, 1), jnp.float32), take(cand_scores, sel)], axis=1)
    return tokens, parents, scores, cache
