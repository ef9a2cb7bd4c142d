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
Scales are bfloat16: float32's exponent range in float16's two bytes. float16 scales flushed
small vectors to zero (float8_e5m2's absmax / 57344 underflows float16 below an absmax of about
1.7e-3) and sent int4's low of large ones to inf; bfloat16 covers float32's normal range.
Its coarser rounding (2^-8 relative) costs nothing measurable: data are quantized against the
stored, rounded scale, so the rounding only stretches the grid by at most 2^-8, and int4's low is
rounded down, so it widens its group's range by at most 2^-7 |low| instead of clipping values.
A zero vector gets scale 0 and dequantizes to zeros.

Aliases (`KV_FORMAT_ALIASES`: fp8 = float8_e4m3fn as in vLLM, bf16, fp16, ...) are accepted by
every function here and resolved by `resolve_kv_format`, the one place a format name is parsed.

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
# Formats of the paged cache alone, laid out per page rather than per vector, so not formats of
# the functions here or of the kernels: int4_kivi (`infer.cache.kivi`).
PAGE_FORMATS: tuple[str, ...] = ("int4_kivi",)
UNSCALED_FORMATS: tuple[str, ...] = ("float32", "bfloat16", "float16")
_FP8 = ("float8_e4m3fn", "float8_e5m2")
INT4_GROUP = 32
# Short names people use for cache formats; fp8 means e4m3 (vLLM's kv_cache_dtype="fp8" too).
KV_FORMAT_ALIASES: dict[str, str] = {
    "fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
}


def resolve_kv_format(kv_format: str, page_formats: bool = False) -> str:
    """The canonical name of a KV format or alias; ValueError naming both lists otherwise.
    page_formats: accept `PAGE_FORMATS` too (the paged cache's callers); the kernels and the
    per-vector functions here do not."""
    # Strings only: a numpy dtype compares equal to its name, and would then key jit caches as
    # a second spelling of the same format.
    name = KV_FORMAT_ALIASES.get(kv_format, kv_format) if isinstance(kv_format, str) else None
    if name in PAGE_FORMATS and not page_formats:
        raise ValueError(f"kv_format {name!r} is a format of the paged cache, laid out per page; "
                         "the Pallas kernels and per-vector quantization do not read it")
    if name not in SUPPORTED_KV_FORMATS + PAGE_FORMATS:
        supported = SUPPORTED_KV_FORMATS + (PAGE_FORMATS if page_formats else ())
        raise ValueError(
            f"unsupported kv_format {kv_format!r}; supported: {', '.join(supported)} "
            f"(aliases: {', '.join(sorted(KV_FORMAT_ALIASES))})")
    return name


# The older name. Callers must use the returned name: this module compares canonical names.
check_kv_format = resolve_kv_format


def storage_dtype(kv_format: str) -> jnp.dtype:
    """dtype of the stored page data."""
    kv_format = check_kv_format(kv_format)
    if kv_format == "int4":
        return jnp.dtype(jnp.uint8)
    return jnp.dtype(kv_format)


def bits_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """The dtype a cache holds values of `dtype` in. On CPU a float narrower than 32 bits is
    held as the unsigned integer of its width, its bits: XLA:CPU scatters into such a float
    array by converting the whole array to float32 and back (a bfloat16 write of 8 tokens into
    a [8, 3, 1024, 64] cache took 630 us, 6 us into its uint16 bits), so every cache write would
    copy the cache twice. Elsewhere, and for other dtypes, the dtype itself."""
    dtype = jnp.dtype(dtype)
    if (jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4
            and jax.default_backend() == "cpu"):
        return jnp.dtype(f"uint{8 * dtype.itemsize}")
    return dtype


def to_bits(x: jax.Array, held: jnp.dtype) -> jax.Array:
    """`x` as a cache holding `held` (`bits_dtype`) stores it: a bitcast, or `x` itself."""
    return x if x.dtype == held else jax.lax.bitcast_convert_type(x, held)


