"""GPU-style (Triton lowering) paged attention kernel: pages fetched by dynamic index in a loop.

No scalar prefetch; everything stays in global memory and the kernel reads the page table and the
pages by dynamic index, grid (batch, kv head, query-row block, split), a loop over steps of
several pages each (one softmax rescale a step, however many pages). The block math is
`common`'s; `api` builds the query planes and calls `call_gpu`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.kv_quant import dequantize_planes, int4_planes
from kernels_pallas.paged_attention.common import MASK, finalize, online_softmax_pages, visible


def _load_columns(ref, page, head, width):
    """Page `page` of head `head` of ref [P, K, G, Ds], as [G, width >= Ds] with zeros past Ds:
    Triton blocks are powers of two, head dims (80, 96) need not be. A masked load reads only
    the real columns."""
    if ref.shape[-1] == width:
        return ref[page, head, :, :]
    cols = jax.lax.broadcasted_iota(jnp.int32, (ref.shape[2], width), 1)
    return plgpu.load(ref.at[page, head, :, pl.ds(0, width)], mask=cols < ref.shape[-1],
                      other=jnp.zeros((), ref.dtype))


def _gpu_kernel(lengths_ref, q_lens_ref, pt_ref, *refs, kv_format, n_planes, r, scaled, tree, small,
                pages_per_step, steps_per_split):
    it = iter(refs)
    q_refs = [next(it) for _ in range(n_planes)]  # [rb, Dp] each
    tree_ref = next(it) if tree else None  # [rb, T]
    k_ref = next(it)  # [P, K, G, Ds], whole
    ks_ref = next(it) if scaled else None
    v_ref = next(it)
    vs_ref = next(it) if scaled else None
    acc_refs = [next(it) for _ in range(n_planes)]  # [rb, Dp] each, unnormalized
    m_ref, l_ref = next(it), next(it)  # [rb, 1]

    b, h, row_blk, split = (pl.program_id(i) for i in range(4))
    length, q_len = lengths_ref[b], q_lens_ref[b]
    rb, Dp = q_refs[0].shape
    G = k_ref.shape[2]
    max_pages = pt_ref.shape[1]
    row_q = (row_blk * rb + jax.lax.broadcasted_iota(jnp.int32, (rb, 1), 0)) // r
    q_planes = [q_ref[...].astype(jnp.float32) for q_ref in q_refs]
    tree_rows = tree_ref[...] if tree else None

    def page_block(index):
        """(k planes, v planes, visible, v_ok) of the row's page `index`. An index past the
        table reads its last page, whose positions (index * G on) lie past the length: masked."""
        page = pt_ref[b, jnp.minimum(index, max_pages - 1)]

        def load(data_ref, scale_ref):
            data = _load_columns(data_ref, page, h, Dp)
            if kv_format == "int4":
                # Scales and lows as two loads: Triton cannot slice a loaded block. Groups
                # span the stored columns, not the padded width the data was loaded at.
                n = scale_ref.shape[-1] // 2
                return int4_planes(data, scale_ref[page, h, :, pl.ds(0, n)],
                                   scale_ref[page, h, :, pl.ds(n, n)],
                                   half=data_ref.shape[-1] // n)
            scales = None if scale_ref is None else scale_ref[page, h, :, :]
            return dequantize_planes(data, scales, kv_format)

        pos_row = index * G + jax.lax.broadcasted_iota(jnp.int32, (1, G), 1)
        pos_col = index * G + jax.lax.broadcasted_iota(jnp.int32, (G, 1), 0)
        vis = visible(pos_row, length, q_len, row_q, tree_rows, small)
        return load(k_ref, ks_ref), load(v_ref, vs_ref), vis, pos_col < length

    def body(step, carry):
        m, l, accs = carry
        pages = [page_block(step * pages_per_step + j) for j in range(pages_per_step)]
        m, l, accs = online_softmax_pages(q_planes, pages, m, l, accs, small)
        return m, l, tuple(accs)

    init = (jnp.full((rb, 1), MASK, jnp.float32), jnp.zeros((rb, 1), jnp.float32),
            tuple(jnp.zeros((rb, Dp), jnp.float32) for _ in range(n_planes)))
    # This program's share of the sequence's steps; past the length it has none.
    first = split * steps_per_split
    last = jnp.minimum(first + steps_per_split, pl.cdiv(length, G * pages_per_step))
    # A block of padding rows (past the row's queries) has nothing to attend.
    last = jnp.where(row_blk * rb < q_len * r, last, first)
    m, l, accs = jax.lax.fori_loop(first, jnp.maximum(first, last), body, init)
    m_ref[...], l_ref[...] = m, l
    for acc_ref, acc in zip(acc_refs, accs):
        acc_ref[...] = acc


def combine_splits(m, l, accs, row_ok):
    """Merges the splits' partial softmaxes (flash-decoding): m, l [..., S, rows, 1], accs
    [..., S, rows, Dp] -> outputs [..., rows, Dp]. Each split's sums are rescaled to the largest
    running max; a split that saw nothing has l = 0 and adds nothing."""
    top = jnp.max(m, axis=-3, keepdims=True)
    weight = jnp.exp(m - top)
    l = jnp.sum(weight * l, axis=-3)
    return [finalize(jnp.sum(weight * acc, axis=-3), l, row_ok) for acc in accs]


def call_gpu(q_planes, tree_rows, k_pages, v_pages, k_scales, v_scales, lengths, q_lens,
             page_tables, *, kv_format, r, out_dtype, interpret, splits=None, pages_per_step=8):
    """pallas_call of the GPU-style kernel: q planes [B, K, rows, Dp] -> outputs of that shape.

    tree_rows [B, rows, T] float 0/1 or None (causal); pages [P, K, G, Ds], scales [P, K, G,
    groups] or None; lengths, q_lens [B] int32; page_tables [B, max_pages] int32; r query heads
    per kv head. `splits` programs share each sequence's pages (flash-decoding), merged by
    `combine_splits`; by default enough that the grid has about `TARGET_PROGRAMS` programs, since
    B x K alone leaves most of a GPU idle at small batches. Each program's loop takes up to
    `pages_per_step` pages a step (fewer when its share of the pages is smaller): one running
    max and one rescale of the accumulators per step instead of per page, and that many page
    loads in flight before the first product needs them.
    """
    B, K, rows, Dp = q_planes[0].shape
    G = k_pages.shape[2]
    max_pages = page_tables.shape[1]
    # Triton wants power-of-two block dims and dot operands of at least 16: pad the rows.
    rb = min(64, max(16, pl.next_power_of_2(rows)))
    rows_pad = pl.cdiv(rows, rb) * rb
    if splits is None:
        splits = max(1, min(max_pages, TARGET_PROGRAMS // (B * K * (rows_pad // rb))))
    if not 1 <= splits <= max_pages:
        raise ValueError(f"splits must lie in [1, max_pages={max_pages}], got {splits}")
    if pages_per_step < 1:
        raise ValueError(f"pages_per_step must be >= 1, got {pages_per_step}")
    # A split's share is whole steps, so that no two splits fold the same page in.
    pages_per_step = min(pages_per_step, pl.cdiv(max_pages, splits))
    steps_per_split = pl.cdiv(pl.cdiv(max_pages, splits), pages_per_step)
    splits = pl.cdiv(max_pages, steps_per_split * pages_per_step)
    width = pl.next_power_of_2(Dp)  # zero query columns past Dp meet zero key columns
    pad = ((0, 0), (0, 0), (0, rows_pad - rows), (0, width - Dp))
    q_planes = [jnp.pad(qp, pad) for qp in q_planes]
    q_spec = pl.BlockSpec((None, None, rb, width), lambda b, h, i, s: (b, h, i, 0))
    small = min(G, Dp, rb) < 16
    scaled = k_scales is not None
    n_planes = len(q_planes)

    whole = pl.BlockSpec()  # the full array, left in global memory
    in_specs, operands = [whole] * 3 + [q_spec] * n_planes, list(q_planes)
    if tree_rows is not None:
        # Triton blocks are powers of two: pad the tree's columns with nodes nobody sees (a
        # column j >= T matches no new slot anyway).
        T = pl.next_power_of_2(tree_rows.shape[2])
        small = small or T < 16
        in_specs.append(pl.BlockSpec((None, rb, T), lambda b, h, i, s: (b, i, 0)))
        operands.append(jnp.pad(tree_rows, pad[1:3] + ((0, T - tree_rows.shape[2]),)))
    for pages, scales in ((k_pages, k_scales), (v_pages, v_scales)):
        in_specs.append(whole)
        operands.append(pages)
        if scaled:
            in_specs.append(whole)
            operands.append(scales)

    split_spec = lambda last: pl.BlockSpec((None, None, None, rb, last),
                                           lambda b, h, i, s: (b, h, s, i, 0))
    partial = lambda last: jax.ShapeDtypeStruct((B, K, splits, rows_pad, last), jnp.float32)
    compiler_params = None
    if not interpret:
        compiler_params = plgpu.CompilerParams(num_warps=4, num_stages=2)
    kernel = functools.partial(_gpu_kernel, kv_format=kv_format, n_planes=n_planes, r=r,
                               scaled=scaled, tree=tree_rows is not None, small=small,
                               pages_per_step=pages_per_step, steps_per_split=steps_per_split)
    *accs, m, l = pl.pallas_call(
        kernel,
        grid=(B, K, rows_pad // rb, splits),
        in_specs=in_specs,
        out_specs=[split_spec(width)] * n_planes + [split_spec(1)] * 2,
        out_shape=[partial(width)] * n_planes + [partial(1)] * 2,
        compiler_params=compiler_params,
        interpret=interpret,
        name="paged_attention_gpu",
    )(lengths, q_lens, page_tables, *operands)
    row_ok = (jnp.arange(rows_pad)[None, :] // r < q_lens[:, None])[:, None, :, None]
    outs = combine_splits(m, l, accs, row_ok)
    return [o[:, :, :rows, :Dp].astype(out_dtype) for o in outs]


# Programs the default split aims the grid at: a few per SM of a large GPU (an H100 has 132).
TARGET_PROGRAMS = 256

__all__ = ["call_gpu", "combine_splits", "TARGET_PROGRAMS"]
