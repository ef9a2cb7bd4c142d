"""Attention math shared by the caches: which cached slots each new query sees, and softmax
attention over them with grouped-query heads, accumulated in float32."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from infer.kv_cache import AttentionMetadata


def visibility_mask(meta: "AttentionMetadata", num_slots: int) -> jax.Array:
    """[B, T, S] bool: new query t of row b may read cache slot s.

    Every slot before the row's first new token is visible; among the new tokens, causal order,
    or the tree mask when one is given. Padding queries see slot 0 only, so their softmax stays
    finite; their outputs are never used.
    """
    starts = meta.starts[:, None, None]
    s = jnp.arange(num_slots, dtype=jnp.int32)[None, None, :]
    t = jnp.arange(meta.positions.shape[1], dtype=jnp.int32)[None, :, None]
    new = s - starts  # index of slot s among the row's new tokens
    if meta.tree_mask is None:
        among_new = new <= t
    else:
        tree = meta.tree_mask
        cols = jnp.clip(new, 0, tree.shape[2] - 1)
        among_new = jnp.take_along_axis(
            tree, jnp.broadcast_to(cols, (tree.shape[0], tree.shape[1], num_slots)), axis=2)
    visible = (s < starts) | ((new >= 0) & (new < meta.q_lens[:, None, None]) & among_new)
    padding_query = t >= meta.q_lens[:, None, None]
    return jnp.where(padding_query, s == 0, visible)


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                     scale: float | None = None) -> jax.Array:
    """q [B, T, H, D] over k, v [B, S, K, D] where mask [B, T, S] is true; returns [B, T, H, D].

    Query head h reads KV head h // (H // K). Masked values are zeroed as well as their scores:
    unused slots may hold anything, NaN included, and 0 * NaN would leak into the sum.
    """
    b, t, h, d = q.shape
    kv_heads = k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    qg = q.reshape(b, t, kv_heads, h // kv_heads, d)
    scores = jnp.einsum("btkrd,bskd->bkrts", qg, k, preferred_element_type=jnp.float32) * scale
    visible = mask[:, None, None, :, :]
    scores = jnp.where(visible, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    v = jnp.where(mask.any(axis=1)[:, :, None, None], v, jnp.zeros((), v.dtype))
    out = jnp.einsum("bkrts,bskd->btkrd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)
