"""KV storage formats in plain numpy, written from the format description in kv_quant's module
docstring rather than from its code, so that the naive-attention tests do not share the
kernels' dequantization (`kv_quant.dequantize_planes`): a bug there would otherwise cancel out.

No JAX here: JAX arrays cross into numpy with np.asarray, and bfloat16 / float8 values are
widened by ml_dtypes, a conversion independent of XLA's.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

# Storage dtype of the data per format, restated from the spec (not imported from kv_quant).
STORAGE_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "int8": np.dtype(np.int8),
    "int4": np.dtype(np.uint8),
}
UNSCALED = ("float32", "bfloat16", "float16")
SCALE_DTYPE = np.dtype(ml_dtypes.bfloat16)
INT4_GROUP = 32


def int4_group(D: int) -> int:
    return min(INT4_GROUP, D)


def _check(kv_format: str, data: np.ndarray, scales: np.ndarray | None) -> None:
    if kv_format not in STORAGE_DTYPES:
        raise ValueError(f"unknown kv_format {kv_format!r}")
    if data.dtype != STORAGE_DTYPES[kv_format]:
        raise ValueError(f"{kv_format} data must be {STORAGE_DTYPES[kv_format]}, got {data.dtype}")
    if (scales is None) != (kv_format in UNSCALED):
        raise ValueError(f"{kv_format}: scales {'missing' if scales is None else 'unexpected'}")
    # A different scale dtype would be a format change the tests should hear about.
    if scales is not None and scales.dtype != SCALE_DTYPE:
        raise ValueError(f"scales must be bfloat16, got {scales.dtype}")


def dequantize_np(data: np.ndarray, scales: np.ndarray | None, kv_format: str) -> np.ndarray:
    """(data [..., Ds], scales [..., groups] | None) -> float64 [..., D], from the spec alone.

    float64 holds every product exactly (int4: 4-bit q times an 8-bit bfloat16 scale), so the
    only rounding left is int4's addition of the low, which float32 code rounds once more."""
    data = np.asarray(data)
    scales = None if scales is None else np.asarray(scales)
    _check(kv_format, data, scales)
    if kv_format in UNSCALED:
        return data.astype(np.float64)
    s = scales.astype(np.float64)
    if kv_format != "int4":  # int8 and float8: one absmax scale per vector
        if s.shape != data.shape[:-1] + (1,):
            raise ValueError(f"{kv_format} scales {s.shape} for data {data.shape}")
        return data.astype(np.float64) * s
    D = 2 * data.shape[-1]
    g = int4_group(D)
    n = D // g
    if D % g or s.shape != data.shape[:-1] + (2 * n,):
        raise ValueError(f"int4 scales {s.shape} for data {data.shape}")
    q = np.empty(data.shape[:-1] + (D,), np.uint8)
    q[..., 0::2] = data & 0x0F  # element 2i: low nibble
    q[..., 1::2] = data >> 4  # element 2i + 1: high nibble
    q = q.reshape(*data.shape[:-1], n, g).astype(np.float64)
    x = q * s[..., :n, None] + s[..., n:, None]  # the groups' scales, then their lows
    return x.reshape(*data.shape[:-1], D)


def quantize_int8_np(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., D] -> (int8 data [..., D], bfloat16 scales [..., 1]): symmetric absmax / 127,
    round half to even, clip to [-127, 127]; a zero vector gets scale 0 and zeros.

    float32 arithmetic, as the cache's writes do it, so the result can match bit for bit: in
    float64 a quotient at a rounding tie could land on the other side."""
    x = np.asarray(x, np.float32)
    absmax = np.abs(x).max(axis=-1, keepdims=True)
    scale = (absmax / np.float32(127)).astype(SCALE_DTYPE)
    s = scale.astype(np.float32)
    q = np.round(x / np.where(s > 0, s, np.float32(1)))
    return np.clip(q, -127, 127).astype(np.int8), scale


def int4_round_trip_bound(x: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Per-element bound on |x - dequantize_np(quantize(x))| for int4 from the stored scales:
    half a step of the group's grid, plus slack for the float32 arithmetic of quantization
    ((x - low) / scale can round across a .5 tie)."""
    x = np.asarray(x, np.float64)
    s = np.asarray(scales).astype(np.float64)
    D = x.shape[-1]
    g = int4_group(D)
    n = D // g
    step = s[..., :n, None]
    low = s[..., n:, None]
    xg = x.reshape(*x.shape[:-1], n, g)
    slack = 2.0 ** -20 * (np.abs(xg) + np.abs(low) + 16 * step)
    return np.broadcast_to(step / 2 + slack, xg.shape).reshape(x.shape)


__all__ = ["STORAGE_DTYPES", "SCALE_DTYPE", "int4_group", "dequantize_np", "quantize_int8_np",
           "int4_round_trip_bound"]
