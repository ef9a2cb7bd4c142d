"""Caches of floats narrower than 32 bits hold their bits on CPU (`kv_quant.bits_dtype`), so that
XLA scatters each write in place instead of converting the whole cache to float32 and back:
values written at random slots read back exactly, through the contiguous and the paged cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infer.cache.contiguous import KVCache
from infer.cache.metadata import AttentionMetadata
from infer.cache.paged import PagedKVCache
from kernels_pallas import kv_quant

@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_contiguous_cache_reads_back_what_it_wrote(dtype: str) -> None:
    rng = np.random.default_rng(len(dtype))
    b, k_heads, d, max_len = 3, 2, 8, 16
    cache = KVCache.create(2, b, max_len, k_heads, d, jnp.dtype(dtype))
    assert cache.k[0].dtype == kv_quant.bits_dtype(jnp.dtype(dtype))
    if jax.default_backend() == "cpu":
        assert jnp.issubdtype(cache.k[0].dtype, jnp.unsignedinteger)
    expected = np.zeros((b, k_heads, max_len, d), np.float32)
    write = jax.jit(lambda c, x, m: c.write(1, x, -x, m), donate_argnums=0)
    for _ in range(4):  # rows of random lengths, each after a random number of cached slots
        t = int(rng.integers(1, 4))
        cached = rng.integers(0, max_len - t, b)
        q_lens = rng.integers(0, t + 1, b)
        x = rng.standard_normal((b, t, k_heads, d)).astype(np.float32)
        meta = AttentionMetadata.for_prefill(jnp.asarray(q_lens), t, cached=jnp.asarray(cached))
        cache = write(cache, jnp.asarray(x), meta)
        stored = np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32))
        for row in range(b):
            for i in range(q_lens[row]):
                expected[row, :, cached[row] + i] = stored[row, i]
    keys, values = cache.layer(1)
    assert keys.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(keys.astype(jnp.float32)), expected)
    np.testing.assert_array_equal(np.asarray(values.astype(jnp.float32)), -expected)
    np.testing.assert_array_equal(np.asarray(cache.layer(0)[0].astype(jnp.float32)), 0)


# The scaled formats (fp8, int8, int4) are read back through quantize's own output in
# tests/cache/test_paged.py::test_quantized_write_stores_quantize_output.
@pytest.mark.parametrize("kv_format", ["bfloat16", "float16"])
def test_paged_cache_reads_back_what_it_wrote(kv_format: str) -> None:
    rng = np.random.default_rng(7 + len(kv_format))
    num_pages, g, k_heads, d = 12, 4, 2, 8
    cache = PagedKVCache.create(1, num_pages, g, k_heads, d, kv_format)
    tables = rng.permutation(num_pages)[:6].reshape(2, 3)
    x = rng.standard_normal((2, 5, k_heads, d)).astype(np.float32)
    meta = AttentionMetadata.for_prefill(jnp.asarray([5, 3]), 5, cached=jnp.asarray([4, 6]),
                                         page_tables=jnp.asarray(tables, jnp.int32))
    out = jax.jit(lambda c, m: c.write(0, jnp.asarray(x), jnp.asarray(x), m))(cache, meta)
    pages = np.asarray(out.pages(0)[0].astype(jnp.float32))
    stored = np.asarray(jnp.asarray(x).astype(kv_format).astype(jnp.float32))
    expected = np.zeros_like(pages)
    for row, (start, n) in enumerate([(4, 5), (6, 3)]):
        for i in range(n):
            slot = start + i
            expected[tables[row, slot // g], :, slot % g] = stored[row, i]
    np.testing.assert_array_equal(pages, expected)


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn", "float8_e5m2", "int32"])
def test_contiguous_cache_refuses_formats_that_need_scales(dtype: str) -> None:
    # It stores keys as they are: int8 truncated 0.13 to 0, e4m3 turned 473 into NaN, silently.
    with pytest.raises(ValueError, match=f"contiguous cache holds .*got {dtype}"):
        KVCache.create(1, 1, 4, 1, 8, jnp.dtype(dtype))


@pytest.mark.parametrize("kv_format", ["int8", "float8_e4m3fn", "int4"])
def test_scales_held_as_bits_are_refused(kv_format: str) -> None:
    # On CPU the paged cache holds bfloat16 scales as uint16 bits; passed on as they are, they
    # scaled by the bits' values (errors near 2e6) with no error.
    cache = PagedKVCache.create(1, 4, 4, 1, 64, kv_format)
    data, _, scales, _ = cache.pages(0)
    held = jax.lax.bitcast_convert_type(scales, jnp.uint16)  # what bits_dtype holds on CPU
    with pytest.raises(ValueError, match="from_bits first"):
        kv_quant.dequantize(data, held, kv_format)
    from kernels_pallas.paged_attention import paged_attention
    with pytest.raises(ValueError, match="k_scales .* dtype uint16"):
        paged_attention(jnp.zeros((1, 2, 64), jnp.float32), data, data, jnp.asarray([1]),
                        jnp.zeros((1, 1), jnp.int32), k_scales=held, v_scales=held,
                        kv_format=kv_format, interpret=True)
