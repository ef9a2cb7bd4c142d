"""Paged decode attention: one query token per sequence against a paged (optionally quantized) KV cache.

Cache layout (one layer): k_pages, v_pages [P, G, K, Ds]; page_tables [B, max_pages] int32;
lengths [B] int32; optional scales [P, G, K, groups] float32 (see kv_quant).

Two Pallas kernels share the math below. Both are written for T query tokens per sequence so that
`paged_prefill_attention` (chunked prefill, speculative verification) reuses them; decode is T = 1.
  * TPU style: PrefetchScalarGridSpec with lengths, q_lens and the page table as scalar prefetch,
    grid (batch, kv head, page block); each page of a block is its own input whose index map looks
    the page id up in the page table, so the pipeline DMAs exactly the pages of the sequence.
  * GPU style (Triton lowering): no scalar prefetch; the kernel reads the page table and the pages
    from global memory by dynamic index, grid (batch, kv head, query-row block), a loop over pages.
Every r = H / K query heads of one kv head (times the T tokens) are the rows of one block (GQA).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.kv_quant import (
    SUPPORTED_KV_FORMATS, check_kv_format, dequantize, dequantize_planes, scale_groups,
    storage_dtype, stored_head_dim,
)

# Finite, so that a row with no visible key in a block keeps m finite and exp(m_prev - m_new)
# never becomes exp(-inf + inf) = NaN. Scores are far above it.
_MASK = -1e30
_HIGHEST = jax.lax.Precision.HIGHEST


# ---------------------------------------------------------------------------------------------
# Math shared by both kernels (plain jnp on loaded blocks).


def _visible(pos_row, length, q_len, row_q, tree_rows, small=False):
    """Which (query row, key position) pairs attend: [rows, bk] bool.

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
    hit = _weighted_sum(tree_rows, onehot.astype(jnp.float32), small) > 0.5  # [rows, bk]
    return valid & ((pos_row < start) | hit)


# Small blocks use broadcast-multiply-reduce: Triton's dot needs every dim >= 16.


def _scores(q, k, small=False):
    """q [rows, Dp] . k [bk, Dp] -> [rows, bk] in f32."""
    if small:
        return jnp.sum(q[:, None, :] * k[None, :, :], axis=2)
    return jnp.einsum("rd,td->rt", q, k, precision=_HIGHEST, preferred_element_type=jnp.float32)


def _weighted_sum(p, v, small=False):
    """p [rows, bk] @ v [bk, Dp] -> [rows, Dp] in f32."""
    if small:
        return jnp.sum(p[:, :, None] * v[None, :, :], axis=1)
    return jnp.einsum("rt,td->rd", p, v, precision=_HIGHEST, preferred_element_type=jnp.float32)


def _online_softmax_step(q_planes, k_planes, v_planes, visible, v_ok, m, l, accs, small=False):
    """One block of keys: q planes [rows, Dp], k/v planes [bk, Dp], visible [rows, bk],
    v_ok [bk, 1] (position < length). Returns updated (m [rows,1], l [rows,1], accs)."""
    s = sum(_scores(qp, kp, small) for qp, kp in zip(q_planes, k_planes))  # [rows, bk]
    s = jnp.where(visible, s, _MASK)  # where, not add: an unused slot's score may be NaN
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m - m_new)
    l_new = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    # Zero values past the length too: p is 0 there, but 0 * NaN is NaN.
    accs = [alpha * acc + _weighted_sum(p, jnp.where(v_ok, vp, 0.0), small)
            for acc, vp in zip(accs, v_planes)]
    return m_new, l_new, accs


def _finalize(acc, l, row_ok):
    # Padding rows and rows that saw nothing (length 0) give zeros.
    return jnp.where(row_ok & (l > 0), acc / jnp.where(l > 0, l, 1.0), 0.0)


# ---------------------------------------------------------------------------------------------
# TPU-style kernel: scalar prefetch, the page table drives the index maps.


