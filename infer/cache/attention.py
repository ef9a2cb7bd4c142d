"""Attention math shared by the caches: which cached slots each new query sees, and softmax
attention over them with grouped-query heads, accumulated in float32."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from infer.cache.metadata import AttentionMetadata


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


def compute_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """The dtype attention's products run in for keys and values of `dtype`: float32 for 16-bit
    ones on CPU, where XLA's batched bfloat16 products are slower than float32 ones (a plain-loop
    bfloat16 decode step of SmolLM2 over 8 rows, bfloat16 cache: 24.5 ms with bfloat16 products,
    20.4 ms with the keys and values turned to float32 first); the dtype itself elsewhere."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize < 4 and jax.default_backend() == "cpu":
        return jnp.dtype(jnp.float32)
    return dtype


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                     scale: float | None = None) -> jax.Array:
    """q [B, T, H, D] over head-major k, v [B, K, S, D] where mask [B, T, S] is true.
    Returns [B, T, H, D]; query head h reads KV head h // (H // K).

    Head-major keys and values make both products plain batched matmuls over (B, K); with
    [B, S, K, D] XLA:CPU transposed a copy of them first, which cost more than the products.
    Masked scores get probability exactly 0, so masked slots must hold finite values (0 * NaN
    is NaN): the caches guarantee it by starting zeroed and storing only real keys and values.
    """
    out_dtype = q.dtype
    work = compute_dtype(k.dtype)
    q, k, v = q.astype(work), k.astype(work), v.astype(work)
    b, t, h, d = q.shape
    kv_heads = k.shape[1]
    group = h // kv_heads
    scale = d ** -0.5 if scale is None else scale
    # Queries of one KV head as rows of one matrix [B, K, r*T, D]: both products become
    # [rows, D] x [D, S] and [rows, S] x [S, D] per (b, k), the layouts XLA:CPU multiplies
    # without transposing anything. (Left to pick from a 5-d einsum, it computed K q^T instead.)
    qg = q.reshape(b, t, kv_heads, group, d).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, group * t, d)
    scores = jnp.einsum("bkqd,bksd->bkqs", qg, k, preferred_element_type=jnp.float32)
    scores = scores * scale
    visible = jnp.broadcast_to(mask[:, None, None], (b, 1, group, t, mask.shape[-1]))
    scores = jnp.where(visible.reshape(b, 1, group * t, -1), scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkqs,bksd->bkqd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    out = out.reshape(b, kv_heads, group, t, d).transpose(0, 3, 1, 2, 4)
    return out.reshape(b, t, h, d).astype(out_dtype)
