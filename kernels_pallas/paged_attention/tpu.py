"""TPU-style paged attention kernel: scalar prefetch, the page table drives the index maps.

PrefetchScalarGridSpec with lengths, q_lens and the page table as scalar prefetch, grid (batch,
kv head, page block); each page of a block is its own input whose index map looks the page id up
in the page table, so the pipeline DMAs exactly the pages of the sequence. The block math is
`common`'s; `api` builds the query planes and calls `call_tpu`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.kv_quant import dequantize_planes
from kernels_pallas.paged_attention.common import MASK, finalize, online_softmax_step, visible


def _tpu_kernel(lengths_ref, q_lens_ref, pt_ref, *refs, kv_format, n_planes, ppb, r, n_blocks,
                scaled, tree, page_size):
    it = iter(refs)
    q_refs = [next(it) for _ in range(n_planes)]  # [bq, Dp] each: one block of query rows
    tree_ref = next(it) if tree else None  # [bq, T]
    k_refs = [next(it) for _ in range(ppb)]  # one [G, Ds] page each
    ks_refs = [next(it) for _ in range(ppb)] if scaled else [None] * ppb
    v_refs = [next(it) for _ in range(ppb)]
    vs_refs = [next(it) for _ in range(ppb)] if scaled else [None] * ppb
    o_refs = [next(it) for _ in range(n_planes)]
    m_ref, l_ref = next(it), next(it)
    acc_refs = [next(it) for _ in range(n_planes)]

    b, q_blk, blk = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    length, q_len = lengths_ref[b], q_lens_ref[b]
    bk = ppb * page_size
    bq = q_refs[0].shape[0]
    row_q = (q_blk * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)) // r

    @pl.when(blk == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        for acc_ref in acc_refs:
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    # Blocks wholly past the length, and query blocks wholly past the row's queries (a decode
    # row in a batch padded to a prefill chunk), do no work; their index maps repeat a block
    # already fetched, so the pipeline issues no DMA for them either.
    @pl.when((blk * bk < length) & (q_blk * bq < q_len * r))
    def _compute():
        def load(data_refs, scale_refs):
            pages = [dequantize_planes(d[...], None if s is None else s[...], kv_format)
                     for d, s in zip(data_refs, scale_refs)]
            return [jnp.concatenate([pg[i] for pg in pages], axis=0) for i in range(n_planes)]

        pos_row = blk * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        pos_col = blk * bk + jax.lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
        vis = visible(pos_row, length, q_len, row_q, tree_ref[...] if tree else None)
        m, l, accs = online_softmax_step(
            [q_ref[...].astype(jnp.float32) for q_ref in q_refs],
            load(k_refs, ks_refs), load(v_refs, vs_refs), vis, pos_col < length,
            m_ref[...], l_ref[...], [acc_ref[...] for acc_ref in acc_refs])
        m_ref[...], l_ref[...] = m, l
        for acc_ref, acc in zip(acc_refs, accs):
            acc_ref[...] = acc

    @pl.when(blk == n_blocks - 1)
    def _store():
        for o_ref, acc_ref in zip(o_refs, acc_refs):
            o_ref[...] = finalize(acc_ref[...], l_ref[...], row_q < q_len).astype(o_ref.dtype)


def call_tpu(q_planes, tree_rows, k_pages, v_pages, k_scales, v_scales, lengths, q_lens,
             page_tables, *, kv_format, ppb, r, out_dtype, interpret):
    """pallas_call of the TPU-style kernel: q planes [B, K, rows, Dp] -> outputs of that shape.

    tree_rows [B, rows, T] float 0/1 or None (causal); pages [P, K, G, Ds], scales [P, K, G,
    groups] or None; lengths, q_lens [B] int32; page_tables [B, max_pages] int32; ppb pages per
    grid step (at most max_pages); r query heads per kv head. Grid (batch, kv head, query block,
    page block): query rows come in blocks of at most `MAX_QUERY_ROWS`.
    """
    B, K, rows, Dp = q_planes[0].shape
    _, _, G, Ds = k_pages.shape
    max_pages = page_tables.shape[1]
    n_blocks = pl.cdiv(max_pages, ppb)
    bk = ppb * G
    scaled = k_scales is not None
    n_planes = len(q_planes)
    # Whole rows when few (a block dim equal to the array's), else blocks of a multiple of 8.
    bq = rows if rows <= MAX_QUERY_ROWS else MAX_QUERY_ROWS
    rows_pad = pl.cdiv(rows, bq) * bq
    if rows_pad != rows:  # padding rows are queries past T: past q_len, zeros
        q_planes = [jnp.pad(qp, ((0, 0), (0, 0), (0, rows_pad - rows), (0, 0))) for qp in q_planes]
        if tree_rows is not None:
            tree_rows = jnp.pad(tree_rows, ((0, 0), (0, rows_pad - rows), (0, 0)))

    def page_spec(j, last_dim):
        def index_map(b, h, q_blk, blk, lengths_ref, q_lens_ref, pt_ref):
            # Clamp to the last block that holds tokens (so nothing past the length is fetched)
            # and to the table's end (max_pages need not be a multiple of ppb); a query block
            # with no queries stays on block 0.
            last = jnp.maximum(pl.cdiv(lengths_ref[b], bk) - 1, 0)
            last = jnp.where(q_blk * bq < q_lens_ref[b] * r, last, 0)
            idx = jnp.minimum(jnp.minimum(blk, last) * ppb + j, max_pages - 1)
            return pt_ref[b * max_pages + idx], h, 0, 0
        # One (page, head) tile: its last two dims are the array's own, which Mosaic accepts.
        return pl.BlockSpec((None, None, G, last_dim), index_map)

    q_spec = pl.BlockSpec((None, None, bq, Dp), lambda b, h, q_blk, blk, *_: (b, h, q_blk, 0))
    in_specs, operands = [q_spec] * n_planes, list(q_planes)
    if tree_rows is not None:
        in_specs.append(pl.BlockSpec((None, bq, tree_rows.shape[2]),
                                     lambda b, h, q_blk, blk, *_: (b, q_blk, 0)))
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
        grid=(B, K, rows_pad // bq, n_blocks),
        in_specs=in_specs,
        out_specs=[q_spec] * n_planes,
        scratch_shapes=[pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32)]
        + [pltpu.VMEM((bq, Dp), jnp.float32) for _ in range(n_planes)],
    )
    kernel = functools.partial(_tpu_kernel, kv_format=kv_format, n_planes=n_planes, ppb=ppb, r=r,
                               n_blocks=n_blocks, scaled=scaled, tree=tree_rows is not None,
                               page_size=G)
    outs = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((B, K, rows_pad, Dp), out_dtype)] * n_planes,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="paged_attention_tpu",
    )(lengths, q_lens, page_tables.reshape(-1), *operands)
    return [o[:, :, :rows] for o in outs]


# Query rows of one TPU block (a multiple of 8): a long chunk is split so that a row's padding
# blocks are skipped and the softmax state fits VMEM.
MAX_QUERY_ROWS = 128

__all__ = ["call_tpu", "MAX_QUERY_ROWS"]