def _tpu_kernel(lengths_ref, q_lens_ref, pt_ref, *refs, kv_format, n_planes, ppb, r, n_blocks,
                scaled, tree, page_size):
    it = iter(refs)
    q_refs = [next(it) for _ in range(n_planes)]  # [rows, Dp] each
    tree_ref = next(it) if tree else None  # [rows, T]
    k_refs = [next(it) for _ in range(ppb)]  # one [G, Ds] page each
    ks_refs = [next(it) for _ in range(ppb)] if scaled else [None] * ppb
    v_refs = [next(it) for _ in range(ppb)]
    vs_refs = [next(it) for _ in range(ppb)] if scaled else [None] * ppb
    o_refs = [next(it) for _ in range(n_planes)]
    m_ref, l_ref = next(it), next(it)
    acc_refs = [next(it) for _ in range(n_planes)]

    b, blk = pl.program_id(0), pl.program_id(2)
    length, q_len = lengths_ref[b], q_lens_ref[b]
    bk = ppb * page_size
    rows = q_refs[0].shape[0]
    row_q = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // r

    @pl.when(blk == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _MASK, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        for acc_ref in acc_refs:
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    # Blocks wholly past the length do no work; their index maps repeat the last real block,
    # so the pipeline issues no DMA for them either.
    @pl.when(blk * bk < length)
    def _compute():
        def load(data_refs, scale_refs):
            pages = [dequantize_planes(d[...], None if s is None else s[...], kv_format)
                     for d, s in zip(data_refs, scale_refs)]
            return [jnp.concatenate([pg[i] for pg in pages], axis=0) for i in range(n_planes)]

        pos_row = blk * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        pos_col = blk * bk + jax.lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
        visible = _visible(pos_row, length, q_len, row_q, tree_ref[...] if tree else None)
        m, l, accs = _online_softmax_step(
            [q_ref[...].astype(jnp.float32) for q_ref in q_refs],
            load(k_refs, ks_refs), load(v_refs, vs_refs), visible, pos_col < length,
            m_ref[...], l_ref[...], [acc_ref[...] for acc_ref in acc_refs])
        m_ref[...], l_ref[...] = m, l
        for acc_ref, acc in zip(acc_refs, accs):
            acc_ref[...] = acc

    @pl.when(blk == n_blocks - 1)
    def _store():
        for o_ref, acc_ref in zip(o_refs, acc_refs):
            o_ref[...] = _finalize(acc_ref[...], l_ref[...], row_q < q_len).astype(o_ref.dtype)


def _call_tpu(q_planes, tree_rows, k_pages, v_pages, k_scales, v_scales, lengths, q_lens,
              page_tables, *, kv_format, ppb, r, out_dtype, interpret):
    B, K, rows, Dp = q_planes[0].shape
    _, G, _, Ds = k_pages.shape
    max_pages = page_tables.shape[1]
    n_blocks = pl.cdiv(max_pages, ppb)
    bk = ppb * G
    scaled = k_scales is not None
    n_planes = len(q_planes)

    def page_spec(j, last_dim):
        def index_map(b, h, blk, lengths_ref, q_lens_ref, pt_ref):
            # Clamp to the last block that holds tokens (so nothing past the length is fetched)
            # and to the table's end (max_pages need not be a multiple of ppb).
            last = jnp.maximum(pl.cdiv(lengths_ref[b], bk) - 1, 0)
            idx = jnp.minimum(jnp.minimum(blk, last) * ppb + j, max_pages - 1)
            return pt_ref[b * max_pages + idx], 0, h, 0
        return pl.BlockSpec((None, G, None, last_dim), index_map)

    q_spec = pl.BlockSpec((None, None, rows, Dp), lambda b, h, blk, *_: (b, h, 0, 0))
    in_specs, operands = [q_spec] * n_planes, list(q_planes)
    if tree_rows is not None:
        in_specs.append(pl.BlockSpec((None, rows, tree_rows.shape[2]), lambda b, h, blk, *_: (b, 0, 0)))
        operands.append(tree_rows)
    for pages, scales in ((k_pages, k_scales), (v_pages, v_scales)):
        # The same array once per page slot of a block: each slot's index map picks its own page.
        in_specs += [page_spec(j, Ds) for j in range(ppb)]
        operands += [pages] * ppb
        if scaled:
            in_specs += [page_spec(j, scales.shape[-1]) for j in range(ppb)]
            operands += [scales] * ppb

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(B, K, n_blocks),
        in_specs=in_specs,
        out_specs=[q_spec] * n_planes,
        scratch_shapes=[pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, 1), jnp.float32)]
        + [pltpu.VMEM((rows, Dp), jnp.float32) for _ in range(n_planes)],
    )
    kernel = functools.partial(_tpu_kernel, kv_format=kv_format, n_planes=n_planes, ppb=ppb, r=r,
                               n_blocks=n_blocks, scaled=scaled, tree=tree_rows is not None,
                               page_size=G)
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((B, K, rows, Dp), out_dtype)] * n_planes,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="paged_attention_tpu",
    )(lengths, q_lens, page_tables.reshape(-1), *operands)


