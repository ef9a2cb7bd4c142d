"""Paged decode / prefill attention kernels against their jnp references, and the references
against a naive numpy attention over caches dequantized by tests/kernels/numpy_kv.py, a numpy
reading of the format spec that shares no code with the kernels' dequantization, which is itself
checked against kv_quant.dequantize here.

The kernel class runs with interpret=True on CPU; on an accelerator the same class also runs
compiled (the compiled variant is skipped on CPU). Every unused page and unused slot holds NaN
(NaN scales for integer formats), so any read of them shows up as NaN in the output.
Interpreted Pallas compiles ~1 s per shape: each case reuses one shape for several length sets.
"""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernels_pallas.kv_quant import SUPPORTED_KV_FORMATS, dequantize, quantize
from kernels_pallas.paged_attention import (paged_attention, paged_attention_reference,
                                            paged_prefill_attention,
                                            paged_prefill_attention_reference,
                                            ragged_paged_attention,
                                            ragged_paged_attention_reference)
from kernels_pallas.paged_attention import api as paged_api
from kernels_pallas.paged_attention.api import UnsupportedKernelConfig
from tests.kernels.numpy_kv import (STORAGE_DTYPES, dequantize_np, int4_round_trip_bound,
                                    quantize_int8_np)

D = 64
K = 2
ON_ACCELERATOR = jax.default_backend() in ("gpu", "tpu")
MODES = [
    pytest.param(True, id="interpret"),
    pytest.param(False, id="compiled", marks=pytest.mark.skipif(
        not ON_ACCELERATOR, reason="compiled Pallas needs a GPU or TPU")),
]


