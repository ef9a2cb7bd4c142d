"""Public entry points: paged decode attention (`paged_attention`, one query token per sequence)
and paged prefill attention (`paged_prefill_attention`, several new query tokens per sequence:
chunked prefill and speculative verification, chain: causal; tree: an explicit [T, T] mask),
against a paged (optionally quantized) KV cache.

Cache layout (one layer): k_pages, v_pages [P, K, G, Ds]; page_tables [B, max_pages] int32;
lengths [B] int32; optional scales [P, K, G, groups] in kv_quant.SCALE_DTYPE (see kv_quant).

For prefill the new tokens' K/V are already written into the pages. Row b has q_lens[b] <= T
real queries; query i sits at slot start + i with start = lengths[b] - q_lens[b], sees every slot
< start, and new slot start + j iff j <= i (causal) or iff tree_mask[b, i, j]. Rows
i >= q_lens[b] are padding and give zeros. Decode is the T = 1 case of the same kernels.

This file validates the arguments (every error names the offending argument's shape and what it
was checked against), chooses the backend, lays the queries out as kernel rows and calls the
TPU-style (`tpu.call_tpu`) or GPU-style (`gpu.call_gpu`) kernel.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.kv_quant import (PAGE_FORMATS, SCALE_DTYPE, check_kv_format,
                                     resolve_kv_format, scale_groups, storage_dtype,
                                     stored_head_dim)
from kernels_pallas.paged_attention.gpu import call_gpu
from kernels_pallas.paged_attention.tpu import call_tpu

# ---------------------------------------------------------------------------------------------
# Shared wrapper: [B, T, H, D] queries, T >= 1.


def _paged_attention_impl(q, k_pages, v_pages, lengths, q_lens, page_tables, k_scales, v_scales,
                          tree_mask, *, kv_format, sm_scale, pages_per_block, num_splits, backend,
                          interpret):
    B, T, H, D = q.shape
    K = k_pages.shape[1]
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
        outs = call_tpu(*args, kv_format=kv_format, ppb=min(pages_per_block, page_tables.shape[1]),
                        r=r, out_dtype=q.dtype, interpret=interpret)
    else:
        outs = call_gpu(*args, kv_format=kv_format, r=r, out_dtype=q.dtype, interpret=interpret,
                        splits=num_splits, pages_per_step=pages_per_block)
    out = outs[0] if len(outs) == 1 else jnp.stack(outs, axis=-1).reshape(B, K, T * r, D)
    return jnp.einsum("bktrd->btkrd", out.reshape(B, K, T, r, D)).reshape(B, T, H, D)


_STATIC = ("kv_format", "sm_scale", "pages_per_block", "num_splits", "backend", "interpret")
_jit_compiled = jax.jit(_paged_attention_impl, static_argnames=_STATIC)
# The interpreter is a correctness tool: XLA's backend optimizations of its grid loop cost ~40%
# of the compile time and buy nothing measurable at test sizes.
_jit_interpret = jax.jit(_paged_attention_impl, static_argnames=_STATIC,
                         compiler_options={"xla_backend_optimization_level": 0})


def _paged_attention_pallas(*args, interpret, **kwargs):
    q, page_tables = args[0], args[5]
    if q.size == 0 or page_tables.shape[1] == 0:
        # Nothing to attend: no queries, or no table slots (then every length is 0, and a row of
        # length 0 gives zeros). The kernels' grids and blocks would be empty, and their block
        # arithmetic divides by these sizes.
        return jnp.zeros(q.shape, q.dtype)
    # compiler_options are only allowed on a top-level jit, not inside a caller's trace.
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))
    fn = _jit_interpret if interpret is not False and not traced else _jit_compiled
    return fn(*args, interpret=interpret, **kwargs)


# ---------------------------------------------------------------------------------------------
# Backend choice and validation, shared by decode and prefill.


Interpret = bool | pltpu.InterpretParams | None


class UnsupportedKernelConfig(ValueError):
    """A valid request that a kernel cannot serve (a format with this head dim, a shape the
    backend's lowering has no rule for): raised up front by the entry points, before lowering,
    naming the constraint. Bad arguments (mismatched shapes, ids out of range) raise plain
    ValueError."""


def _resolve_backend(backend: str, interpret: Interpret) -> tuple[str, Interpret]:
    platform = jax.default_backend()
    if backend == "auto":
        backend = "gpu" if platform == "gpu" else "tpu"
    if backend not in ("tpu", "gpu"):
        raise ValueError(f"backend must be 'auto', 'tpu' or 'gpu', got {backend!r}")
    if interpret is None:
        interpret = platform == "cpu"  # Pallas compiles only for accelerators
    return backend, interpret


def check_backend_limits(backend: str, page_size: int, head_dim: int, kv_format: str) -> None:
    """What a backend's lowering cannot do, refused before lowering starts (and by an engine
    when it is configured): UnsupportedKernelConfig naming the constraint. backend "auto" is
    the one this host's kernels would take."""
    backend, _ = _resolve_backend(backend, False)
    if backend == "gpu" and page_size & (page_size - 1):
        # Triton blocks are powers of two, and a page is the block the GPU kernel loads.
        raise UnsupportedKernelConfig(f"the GPU kernel needs a power-of-two page size, got "
                                      f"G={page_size}")
    if backend == "gpu" and resolve_kv_format(kv_format) == "int4":
        groups = scale_groups(head_dim, "int4") // 2
        if groups & (groups - 1):
            # The GPU kernel loads a page's int4 scales (and lows) as one [G, groups] block,
            # which Triton cannot lower unless groups is a power of two (D=96: 3 groups of 32).
            raise UnsupportedKernelConfig(
                f"the GPU kernel needs a power-of-two number of int4 groups, got {groups} "
                f"(head dim D={head_dim})")