# ---------------------------------------------------------------------------------------------
# GPU-style kernel: everything in global memory, pages fetched by dynamic index in a loop.


def _gpu_kernel(lengths_ref, q_lens_ref, pt_ref, *refs, kv_format, n_planes, r, scaled, tree, small):
    it = iter(refs)
    q_refs = [next(it) for _ in range(n_planes)]  # [rb, Dp] each
    tree_ref = next(it) if tree else None  # [rb, T]
    k_ref = next(it)  # [P, G, K, Ds], whole
    ks_ref = next(it) if scaled else None
    v_ref = next(it)
    vs_ref = next(it) if scaled else None
    o_refs = [next(it) for _ in range(n_planes)]

    b, h, row_blk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length, q_len = lengths_ref[b], q_lens_ref[b]
    rb, Dp = q_refs[0].shape
    G = k_ref.shape[1]
    row_q = (row_blk * rb + jax.lax.broadcasted_iota(jnp.int32, (rb, 1), 0)) // r
    q_planes = [q_ref[...].astype(jnp.float32) for q_ref in q_refs]
    tree_rows = tree_ref[...] if tree else None

    def body(i, carry):
        m, l, accs = carry
        page = pt_ref[b, i]

        def load(data_ref, scale_ref):
            scales = None if scale_ref is None else scale_ref[page, :, h, :]
            return dequantize_planes(data_ref[page, :, h, :], scales, kv_format)

        pos_row = i * G + jax.lax.broadcasted_iota(jnp.int32, (1, G), 1)
        pos_col = i * G + jax.lax.broadcasted_iota(jnp.int32, (G, 1), 0)
        visible = _visible(pos_row, length, q_len, row_q, tree_rows, small)
        m, l, accs = _online_softmax_step(q_planes, load(k_ref, ks_ref), load(v_ref, vs_ref), visible,
                                          pos_col < length, m, l, accs, small)
        return m, l, tuple(accs)

    init = (jnp.full((rb, 1), _MASK, jnp.float32), jnp.zeros((rb, 1), jnp.float32),
            tuple(jnp.zeros((rb, Dp), jnp.float32) for _ in range(n_planes)))
    _, l, accs = jax.lax.fori_loop(0, pl.cdiv(length, G), body, init)
    for o_ref, acc in zip(o_refs, accs):
        o_ref[...] = _finalize(acc, l, row_q < q_len).astype(o_ref.dtype)


