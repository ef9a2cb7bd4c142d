"""Decode attention over the paged KV cache on CPU (XLA FFI custom call; `attention.cc`).

Why: XLA's path for a decode step gathers every row's pages of the attention window into a
contiguous copy, masks the slots past each row's length and multiplies, and its scores product
(contracting the keys' minor dim) read keys at about 4 GB/s on the development machine: a
quarter of a batch-32 float32 step (`python -m experiments.profile_step`). The kernel reads each
row's valid keys and values once, from their pages.

`infer.cache.paged.PagedKVCache` hands it decode steps (one query token per row, no tree mask) of
float32 and bfloat16 caches on CPU; everything else keeps the masked attention of
`infer.cache.attention`, which `reference` is. Built on first use (`kernels_cpu.build`).
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import jax.numpy as jnp

from kernels_cpu.build import Kernel

KERNEL = Kernel(Path(__file__).with_name("attention.cc"), "InferDecodeAttentionCpu",
                "infer_decode_attention_cpu")
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def available() -> bool:
    """Whether the kernel is built and registered with XLA:CPU (see `kernels_cpu.build`)."""
    return KERNEL.available()


def takes(q: jax.Array, k_pages: jax.Array) -> bool:
    """Whether the kernel should run this decode step: on CPU, float32 or bfloat16 queries and
    pages, and the kernel available."""
    return (jnp.dtype(q.dtype) in DTYPES and jnp.dtype(k_pages.dtype) in DTYPES
            and jax.default_backend() == "cpu" and available())


def _check(q, k_pages, v_pages, lengths, page_tables) -> None:
    if q.ndim != 3 or k_pages.ndim != 4 or page_tables.ndim != 2 or lengths.ndim != 1:
        raise ValueError(f"q must be [B, H, D], pages [P, K, G, D], lengths [B] and page_tables "
                         f"[B, n]; got {q.shape}, {k_pages.shape}, {lengths.shape}, "
                         f"{page_tables.shape}")
    if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise ValueError(f"keys and values differ: {k_pages.shape} {k_pages.dtype}, "
                         f"{v_pages.shape} {v_pages.dtype}")
    b, h, d = q.shape
    if k_pages.shape[3] != d or h % k_pages.shape[1] or page_tables.shape[0] != b \
            or lengths.shape[0] != b:
        raise ValueError(f"shapes disagree: q {q.shape}, pages {k_pages.shape}, lengths "
                         f"{lengths.shape}, page_tables {page_tables.shape}")
    if jnp.dtype(q.dtype) not in DTYPES or jnp.dtype(k_pages.dtype) not in DTYPES:
        raise ValueError(f"q and pages must be float32 or bfloat16, got {q.dtype}, "
                         f"{k_pages.dtype}")


def decode(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
           page_tables: jax.Array, scale: float | None = None) -> jax.Array:
    """q [B, H, D] over each row's first lengths[b] tokens of the pages [P, K, G, D] its
    page_tables row [n] names -> [B, H, D] in q's dtype (accumulated in float32). A row of
    length 0 reads slot 0 (padding: its output is not meant to be used)."""
    _check(q, k_pages, v_pages, lengths, page_tables)
    if not available():
        raise RuntimeError("the CPU attention kernel is not available here "
                           "(see kernels_cpu/build.py)")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    result = jax.ffi.ffi_call(KERNEL.target, out, vmap_method="sequential")(
        q, k_pages, v_pages, lengths.astype(jnp.int32), page_tables.astype(jnp.int32),
        scale=np.float32(scale))
    return result.astype(q.dtype)


def reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
              page_tables: jax.Array, scale: float | None = None) -> jax.Array:
    """`decode` by jnp: the pages gathered, the slots past each length masked."""
    _check(q, k_pages, v_pages, lengths, page_tables)
    b, h, d = q.shape
    _, kv_heads, g, _ = k_pages.shape
    n = page_tables.shape[1]
    scale = d ** -0.5 if scale is None else scale
    gather = lambda pages: pages[page_tables].transpose(0, 2, 1, 3, 4).reshape(
        b, kv_heads, n * g, d).astype(jnp.float32)
    k, v = gather(k_pages), gather(v_pages)
    qg = q.astype(jnp.float32).reshape(b, kv_heads, h // kv_heads, d)
    scores = jnp.einsum("bkqd,bksd->bkqs", qg, k) * scale
    length = jnp.clip(lengths, 1, n * g)[:, None, None, None]
    scores = jnp.where(jnp.arange(n * g)[None, None, None, :] < length, scores, -jnp.inf)
    out = jnp.einsum("bkqs,bksd->bkqd", jax.nn.softmax(scores, axis=-1), v)
    return out.reshape(b, h, d).astype(q.dtype)
