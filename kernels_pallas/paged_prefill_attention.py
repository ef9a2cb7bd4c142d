"""Paged attention for several new query tokens per sequence: chunked prefill and speculative
verification (chain: causal; tree: an explicit [T, T] mask).

The new tokens' K/V are already written into the pages. Row b has q_lens[b] <= T real queries;
query i sits at slot start + i with start = lengths[b] - q_lens[b], sees every slot < start, and
new slot start + j iff j <= i (causal) or iff tree_mask[b, i, j]. Rows i >= q_lens[b] are padding
and give zeros.

The kernels are those of `paged_attention` (they are written for T tokens; decode is T = 1):
TPU style (scalar-prefetched page table, grid (batch, kv head, page block), the T x r query rows
of one kv head in one block) and GPU style (grid (batch, kv head, row block), page loop).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from kernels_pallas.paged_attention import (
    _concrete, _paged_attention_pallas, _resolve_backend, _validate, attend_reference, gather_kv,
)


def paged_prefill_attention(
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
    pages_per_block: int = 8,
    backend: str = "auto",
    interpret: Any = False,
) -> jax.Array:
    """q [B, T, H, D] -> [B, T, H, D] in q's dtype (f32 accumulation).

    lengths [B]: valid kv tokens including the new ones; q_lens [B]: real queries of each row;
    tree_mask [B, T, T] bool or None (causal). Other arguments as in `paged_attention`.
    """
    if q.ndim != 4:
        raise ValueError(f"q {q.shape} must be [B, T, H, D]")
    B, T = q.shape[:2]
    _validate(q.shape, k_pages, v_pages, lengths, page_tables, k_scales, v_scales, kv_format,
              pages_per_block)
    if q_lens.shape != (B,) or not jnp.issubdtype(q_lens.dtype, jnp.integer):
        raise ValueError(f"q_lens {q_lens.shape} {q_lens.dtype} must be integer [B] = ({B},) "
                         f"(q {q.shape})")
    if tree_mask is not None and tree_mask.shape != (B, T, T):
        raise ValueError(f"tree_mask {tree_mask.shape} must be [B, T, T] = {(B, T, T)} (q {q.shape})")
    qls, lens = _concrete(q_lens), _concrete(lengths)
    if qls is not None and (qls.min(initial=0) < 0 or qls.max(initial=0) > T):
        raise ValueError(f"q_lens {qls.tolist()} must lie in [0, T={T}] (q {q.shape})")
    if qls is not None and lens is not None and (qls > lens).any():
        raise ValueError(f"q_lens {qls.tolist()} exceed lengths {lens.tolist()}: the new tokens "
                         f"count in lengths")
    backend, interpret = _resolve_backend(backend, interpret)
    sm_scale = float(1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale)
    return _paged_attention_pallas(q, k_pages, v_pages, lengths, q_lens, page_tables, k_scales,
                                   v_scales, tree_mask, kv_format=kv_format, sm_scale=sm_scale,
                                   pages_per_block=pages_per_block, backend=backend,
                                   interpret=interpret)


def prefill_visibility(lengths: jax.Array, q_lens: jax.Array, T: int, S: int,
                       tree_mask: jax.Array | None = None) -> jax.Array:
    """[B, T, S] bool: which cache slot each query sees (padding rows included)."""
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


__all__ = ["paged_prefill_attention", "paged_prefill_attention_reference", "prefill_visibility"]