def _call_gpu(q_planes, tree_rows, k_pages, v_pages, k_scales, v_scales, lengths, q_lens,
              page_tables, *, kv_format, r, out_dtype, interpret):
    B, K, rows, Dp = q_planes[0].shape
    G = k_pages.shape[1]
    # Triton wants power-of-two block dims and dot operands of at least 16: pad the rows.
    rb = min(64, max(16, pl.next_power_of_2(rows)))
    rows_pad = pl.cdiv(rows, rb) * rb
    pad = ((0, 0), (0, 0), (0, rows_pad - rows), (0, 0))
    q_planes = [jnp.pad(qp, pad) for qp in q_planes]
    small = min(G, Dp, rb) < 16
    scaled = k_scales is not None
    n_planes = len(q_planes)

    whole = pl.BlockSpec()  # the full array, left in global memory
    q_spec = pl.BlockSpec((None, None, rb, Dp), lambda b, h, i: (b, h, i, 0))
    in_specs, operands = [whole] * 3 + [q_spec] * n_planes, list(q_planes)
    if tree_rows is not None:
        T = tree_rows.shape[2]
        small = small or T < 16
        in_specs.append(pl.BlockSpec((None, rb, T), lambda b, h, i: (b, i, 0)))
        operands.append(jnp.pad(tree_rows, pad[1:]))
    for pages, scales in ((k_pages, k_scales), (v_pages, v_scales)):
        in_specs.append(whole)
        operands.append(pages)
        if scaled:
            in_specs.append(whole)
            operands.append(scales)

    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        compiler_params = plgpu.CompilerParams(num_warps=4, num_stages=2)
    kernel = functools.partial(_gpu_kernel, kv_format=kv_format, n_planes=n_planes, r=r,
                               scaled=scaled, tree=tree_rows is not None, small=small)
    outs = pl.pallas_call(
        kernel,
        grid=(B, K, rows_pad // rb),
        in_specs=in_specs,
        out_specs=[q_spec] * n_planes,
        out_shape=[jax.ShapeDtypeStruct((B, K, rows_pad, Dp), out_dtype)] * n_planes,
        compiler_params=compiler_params,
        interpret=interpret,
        name="paged_attention_gpu",
    )(lengths, q_lens, page_tables, *operands)
    return [o[:, :, :rows] for o in outs]


# ---------------------------------------------------------------------------------------------
# Shared wrapper: [B, T, H, D] queries, T >= 1.


def _paged_attention_impl(q, k_pages, v_pages, lengths, q_lens, page_tables, k_scales, v_scales,
                          tree_mask, *, kv_format, sm_scale, pages_per_block, backend, interpret):
    B, T, H, D = q.shape
    K = k_pages.shape[2]
    r = H // K
    # Rows of a block: the T tokens x r query heads of one kv head, row = t * r + j.
    qr = (q.astype(jnp.float32) * sm_scale).reshape(B, T, K, r, D)
    qr = jnp.einsum("btkrd->bktrd", qr).reshape(B, K, T * r, D)
    # int4 pages dequantize to even/odd column planes; split q the same way.
    q_planes = [qr[..., 0::2], qr[..., 1::2]] if kv_format == "int4" else [qr]
    tree_rows = None
    if tree_mask is not None:
        tree_rows = jnp.repeat(tree_mask.astype(jnp.float32), r, axis=1)  # [B, T * r, T]
    args = (q_planes, tree_rows, k_pages, v_pages, k_scales, v_scales, lengths.astype(jnp.int32),
            q_lens.astype(jnp.int32), page_tables.astype(jnp.int32))
    if backend == "tpu":
        outs = _call_tpu(*args, kv_format=kv_format, ppb=min(pages_per_block, page_tables.shape[1]),
                         r=r, out_dtype=q.dtype, interpret=interpret)
    else:
        outs = _call_gpu(*args, kv_format=kv_format, r=r, out_dtype=q.dtype, interpret=interpret)
    out = outs[0] if len(outs) == 1 else jnp.stack(outs, axis=-1).reshape(B, K, T * r, D)
    return jnp.einsum("bktrd->btkrd", out.reshape(B, K, T, r, D)).reshape(B, T, H, D)


_STATIC = ("kv_format", "sm_scale", "pages_per_block", "backend", "interpret")
_jit_compiled = jax.jit(_paged_attention_impl, static_argnames=_STATIC)
# The interpreter is a correctness tool: XLA's backend optimizations of its grid loop cost ~40%
# of the compile time and buy nothing measurable at test sizes.
_jit_interpret = jax.jit(_paged_attention_impl, static_argnames=_STATIC,
                         compiler_options={"xla_backend_optimization_level": 0})


def _paged_attention_pallas(*args, interpret, **kwargs):
    # compiler_options are only allowed on a top-level jit, not inside a caller's trace.
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))
    fn = _jit_interpret if interpret is not False and not traced else _jit_compiled
    return fn(*args, interpret=interpret, **kwargs)