def check_kernel_format(kv_format: str) -> None:
    """Refuses, naming why, the formats the paged cache alone lays out (`kv_quant.PAGE_FORMATS`):
    their pages are not a per-vector format the kernels' dequantization reads."""
    name = resolve_kv_format(kv_format, page_formats=True)
    if name in PAGE_FORMATS:
        raise UnsupportedKernelConfig(
            f"{name} is laid out per page (keys quantized per channel over a page, each "
            "sequence's two newest pages in a bfloat16 window), which the kernels do not implement; "
            "the cache reads it with attention_backend='reference'")


def _concrete(x) -> np.ndarray | None:
    """Host values of x, or None under tracing (then only shapes are checked)."""
    return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


def _validate(q_shape, k_pages, v_pages, lengths, page_tables, k_scales, v_scales, kv_format,
              pages_per_block, num_splits) -> None:
    """Shape/dtype checks shared by decode and prefill; q_shape is (B, ..., H, D)."""
    check_kernel_format(kv_format)
    check_kv_format(kv_format)
    B, H, D = q_shape[0], q_shape[-2], q_shape[-1]
    if k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} must both be [P, K, G, Ds]")
    P, K, G, Ds = k_pages.shape
    if H % K:
        raise ValueError(f"query heads H={H} (q {tuple(q_shape)}) must be a multiple of kv heads "
                         f"K={K} (k_pages {k_pages.shape})")
    try:
        want_ds = stored_head_dim(D, kv_format)
    except ValueError as e:  # a real head dim this format cannot pack
        raise UnsupportedKernelConfig(f"{e} (q {tuple(q_shape)})") from None
    if Ds != want_ds:
        raise ValueError(f"k_pages {k_pages.shape}: stored head dim {Ds} != {want_ds} "
                         f"for head dim D={D} (q {tuple(q_shape)}) in {kv_format}")
    for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
        if pages.dtype != storage_dtype(kv_format):
            raise ValueError(f"{name} {pages.shape} has dtype {pages.dtype}, {kv_format} stores "
                             f"{storage_dtype(kv_format)}")
    groups = scale_groups(D, kv_format)
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        if groups == 0 and scales is not None:
            raise ValueError(f"{kv_format} takes no scales, got {name} {scales.shape}")
        if groups and (scales is None or scales.shape != (P, K, G, groups)):
            got = None if scales is None else scales.shape
            raise ValueError(f"{kv_format} needs {name} of shape {(P, K, G, groups)} "
                             f"(k_pages {k_pages.shape}), got {got}")
        if groups and not jnp.issubdtype(scales.dtype, jnp.floating):
            # Scales held as their integer bits would scale by the bits' values.
            raise ValueError(f"{name} {scales.shape} has dtype {scales.dtype}; scales are "
                             f"{jnp.dtype(SCALE_DTYPE).name} (bits go through from_bits first)")
    if lengths.shape != (B,):
        raise ValueError(f"lengths {lengths.shape} must be [B] = ({B},) (q {tuple(q_shape)})")
    if page_tables.ndim != 2 or page_tables.shape[0] != B:
        raise ValueError(f"page_tables {page_tables.shape} must be [B, max_pages] with B={B} "
                         f"(q {tuple(q_shape)})")
    for name, x in (("lengths", lengths), ("page_tables", page_tables)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} {x.shape} must be integer, got {x.dtype}")
    if pages_per_block < 1:
        raise ValueError(f"pages_per_block must be >= 1, got {pages_per_block}")
    if num_splits is not None and not 1 <= num_splits <= page_tables.shape[1]:
        raise ValueError(f"num_splits must lie in [1, max_pages={page_tables.shape[1]}] "
                         f"(page_tables {page_tables.shape}), got {num_splits}")
    capacity = page_tables.shape[1] * G
    lens = _concrete(lengths)
    if lens is not None and (lens.min(initial=0) < 0 or lens.max(initial=0) > capacity):
        raise ValueError(f"lengths {lens.tolist()} must lie in [0, max_pages * G = {capacity}] "
                         f"(page_tables {page_tables.shape}, k_pages {k_pages.shape})")
    table = _concrete(page_tables)
    if table is not None and table.size and (table.min() < 0 or table.max() >= P):
        raise ValueError(f"page_tables {page_tables.shape} holds page ids in [{table.min()}, {table.max()}], "
                         f"outside [0, P={P}) of k_pages {k_pages.shape}")