def make_cache(seed, kv_format, lengths, G, max_pages, extra_pages=3, head_dim=D):
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
        x = jnp.asarray(rng.standard_normal((P, K, G, head_dim)), jnp.float32)
        data, scales = quantize(x, kv_format)
        if scales is None or kv_format.startswith("float8"):
            data = jnp.where(used[:, None, :, None], data, jnp.nan).astype(data.dtype)
        if scales is not None:
            scales = jnp.where(used[:, None, :, None], scales, jnp.nan)
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
    ("int8", 16, 1, 5, True, 1),  # a tree of 5: Triton pads it to 8
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

    @pytest.mark.parametrize("backend", ["tpu", "gpu"])
    @pytest.mark.parametrize("kv_format, d", [("float32", 80), ("int8", 80), ("int4", 96)])
    def test_head_dim_not_a_power_of_two(self, interpret, backend, kv_format, d, monkeypatch):
        """D = 80 (Phi-2): the GPU kernel pads to 128 columns with masked loads. int4 needs
        groups of 32, so D = 96: 48 packed columns padded to 64, in 3 groups of 16. Triton cannot
        lower 3 groups' scales, so the GPU entry points refuse it; the kernel's own math is still
        checked in the interpreter, past the refusal (groups must not stretch over the padding)."""
        backend = backend_or_skip(backend, interpret)
        G, lengths = 8, [1, 8, 17]
        k, v, ks, vs, table = make_cache(40, kv_format, lengths, G, MAX_PAGES, head_dim=d)
        rng = np.random.default_rng(41)
        lens, q_lens = jnp.asarray(lengths, jnp.int32), jnp.asarray([1, 3, 2], jnp.int32)
        kw = dict(k_scales=ks, v_scales=vs, kv_format=kv_format)
        q = jnp.asarray(rng.standard_normal((3, 3, K * 2, d)), jnp.float32)
        if backend == "gpu" and kv_format == "int4":
            for call in (lambda: paged_attention(q[:, 0], k, v, lens, table, **kw, backend=backend,
                                                 interpret=interpret),
                         lambda: paged_prefill_attention(q, k, v, lens, q_lens, table, **kw,
                                                         backend=backend, interpret=interpret)):
                with pytest.raises(UnsupportedKernelConfig,
                                   match="power-of-two number of int4 groups, got 3 .*D=96"):
                    call()
            if not interpret:
                return
            monkeypatch.setattr(paged_api, "check_backend_limits", lambda *args: None)
        out = paged_prefill_attention(q, k, v, lens, q_lens, table, **kw, backend=backend,
                                      interpret=interpret)
        ref = paged_prefill_attention_reference(q, k, v, lens, q_lens, table, **kw)
        assert out.shape == q.shape
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref),
                                   **tolerance(jnp.float32, interpret))
        out = paged_attention(q[:, 0], k, v, lens, table, **kw, backend=backend,
                              interpret=interpret)
        ref = paged_attention_reference(q[:, 0], k, v, lens, table, **kw)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref),
                                   **tolerance(jnp.float32, interpret))

    @pytest.mark.parametrize("pages_per_block", [1, 2, 8])
    @pytest.mark.parametrize("num_splits", [1, 2, 3])
    def test_gpu_sequence_splits(self, interpret, num_splits, pages_per_block):
        """Flash-decoding: however the pages are shared among programs (2 splits of 3 pages
        leave the second with one page, or none for short rows) and however many pages each
        loop step takes (a step past the table's end, pages past the length), the merged
        softmax is the reference's."""
        backend = backend_or_skip("gpu", interpret)
        lengths = [0, 1, 7, 9, 24]
        k, v, ks, vs, table = make_cache(50, "int8", lengths, 8, MAX_PAGES)
        q = jnp.asarray(np.random.default_rng(50).standard_normal((5, K * 3, D)), jnp.float32)
        lens = jnp.asarray(lengths, jnp.int32)
        kw = dict(k_scales=ks, v_scales=vs, kv_format="int8")
        out = paged_attention(q, k, v, lens, table, **kw, num_splits=num_splits,
                              pages_per_block=pages_per_block, backend=backend,
                              interpret=interpret)
        ref = paged_attention_reference(q, k, v, lens, table, **kw)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref),
                                   **tolerance(jnp.float32, interpret))
        assert np.all(np.asarray(out)[0] == 0)

    @pytest.mark.parametrize("backend", ["tpu", "gpu"])
    @pytest.mark.parametrize("kv_format", ["bfloat16", "int4"])
    def test_ragged_matches_reference(self, interpret, backend, kv_format):
        """A mixed step: decode rows, chunks from scratch and mid-sequence, an empty row, a row
        at capacity, then padding tokens. 40 queries x 4 heads per kv head are 160 rows: two
        TPU query blocks, and several padding blocks for every decode row."""
        backend = backend_or_skip(backend, interpret)
        k, v, ks, vs, table, cu, lengths, q = ragged_case(7, kv_format)
        kw = dict(k_scales=ks, v_scales=vs, kv_format=kv_format)
        out = ragged_paged_attention(q, k, v, lengths, cu, table, **kw, max_q_len=RAGGED_T,
                                     backend=backend, interpret=interpret)
        ref = ragged_paged_attention_reference(q, k, v, lengths, cu, table, **kw)
        out = np.asarray(out)
        assert out.shape == q.shape and np.isfinite(out).all()
        np.testing.assert_allclose(out, np.asarray(ref), **tolerance(jnp.float32, interpret))
        assert np.all(out[int(cu[-1]):] == 0), "padding tokens must be zero"

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