def _resolve_backend(backend: str, interpret: Any) -> tuple[str, Any]:
    platform = jax.default_backend()
    if backend == "auto":
        backend = "gpu" if platform == "gpu" else "tpu"
    if backend not in ("tpu", "gpu"):
        raise ValueError(f"backend must be 'auto', 'tpu' or 'gpu', got {backend!r}")
    if platform == "cpu" and interpret is False:
        interpret = True  # Pallas compiles only for accelerators; CPU runs the interpreter
    return backend, interpret


def _concrete(x) -> np.ndarray | None:
    """Host values of x, or None under tracing (then only shapes are checked)."""
    return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


def _validate(q_shape, k_pages, v_pages, lengths, page_tables, k_scales, v_scales, kv_format,
              pages_per_block) -> None:
    """Shape/dtype checks shared by decode and prefill; q_shape is (B, ..., H, D)."""
    check_kv_format(kv_format)
    B, H, D = q_shape[0], q_shape[-2], q_shape[-1]
    if k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} must both be [P, G, K, Ds]")
    P, G, K, Ds = k_pages.shape
    if H % K:
        raise ValueError(f"query heads H={H} (q {tuple(q_shape)}) must be a multiple of kv heads "
                         f"K={K} (k_pages {k_pages.shape})")
    if Ds != stored_head_dim(D, kv_format):
        raise ValueError(f"k_pages {k_pages.shape}: stored head dim {Ds} != {stored_head_dim(D, kv_format)} "
                         f"for head dim D={D} (q {tuple(q_shape)}) in {kv_format}")
    for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
        if pages.dtype != storage_dtype(kv_format):
            raise ValueError(f"{name} {pages.shape} has dtype {pages.dtype}, {kv_format} stores "
                             f"{storage_dtype(kv_format)}")
    groups = scale_groups(D, kv_format)
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        if groups == 0 and scales is not None:
            raise ValueError(f"{kv_format} takes no scales, got {name} {scales.shape}")
        if groups and (scales is None or scales.shape != (P, G, K, groups)):
            got = None if scales is None else scales.shape
            raise ValueError(f"{kv_format} needs {name} of shape {(P, G, K, groups)} "
                             f"(k_pages {k_pages.shape}), got {got}")
    if lengths.shape != (B,):
        raise ValueError(f"lengths {lengths.shape} must be [B] = ({B},) (q {tuple(q_shape)})")
    if page_tables.ndim != 2 or page_tables.shape[0] != B:
        raise ValueError(f"page_tables {page_tables.shape} must be [B, max_pages] with B={B}")
    for name, x in (("lengths", lengths), ("page_tables", page_tables)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} {x.shape} must be integer, got {x.dtype}")
    if pages_per_block < 1:
        raise ValueError(f"pages_per_block must be >= 1, got {pages_per_block}")
    capacity = page_tables.shape[1] * G
    lens = _concrete(lengths)
    if lens is not None and (lens.min(initial=0) < 0 or lens.max(initial=0) > capacity):
        raise ValueError(f"lengths {lens.tolist()} must lie in [0, max_pages * G = {capacity}] "
                         f"(page_tables {page_tables.shape}, k_pages {k_pages.shape})")
    table = _concrete(page_tables)
    if table is not None and table.size and (table.min() < 0 or table.max() >= P):
        raise ValueError(f"page_tables {page_tables.shape} holds page ids in [{table.min()}, {table.max()}], "
                         f"outside [0, P={P}) of k_pages {k_pages.shape}")


