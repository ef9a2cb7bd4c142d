"""Paged decode / prefill attention kernels against their jnp references, and the references
against a naive numpy attention.

The kernel class runs with interpret=True on CPU; on an accelerator the same class also runs
compiled (the compiled variant is skipped on CPU). Every unused page and unused slot holds NaN
(NaN scales for integer formats), so any read of them shows up as NaN in the output.
Interpreted Pallas compiles ~1 s per shape: each case reuses one shape for several length sets.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.kv_quant import SUPPORTED_KV_FORMATS, dequantize, quantize
from kernels_pallas.paged_attention import (paged_attention, paged_attention_reference,
                                            paged_prefill_attention,
                                            paged_prefill_attention_reference)

D = 64
K = 2
ON_ACCELERATOR = jax.default_backend() in ("gpu", "tpu")
MODES = [
    pytest.param(True, id="interpret"),
    pytest.param(False, id="compiled", marks=pytest.mark.skipif(
        not ON_ACCELERATOR, reason="compiled Pallas needs a GPU or TPU")),
]


def make_cache(seed, kv_format, lengths, G, max_pages, extra_pages=3):
    """Random paged cache holding `lengths` tokens per row, page ids permuted, the rest NaN.

    Returns (k_pages, v_pages, k_scales, v_scales, page_tables)."""
    rng = np.random.default_rng(seed)
    B = len(lengths)
    P = B * max_pages + extra_pages
    perm = rng.permutation(P)
    # Entries past a row's used pages are garbage ids anywhere in [0, P).
    table = rng.integers(0, P, size=(B, max_pages))
    used = np.zeros((P, G), bool)
    for b, n in enumerate(lengths):
        n_pages = -(-n // G)
        table[b, :n_pages] = perm[b * max_pages: b * max_pages + n_pages]
        for t in range(n):
            used[table[b, t // G], t % G] = True
    out = []
    for _ in range(2):
        x = jnp.asarray(rng.standard_normal((P, G, K, D)), jnp.float32)
        data, scales = quantize(x, kv_format)
        if scales is None or kv_format.startswith("float8"):
            data = jnp.where(used[:, :, None, None], data, jnp.nan).astype(data.dtype)
        if scales is not None:
            scales = jnp.where(used[:, :, None, None], scales, jnp.nan)
        out += [data, scales]
    k, ks, v, vs = out
    return k, v, ks, vs, jnp.asarray(table, jnp.int32)


def backend_or_skip(backend, interpret):
    if not interpret and backend != jax.default_backend():
        pytest.skip(f"compiled {backend} kernel needs a {backend}")
    return backend


def tolerance(q_dtype, interpret):
    if q_dtype == jnp.bfloat16:
        return dict(rtol=1e-2, atol=1e-2)
    return dict(rtol=1e-5, atol=1e-5) if interpret else dict(rtol=1e-4, atol=1e-4)


# (kv_format, page size G, GQA ratio r, batch B, pages_per_block, q dtype, backends); max_pages = 3.
# Both kernels share the dequantization code, so the GPU kernel gets a subset: unscaled with its
# broadcast-reduce path (G=8) and its dot path (G=16), scaled int8 and two-plane int4.
DECODE_CASES = [
    ("float32", 8, 3, 3, 2, jnp.float32, "tpu gpu"),
    ("float32", 16, 1, 1, 1, jnp.float32, "tpu"),
    ("bfloat16", 16, 3, 3, 3, jnp.bfloat16, "tpu gpu"),
    ("float16", 8, 1, 3, 2, jnp.float32, "tpu"),
    ("float8_e4m3fn", 16, 1, 3, 2, jnp.float32, "tpu"),
    ("float8_e5m2", 8, 3, 1, 2, jnp.float32, "tpu"),
    ("int8", 8, 3, 3, 1, jnp.float32, "tpu gpu"),
    ("int4", 16, 3, 3, 2, jnp.float32, "tpu gpu"),
]
DECODE_PARAMS = [
    pytest.param(backend, case, id=f"{backend}-{case[0]}-G{case[1]}-r{case[2]}-B{case[3]}")
    for case in DECODE_CASES for backend in case[6].split()
]
MAX_PAGES = 3


def test_decode_cases_cover_every_format():
    assert {c[0] for c in DECODE_CASES} == set(SUPPORTED_KV_FORMATS)


def decode_length_sets(G, B):
    """Length vectors that together cover 0, 1, G-1, G, G+1 and the capacity."""
    lens = [0, 1, G - 1, G, G + 1, MAX_PAGES * G]
    if B == 1:
        return [[n] for n in lens]
    return [lens[:3], lens[3:]]


# Prefill: (kv_format, G, r, T, tree, pages_per_block). Rows per call: (start, q_len) pairs.
# int4 has T * r = 66 query rows: two row blocks in the GPU kernel.
PREFILL_CASES = [
    ("float32", 8, 3, 5, False, 2),
    ("int8", 16, 1, 4, True, 1),
    ("int4", 16, 3, 22, False, 3),
]


def prefill_row_sets(G, T):
    cap = MAX_PAGES * G
    return [
        # start at a page boundary (full T); mid-page with a padding row; nothing at all
        [(G, T), (3, T - 1), (0, 0)],
        # from scratch; ending at capacity; crossing a page boundary with 2 queries
        [(0, T), (cap - T, T), (G - 1, 2)],
    ]


@pytest.mark.parametrize("interpret", MODES)
class TestPagedKernels:
    @pytest.mark.parametrize("backend, case", DECODE_PARAMS)
    def test_decode_matches_reference(self, interpret, backend, case):
        backend = backend_or_skip(backend, interpret)
        kv_format, G, r, B, ppb, q_dtype, _ = case
        for i, lengths in enumerate(decode_length_sets(G, B)):
            k, v, ks, vs, table = make_cache(i, kv_format, lengths, G, MAX_PAGES)
            q = jnp.asarray(np.random.default_rng(10 + i).standard_normal((B, K * r, D)), q_dtype)
            lens = jnp.asarray(lengths, jnp.int32)
            kw = dict(k_scales=ks, v_scales=vs, kv_format=kv_format)
            out = paged_attention(q, k, v, lens, table, **kw, pages_per_block=ppb, backend=backend,
                                  interpret=interpret)
            ref = paged_attention_reference(q, k, v, lens, table, **kw)
            assert out.shape == q.shape and out.dtype == q_dtype
            out32 = np.asarray(out.astype(jnp.float32))
            assert np.isfinite(out32).all(), f"NaN leaked from an unused slot, lengths {lengths}"
            np.testing.assert_allclose(out32, np.asarray(ref.astype(jnp.float32)),
                                       **tolerance(q_dtype, interpret), err_msg=str(lengths))
            for b, n in enumerate(lengths):
                if n == 0:
                    assert np.all(out32[b] == 0)

    @pytest.mark.parametrize("backend", ["tpu", "gpu"])
    @pytest.mark.parametrize("case", PREFILL_CASES,
                             ids=lambda c: f"{c[0]}-G{c[1]}-r{c[2]}-{'tree' if c[4] else 'causal'}")
    def test_prefill_matches_reference(self, interpret, backend, case):
        backend = backend_or_skip(backend, interpret)
        kv_format, G, r, T, tree, ppb = case
        for i, rows in enumerate(prefill_row_sets(G, T)):
            B = len(rows)
            lengths = [s + n for s, n in rows]
            q_lens = jnp.asarray([n for _, n in rows], jnp.int32)
            k, v, ks, vs, table = make_cache(20 + i, kv_format, lengths, G, MAX_PAGES)
            rng = np.random.default_rng(30 + i)
            q = jnp.asarray(rng.standard_normal((B, T, K * r, D)), jnp.float32)
            tree_mask = None
            if tree:
                tm = rng.random((B, T, T)) < 0.5
                tm[:, np.arange(T), np.arange(T)] = True
                tree_mask = jnp.asarray(tm)
            kw = dict(tree_mask=tree_mask, k_scales=ks, v_scales=vs, kv_format=kv_format)
            lens = jnp.asarray(lengths, jnp.int32)
            out = paged_prefill_attention(q, k, v, lens, q_lens, table, **kw, pages_per_block=ppb,
                                          backend=backend, interpret=interpret)
            ref = paged_prefill_attention_reference(q, k, v, lens, q_lens, table, **kw)
            out = np.asarray(out)
            assert out.shape == q.shape and np.isfinite(out).all(), rows
            np.testing.assert_allclose(out, np.asarray(ref), **tolerance(jnp.float32, interpret),
                                       err_msg=str(rows))
            for b, (_, n) in enumerate(rows):
                assert np.all(out[b, n:] == 0), "padding query rows must be zero"

    def test_decode_under_jit_with_traced_lengths(self, interpret):
        k, v, _, _, table = make_cache(0, "float32", [5, 17], 8, MAX_PAGES)
        q = jnp.asarray(np.random.default_rng(0).standard_normal((2, K * 3, D)), jnp.float32)
        fn = jax.jit(lambda q, lens: paged_attention(q, k, v, lens, table, pages_per_block=2,
                                                     interpret=interpret))
        lens = jnp.asarray([5, 17], jnp.int32)
        np.testing.assert_allclose(np.asarray(fn(q, lens)),
                                   np.asarray(paged_attention_reference(q, k, v, lens, table)),
                                   **tolerance(jnp.float32, interpret))


def test_tpu_kernel_under_tpu_interpreter():
    """The TPU interpreter emulates VMEM, DMAs and semaphores: the only check of the TPU kernel's
    data movement without a TPU. One tiny case (it is slow)."""
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    lengths = [9]
    k, v, ks, vs, table = make_cache(3, "int8", lengths, 8, 2, extra_pages=1)
    q = jnp.asarray(np.random.default_rng(3).standard_normal((1, K, D)), jnp.float32)
    lens = jnp.asarray(lengths, jnp.int32)
    kw = dict(k_scales=ks, v_scales=vs, kv_format="int8")
    out = paged_attention(q, k, v, lens, table, **kw, pages_per_block=1, backend="tpu",
                          interpret=pltpu.InterpretParams())
    ref = paged_attention_reference(q, k, v, lens, table, **kw)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


# --- references against a naive per-sequence numpy attention -------------------------------


def naive_attention(q, k, v, visible):
    """q [T, H, D], k/v [S, K, D] float64, visible [T, S] -> [T, H, D]; rows seeing nothing -> 0."""
    T, H, _ = q.shape
    r = H // k.shape[1]
    out = np.zeros(q.shape)
    for t in range(T):
        idx = np.nonzero(visible[t])[0]
        if len(idx) == 0:
            continue
        for h in range(H):
            s = k[idx, h // r] @ q[t, h] / math.sqrt(q.shape[-1])
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ v[idx, h // r]
    return out


def dequantized_sequence(pages, scales, table_row, n, kv_format):
    x = np.asarray(dequantize(pages, scales, kv_format), np.float64)  # [P, G, K, D]
    G = x.shape[1]
    return np.stack([x[table_row[t // G], t % G] for t in range(n)]) if n else np.zeros((0, K, D))


@pytest.mark.parametrize("kv_format", ["float32", "int8", "int4", "float8_e5m2"])
def test_decode_reference_matches_naive(kv_format):
    G, lengths = 8, [0, 1, 9, 24]
    k, v, ks, vs, table = make_cache(5, kv_format, lengths, G, MAX_PAGES)
    q = np.random.default_rng(5).standard_normal((len(lengths), 6, D)).astype(np.float32)
    ref = paged_attention_reference(jnp.asarray(q), k, v, jnp.asarray(lengths), table,
                                    k_scales=ks, v_scales=vs, kv_format=kv_format)
    tab = np.asarray(table)
    for b, n in enumerate(lengths):
        kb = dequantized_sequence(k, ks, tab[b], n, kv_format)
        vb = dequantized_sequence(v, vs, tab[b], n, kv_format)
        want = naive_attention(q[b, None].astype(np.float64), kb, vb, np.ones((1, n), bool))[0]
        np.testing.assert_allclose(np.asarray(ref[b]), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tree", [False, True])
def test_prefill_reference_matches_naive(tree):
    G, T = 8, 4
    rows = [(G, T), (3, 3), (0, 0)]  # page-boundary start; mid-page start with a padding row
    lengths = [s + n for s, n in rows]
    k, v, _, _, table = make_cache(6, "float32", lengths, G, MAX_PAGES)
    rng = np.random.default_rng(6)
    q = rng.standard_normal((len(rows), T, 6, D)).astype(np.float32)
    tm = rng.random((len(rows), T, T)) < 0.5
    tm[:, np.arange(T), np.arange(T)] = True
    ref = np.asarray(paged_prefill_attention_reference(
        jnp.asarray(q), k, v, jnp.asarray(lengths), jnp.asarray([n for _, n in rows]), table,
        tree_mask=jnp.asarray(tm) if tree else None))
    tab = np.asarray(table)
    for b, (start, n) in enumerate(rows):
        kb = dequantized_sequence(k, None, tab[b], start + n, "float32")
        vb = dequantized_sequence(v, None, tab[b], start + n, "float32")
        visible = np.zeros((T, start + n), bool)
        for i in range(n):
            visible[i, :start] = True
            for j in range(n):
                visible[i, start + j] = tm[b, i, j] if tree else j <= i
        want = naive_attention(q[b].astype(np.float64), kb, vb, visible)
        np.testing.assert_allclose(ref[b], want, rtol=1e-5, atol=1e-5)
        assert np.all(ref[b, n:] == 0)


# --- validation -------------------------------------------------------------------------------


def _small_cache(kv_format="float32"):
    k, v, ks, vs, table = make_cache(0, kv_format, [5, 9], 8, 2)
    q = jnp.zeros((2, 4, D), jnp.float32)
    return q, k, v, ks, vs, table


def test_validation_page_index_out_of_range():
    q, k, v, _, _, table = _small_cache()
    bad = table.at[1, 1].set(k.shape[0])  # P is one past the last page
    with pytest.raises(ValueError, match=r"page_tables \(2, 2\).*k_pages \(7, 8, 2, 64\)"):
        paged_attention(q, k, v, jnp.asarray([5, 9]), bad)


def test_validation_head_counts():
    _, k, v, _, _, table = _small_cache()
    with pytest.raises(ValueError, match=r"H=3.*\(2, 3, 64\).*K=2"):
        paged_attention(jnp.zeros((2, 3, D)), k, v, jnp.asarray([5, 9]), table)
    with pytest.raises(ValueError, match=r"v_pages"):
        paged_attention(jnp.zeros((2, 4, D)), k, v[:, :, :1], jnp.asarray([5, 9]), table)


def test_validation_lengths_over_capacity():
    q, k, v, _, _, table = _small_cache()
    with pytest.raises(ValueError, match=r"lengths \[5, 17\].*max_pages \* G = 16"):
        paged_attention(q, k, v, jnp.asarray([5, 17]), table)
    with pytest.raises(ValueError, match=r"lengths \(3,\)"):
        paged_attention(q, k, v, jnp.asarray([5, 9, 1]), table)


def test_validation_formats_and_scales():
    q, k, v, ks, vs, table = _small_cache("int8")
    lens = jnp.asarray([5, 9])
    with pytest.raises(ValueError, match="supported: float32"):
        paged_attention(q, k, v, lens, table, kv_format="int3")
    with pytest.raises(ValueError, match=r"k_scales of shape \(7, 8, 2, 1\)"):
        paged_attention(q, k, v, lens, table, kv_format="int8")
    with pytest.raises(ValueError, match=r"k_pages \(7, 8, 2, 64\) has dtype int8"):
        paged_attention(q, k, v, lens, table, kv_format="float32")
    with pytest.raises(ValueError, match=r"stored head dim 64 != 32"):
        paged_attention(q, k.view(jnp.uint8), v.view(jnp.uint8), lens, table, k_scales=ks,
                        v_scales=vs, kv_format="int4")


def test_validation_prefill_shapes():
    _, k, v, _, _, table = _small_cache()
    q = jnp.zeros((2, 3, 4, D))
    lens = jnp.asarray([5, 9])
    with pytest.raises(ValueError, match=r"q_lens \[4, 1\].*T=3"):
        paged_prefill_attention(q, k, v, lens, jnp.asarray([4, 1]), table)
    with pytest.raises(ValueError, match=r"exceed lengths"):
        paged_prefill_attention(q, k, v, jnp.asarray([2, 9]), jnp.asarray([3, 1]), table)
    with pytest.raises(ValueError, match=r"tree_mask \(2, 3, 2\)"):
        paged_prefill_attention(q, k, v, lens, jnp.asarray([3, 1]), table,
                                tree_mask=jnp.ones((2, 3, 2), bool))
    with pytest.raises(ValueError, match=r"q \(2, 4, 64\) must be \[B, T, H, D\]"):
        paged_prefill_attention(q[:, 0], k, v, lens, jnp.asarray([3, 1]), table)
