"""Attention over the paged KV cache on CPU: decode and verify steps and prefill chunks (XLA FFI
custom call, `attention.cc`).

Why: XLA's path gathers every row's pages of the attention window into a contiguous copy, masks
the slots each query may not see and multiplies, and its scores product (contracting the keys'
minor dim) read keys at about 4 GB/s on the development machine: a quarter of a batch-32 float32
decode step (`python -m experiments.profile_step`). The kernel reads each row's visible keys and
values once, from their pages; a prefill chunk's new tokens go kQueryBlock (16) at a time, each
block reading only the tokens its last query sees, so the causal triangle is skipped and one
row's chunk splits between the threads.

`infer.cache.paged.PagedKVCache` hands it every step without a tree mask over float32 and
bfloat16 caches on CPU; tree verification and the quantized formats keep the masked attention
of `infer.cache.attention`, which `reference` is. Built on first use (`kernels_cpu.build`).
`python -m experiments.attention_cpu` times the two.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels_cpu.build import Kernel

KERNEL = Kernel(Path(__file__).with_name("attention.cc"), "InferPagedAttentionCpu",
                "infer_paged_attention_cpu")
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# bfloat16 pages may come as their bits (`kv_quant.bits_dtype` holds them so on CPU), read in
# place: bitcasting them first would copy the whole pool for each layer (8.8 ms a bfloat16
# decode step of a 16-slot, 512-token engine).
BITS = {jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16)}
# The longest head the kernel keeps in registers (16 vectors of 16 float32; attention.cc).
MAX_HEAD_DIM = 256


def available() -> bool:
    """Whether the kernel is built and registered with XLA:CPU (see `kernels_cpu.build`)."""
    return KERNEL.available()


def _held_as(held: jnp.dtype, page_dtype: jnp.dtype) -> bool:
    return jnp.dtype(held) in (page_dtype, BITS.get(page_dtype))


def takes(q_dtype: jnp.dtype, kv_dtype: jnp.dtype, head_dim: int) -> bool:
    """Whether the kernel runs steps of these query and page dtypes and head dim here: float32
    or bfloat16, heads of at most MAX_HEAD_DIM (the kernel refuses longer ones at run time), on
    CPU, and the kernel available."""
    return (jnp.dtype(q_dtype) in DTYPES and jnp.dtype(kv_dtype) in DTYPES
            and 0 < head_dim <= MAX_HEAD_DIM and jax.default_backend() == "cpu"
            and available())


def _check(q, k_pages, v_pages, lengths, q_lens, page_tables, page_dtype) -> None:
    if (q.ndim != 4 or k_pages.ndim != 4 or page_tables.ndim != 2 or lengths.ndim != 1
            or q_lens.ndim != 1):
        raise ValueError(f"q must be [B, T, H, D], pages [P, K, G, D], lengths and q_lens [B] "
                         f"and page_tables [B, n]; got {q.shape}, {k_pages.shape}, "
                         f"{lengths.shape}, {q_lens.shape}, {page_tables.shape}")
    if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise ValueError(f"keys and values differ: {k_pages.shape} {k_pages.dtype}, "
                         f"{v_pages.shape} {v_pages.dtype}")
    b, _, h, d = q.shape
    if (k_pages.shape[3] != d or h % k_pages.shape[1] or page_tables.shape[0] != b
            or lengths.shape[0] != b or q_lens.shape[0] != b):
        raise ValueError(f"shapes disagree: q {q.shape}, pages {k_pages.shape}, lengths "
                         f"{lengths.shape}, q_lens {q_lens.shape}, page_tables "
                         f"{page_tables.shape}")
    if jnp.dtype(q.dtype) not in DTYPES or page_dtype not in DTYPES:
        raise ValueError(f"q and pages must be float32 or bfloat16, got {q.dtype}, "
                         f"{page_dtype}")
    if not _held_as(k_pages.dtype, page_dtype):
        raise ValueError(f"pages holding {page_dtype} come as {page_dtype} or as its bits "
                         f"({BITS.get(page_dtype)}), not {k_pages.dtype}")


def attend(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
           q_lens: jax.Array, page_tables: jax.Array, scale: float | None = None,
           page_dtype: jnp.dtype | None = None) -> jax.Array:
    """q [B, T, H, D], the new tokens of rows holding lengths[b] tokens after this step (the
    last q_lens[b] of them new), over the pages [P, K, G, D] each page_tables row [n] names ->
    [B, T, H, D] in q's dtype, accumulated in float32. New token t sees the row's first
    lengths - q_lens + t + 1 tokens; a padding query (t >= q_lens[b]) sees slot 0 (its output
    is not meant to be used). `page_dtype`: what the pages hold (default: their dtype);
    bfloat16 pages may come as their uint16 bits (`BITS`)."""
    page_dtype = jnp.dtype(k_pages.dtype if page_dtype is None else page_dtype)
    _check(q, k_pages, v_pages, lengths, q_lens, page_tables, page_dtype)
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"the kernel takes heads of at most {MAX_HEAD_DIM}, got {q.shape[-1]}")
    if not available():
        raise RuntimeError("the CPU attention kernel is not available here "
                           "(see kernels_cpu/build.py)")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    result = jax.ffi.ffi_call(KERNEL.target, out, vmap_method="sequential")(
        q, k_pages, v_pages, lengths.astype(jnp.int32), q_lens.astype(jnp.int32),
        page_tables.astype(jnp.int32), scale=np.float32(scale))
    return result.astype(q.dtype)


def reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
              q_lens: jax.Array, page_tables: jax.Array, scale: float | None = None,
              page_dtype: jnp.dtype | None = None) -> jax.Array:
    """`attend` by jnp: the pages gathered, the slots each query may not see masked."""
    page_dtype = jnp.dtype(k_pages.dtype if page_dtype is None else page_dtype)
    _check(q, k_pages, v_pages, lengths, q_lens, page_tables, page_dtype)
    if k_pages.dtype != page_dtype:
        k_pages = jax.lax.bitcast_convert_type(k_pages, page_dtype)
        v_pages = jax.lax.bitcast_convert_type(v_pages, page_dtype)
    b, t, h, d = q.shape
    _, kv_heads, g, _ = k_pages.shape
    n = page_tables.shape[1]
    scale = d ** -0.5 if scale is None else scale
    gather = lambda pages: pages[page_tables].transpose(0, 2, 1, 3, 4).reshape(
        b, kv_heads, n * g, d).astype(jnp.float32)
    k, v = gather(k_pages), gather(v_pages)
    qg = q.astype(jnp.float32).reshape(b, t, kv_heads, h // kv_heads, d)
    scores = jnp.einsum("btkgd,bksd->btkgs", qg, k) * scale
    query = jnp.arange(t)[None, :]
    seen = jnp.where(query < q_lens[:, None],
                     jnp.clip(lengths[:, None] - q_lens[:, None] + query + 1, 1, n * g), 1)
    visible = jnp.arange(n * g)[None, None, :] < seen[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, :, None, None, :], scores, -jnp.inf)
    out = jnp.einsum("btkgs,bksd->btkgd", jax.nn.softmax(scores, axis=-1), v)
    return out.reshape(b, t, h, d).astype(q.dtype)
