"""KV-cache storage formats: quantize on write, dequantize on read.

Pure jnp, no Pallas: the framework's cache writes call `quantize`, the attention kernels call
`dequantize_planes` on the page blocks they load (it uses only elementwise ops, broadcasts and
reductions, which every Pallas lowering supports), and the references call `dequantize`.

Formats (`kv_format`):
  float32 / bfloat16 / float16   stored as is, no scales
  float8_e4m3fn / float8_e5m2    per-vector absmax scale [..., 1]: scale = absmax / finfo(fp8).max
  int8                           per-vector symmetric absmax scale [..., 1]: values in [-127, 127]
  int4                           two unsigned nibbles per uint8 byte along D (element 2i in the low
                                 nibble, 2i+1 in the high one), asymmetric: x = q * scale + low with
                                 q in [0, 15], per group of min(32, D) consecutive elements;
                                 scales [..., 2 * D//group] hold the groups' scales, then their lows
Scales are float16: their rounding (2^-11 relative) is far below any format's step, and at half
the bytes of float32 they keep int4's overhead at a quarter of its data. A zero vector gets
scale 0 and dequantizes to zeros.

Asymmetric int4: on SmolLM2 keys, whose groups are often skewed to one side, it raised top-1
agreement with the float32 cache by about 4 points over a symmetric [-7, 7] grid.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

SUPPORTED_KV_FORMATS: tuple[str, ...] = (
    "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int8", "int4",
)
_UNSCALED = ("float32", "bfloat16", "float16")
_FP8 = ("float8_e4m3fn", "float8_e5m2")
INT4_GROUP = 32


def check_kv_format(kv_format: str) -> None:
    if kv_format not in SUPPORTED_KV_FORMATS:
        raise ValueError(
            f"unsupported kv_format {kv_format!r}; supported: {', '.join(SUPPORTED_KV_FORMATS)}")


def storage_dtype(kv_format: str) -> jnp.dtype:
    """dtype of the stored page data."""
    check_kv_format(kv_format)
    if kv_format == "int4":
        return jnp.dtype(jnp.uint8)
    return jnp.dtype(kv_format)


def int4_group(D: int) -> int:
    return min(INT4_GROUP, D)


def stored_head_dim(D: int, kv_format: str) -> int:
    """Last dim of the stored data (Ds): D, or D // 2 for int4 (two values per byte)."""
    check_kv_format(kv_format)
    if kv_format != "int4":
        return D
    if D % 2 or D % int4_group(D):
        raise ValueError(f"int4 needs an even head dim divisible by {INT4_GROUP} (or < it): D={D}")
    return D // 2


SCALE_DTYPE = jnp.float16


