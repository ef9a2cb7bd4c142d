"""GPU-style (Triton lowering) paged attention kernel: pages fetched by dynamic index in a loop.

No scalar prefetch; everything stays in global memory and the kernel reads the page table and the
pages by dynamic index, grid (batch, kv head, query-row block), a loop over pages. The block math
is `common`'s; `api` builds the query planes and calls `call_gpu`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.kv_quant import dequantize_planes
from kernels_pallas.paged_attention.common import MASK, finalize, online_softmax_step, visible


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
        vis = visible(pos_row, length, q_len, row_q, tree_rows, small)
        m, l, accs = online_softmax_step(q_planes, load(k_ref, ks_ref), load(v_ref, vs_ref), vis,
                                         pos_col < length, m, l, accs, small)
        return m, l, tuple(accs)

    init = (jnp.full((rb, 1), MASK, jnp.float32), jnp.zeros((rb, 1), jnp.float32),
            tuple(jnp.zeros((rb, Dp), jnp.float32) for _ in range(n_planes)))
    _, l, accs = jax.lax.fori_loop(0, pl.cdiv(length, G), body, init)
    for o_ref, acc in zip(o_refs, accs):
        o_ref[...] = finalize(acc, l, row_q < q_len).astype(o_ref.dtype)


def call_gpu(q_planes, tree_rows, k_pages, v_pages, k_scales, v_scales, lengths, q_lens,
             page_tables, *, kv_format, r, out_dtype, interpret):
    """pallas_call of the GPU-style kernel: q planes [B, K, rows, Dp] -> outputs of that shape.

    tree_rows [B, rows, T] float 0/1 or None (causal); pages [P, G, K, Ds], scales [P, G, K,
    groups] or None; lengths, q_lens [B] int32; page_tables [B, max_pages] int32; r query heads
    per kv head. The kernel steps one page at a time (no pages_per_block).
    """
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


__all__ = ["call_gpu"]
