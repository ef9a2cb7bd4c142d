"""The CPU paged attention kernel (kernels_cpu/attention.cc) against its jnp reference: random
shapes (head dims off the 16-lane vector, grouped and ungrouped heads, page sizes 1-16, 1 to
48 new tokens a row with padding queries: decode, verify and prefill steps, on either side of
the kernel's 16-token query blocks), permuted page tables, lengths at every boundary (0, 1, a
page +- 1, the table's end), pages no visible token uses filled with NaN, both dtypes of
queries and pages; the paged cache handing it every step without a tree mask; errors.

The kernel needs an x86-64 CPU with AVX-512 and a C++ compiler; elsewhere these tests skip and
the paged cache keeps the masked attention (tests/cache covers that path)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_cpu import attention as cpu_attention

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or not cpu_attention.available(),
    reason="the CPU attention kernel needs XLA:CPU, x86-64 with AVX-512 and a C++ compiler")

attend = jax.jit(cpu_attention.attend)
attend_bits = jax.jit(lambda *args: cpu_attention.attend(*args, page_dtype=jnp.bfloat16))
reference = jax.jit(cpu_attention.reference)


def _case(rng: np.random.Generator, q_dtype, kv_dtype):
    b = int(rng.integers(1, 7))
    kv_heads = int(rng.choice([1, 2, 3]))
    heads = kv_heads * int(rng.choice([1, 3, 4]))
    d = int(rng.choice([8, 16, 40, 64, 80]))
    g = int(rng.choice([1, 4, 16]))
    n = int(rng.integers(1, 7))
    pages = b * n + 2
    t = int(rng.choice([1, 1, 2, 5, 15, 16, 17, 32, 33, 48]))
    q_lens = rng.integers(0, t + 1, size=b).astype(np.int32)
    q_lens[0] = t
    # Lengths at the boundaries: none, one, a page and either side of it, the table's end.
    choices = sorted({0, 1, max(g - 1, 1), g, g + 1, n * g, int(rng.integers(0, n * g + 1))})
    lengths = np.clip(rng.choice(choices, size=b), q_lens, n * g).astype(np.int32)
    q_lens = np.minimum(q_lens, lengths)
    table = rng.permutation(pages)[:b * n].reshape(b, n).astype(np.int32)
    k = rng.standard_normal((pages, kv_heads, g, d)).astype(np.float32)
    v = rng.standard_normal((pages, kv_heads, g, d)).astype(np.float32)
    # NaN in every slot no query sees (a row's queries see at most its length; padding queries
    # and length-0 rows read slot 0).
    used = np.zeros((pages, g), bool)
    for row in range(b):
        for t in range(max(int(lengths[row]), 1)):
            used[table[row, t // g], t % g] = True
    poisoned_k, poisoned_v = k.copy(), v.copy()
    unused = np.broadcast_to(~used[:, None, :], (pages, kv_heads, g))
    poisoned_k[unused] = np.nan
    poisoned_v[unused] = np.nan
    q = jnp.asarray(rng.standard_normal((b, t, heads, d)).astype(np.float32)).astype(q_dtype)
    as_kv = lambda x: jnp.asarray(x).astype(kv_dtype)
    return (q, as_kv(poisoned_k), as_kv(poisoned_v), as_kv(k), as_kv(v), jnp.asarray(lengths),
            jnp.asarray(q_lens), jnp.asarray(table))


@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16])
def test_random_shapes_match_the_reference_and_read_only_visible_tokens(q_dtype, kv_dtype) -> None:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    for _ in range(20):
        q, poisoned_k, poisoned_v, k, v, lengths, q_lens, table = _case(rng, q_dtype, kv_dtype)
        if kv_dtype == jnp.bfloat16 and rng.random() < 0.5:
            # As the paged cache holds them on CPU: their uint16 bits, read in place.
            bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16)
            got = attend_bits(q, bits(poisoned_k), bits(poisoned_v), lengths, q_lens, table)
        else:
            got = attend(q, poisoned_k, poisoned_v, lengths, q_lens, table)
        got = np.asarray(got, np.float32)
        want = np.asarray(reference(q, k, v, lengths, q_lens, table), np.float32)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.isfinite(got).all(), (seed, "read a slot past a row's length")
        # float32: accumulation order alone; bfloat16 output: one rounding of the result.
        tol = 2e-5 if q_dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"seed {seed}")


def test_a_large_softmax_range_stays_exact() -> None:
    """Scores tens apart: exp of the differences underflows gracefully, the peak token wins."""
    rng = np.random.default_rng(5)
    q, _, _, k, v, lengths, q_lens, table = _case(rng, jnp.float32, jnp.float32)
    q = q * 30.0
    np.testing.assert_allclose(np.asarray(attend(q, k, v, lengths, q_lens, table)),
                               np.asarray(reference(q, k, v, lengths, q_lens, table)),
                               rtol=1e-4, atol=1e-4)


def test_the_paged_cache_hands_every_step_without_a_tree_mask_to_the_kernel() -> None:
    """Decode, verify and prefill steps of a float32 or bfloat16 paged cache (reference backend)
    lower to the kernel and give the masked attention's values, reading bfloat16 pages as the
    cache holds them (their bits, no copy of the pool); a step with a tree mask keeps the
    masked attention."""
    from infer.cache import attention
    from infer.cache.metadata import AttentionMetadata
    from infer.cache.paged import PagedKVCache
    from kernels_pallas import kv_quant

    rng = np.random.default_rng(3)
    for dtype in (jnp.float32, jnp.bfloat16):
        cache = PagedKVCache.create(1, 9, 4, 2, 16, kv_format=jnp.dtype(dtype).name)
        k = jnp.asarray(rng.standard_normal((1, 9, 2, 4, 16)).astype(np.float32)).astype(dtype)
        v = jnp.asarray(rng.standard_normal((1, 9, 2, 4, 16)).astype(np.float32)).astype(dtype)
        held = kv_quant.bits_dtype(dtype)
        cache = dataclasses.replace(cache, k=(kv_quant.to_bits(k[0], held),),
                                    v=(kv_quant.to_bits(v[0], held),))
        table = jnp.asarray([[3, 1, 7, 0, 4, 6], [2, 8, 5, 0, 0, 0]], jnp.int32)
        for t, tree in ((1, False), (3, False), (17, False), (20, False), (3, True)):
            lengths = jnp.asarray([t + 4, t], jnp.int32)
            # A chain as a tree: each node sees itself and the nodes before it.
            tree_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (2, t, t))
            meta = AttentionMetadata(positions=lengths[:, None] - t + jnp.arange(t)[None],
                                     lengths=lengths, q_lens=jnp.full((2,), t, jnp.int32),
                                     page_tables=table, tree_mask=tree_mask if tree else None)
            q = jnp.asarray(rng.standard_normal((2, t, 4, 16)).astype(np.float32)).astype(dtype)
            attend = jax.jit(lambda q, cache, meta: cache.attend(0, q, meta))
            lowered = attend.lower(q, cache, meta)
            assert (cpu_attention.KERNEL.target in lowered.as_text()) == (not tree), (dtype, t)
            if not tree:
                assert "bitcast-convert" not in lowered.compile().as_text(), (dtype, t)
            keys = cache._gather(k[0], None, table, jnp.float32)
            values = cache._gather(v[0], None, table, jnp.float32)
            want = attention.masked_attention(q, keys, values,
                                              attention.visibility_mask(meta, keys.shape[2]))
            tol = 2e-5 if dtype == jnp.float32 else 1e-2
            np.testing.assert_allclose(np.asarray(attend(q, cache, meta), np.float32),
                                       np.asarray(want, np.float32), rtol=tol, atol=tol)


def test_heads_longer_than_the_kernel_takes_keep_the_masked_attention() -> None:
    """The kernel keeps a head in registers up to MAX_HEAD_DIM: a paged cache with longer heads
    hands its steps to the masked attention (it raised at run time), `attend` refuses them."""
    from infer.cache import attention
    from infer.cache.metadata import AttentionMetadata
    from infer.cache.paged import PagedKVCache

    rng = np.random.default_rng(6)
    table = jnp.asarray([[2, 0], [1, 3]], jnp.int32)
    meta = AttentionMetadata(positions=jnp.asarray([[4, 5], [1, 2]]),
                             lengths=jnp.asarray([6, 3]), q_lens=jnp.asarray([2, 2]),
                             page_tables=table)
    for d in (cpu_attention.MAX_HEAD_DIM, cpu_attention.MAX_HEAD_DIM + 16, 320):
        cache = PagedKVCache.create(1, 4, 4, 1, d, kv_format="float32")
        k, v = (jnp.asarray(rng.standard_normal((4, 1, 4, d)), jnp.float32) for _ in range(2))
        cache = dataclasses.replace(cache, k=(k,), v=(v,))
        q = jnp.asarray(rng.standard_normal((2, 2, 2, d)), jnp.float32)
        attend_cache = jax.jit(lambda q, cache: cache.attend(0, q, meta))
        lowered = attend_cache.lower(q, cache).as_text()
        assert (cpu_attention.KERNEL.target in lowered) == (d <= cpu_attention.MAX_HEAD_DIM), d
        keys = cache._gather(k, None, table, jnp.float32)
        values = cache._gather(v, None, table, jnp.float32)
        want = attention.masked_attention(q, keys, values,
                                          attention.visibility_mask(meta, keys.shape[2]))
        np.testing.assert_allclose(np.asarray(attend_cache(q, cache)), np.asarray(want),
                                   rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="at most"):
        cpu_attention.attend(q, k, v, meta.lengths, meta.q_lens, table)


def test_bad_operands_are_refused() -> None:
    q = jnp.ones((2, 1, 4, 16), jnp.float32)
    pages = jnp.ones((5, 2, 4, 16), jnp.float32)
    lengths, q_lens, table = jnp.ones((2,), jnp.int32), jnp.ones((2,), jnp.int32), \
        jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match="shapes disagree"):
        cpu_attention.attend(q, jnp.ones((5, 3, 4, 16), jnp.float32),
                             jnp.ones((5, 3, 4, 16), jnp.float32), lengths, q_lens, table)
    with pytest.raises(ValueError, match="keys and values differ"):
        cpu_attention.attend(q, pages, pages.astype(jnp.bfloat16), lengths, q_lens, table)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_attention.attend(q.astype(jnp.float16), pages, pages, lengths, q_lens, table)
    with pytest.raises(ValueError, match=r"\[B, T, H, D\]"):
        cpu_attention.attend(q[0], pages, pages, lengths, q_lens, table)


def test_the_custom_call_refuses_an_output_of_another_shape() -> None:
    """The kernel writes one float per element of q: an output of any other shape is refused,
    not written past its end (these are as large or larger, so the old binding wrote in bounds
    and said nothing; smaller ones crashed the process)."""
    rng = np.random.default_rng(4)
    q, k, v, _, _, lengths, q_lens, table = _case(rng, jnp.float32, jnp.float32)
    b, t, h, d = q.shape
    for shape in [(b, t, h * d), (b, t, h, 2 * d), (b + 1, t, h, d), (b, t, d, h) if h != d
                  else (b, t, h, d + 1)]:
        call = jax.ffi.ffi_call(cpu_attention.KERNEL.target,
                                jax.ShapeDtypeStruct(shape, jnp.float32))
        with pytest.raises(Exception, match="q's shape"):
            jax.block_until_ready(call(q, k, v, lengths, q_lens, table, scale=np.float32(1)))