# ---------------------------------------------------------------------------------------------
# Public entry points.


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
    num_splits: int | None = None,
    backend: str = "auto",
    interpret: Interpret = None,
) -> jax.Array:
    """Decode attention of q [B, H, D] (one token per sequence) over the paged cache -> [B, H, D].

    The query of row b sits at position lengths[b] - 1 and sees slots [0, lengths[b]); a row of
    length 0 gives zeros. Output in q's dtype, f32 accumulation. Page ids and lengths are
    range-checked only when concrete (not under a caller's jit); every page_tables entry must lie
    in [0, P), used or not.

    Args:
      q: [B, H, D] queries, H a multiple of K.
      k_pages, v_pages: [P, K, G, Ds] pages of G tokens in the storage dtype of kv_format; Ds is
        D, or D / 2 for int4.
      lengths: [B] integer, valid kv tokens of each row, in [0, max_pages * G].
      page_tables: [B, max_pages] integer page ids in [0, P).
      k_scales, v_scales: [P, K, G, groups] (kv_quant.SCALE_DTYPE) for the scaled formats,
        else None; groups = kv_quant.scale_groups(D, kv_format).
      kv_format: one of kv_quant.SUPPORTED_KV_FORMATS.
      sm_scale: softmax scale, default 1 / sqrt(D).
      pages_per_block: pages per grid step of the TPU kernel, and per loop step of the GPU
        kernel (at most the pages one of its splits holds).
      num_splits: programs of the GPU kernel that share one sequence's pages, their partial
        softmaxes merged afterwards (flash-decoding), in [1, max_pages]; None picks enough for
        about 256 programs. The TPU kernel does not split.
      backend: "tpu", "gpu" or "auto" (by jax.default_backend(); on CPU the TPU-style kernel,
        interpreted).
      interpret: None (default) interprets on CPU and compiles on accelerators; True, or
        pltpu.InterpretParams() for the TPU interpreter, interprets anywhere; False compiles
        for `backend` even on a CPU host, which only lowering for another platform can use
        (`kernels_pallas.paged_attention.lowering`).

    Returns:
      [B, H, D] in q's dtype.
    """
    if q.ndim != 3:
        raise ValueError(f"q {q.shape} must be [B, H, D]")
    _validate(q.shape, k_pages, v_pages, lengths, page_tables, k_scales, v_scales, kv_format,
              pages_per_block, num_splits)
    backend, interpret = _resolve_backend(backend, interpret)
    check_backend_limits(backend, k_pages.shape[2], q.shape[-1], kv_format)
    sm_scale = float(1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale)
    # Decode is the one-token case of the prefill kernel: q_len 1 (0 for an empty sequence).
    q_lens = jnp.minimum(lengths, 1)
    out = _paged_attention_pallas(q[:, None], k_pages, v_pages, lengths, q_lens, page_tables,
                                  k_scales, v_scales, None, kv_format=kv_format, sm_scale=sm_scale,
                                  pages_per_block=pages_per_block, num_splits=num_splits,
                                  backend=backend, interpret=interpret)
    return out[:, 0]


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
    num_splits: int | None = None,
    backend: str = "auto",
    interpret: Interpret = None,
) -> jax.Array:
    """q [B, T, H, D] -> [B, T, H, D] in q's dtype (f32 accumulation).

    Attention of T new query tokens per sequence whose K/V are already in the pages: query i of
    row b sits at slot start + i with start = lengths[b] - q_lens[b], sees every slot < start,
    and new slot start + j iff j <= i (causal) or iff tree_mask[b, i, j]; rows i >= q_lens[b]
    are padding and give zeros. Range checks as in `paged_attention`.

    Args:
      q: [B, T, H, D] queries, H a multiple of K.
      k_pages, v_pages: [P, K, G, Ds] pages of G tokens in the storage dtype of kv_format; Ds is
        D, or D / 2 for int4.
      lengths: [B] integer, valid kv tokens including the new ones, in [0, max_pages * G].
      q_lens: [B] integer, real queries of each row, in [0, T] and at most lengths.
      page_tables: [B, max_pages] integer page ids in [0, P).
      tree_mask: [B, T, T] bool (new token i sees new token j iff tree_mask[b, i, j]) or None
        (causal).
      k_scales, v_scales: [P, K, G, groups] (kv_quant.SCALE_DTYPE) for the scaled formats,
        else None; groups = kv_quant.scale_groups(D, kv_format).
      kv_format: one of kv_quant.SUPPORTED_KV_FORMATS.
      sm_scale: softmax scale, default 1 / sqrt(D).
      pages_per_block: pages per grid step of the TPU kernel, and per loop step of the GPU
        kernel (at most the pages one of its splits holds).
      num_splits: as in `paged_attention`.
      backend: "tpu", "gpu" or "auto", as in `paged_attention`.
      interpret: as in `paged_attention`.

    Returns:
      [B, T, H, D] in q's dtype.
    """
    if q.ndim != 4:
        raise ValueError(f"q {q.shape} must be [B, T, H, D]")
    B, T = q.shape[:2]
    _validate(q.shape, k_pages, v_pages, lengths, page_tables, k_scales, v_scales, kv_format,
              pages_per_block, num_splits)
    if q_lens.shape != (B,) or not jnp.issubdtype(q_lens.dtype, jnp.integer):
        raise ValueError(f"q_lens {q_lens.shape} {q_lens.dtype} must be integer [B] = ({B},) "
                         f"(q {q.shape})")
    if tree_mask is not None and tree_mask.shape != (B, T, T):
        raise ValueError(f"tree_mask {tree_mask.shape} must be [B, T, T] = {(B, T, T)} (q {q.shape})")
    if tree_mask is not None and tree_mask.dtype != jnp.bool_:
        # The kernels read the mask as 0/1 (a one-hot matmul thresholded at 0.5), the reference
        # as nonzero: a float or integer mask of other values would make them disagree.
        raise ValueError(f"tree_mask {tree_mask.shape} must be bool, got {tree_mask.dtype}")
    qls, lens = _concrete(q_lens), _concrete(lengths)
    if qls is not None and (qls.min(initial=0) < 0 or qls.max(initial=0) > T):
        raise ValueError(f"q_lens {qls.tolist()} must lie in [0, T={T}] (q {q.shape})")
    if qls is not None and lens is not None and (qls > lens).any():
        raise ValueError(f"q_lens {qls.tolist()} exceed lengths {lens.tolist()}: the new tokens "
                         f"count in lengths")
    backend, interpret = _resolve_backend(backend, interpret)
    check_backend_limits(backend, k_pages.shape[2], q.shape[-1], kv_format)
    sm_scale = float(1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale)
    return _paged_attention_pallas(q, k_pages, v_pages, lengths, q_lens, page_tables, k_scales,
                                   v_scales, tree_mask, kv_format=kv_format, sm_scale=sm_scale,
                                   pages_per_block=pages_per_block, num_splits=num_splits,
                                   backend=backend, interpret=interpret)


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    cu_q_lens: jax.Array,
    page_tables: jax.Array,
    *,
    max_q_len: int,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    kv_format: str = "float32",
    sm_scale: float | None = None,
    pages_per_block: int = 8,
    num_splits: int | None = None,
    backend: str = "auto",
    interpret: Interpret = None,
) -> jax.Array:
    """Causal attention of a ragged batch: q [N, H, D] -> [N, H, D], one call for decode rows
    and prefill chunks of any lengths (a mixed step), as tpu-inference's ragged paged attention.

    Row b's queries are q[cu_q_lens[b]:cu_q_lens[b + 1]], its q_len new tokens, already written
    into the pages: they are the last q_len of its lengths[b] tokens, each seeing every slot
    up to its own. Tokens from cu_q_lens[B] to N are padding and give zeros. The kernels run
    over the rows padded to max_q_len queries and skip every block of padding queries, so a
    decode row costs one query block, not max_q_len.

    Args:
      q: [N, H, D] queries of every row, row after row.
      k_pages, v_pages, k_scales, v_scales, page_tables, kv_format, sm_scale, pages_per_block,
        num_splits, backend, interpret: as in `paged_attention`.
      lengths: [B] integer, each row's tokens including its new ones.
      cu_q_lens: [B + 1] integer cumulative query counts: 0, then nondecreasing, at most N.
      max_q_len: static bound on any row's queries (the chunk size of a mixed step).

    Returns:
      [N, H, D] in q's dtype.
    """
    if q.ndim != 3:
        raise ValueError(f"q {q.shape} must be [N, H, D]")
    if page_tables.ndim != 2:
        raise ValueError(f"page_tables {page_tables.shape} must be [B, max_pages]")
    B = page_tables.shape[0]
    if cu_q_lens.shape != (B + 1,) or not jnp.issubdtype(cu_q_lens.dtype, jnp.integer):
        raise ValueError(f"cu_q_lens {cu_q_lens.shape} {cu_q_lens.dtype} must be integer "
                         f"[B + 1] = ({B + 1},) (page_tables {page_tables.shape})")
    if not isinstance(max_q_len, int) or max_q_len < 1:
        raise ValueError(f"max_q_len must be a positive int, got {max_q_len!r}")
    _validate((B,) + q.shape[1:], k_pages, v_pages, lengths, page_tables, k_scales, v_scales,
              kv_format, pages_per_block, num_splits)
    cu, lens = _concrete(cu_q_lens), _concrete(lengths)
    if cu is not None:
        q_lens = np.diff(cu)
        if cu[0] != 0 or (q_lens < 0).any() or cu[-1] > q.shape[0]:
            raise ValueError(f"cu_q_lens {cu.tolist()} must start at 0, never decrease and end "
                             f"at most at N={q.shape[0]} (q {q.shape})")
        if q_lens.max(initial=0) > max_q_len:
            raise ValueError(f"cu_q_lens {cu.tolist()} holds a row of {q_lens.max()} queries, "
                             f"more than max_q_len={max_q_len}")
        if lens is not None and (q_lens > lens).any():
            raise ValueError(f"query counts {q_lens.tolist()} (cu_q_lens) exceed lengths "
                             f"{lens.tolist()}: the new tokens count in lengths")
    backend, interpret = _resolve_backend(backend, interpret)
    check_backend_limits(backend, k_pages.shape[2], q.shape[-1], kv_format)
    sm_scale = float(1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale)
    if q.shape[0] == 0 or B == 0:  # no tokens, or no rows: every token is padding
        return jnp.zeros(q.shape, q.dtype)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    # Rows padded to max_q_len: token t of row b is q[cu[b] + t] for t < q_lens[b].
    t = jnp.arange(max_q_len)
    index = jnp.clip(cu_q_lens[:-1, None] + t, 0, q.shape[0] - 1)
    real = t < q_lens[:, None]
    padded = jnp.where(real[..., None, None], q[index], 0).astype(q.dtype)
    out = _paged_attention_pallas(padded, k_pages, v_pages, lengths, q_lens, page_tables,
                                  k_scales, v_scales, None, kv_format=kv_format,
                                  sm_scale=sm_scale, pages_per_block=pages_per_block,
                                  num_splits=num_splits, backend=backend, interpret=interpret)
    # Back to token order: token n is query n - cu[b] of the row b whose range holds it.
    n = jnp.arange(q.shape[0])
    row = jnp.clip(jnp.searchsorted(cu_q_lens, n, side="right") - 1, 0, B - 1)
    flat = out[row, jnp.clip(n - cu_q_lens[row], 0, max_q_len - 1)]
    return jnp.where((n < cu_q_lens[-1])[:, None, None], flat, 0).astype(q.dtype)


__all__ = ["paged_attention", "paged_prefill_attention", "ragged_paged_attention",
           "UnsupportedKernelConfig", "check_backend_limits"]