def test_ragged_tpu_kernel_under_tpu_interpreter():
    """The TPU kernel's query-block axis under the TPU interpreter, which runs the grid's index
    maps and DMAs: two query blocks of 128 rows, decode rows whose second block is all padding,
    two pages a block, NaN in every unused slot."""
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    k, v, ks, vs, table, cu, lengths, q = ragged_case(11, "int8")
    kw = dict(k_scales=ks, v_scales=vs, kv_format="int8")
    out = ragged_paged_attention(q, k, v, lengths, cu, table, **kw, max_q_len=RAGGED_T,
                                 pages_per_block=2, backend="tpu",
                                 interpret=pltpu.InterpretParams())
    ref = ragged_paged_attention_reference(q, k, v, lengths, cu, table, **kw)
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
    """Row's first n tokens [n, K, D] float64, through numpy_kv rather than kv_quant."""
    x = dequantize_np(pages, scales, kv_format)  # [P, K, G, D]
    G = x.shape[2]
    if n == 0:
        return np.zeros((0, K, x.shape[-1]))
    return np.stack([x[table_row[t // G], :, t % G] for t in range(n)])


NAIVE_G = 8
# Rows of 0, 1, G-1, G, G+1 and max_pages * G tokens.
NAIVE_LENGTHS = [0, 1, NAIVE_G - 1, NAIVE_G, NAIVE_G + 1, MAX_PAGES * NAIVE_G]


@pytest.mark.parametrize("kv_format", SUPPORTED_KV_FORMATS)
def test_decode_reference_matches_naive(kv_format):
    k, v, ks, vs, table = make_cache(5, kv_format, NAIVE_LENGTHS, NAIVE_G, MAX_PAGES)
    q = np.random.default_rng(5).standard_normal((len(NAIVE_LENGTHS), 6, D)).astype(np.float32)
    ref = np.asarray(paged_attention_reference(
        jnp.asarray(q), k, v, jnp.asarray(NAIVE_LENGTHS), table, k_scales=ks, v_scales=vs,
        kv_format=kv_format))
    assert np.isfinite(ref).all(), "NaN leaked from an unused page"
    tab = np.asarray(table)
    for b, n in enumerate(NAIVE_LENGTHS):
        kb = dequantized_sequence(k, ks, tab[b], n, kv_format)
        vb = dequantized_sequence(v, vs, tab[b], n, kv_format)
        want = naive_attention(q[b, None].astype(np.float64), kb, vb, np.ones((1, n), bool))[0]
        np.testing.assert_allclose(ref[b], want, rtol=1e-5, atol=1e-5, err_msg=f"length {n}")


@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
@pytest.mark.parametrize("kv_format", SUPPORTED_KV_FORMATS)
def test_prefill_reference_matches_naive(kv_format, tree):
    G, T = NAIVE_G, 4
    # (start, q_len) with lengths start + q_len = 0, 1, G-1, G, G+1, max and a page-boundary
    # start; q_len < T leaves padding rows, (G-1, 2) crosses a page boundary.
    rows = [(0, 0), (0, 1), (3, T), (G - 3, 3), (G - 1, 2), (MAX_PAGES * G - T, T), (G, T)]
    assert [s + n for s, n in rows][:6] == NAIVE_LENGTHS
    lengths = [s + n for s, n in rows]
    k, v, ks, vs, table = make_cache(6, kv_format, lengths, G, MAX_PAGES)
    rng = np.random.default_rng(6)
    q = rng.standard_normal((len(rows), T, 6, D)).astype(np.float32)
    tm = rng.random((len(rows), T, T)) < 0.5
    tm[:, np.arange(T), np.arange(T)] = True
    ref = np.asarray(paged_prefill_attention_reference(
        jnp.asarray(q), k, v, jnp.asarray(lengths), jnp.asarray([n for _, n in rows]), table,
        tree_mask=jnp.asarray(tm) if tree else None, k_scales=ks, v_scales=vs,
        kv_format=kv_format))
    assert np.isfinite(ref).all(), "NaN leaked from an unused page"
    tab = np.asarray(table)
    for b, (start, n) in enumerate(rows):
        kb = dequantized_sequence(k, ks, tab[b], start + n, kv_format)
        vb = dequantized_sequence(v, vs, tab[b], start + n, kv_format)
        visible = np.zeros((T, start + n), bool)
        for i in range(n):
            visible[i, :start] = True
            for j in range(n):
                visible[i, start + j] = tm[b, i, j] if tree else j <= i
        want = naive_attention(q[b].astype(np.float64), kb, vb, visible)
        np.testing.assert_allclose(ref[b], want, rtol=1e-5, atol=1e-5, err_msg=str(rows[b]))
        assert np.all(ref[b, n:] == 0)


RAGGED_G, RAGGED_T = 16, 40
# (cached tokens, new queries) per row of a mixed step; capacity MAX_PAGES * G = 48.
RAGGED_ROWS = [(19, 1), (0, 40), (19, 17), (5, 0), (47, 1), (0, 1)]


def ragged_case(seed, kv_format):
    """A paged cache holding RAGGED_ROWS and their flat queries [N, 4K, D], 3 padding tokens."""
    lengths = [c + n for c, n in RAGGED_ROWS]
    k, v, ks, vs, table = make_cache(seed, kv_format, lengths, RAGGED_G, MAX_PAGES)
    cu = np.concatenate([[0], np.cumsum([n for _, n in RAGGED_ROWS])])
    q = np.random.default_rng(seed).standard_normal((int(cu[-1]) + 3, K * 4, D))
    return (k, v, ks, vs, table, jnp.asarray(cu, jnp.int32), jnp.asarray(lengths, jnp.int32),
            jnp.asarray(q, jnp.float32))


@pytest.mark.parametrize("kv_format", ["float32", "int8", "int4"])
def test_ragged_reference_matches_naive(kv_format):
    k, v, ks, vs, table, cu, lengths, q = ragged_case(8, kv_format)
    ref = np.asarray(ragged_paged_attention_reference(q, k, v, lengths, cu, table, k_scales=ks,
                                                      v_scales=vs, kv_format=kv_format))
    tab, qs = np.asarray(table), np.asarray(q, np.float64)
    for b, (cached, n) in enumerate(RAGGED_ROWS):
        kb = dequantized_sequence(k, ks, tab[b], cached + n, kv_format)
        vb = dequantized_sequence(v, vs, tab[b], cached + n, kv_format)
        visible = np.arange(cached + n)[None, :] <= cached + np.arange(n)[:, None]
        want = naive_attention(qs[cu[b]:cu[b + 1]], kb, vb, visible)
        np.testing.assert_allclose(ref[cu[b]:cu[b + 1]], want, rtol=1e-5, atol=1e-5,
                                   err_msg=str(RAGGED_ROWS[b]))
    assert np.all(ref[int(cu[-1]):] == 0)


def test_ragged_validation():
    k, v, _, _, table, cu, lengths, q = ragged_case(9, "float32")
    call = lambda **kw: ragged_paged_attention(
        **{**dict(q=q, k_pages=k, v_pages=v, lengths=lengths, cu_q_lens=cu, page_tables=table,
                  max_q_len=RAGGED_T), **kw})
    with pytest.raises(ValueError, match=r"more than max_q_len=39"):
        call(max_q_len=39)
    with pytest.raises(ValueError, match=r"must start at 0, never decrease"):
        call(cu_q_lens=cu.at[2].set(0))
    with pytest.raises(ValueError, match=r"end at most at N=10"):
        call(q=q[:10])
    with pytest.raises(ValueError, match=r"exceed lengths"):
        call(lengths=lengths.at[1].set(3))
    with pytest.raises(ValueError, match=r"cu_q_lens \(6,\)"):
        call(cu_q_lens=cu[:-1])
    with pytest.raises(ValueError, match=r"page_tables \(\d+,\) must be \[B, max_pages\]"):
        call(page_tables=table[0])


def test_ragged_without_rows_is_all_padding():
    """B = 0 rows with N > 0 tokens (every token padding): zeros, as the docstring says, from
    the kernels and the reference alike; both failed gathering from an empty batch."""
    k, v, _, _, table, _, _, q = ragged_case(9, "float32")
    no_rows = dict(lengths=jnp.zeros((0,), jnp.int32), cu_q_lens=jnp.zeros((1,), jnp.int32),
                   page_tables=table[:0])
    out = ragged_paged_attention(q, k, v, **no_rows, max_q_len=RAGGED_T)
    ref = ragged_paged_attention_reference(q, k, v, **no_rows)
    assert out.shape == ref.shape == q.shape
    assert not np.any(np.asarray(out)) and not np.any(np.asarray(ref))


# --- numpy_kv against kv_quant: a bug in either shows up here --------------------------------


def random_stored(rng, kv_format, shape, D):
    """Random stored data [*shape, Ds] and scales of `kv_format`, not made by quantize: every
    code of the narrow formats, zero and negative scales, int4 lows of both signs."""
    lead = tuple(shape)
    bf16 = lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16)
    if kv_format == "int4":
        data = rng.integers(0, 256, size=(*lead, D // 2), dtype=np.uint8)
        n = D // min(32, D)
        scale = np.abs(rng.standard_normal((*lead, n))) * 10.0 ** rng.uniform(-3, 2, (*lead, n))
        scale[..., 0, :] = 0.0  # a zero vector's scale
        low = rng.standard_normal((*lead, n)) * 10.0 ** rng.uniform(-3, 2, (*lead, n))
        return data, bf16(np.concatenate([scale, low], axis=-1))
    dtype = STORAGE_DTYPES[kv_format]
    if kv_format == "int8":
        data = rng.integers(-128, 128, size=(*lead, D), dtype=np.int8)
    elif dtype.itemsize == 1:  # float8: all 256 codes, NaN and inf included
        data = np.resize(np.arange(256, dtype=np.uint8), (*lead, D)).view(dtype)
        data = rng.permuted(data.reshape(-1)).reshape(data.shape)
    else:
        mag = 10.0 ** rng.uniform(-6, 4, (*lead, D))
        data = (rng.standard_normal((*lead, D)) * mag).astype(np.float32).astype(dtype)
    if kv_format in ("float32", "bfloat16", "float16"):
        return data, None
    scale = np.abs(rng.standard_normal((*lead, 1))) * 10.0 ** rng.uniform(-3, 2, (*lead, 1))
    scale[..., 0, :] = 0.0
    return data, bf16(scale)


@pytest.mark.parametrize("kv_format", SUPPORTED_KV_FORMATS)
def test_numpy_dequantize_matches_kv_quant(kv_format):
    rng = np.random.default_rng(7)
    for head_dim in (16, 64, 96):  # int4: one group of D < 32, then two and three groups of 32
        data, scales = random_stored(rng, kv_format, (3, K, 8), head_dim)
        got = np.asarray(dequantize(jnp.asarray(data), None if scales is None
                                    else jnp.asarray(scales), kv_format))
        with np.errstate(invalid="ignore"):  # float8's inf codes times a zero scale: NaN
            want = dequantize_np(data, scales, kv_format)
        assert got.shape == want.shape == (3, K, 8, head_dim) and got.dtype == np.float32
        # Products are exact in float32 too: only int4's add of the low rounds, once.
        np.testing.assert_allclose(got, want, rtol=2.0 ** -23, atol=0,
                                   err_msg=f"{kv_format} D={head_dim}")


def test_numpy_int4_dequantize_by_hand():
    """The spec's int4 layout on a case worked by hand, so numpy_kv cannot drift with kv_quant:
    D = 64 is two groups of 32; byte i holds elements 2i (low nibble) and 2i + 1 (high)."""
    data = np.zeros((1, 32), np.uint8)
    data[0, 0] = 0x21  # elements 0, 1 -> q 1, 2
    data[0, 16] = 0xF3  # elements 32, 33 (group 1) -> q 3, 15
    scales = np.asarray([[0.5, 2.0, -1.0, 4.0]], np.float32).astype(ml_dtypes.bfloat16)
    x = dequantize_np(data, scales, "int4")[0]
    want = np.concatenate([np.full(32, -1.0), np.full(32, 4.0)])
    want[[0, 1, 32, 33]] = [-0.5, 0.0, 10.0, 34.0]
    np.testing.assert_array_equal(x, want)


def skewed_vectors(rng, shape):
    """Random vectors over seven decades, with a zero vector and one-signed ones (int4's low
    far from zero), as float32."""
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-4, 3, (*shape[:-1], 1))
    x[..., 0, :] = 0.0  # a zero vector
    x[..., 1, :] = np.abs(x[..., 1, :]) + 5.0  # all positive: a low far from zero
    x[..., 2, :] = -np.abs(x[..., 2, :]) - 5.0
    return x.astype(np.float32)


def test_int8_quantize_matches_numpy_bit_for_bit():
    rng = np.random.default_rng(8)
    x = skewed_vectors(rng, (4, K, 8, D))
    data, scales = quantize(jnp.asarray(x), "int8")
    want_data, want_scales = quantize_int8_np(x)
    np.testing.assert_array_equal(np.asarray(data), want_data)
    np.testing.assert_array_equal(np.asarray(scales).view(np.uint16), want_scales.view(np.uint16))


@pytest.mark.parametrize("head_dim", [16, 64, 96])
def test_int4_round_trip_within_half_a_step(head_dim):
    """kv_quant.quantize read back by numpy_kv: a packing or scale-order mismatch between the two
    lands values far off. The stored scales must also be tight (low at most the group's minimum,
    step about its range / 15), or a loose scale would hide errors under a wide bound."""
    rng = np.random.default_rng(9)
    x = skewed_vectors(rng, (4, K, 8, head_dim))
    data, scales = quantize(jnp.asarray(x), "int4")
    data, scales = np.asarray(data), np.asarray(scales)
    err = np.abs(dequantize_np(data, scales, "int4") - x)
    bound = int4_round_trip_bound(x, scales)
    assert np.all(err <= bound), f"worst excess {np.max(err - bound)}"
    g = min(32, head_dim)
    n = head_dim // g
    xg = x.astype(np.float64).reshape(*x.shape[:-1], n, g)
    step, low = scales[..., :n].astype(np.float64), scales[..., n:].astype(np.float64)
    gmin, gmax = xg.min(-1), xg.max(-1)
    assert np.all(low <= gmin) and np.all(low >= gmin - np.abs(gmin) * 2.0 ** -7)
    # bfloat16 rounding of the step, and of the low widening the range
    np.testing.assert_allclose(step, (gmax - low) / 15, rtol=2.0 ** -8, atol=0)


# --- validation -------------------------------------------------------------------------------


def _small_cache(kv_format="float32"):
    k, v, ks, vs, table = make_cache(0, kv_format, [5, 9], 8, 2)
    q = jnp.zeros((2, 4, D), jnp.float32)
    return q, k, v, ks, vs, table


def test_validation_page_index_out_of_range():
    q, k, v, _, _, table = _small_cache()
    bad = table.at[1, 1].set(k.shape[0])  # P is one past the last page
    with pytest.raises(ValueError, match=r"page_tables \(2, 2\).*k_pages \(7, 2, 8, 64\)"):
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
    with pytest.raises(ValueError, match=r"k_scales of shape \(7, 2, 8, 1\)"):
        paged_attention(q, k, v, lens, table, kv_format="int8")
    with pytest.raises(ValueError, match=r"k_pages \(7, 2, 8, 64\) has dtype int8"):
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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32, jnp.uint8])
def test_validation_tree_mask_dtype(dtype):
    """A non-bool tree mask is refused: the kernels threshold it at 0.5, the reference reads any
    nonzero as visible, so a float 0.3 (or an int -1) was served with outputs that disagree."""
    _, k, v, _, _, table = _small_cache()
    q = jnp.zeros((2, 3, 4, D))
    mask = jnp.tril(jnp.ones((2, 3, 3), dtype))
    message = rf"tree_mask \(2, 3, 3\) must be bool, got {jnp.dtype(dtype)}"
    with pytest.raises(ValueError, match=message):
        paged_prefill_attention(q, k, v, jnp.asarray([5, 9]), jnp.asarray([3, 1]), table,
                                tree_mask=mask, interpret=True)


# --- empty shapes -----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_empty_shapes_give_empty_or_zero_outputs(backend):
    """No queries (T = 0, B = 0, N = 0) or no table slots (max_pages = 0, so every length is 0):
    the entry points return what the references do (empty, or zeros for rows of length 0)
    instead of dividing by the empty sizes (ZeroDivisionError) or gathering from nothing."""
    k = jnp.zeros((4, K, 8, D), jnp.float32)
    H = 2 * K
    zeros, table = jnp.zeros((2,), jnp.int32), jnp.zeros((2, 2), jnp.int32)
    kw = dict(backend=backend, interpret=True)
    q_lens = jnp.zeros(3, jnp.int32)
    no_slots = table[:, :0]

    def both(entry, reference, *args, **options):
        return (lambda: entry(*args, **options, **kw), lambda: reference(*args))

    calls = {
        "prefill T=0": both(paged_prefill_attention, paged_prefill_attention_reference,
                            jnp.zeros((2, 0, H, D)), k, k, zeros, zeros, table),
        "decode B=0": both(paged_attention, paged_attention_reference,
                           jnp.zeros((0, H, D)), k, k, zeros[:0], table[:0]),
        "ragged N=0": both(ragged_paged_attention, ragged_paged_attention_reference,
                           jnp.zeros((0, H, D)), k, k, zeros, q_lens, table, max_q_len=1),
        "decode max_pages=0": both(paged_attention, paged_attention_reference,
                                   jnp.ones((2, H, D)), k, k, zeros, no_slots),
        "ragged max_pages=0": both(ragged_paged_attention, ragged_paged_attention_reference,
                                   jnp.ones((3, H, D)), k, k, zeros, q_lens, no_slots,
                                   max_q_len=2),
    }
    for name, (kernel, reference) in calls.items():
        want = reference()
        got = kernel()
        assert got.shape == want.shape, name
        np.testing.assert_array_equal(np.asarray(got), np.zeros(want.shape), err_msg=name)
        np.testing.assert_array_equal(np.asarray(want), np.zeros(want.shape), err_msg=name)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nan_or_inf_key_in_a_row_stays_nan(backend, seed):
    """A NaN or inf key inside a row's length (a float16 cache entry that overflowed) makes the
    queries that see it NaN, as in the reference; those that do not see it are unaffected. The
    kernels' finalize took the NaN denominator for a row that saw nothing and returned zeros, a
    plausible value that hid the overflow."""
    rng = np.random.default_rng(seed)
    G, T, B = 8, 4, 3
    lengths = rng.integers(T + 1, MAX_PAGES * G + 1, size=B)
    q_lens = np.full(B, T)
    k, v, _, _, table = make_cache(seed, "float32", lengths.tolist(), G, MAX_PAGES)
    b = int(rng.integers(B))
    slot = int(rng.integers(lengths[b] - 2, lengths[b]))  # one of the chunk's last two tokens
    k = k.at[table[b, slot // G], int(rng.integers(K)), slot % G].set(
        [jnp.nan, jnp.inf][seed % 2])
    q = jnp.asarray(rng.standard_normal((B, T, 2 * K, D)), jnp.float32)
    args = (q, k, v, jnp.asarray(lengths), jnp.asarray(q_lens), table)
    want = np.asarray(paged_prefill_attention_reference(*args))
    got = np.asarray(paged_prefill_attention(*args, backend=backend, interpret=True))
    assert np.isnan(want).any() and not np.isnan(want).all()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