def paged_attention(
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
    pages_per_block: int = 8,
    backend: str = "auto",
    interpret: Any = False,
) -> jax.Array:
    """Decode attention of q [B, H, D] (one token per sequence) over the paged cache -> [B, H, D].

    The query of row b sits at position lengths[b] - 1 and sees slots [0, lengths[b]); a row of
    length 0 gives zeros. Output in q's dtype, f32 accumulation. backend: "tpu", "gpu" or "auto"
    (by jax.default_backend(); on CPU the TPU-style kernel, interpreted). interpret: True, or
    pltpu.InterpretParams() to run the TPU kernel under the TPU interpreter; on CPU the kernels
    are always interpreted. pages_per_block: pages per grid step of the TPU kernel (the GPU
    kernel steps one page at a time). Page ids and lengths are range-checked only when concrete
    (not under a caller's jit); every page_tables entry must lie in [0, P), used or not.
    """
    if q.ndim != 3:
        raise ValueError(f"q {q.shape} must be [B, H, D]")
    _validate(q.shape, k_pages, v_pages, lengths, page_tables, k_scales, v_scales, kv_format,
              pages_per_block)
    backend, interpret = _resolve_backend(backend, interpret)
    sm_scale = float(1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale)
    # Decode is the one-token case of the prefill kernel: q_len 1 (0 for an empty sequence).
    q_lens = jnp.minimum(lengths, 1)
    out = _paged_attention_pallas(q[:, None], k_pages, v_pages, lengths, q_lens, page_tables,
                                  k_scales, v_scales, None, kv_format=kv_format, sm_scale=sm_scale,
                                  pages_per_block=pages_per_block, backend=backend, interpret=interpret)
    return out[:, 0]


# ---------------------------------------------------------------------------------------------
# References (pure jnp).


def gather_kv(pages: jax.Array, scales: jax.Array | None, page_tables: jax.Array,
              kv_format: str) -> jax.Array:
    """Dequantized keys or values of every table slot: [B, max_pages * G, K, D] float32."""
    B, M = page_tables.shape
    G = pages.shape[1]
    x = dequantize(pages[page_tables], None if scales is None else scales[page_tables], kv_format)
    return x.reshape(B, M * G, *x.shape[3:])


def attend_reference(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array,
                     row_ok: jax.Array, sm_scale: float) -> jax.Array:
    """Masked softmax attention in f32: q [B, T, H, D], k/v [B, S, K, D], visible [B, T, S],
    row_ok [B, T] (False rows give zeros) -> [B, T, H, D] in q's dtype."""
    B, T, H, D = q.shape
    K = k.shape[2]
    qg = q.astype(jnp.float32).reshape(B, T, K, H // K, D)
    s = jnp.einsum("btkrd,bskd->btkrs", qg, k, precision=_HIGHEST) * sm_scale
    vis = visible[:, :, None, None, :]
    s = jnp.where(vis, s, -jnp.inf)
    # Zero values no query sees: unused slots may hold NaN, and 0 * NaN is NaN.
    v = jnp.where(jnp.any(visible, axis=1)[:, :, None, None], v, 0.0)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("btkrs,bskd->btkrd", p, v, precision=_HIGHEST) / jnp.where(l > 0, l, 1.0)
    o = jnp.where(row_ok[:, :, None, None, None], o, 0.0)
    return o.reshape(B, T, H, D).astype(q.dtype)


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


__all__ = ["SUPPORTED_KV_FORMATS", "paged_attention", "paged_attention_reference", "gather_kv",
           "attend_reference"]