def scale_groups(D: int, kv_format: str) -> int:
    """Number of scale entries per stored vector (last dim of `scales`); 0 when unscaled.
    For int4, a scale and a low value per group."""
    check_kv_format(kv_format)
    if kv_format in _UNSCALED:
        return 0
    if kv_format == "int4":
        stored_head_dim(D, kv_format)  # validates D
        return 2 * (D // int4_group(D))
    return 1


def bytes_per_token_per_head(D: int, kv_format: str) -> int:
    """Bytes one token costs in one kv head of one of K or V: data plus its scales."""
    return (stored_head_dim(D, kv_format) * storage_dtype(kv_format).itemsize
            + jnp.dtype(SCALE_DTYPE).itemsize * scale_groups(D, kv_format))


def _safe_div(x: jax.Array, scale: jax.Array) -> jax.Array:
    # An all-zero vector has scale 0: divide by 1 instead so it stays 0 rather than NaN.
    return x / jnp.where(scale > 0, scale, 1.0)


def quantize(x: jax.Array, kv_format: str) -> tuple[jax.Array, jax.Array | None]:
    """x [..., D] -> (data [..., Ds] in storage_dtype, scales [..., groups] SCALE_DTYPE or None)."""
    check_kv_format(kv_format)
    stored_head_dim(x.shape[-1], kv_format)  # validates D (int4) with a clear message
    return _quantize(x, kv_format)


# jit: eager dispatch compiles each small op separately, which is slow for int4's dozen ops.
@functools.partial(jax.jit, static_argnames="kv_format")
def _quantize(x: jax.Array, kv_format: str) -> tuple[jax.Array, jax.Array | None]:
    if kv_format in _UNSCALED:
        return x.astype(kv_format), None
    x = x.astype(jnp.float32)
    if kv_format == "int8":
        scale = (jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0).astype(SCALE_DTYPE)
        data = jnp.clip(jnp.round(_safe_div(x, scale)), -127, 127).astype(jnp.int8)
        return data, scale
    if kv_format in _FP8:
        fmax = float(jnp.finfo(kv_format).max)
        scale = (jnp.max(jnp.abs(x), axis=-1, keepdims=True) / fmax).astype(SCALE_DTYPE)
        # Clip: x / scale can land one rounding step above fmax, and e4m3fn has no inf (NaN).
        data = jnp.clip(_safe_div(x, scale), -fmax, fmax).astype(kv_format)
        return data, scale
    # int4
    D = x.shape[-1]
    g = int4_group(D)
    xg = x.reshape(*x.shape[:-1], D // g, g)
    low = jnp.min(xg, axis=-1).astype(SCALE_DTYPE)  # [..., D // g]
    scale = ((jnp.max(xg, axis=-1) - low) / 15.0).astype(SCALE_DTYPE)
    q = jnp.clip(jnp.round(_safe_div(xg - low[..., None], scale[..., None])), 0, 15)
    q = q.astype(jnp.int32).reshape(x.shape)
    data = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(jnp.uint8)
    return data, jnp.concatenate([scale, low], axis=-1)


def dequantize_planes(data: jax.Array, scales: jax.Array | None, kv_format: str) -> tuple[jax.Array, ...]:
    """Dequantize to float32 "column planes" without interleaving.

    Returns (x [..., D],) for every format but int4, and (even [..., D/2], odd [..., D/2]) for int4:
    the values at even and odd positions of D. Kernels contract each plane with the matching
    plane of q, which avoids an in-kernel lane interleave; `dequantize` interleaves them.
    """
    if kv_format in _UNSCALED:
        return (data.astype(jnp.float32),)
    if kv_format != "int4":
        return (data.astype(jnp.float32) * scales.astype(jnp.float32),)
    d = data.astype(jnp.int32)
    lo = (d & 0xF).astype(jnp.float32)
    hi = ((d >> 4) & 0xF).astype(jnp.float32)
    n_groups = scales.shape[-1] // 2
    half = data.shape[-1] // n_groups  # packed columns per group: group // 2
    # Expand per-group values [..., n_groups] to one per packed column with a one-hot
    # select-and-sum (where, not multiply, so a NaN in another group cannot leak in): no reshape.
    col_group = jax.lax.broadcasted_iota(jnp.int32, (n_groups, data.shape[-1]), 1) // half
    hit = col_group == jax.lax.broadcasted_iota(jnp.int32, (n_groups, data.shape[-1]), 0)
    expand = lambda v: jnp.sum(jnp.where(hit, v.astype(jnp.float32)[..., :, None], 0.0), axis=-2)
    s_full, low_full = expand(scales[..., :n_groups]), expand(scales[..., n_groups:])
    return lo * s_full + low_full, hi * s_full + low_full


def dequantize(
    data: jax.Array, scales: jax.Array | None, kv_format: str, dtype: jnp.dtype = jnp.float32,
) -> jax.Array:
    """(data [..., Ds], scales [..., groups] | None) -> [..., D] in `dtype`."""
    check_kv_format(kv_format)
    if (scales is None) != (kv_format in _UNSCALED):
        raise ValueError(f"kv_format {kv_format!r} {'needs' if scales is None else 'takes no'} scales")
    return _dequantize(data, scales, kv_format, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnames=("kv_format", "dtype"))
def _dequantize(data, scales, kv_format, dtype):
    planes = dequantize_planes(data, scales, kv_format)
    if len(planes) == 1:
        return planes[0].astype(dtype)
    even, odd = planes
    return jnp.stack([even, odd], axis=-1).reshape(*data.shape[:-1], 2 * data.shape[-1]).astype(dtype)
