"""KV-cache quantization formats: round-trip bounds, int4 packing layout, zeros, metadata."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels_pallas.kv_quant import (
    SCALE_DTYPE, SUPPORTED_KV_FORMATS, bytes_per_token_per_head, dequantize, quantize, scale_groups,
    storage_dtype, stored_head_dim,
)

D = 64


def _x(seed=0, shape=(4, 3, D), scale=3.0):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale
    x[0, 0] = 0.0  # an all-zero vector: scale 0 must not give NaN
    return jnp.asarray(x)


@pytest.mark.parametrize("kv_format", SUPPORTED_KV_FORMATS)
def test_round_trip_within_format_bound(kv_format):
    x = _x()
    data, scales = quantize(x, kv_format)
    assert data.dtype == storage_dtype(kv_format)
    assert data.shape == (*x.shape[:-1], stored_head_dim(D, kv_format))
    if scale_groups(D, kv_format):
        assert scales.shape == (*x.shape[:-1], scale_groups(D, kv_format)) and scales.dtype == SCALE_DTYPE
    else:
        assert scales is None
    y = np.asarray(dequantize(data, scales, kv_format))
    xn = np.asarray(x)
    err = np.abs(y - xn)
    absmax = np.abs(xn).max(-1, keepdims=True)
    if kv_format == "float32":
        bound = np.zeros_like(xn)
    elif kv_format in ("bfloat16", "float16"):
        eps = float(jnp.finfo(kv_format).eps)
        bound = np.abs(xn) * eps / 2
    elif kv_format == "int8":
        # half a step of absmax / 127, the step itself rounded to float16 (2^-11 relative)
        bound = np.broadcast_to(absmax / 254 * (1 + 2.0 ** -9), xn.shape)
    elif kv_format == "int4":
        # half a step of (max - min) / 15 per group, plus the float16 rounding of the group's low
        g = min(32, D)
        groups = xn.reshape(*xn.shape[:-1], D // g, g)
        gmax, gmin = groups.max(-1, keepdims=True), groups.min(-1, keepdims=True)
        per_group = (gmax - gmin) / 30 * (1 + 2.0 ** -9) + np.abs(gmin) * 2.0 ** -10
        bound = np.broadcast_to(per_group, groups.shape).reshape(xn.shape)
    else:  # fp8: half an ulp relative for normals, half the smallest subnormal (scaled) below
        fi = jnp.finfo(kv_format)
        scale = absmax / float(fi.max)
        bound = (np.abs(xn) * 2.0 ** -(fi.nmant + 1) + scale * float(fi.smallest_subnormal) / 2
                 + absmax * 2.0 ** -10)  # clipping at fmax when the float16 scale rounds down
    assert np.all(err <= bound * (1 + 1e-5) + 1e-7), (kv_format, float((err - bound).max()))
    assert np.all(y[0, 0] == 0) and np.isfinite(y).all()


@pytest.mark.parametrize("kv_format", SUPPORTED_KV_FORMATS)
def test_zeros_stay_zeros(kv_format):
    x = jnp.zeros((2, 5, D), jnp.float32)
    data, scales = quantize(x, kv_format)
    y = dequantize(data, scales, kv_format)
    assert np.all(np.asarray(y) == 0)


def test_int4_packing_layout_matches_hand_packed_bytes():
    # Group of 32 spanning [-8, 7]: scale (7 - -8) / 15 = 1 and low -8, so each code is x + 8.
    vals = np.zeros(32, np.float32)
    vals[:8] = [1, -1, 7, -7, -3, 2, -8, 0]
    data, scales = quantize(jnp.asarray(vals), "int4")
    assert np.asarray(scales).tolist() == [1.0, -8.0]  # the group's scale, then its low
    # element 2i in the low nibble, 2i+1 in the high nibble:
    # codes (9, 7) -> 0x79; (15, 1) -> 0x1F; (5, 10) -> 0xA5; (0, 8) -> 0x80; zeros (8, 8) -> 0x88
    assert np.asarray(data)[:4].tolist() == [0x79, 0x1F, 0xA5, 0x80]
    assert np.all(np.asarray(data)[4:] == 0x88)
    np.testing.assert_array_equal(np.asarray(dequantize(data, scales, "int4")), vals)


def test_int4_groups_have_own_scales():
    x = np.zeros((1, D), np.float32)
    x[0, :32] = 0.01 * np.arange(32)  # small group
    x[0, 32:] = 100.0 * np.linspace(-1, 1, 32)  # large group must not crush the small one
    data, scales = quantize(jnp.asarray(x), "int4")
    assert scales.shape == (1, 4)  # two groups: two scales, then two lows
    y = np.asarray(dequantize(data, scales, "int4"))
    assert np.abs(y[0, :32] - x[0, :32]).max() <= 0.31 / 30 * 1.01


def test_dequantize_dtype_and_leading_dims():
    data, scales = quantize(_x(shape=(2, 3, 4, D)), "int8")
    y = dequantize(data, scales, "int8", dtype=jnp.bfloat16)
    assert y.shape == (2, 3, 4, D) and y.dtype == jnp.bfloat16


def test_metadata():
    assert stored_head_dim(64, "int4") == 32 and stored_head_dim(64, "int8") == 64
    assert scale_groups(64, "float16") == 0 and scale_groups(64, "int8") == 1
    assert scale_groups(128, "int4") == 8 and scale_groups(16, "int4") == 2  # group = min(32, D)
    assert bytes_per_token_per_head(64, "float32") == 256
    assert bytes_per_token_per_head(64, "bfloat16") == 128
    assert bytes_per_token_per_head(64, "int8") == 64 + 2  # one float16 scale
    assert bytes_per_token_per_head(64, "float8_e5m2") == 64 + 2
    assert bytes_per_token_per_head(64, "int4") == 32 + 4 * 2  # scale and low of 2 groups
    assert storage_dtype("int4") == jnp.uint8 and storage_dtype("float8_e4m3fn") == jnp.float8_e4m3fn


def test_unsupported_format_lists_supported():
    with pytest.raises(ValueError, match="int8.*int4"):
        quantize(jnp.zeros((2, D)), "int3")
    for fn in (storage_dtype, lambda f: stored_head_dim(D, f), lambda f: bytes_per_token_per_head(D, f)):
        with pytest.raises(ValueError, match="supported"):
            fn("float64")
    with pytest.raises(ValueError, match="D=48"):
        stored_head_dim(48, "int4")  # not a multiple of the 32-wide group


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(1e-3, 1e3))
def test_int8_bound_property(seed, magnitude):
    x = _x(seed, shape=(3, D), scale=magnitude)
    data, scales = quantize(x, "int8")
    err = np.abs(np.asarray(dequantize(data, scales, "int8")) - np.asarray(x))
    absmax = np.abs(np.asarray(x)).max(-1, keepdims=True)
    assert np.all(err <= absmax / 254 * (1 + 2.0 ** -9))  # float16 scale: 2^-11 relative