def from_bits(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Held data `x` read back as `dtype` (the inverse of `to_bits`)."""
    dtype = jnp.dtype(dtype)
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


def int4_group(D: int) -> int:
    return min(INT4_GROUP, D)


def stored_head_dim(D: int, kv_format: str) -> int:
    """Last dim of the stored data (Ds): D, or D // 2 for int4 (two values per byte)."""
    kv_format = check_kv_format(kv_format)
    if kv_format != "int4":
        return D
    if D % 2 or D % int4_group(D):
        raise ValueError(f"int4 needs an even head dim divisible by {INT4_GROUP} (or < it): D={D}")
    return D // 2


SCALE_DTYPE = jnp.bfloat16  # see the module docstring: float16's range lost small vectors


def scale_groups(D: int, kv_format: str) -> int:
    """Number of scale entries per stored vector (last dim of `scales`); 0 when unscaled.
    For int4, a scale and a low value per group."""
    kv_format = check_kv_format(kv_format)
    if kv_format in UNSCALED_FORMATS:
        return 0
    if kv_format == "int4":
        stored_head_dim(D, kv_format)  # validates D
        return 2 * (D // int4_group(D))
    return 1


def bytes_per_token_per_head(D: int, kv_format: str) -> int:
    """Bytes one token costs in one kv head of one of K or V: data plus its scales."""
    kv_format = check_kv_format(kv_format)
    return (stored_head_dim(D, kv_format) * storage_dtype(kv_format).itemsize
            + jnp.dtype(SCALE_DTYPE).itemsize * scale_groups(D, kv_format))


def _stored_scale(scale: jax.Array) -> jax.Array:
    """A float32 scale rounded to SCALE_DTYPE's precision, still float32, for the data to be
    quantized against the scale as stored. Not `.astype(SCALE_DTYPE)` and back: XLA's excess
    precision pass may drop that round trip inside a fusion, for some shapes only (int4 codes
    of 4096 x 64 vectors broke the half-step bound, and a vector's codes depended on the batch
    it came in); reduce_precision is never dropped."""
    info = jnp.finfo(SCALE_DTYPE)
    return jax.lax.reduce_precision(scale.astype(jnp.float32), exponent_bits=info.nexp,
                                    mantissa_bits=info.nmant)


def _safe_div(x: jax.Array, scale: jax.Array) -> jax.Array:
    # An all-zero vector has scale 0: divide by 1 instead so it stays 0 rather than NaN.
    return x / jnp.where(scale > 0, scale, 1.0)


def quantize(x: jax.Array, kv_format: str) -> tuple[jax.Array, jax.Array | None]:
    """x [..., D] -> (data [..., Ds] in storage_dtype, scales [..., groups] SCALE_DTYPE or None)."""
    kv_format = check_kv_format(kv_format)
    stored_head_dim(x.shape[-1], kv_format)  # validates D (int4) with a clear message
    return _quantize(x, kv_format)


# jit: eager dispatch compiles each small op separately, which is slow for int4's dozen ops.
@functools.partial(jax.jit, static_argnames="kv_format")
def _quantize(x: jax.Array, kv_format: str) -> tuple[jax.Array, jax.Array | None]:
    if kv_format in UNSCALED_FORMATS:
        return x.astype(kv_format), None
    x = x.astype(jnp.float32)
    if kv_format == "int8":
        scale = _stored_scale(jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0)
        data = jnp.clip(jnp.round(_safe_div(x, scale)), -127, 127).astype(jnp.int8)
        return data, scale.astype(SCALE_DTYPE)
    if kv_format in _FP8:
        fmax = float(jnp.finfo(kv_format).max)
        scale = _stored_scale(jnp.max(jnp.abs(x), axis=-1, keepdims=True) / fmax)
        # Clip: x / scale can land a rounding step above fmax, and e4m3fn has no inf (NaN).
        data = jnp.clip(_safe_div(x, scale), -fmax, fmax).astype(kv_format)
        return data, scale.astype(SCALE_DTYPE)
    # int4
    D = x.shape[-1]
    g = int4_group(D)
    xg = x.reshape(*x.shape[:-1], D // g, g)
    low = _floor_to_scale_dtype(jnp.min(xg, axis=-1))  # [..., D // g], <= every value
    # The range from the stored low, so the stored pair spans the group: no value clips.
    scale = _stored_scale((jnp.max(xg, axis=-1) - low.astype(jnp.float32)) / 15.0)
    q = jnp.clip(jnp.round(_safe_div(xg - low[..., None], scale[..., None])), 0, 15)
    q = q.astype(jnp.int32).reshape(x.shape)
    data = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(jnp.uint8)
    return data, jnp.concatenate([scale.astype(SCALE_DTYPE), low], axis=-1)


def _floor_to_scale_dtype(x: jax.Array) -> jax.Array:
    """float32 -> the largest bfloat16 <= x. Rounding to nearest could put int4's low above the
    group's minimum and clip it; bfloat16 is float32's top 16 bits, so floor is bit masking:
    truncate the magnitude of x >= 0, round the magnitude of x < 0 up."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    up = (bits + jnp.uint32(0xFFFF)) & jnp.uint32(0xFFFF0000)
    floored = jnp.where(x < 0, up, bits & jnp.uint32(0xFFFF0000))
    return jax.lax.bitcast_convert_type(floored, jnp.float32).astype(SCALE_DTYPE)


def dequantize_planes(data: jax.Array, scales: jax.Array | None, kv_format: str) -> tuple[jax.Array, ...]:
    """Dequantize to float32 "column planes" without interleaving.

    Returns (x [..., D],) for every format but int4, and (even [..., D/2], odd [..., D/2]) for int4:
    the values at even and odd positions of D. Kernels contract each plane with the matching
    plane of q, which avoids an in-kernel lane interleave; `dequantize` interleaves them.
    """
    kv_format = resolve_kv_format(kv_format)  # plain Python on a static name: free under tracing
    if kv_format in UNSCALED_FORMATS:
        return (data.astype(jnp.float32),)
    if kv_format != "int4":
        return (data.astype(jnp.float32) * scales.astype(jnp.float32),)
    n_groups = scales.shape[-1] // 2
    return int4_planes(data, scales[..., :n_groups], scales[..., n_groups:])


def int4_planes(data: jax.Array, group_scales: jax.Array, group_lows: jax.Array,
                half: int | None = None) -> tuple[jax.Array, jax.Array]:
    """int4 data [..., D/2] with its groups' scales and lows [..., n_groups] -> the (even, odd)
    float32 planes of `dequantize_planes`. Scales and lows come apart so that a kernel can load
    each as its own block: slicing one loaded array has no Triton lowering.

    `half`: packed columns per group (group // 2), by default D/2 // n_groups. A kernel whose
    data block is padded past D/2 (the GPU kernel's power-of-two width) must pass it: the
    padded width would stretch the groups (D=96: 64 // 3 = 21 columns instead of 16). Padding
    columns then fall in no group and come out 0."""
    d = data.astype(jnp.int32)
    lo = (d & 0xF).astype(jnp.float32)
    hi = ((d >> 4) & 0xF).astype(jnp.float32)
    n_groups = group_scales.shape[-1]
    if half is None:
        half = data.shape[-1] // n_groups
    # Expand per-group values [..., n_groups] to one per packed column with a one-hot
    # select-and-sum (where, not multiply, so a NaN in another group cannot leak in): no reshape.
    col_group = jax.lax.broadcasted_iota(jnp.int32, (n_groups, data.shape[-1]), 1) // half
    hit = col_group == jax.lax.broadcasted_iota(jnp.int32, (n_groups, data.shape[-1]), 0)
    expand = lambda v: jnp.sum(jnp.where(hit, v.astype(jnp.float32)[..., :, None], 0.0), axis=-2)
    s_full, low_full = expand(group_scales), expand(group_lows)
    return lo * s_full + low_full, hi * s_full + low_full


def dequantize(
    data: jax.Array, scales: jax.Array | None, kv_format: str, dtype: jnp.dtype = jnp.float32,
) -> jax.Array:
    """(data [..., Ds], scales [..., groups] | None) -> [..., D] in `dtype`."""
    kv_format = check_kv_format(kv_format)
    if (scales is None) != (kv_format in UNSCALED_FORMATS):
        raise ValueError(f"kv_format {kv_format!r} {'needs' if scales is None else 'takes no'} scales")
    # Data of another dtype (a cache's integer bits, `to_bits`) or scales of another group
    # count would dequantize to plausible-looking wrong numbers: refuse them by name.
    stored = storage_dtype(kv_format)
    if (not jnp.issubdtype(data.dtype, jnp.floating) if kv_format in UNSCALED_FORMATS
            else data.dtype != stored):
        raise ValueError(f"kv_format {kv_format!r} stores {stored} data, got {data.dtype} "
                         f"(bits held as integers go through from_bits first)")
    if scales is not None and not jnp.issubdtype(scales.dtype, jnp.floating):
        raise ValueError(f"kv_format {kv_format!r} takes {jnp.dtype(SCALE_DTYPE).name} scales, "
                         f"got {scales.dtype} (bits held as integers go through from_bits first)")
    D = 2 * data.shape[-1] if kv_format == "int4" else data.shape[-1]
    if scales is not None and scales.shape[-1] != scale_groups(D, kv_format):
        raise ValueError(f"kv_format {kv_format!r} at head dim {D} has "
                         f"{scale_groups(D, kv_format)} scale entries per vector, got scales "
                         f"{scales.shape}")
    return _dequantize(data, scales, kv_format, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnames=("kv_format", "dtype"))
def _dequantize(data, scales, kv_format, dtype):
    planes = dequantize_planes(data, scales, kv_format)
    if len(planes) == 1:
        return planes[0].astype(dtype)
    even, odd = planes
    return jnp.stack([even, odd], axis=-1).reshape(*data.shape[:-1], 2 * data.shape[-1]).astype(dtype)
