"""Block math shared by the TPU-style (`tpu.py`) and GPU-style (`gpu.py`) kernels.

Both kernels are written for T query tokens per sequence so that `paged_prefill_attention`
(chunked prefill, speculative verification) reuses them; decode is T = 1. Every r = H / K query
heads of one kv head (times the T tokens) are the rows of one block (GQA), row = t * r + j.

Everything here is plain jnp on blocks a kernel has already loaded: the kernels differ only in how
they fetch pages (grid and index maps vs. a loop over dynamic indices), never in the math, so the
math lives once, here. The `small` flag of each function selects broadcast-multiply-reduce
instead of a dot: Triton's dot needs every dim >= 16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite, so that a row with no visible key in a block keeps m finite and exp(m_prev - m_new)
# never becomes exp(-inf + inf) = NaN. Scores are far above it.
MASK = -1e30
# f32 dots at full precision (the default may round operands to bfloat16, e.g. on TPU).
HIGHEST = jax.lax.Precision.HIGHEST


def visible(pos_row, length, q_len, row_q, tree_rows, small=False):
    """Which (query row, key position) pairs attend, so both kernels mask alike: [rows, bk] bool.

    pos_row [1, bk] key positions; row_q [rows, 1] query index of each row (query i sits at slot
    start + i, start = length - q_len); tree_rows [rows, T] float 0/1 or None (causal).
    """
    start = length - q_len
    valid = pos_row < length
    if tree_rows is None:
        return valid & (pos_row <= start + row_q)
    T = tree_rows.shape[1]
    # New slot j = pos - start is visible iff tree[i, j]. Gather tree[i, pos - start] with a
    # one-hot matmul (exact on 0/1 values) instead of a dynamic gather that kernels lack.
    onehot = (jax.lax.broadcasted_iota(jnp.int32, (T, pos_row.shape[1]), 0) == pos_row - start)
    hit = weighted_sum(tree_rows, onehot.astype(jnp.float32), small) > 0.5  # [rows, bk]
    return valid & ((pos_row < start) | hit)


def scores(q, k, small=False):
    """q [rows, Dp] . k [bk, Dp] -> [rows, bk] in f32, as a dot or (small) without one."""
    if small:
        return jnp.sum(q[:, None, :] * k[None, :, :], axis=2)
    return jnp.einsum("rd,td->rt", q, k, precision=HIGHEST, preferred_element_type=jnp.float32)


def weighted_sum(p, v, small=False):
    """p [rows, bk] @ v [bk, Dp] -> [rows, Dp] in f32, as a dot or (small) without one."""
    if small:
        return jnp.sum(p[:, :, None] * v[None, :, :], axis=1)
    return jnp.einsum("rt,td->rd", p, v, precision=HIGHEST, preferred_element_type=jnp.float32)


def online_softmax_step(q_planes, k_planes, v_planes, visible, v_ok, m, l, accs, small=False):
    """Fold one block of keys into the running softmax, so no kernel holds all scores at once.

    q planes [rows, Dp], k/v planes [bk, Dp], visible [rows, bk], v_ok [bk, 1] (position <
    length). Returns updated (m [rows,1], l [rows,1], accs).
    """
    return online_softmax_pages(q_planes, [(k_planes, v_planes, visible, v_ok)], m, l, accs,
                                small)


def online_softmax_pages(q_planes, pages, m, l, accs, small=False):
    """`online_softmax_step` over several blocks at once, each (k planes, v planes, visible,
    v_ok) as there: one running max and one rescale of the accumulators for all of them. For a
    kernel that cannot stack its pages into one block (Triton concatenates along the last dim
    only) but should still take several pages a step."""
    s = [jnp.where(vis, sum(scores(qp, kp, small) for qp, kp in zip(q_planes, k_planes)), MASK)
         for k_planes, _, vis, _ in pages]  # where, not add: an unused slot's score may be NaN
    m_new = m
    for block in s:
        m_new = jnp.maximum(m_new, jnp.max(block, axis=1, keepdims=True))
    p = [jnp.where(vis, jnp.exp(block - m_new), 0.0) for block, (_, _, vis, _) in zip(s, pages)]
    alpha = jnp.exp(m - m_new)
    l_new = alpha * l + sum(jnp.sum(block, axis=1, keepdims=True) for block in p)
    # Zero values past the length too: p is 0 there, but 0 * NaN is NaN.
    accs = [alpha * acc + sum(weighted_sum(block, jnp.where(v_ok, v_planes[i], 0.0), small)
                              for block, (_, v_planes, _, v_ok) in zip(p, pages))
            for i, acc in enumerate(accs)]
    return m_new, l_new, accs


def finalize(acc, l, row_ok):
    """acc / l, with zeros for padding rows and rows that saw nothing (length 0), not NaN.

    A row that saw a key has l >= 1 (its largest score contributes exp(0)), so l == 0 means it
    saw nothing. Test l != 0, not l > 0: a NaN l (a NaN or inf key it saw) must stay NaN, as
    in the reference, rather than pass for a row that saw nothing and come out as zeros."""
    return jnp.where(row_ok & (l != 0), acc / jnp.where(l != 0, l, 1.0), 0.0)


__all__ = ["MASK", "HIGHEST", "visible", "scores", "weighted_sum", "online_softmax_step",
           "online_softmax_pages", "finalize"]
