"""Pure-jnp references of paged decode and prefill attention: the ground truth the kernels are
tested against, with no Pallas in them.

Gather every table slot's pages through the page table, dequantize (`kv_quant.dequantize`),
build the [B, T, S] visibility mask, and run masked softmax attention in f32. Decode is the
T = 1 case: the query sees slots [0, lengths[b]). Prefill (chunked prefill, speculative
verification) follows `paged_prefill_attention`'s rule, see `prefill_visibility`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from kernels_pallas.kv_quant import dequantize
from kernels_pallas.paged_attention.common import HIGHEST


def gather_kv(pages: jax.Array, scales: jax.Array | None, page_tables: jax.Array,
              kv_format: str) -> jax.Array:
    """Dequantized keys or values of every table slot: [B, max_pages * G, K, D] float32."""
    B, M = page_tables.shape
    _, K, G, _ = pages.shape
    x = dequantize(pages[page_tables], None if scales is None else scales[page_tables], kv_format)
    return x.transpose(0, 1, 3, 2, 4).reshape(B, M * G, K, x.shape[-1])


def attend_reference(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array,
                     row_ok: jax.Array, sm_scale: float) -> jax.Array:
    """Masked softmax attention in f32: q [B, T, H, D], k/v [B, S, K, D], visible [B, T, S],
    row_ok [B, T] (False rows give zeros) -> [B, T, H, D] in q's dtype."""
    B, T, H, D = q.shape
    K = k.shape[2]
    qg = q.astype(jnp.float32).reshape(B, T, K, H // K, D)
    s = jnp.einsum("btkrd,bskd->btkrs", qg, k, precision=HIGHEST) * sm_scale
    vis = visible[:, :, None, None, :]
    s = jnp.where(vis, s, -jnp.inf)
    # Zero values no query sees: unused slots may hold NaN, and 0 * NaN is NaN.
    v = jnp.where(jnp.any(visible, axis=1)[:, :, None, None], v, 0.0)
    m = jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf)  # initial: S may be 0
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("btkrs,bskd->btkrd", p, v, precision=HIGHEST) / jnp.where(l > 0, l, 1.0)
    o = jnp.where(row_ok[:, :, None, None, None], o, 0.0)
    return o.reshape(B, T, H, D).astype(q.dtype)


def prefill_visibility(lengths: jax.Array, q_lens: jax.Array, T: int, S: int,
                       tree_mask: jax.Array | None = None) -> jax.Array:
    """[B, T, S] bool: which cache slot each query sees (padding rows included).

    Query i sits at slot start + i with start = lengths[b] - q_lens[b], sees every slot < start,
    and new slot start + j iff j <= i (causal) or iff tree_mask[b, i, j].
    """
    start = (lengths - q_lens)[:, None, None]
    i = jnp.arange(T)[None, :, None]
    pos = jnp.arange(S)[None, None, :]
    in_cache = pos < lengths[:, None, None]
    if tree_mask is None:
        return in_cache & (pos <= start + i)
    j = pos - start  # index of a new slot among the T new tokens
    new_j = (j >= 0) & (j < T)
    jj = jnp.broadcast_to(jnp.clip(j, 0, T - 1), (q_lens.shape[0], T, S))
    tree_hit = jnp.take_along_axis(tree_mask.astype(bool), jj, axis=2)
    return in_cache & ((pos < start) | (new_j & tree_hit))


@functools.partial(jax.jit, static_argnames=("kv_format", "sm_scale"))
def paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    page_tables: jax.Array,
    *,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    kv_format: str = "float32",
    sm_scale: float | None = None,
) -> jax.Array:
    """Pure-jnp paged_attention: gather pages through the table, dequantize, mask, softmax."""
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    k = gather_kv(k_pages, k_scales, page_tables, kv_format)
    v = gather_kv(v_pages, v_scales, page_tables, kv_format)
    visible = (jnp.arange(k.shape[1])[None, :] < lengths[:, None])[:, None, :]  # [B, 1, S]
    return attend_reference(q[:, None], k, v, visible, lengths[:, None] > 0, sm_scale)[:, 0]


@functools.partial(jax.jit, static_argnames=("kv_format", "sm_scale"))
def paged_prefill_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    q_lens: jax.Array,
    page_tables: jax.Array,
    *,
    tree_mask: jax.Array | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    kv_format: str = "float32",
    sm_scale: float | None = None,
) -> jax.Array:
    """Pure-jnp paged_prefill_attention: gather, dequantize, mask, softmax in f32."""
    B, T = q.shape[:2]
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    k = gather_kv(k_pages, k_scales, page_tables, kv_format)
    v = gather_kv(v_pages, v_scales, page_tables, kv_format)
    visible = prefill_visibility(lengths, q_lens, T, k.shape[1], tree_mask)
    row_ok = jnp.arange(T)[None, :] < q_lens[:, None]
    return attend_reference(q, k, v, visible, row_ok, sm_scale)


@functools.partial(jax.jit, static_argnames=("kv_format", "sm_scale"))
def ragged_paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    cu_q_lens: jax.Array,
    page_tables: jax.Array,
    *,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    kv_format: str = "float32",
    sm_scale: float | None = None,
) -> jax.Array:
    """Pure-jnp ragged_paged_attention, token by token: each of the N queries finds its row
    and position from cu_q_lens and attends to its row's gathered keys, with no padded rows
    (the kernels' path pads, so the two meet only in their results)."""
    N, H, D = q.shape
    if N == 0 or page_tables.shape[0] == 0:  # no tokens, or no rows: every token is padding
        return jnp.zeros(q.shape, q.dtype)
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    k = gather_kv(k_pages, k_scales, page_tables, kv_format)  # [B, S, K, D]
    v = gather_kv(v_pages, v_scales, page_tables, kv_format)
    n = jnp.arange(N)
    row = jnp.clip(jnp.searchsorted(cu_q_lens, n, side="right") - 1, 0, page_tables.shape[0] - 1)
    q_len = cu_q_lens[row + 1] - cu_q_lens[row]
    position = lengths[row] - q_len + n - cu_q_lens[row]  # the query's own slot
    real = n < cu_q_lens[-1]
    slot = jnp.arange(k.shape[1])
    visible = (slot[None, :] <= position[:, None]) & real[:, None]  # [N, S]
    # One "row" per token: attend_reference's batch axis is the token axis here.
    out = attend_reference(q[:, None], k[row], v[row], visible[:, None, :], real[:, None],
                           sm_scale)
    return out[:, 0]


__all__ = ["ragged_paged_attention_reference", "gather_kv", "attend_reference", "prefill_visibility", "paged_attention_reference",
           "paged_prefill_attention_reference"]
