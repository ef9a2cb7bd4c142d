"""The paged KV cache inside the model: writes through the slot mapping, both attention backends,
every cache format, and copy-on-write page copies."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from infer.cache.contiguous import KVCache
from infer.cache.metadata import AttentionMetadata, MixedMetadata
from infer.cache.paged import PagedKVCache, copy_pages, hadamard_rotate
from infer.engine.device_steps import DeviceSteps
from infer.engine.simple_loop import PagedLayout, decode_stream
from infer.model.config import get_config
from infer.model.llama import Llama
from infer.sampling_params import SamplingParams
from kernels_pallas import kv_quant

CONFIG = get_config("tiny")  # 4 query heads, 2 kv heads, head dim 16


@pytest.fixture(scope="module")
def tiny_model() -> Llama:
    return Llama(CONFIG, jnp.float32, nnx.Rngs(7))


def _paged(num_pages: int, page_size: int, kv_format: str = "float32",
           backend: str = "reference") -> PagedKVCache:
    c = CONFIG
    return PagedKVCache.create(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim,
                               kv_format, backend)


def test_write_goes_through_the_slot_mapping() -> None:
    """Tokens land at page_tables[b, s // G] * G + s % G, nothing else changes."""
    g, p = 4, 10
    cache = _paged(p, g)
    tables = jnp.asarray([[7, 2, 5], [1, 9, 0]], jnp.int32)
    # row 0: 5 cached tokens, 3 new (slots 5..7); row 1: 2 cached, 1 new (slot 2), 2 padding
    meta = AttentionMetadata.for_prefill(jnp.asarray([3, 1]), 3, cached=jnp.asarray([5, 2]),
                                         page_tables=tables)
    k = jax.random.normal(jax.random.key(0), (2, 3, CONFIG.num_kv_heads, CONFIG.head_dim))
    out = cache.write(1, k, -k, meta)
    expected = np.zeros_like(np.asarray(cache.k[1]))
    for s in (5, 6, 7):
        page, off = [7, 2, 5][s // g], s % g
        expected[page, :, off] = np.asarray(k[0, s - 5])
    expected[1, :, 2] = np.asarray(k[1, 0])
    np.testing.assert_array_equal(np.asarray(out.k[1]), expected)
    np.testing.assert_array_equal(np.asarray(out.v[1]), -expected)
    np.testing.assert_array_equal(np.asarray(out.k[0]), 0)  # other layers untouched


@pytest.mark.parametrize("kv_format", kv_quant.SUPPORTED_KV_FORMATS)
def test_quantized_write_stores_quantize_output(kv_format: str) -> None:
    cache = _paged(6, 4, kv_format)
    tables = jnp.asarray([[3, 0]], jnp.int32)
    meta = AttentionMetadata.for_prefill(jnp.asarray([6]), 6, page_tables=tables)
    k = jax.random.normal(jax.random.key(1), (1, 6, CONFIG.num_kv_heads, CONFIG.head_dim)) * 3
    out = cache.write(0, k, k, meta)
    data, scales = kv_quant.quantize(hadamard_rotate(k) if cache.rotate else k, kv_format)
    k_pages, _, k_scales, _ = out.pages(0)
    assert k_pages.dtype == kv_quant.storage_dtype(kv_format)
    # [K, G, Ds] pages, token-major for the comparison
    token_major = lambda *pages: np.concatenate([np.asarray(p) for p in pages], 1).swapaxes(0, 1)
    stored = token_major(k_pages[3], k_pages[0])[:6]
    np.testing.assert_array_equal(stored.view(np.uint8), np.asarray(data[0]).view(np.uint8))
    if scales is not None:
        got = token_major(k_scales[3], k_scales[0])[:6]
        np.testing.assert_array_equal(got, np.asarray(scales[0]))
    # On CPU a float narrower than 32 bits is held as its bits, so that writes scatter in place
    # (kv_quant.bits_dtype); nothing else is.
    held = out.k[0].dtype
    narrow_float = jnp.issubdtype(data.dtype, jnp.floating) and data.dtype.itemsize < 4
    assert (held != data.dtype) == (narrow_float and jax.default_backend() == "cpu"), held
    if held != data.dtype:
        assert jnp.issubdtype(held, jnp.unsignedinteger) and held.itemsize == data.dtype.itemsize


def _prefill_then_decode(model: Llama, cache, tables, tokens: np.ndarray, split: int):
    """Logits of every position: prefill tokens[:, :split], then decode the rest one by one."""
    b, t = tokens.shape
    meta = AttentionMetadata.for_prefill(jnp.full((b,), split), split, page_tables=tables)
    logits, _, cache = model(jnp.asarray(tokens[:, :split]), cache, meta)
    out = [np.asarray(logits)]
    for pos in range(split, t):
        meta = AttentionMetadata.for_decode(jnp.full((b,), pos), page_tables=tables)
        logits, _, cache = model(jnp.asarray(tokens[:, pos:pos + 1]), cache, meta)
        out.append(np.asarray(logits))
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_paged_equals_contiguous(tiny_model: Llama, backend: str) -> None:
    """Permuted page tables, a prompt ending mid-page, decode across page boundaries."""
    b, t, g = 2, 13, 4
    tokens = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (b, t))
    contiguous = _prefill_then_decode(tiny_model, KVCache.create(
        CONFIG.num_layers, b, 16, CONFIG.num_kv_heads, CONFIG.head_dim), None, tokens, 6)
    tables = jnp.asarray(np.random.default_rng(1).permutation(12)[:8].reshape(2, 4), jnp.int32)
    paged = _prefill_then_decode(tiny_model, _paged(12, g, backend=backend), tables, tokens, 6)
    np.testing.assert_allclose(paged, contiguous, atol=2e-5)


def test_quantized_caches_stay_near_float32(tiny_model: Llama) -> None:
    """Each format perturbs the logits by roughly its precision, in the expected order:
    float16 < bfloat16 < int8 < fp8 e4m3 < fp8 e5m2 < int4 (relative to the largest logit)."""
    b, t = 2, 12
    tokens = np.random.default_rng(2).integers(0, CONFIG.vocab_size, (b, t))
    tables = jnp.asarray([[0, 1, 2], [3, 4, 5]], jnp.int32)
    ref = _prefill_then_decode(tiny_model, _paged(6, 4), tables, tokens, 5)
    bounds = {"float16": 5e-4, "bfloat16": 2e-3, "int8": 5e-3, "float8_e4m3fn": 3e-2,
              "float8_e5m2": 6e-2, "int4": 0.12}
    errors = {}
    for kv_format, bound in bounds.items():
        got = _prefill_then_decode(tiny_model, _paged(6, 4, kv_format), tables, tokens, 5)
        errors[kv_format] = np.abs(got - ref).max() / np.abs(ref).max()
        assert 0 < errors[kv_format] < bound, (kv_format, errors[kv_format])
    assert list(errors.values()) == sorted(errors.values()), errors


def test_copy_pages_copies_every_layer_and_nothing_else() -> None:
    cache = _paged(8, 4, "int8")
    filled = jax.tree.map(lambda x: jax.random.normal(jax.random.key(3), x.shape).astype(x.dtype)
                          if x.dtype != jnp.int8 else
                          jax.random.randint(jax.random.key(4), x.shape, -100, 100, jnp.int8), cache)
    before = jax.tree.map(np.asarray, filled)
    after = copy_pages(filled, [1, 6, 2], [4, 0, 7])
    for old, new in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        expected = old.copy()
        expected[[4, 0, 7]] = old[[1, 6, 2]]
        np.testing.assert_array_equal(np.asarray(new), expected)


def test_write_past_the_page_table_raises_eagerly_and_is_dropped_under_jit() -> None:
    """Row 0's table has two pages (slots 0..7); a write of slots 6..8 raises when called
    eagerly. Under jit, which cannot raise (the host callers check first), slot 8 is dropped:
    it used to be clipped onto the table's last page, overwriting that page's slot 0."""
    g = 4
    cache = _paged(10, g)
    tables = jnp.asarray([[7, 2]], jnp.int32)
    meta = AttentionMetadata.for_prefill(jnp.asarray([3]), 3, cached=jnp.asarray([6]),
                                         page_tables=tables)
    k = jax.random.normal(jax.random.key(0), (1, 3, CONFIG.num_kv_heads, CONFIG.head_dim))
    with pytest.raises(ValueError, match=r"row 0 writes slots \[6, 9\) but has room for 8"):
        cache.write(0, k, k, meta)
    out = jax.jit(lambda c, m: c.write(0, k, k, m))(cache, meta)
    expected = np.zeros_like(np.asarray(cache.k[0]))
    expected[2, :, 2:4] = np.asarray(k[0, :2]).swapaxes(0, 1)  # slots 6, 7: page 2, offsets 2, 3
    np.testing.assert_array_equal(np.asarray(out.k[0]), expected)


def test_bad_cache_arguments() -> None:
    with pytest.raises(ValueError, match="unsupported kv_format 'int3'"):
        _paged(4, 4, "int3")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        _paged(4, 4, backend="cuda")
    with pytest.raises(ValueError, match="at least one page"):
        _paged(0, 4)


def test_smollm2_greedy_paged_pallas_equals_contiguous(smollm2_4_layers) -> None:
    """The real weights and shapes (SmolLM2's first 4 layers), greedy, two prompts: contiguous
    cache against paged + Pallas kernels (interpreted on CPU) with shuffled page tables, token
    for token."""
    _, model, tokenizer = smollm2_4_layers
    steps = DeviceSteps(model)
    prompts = [tokenizer.encode("The three primary colors are"),
               tokenizer.encode("import numpy as np\n\ndef softmax(x):\n")]
    params = [SamplingParams(ignore_eos=True)] * 2

    def run(paged):
        out = [[], []]
        for tokens in decode_stream(steps, prompts, params, 10, paged=paged):
            for row, t in enumerate(tokens):
                out[row].append(int(t))
        return out

    assert run(PagedLayout(page_size=8, backend="pallas")) == run(None)


def test_hadamard_rotation_is_exact_and_helps_quantization(tiny_model: Llama) -> None:
    """Rotating keys, values and queries by H (outputs back by H^T) changes nothing in float32;
    with an outlier channel in the keys (as real models have) it shrinks the int8 error."""
    b, t = 2, 10
    tokens = np.random.default_rng(3).integers(0, CONFIG.vocab_size, (b, t))
    tables = jnp.asarray([[0, 1, 2], [3, 4, 5]], jnp.int32)
    c = CONFIG

    def cache(kv_format: str, rotate: bool) -> PagedKVCache:
        return PagedKVCache.create(c.num_layers, 6, 4, c.num_kv_heads, c.head_dim, kv_format,
                                   rotate=rotate)

    plain = _prefill_then_decode(tiny_model, cache("float32", False), tables, tokens, 4)
    rotated = _prefill_then_decode(tiny_model, cache("float32", True), tables, tokens, 4)
    np.testing.assert_allclose(rotated, plain, atol=1e-4)
    assert _paged(2, 4, "int8").rotate and not _paged(2, 4, "bfloat16").rotate  # the defaults

    rng = np.random.default_rng(4)
    shape = (1, 12, c.num_kv_heads, c.head_dim)
    k, v = rng.standard_normal(shape), rng.standard_normal(shape)
    k[..., 3] *= 40.0  # one outlier channel sets every key's int8 scale
    q = jnp.asarray(rng.standard_normal((1, 12, c.num_heads, c.head_dim)), jnp.float32)
    meta = AttentionMetadata.for_prefill(jnp.asarray([12]), 12, page_tables=tables[:1])

    def attend(kv_format: str, rotate: bool) -> np.ndarray:
        written = cache(kv_format, rotate).write(0, jnp.asarray(k, jnp.float32),
                                                jnp.asarray(v, jnp.float32), meta)
        return np.asarray(written.attend(0, q, meta))

    exact = attend("float32", False)
    err = lambda rotate: np.abs(attend("int8", rotate) - exact).max()
    assert err(True) < 0.5 * err(False)


@pytest.mark.parametrize("backend, kv_format", [("reference", "float32"), ("pallas", "float32"),
                                                ("pallas", "int8")])
def test_mixed_step_equals_its_parts(backend: str, kv_format: str) -> None:
    """A mixed step's packed tokens (a chunk padded to 8, then 4 decode rows, one of them
    padding) write and attend as each part does alone; the Pallas backend's one ragged call
    included. Random rows, tables and keys, three draws."""
    c, g = CONFIG, 4
    h, d = c.num_heads, c.head_dim
    for draw in range(3):
        rng = np.random.default_rng(draw)
        tables = jnp.asarray(rng.permutation(24)[:16].reshape(4, 4), jnp.int32)
        start, n = int(rng.integers(0, 8)), int(rng.integers(1, 9))
        chunk = AttentionMetadata.for_prefill(jnp.asarray([n]), 8, cached=jnp.asarray([start]),
                                              page_tables=tables[:1])
        cached = jnp.asarray(rng.integers(0, 15, 4), jnp.int32)
        decode = AttentionMetadata(positions=cached[:, None], lengths=cached + 1,
                                   q_lens=jnp.asarray([1, 1, 1, 0], jnp.int32),
                                   page_tables=tables[jnp.asarray([1, 2, 3, 0])])
        mixed = MixedMetadata((chunk, decode))
        k, v, q = (jnp.asarray(rng.standard_normal((1, 12, n_heads, d)), jnp.float32)
                   for n_heads in (c.num_kv_heads, c.num_kv_heads, h))
        # Old tokens in every page first, so each query has a history to read.
        cache = _paged(24, g, kv_format, backend)
        history = jnp.asarray(rng.standard_normal((1, 24 * g, c.num_kv_heads, d)), jnp.float32)
        full = AttentionMetadata.for_prefill(jnp.asarray([24 * g]), 24 * g,
                                             page_tables=jnp.arange(24, dtype=jnp.int32)[None])
        cache = cache.write(0, history, -history, full)
        together = cache.write(0, k, v, mixed)
        out = together.attend(0, q, mixed)
        alone = cache
        for part, kp, vp in zip(mixed.parts, mixed.split(k), mixed.split(v)):
            alone = alone.write(0, kp, vp, part)
        for a, b in zip(jax.tree.leaves(together), jax.tree.leaves(alone)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        want = [alone.attend(0, qp, part) for qp, part in zip(mixed.split(q), mixed.parts)]
        got = mixed.split(out)
        np.testing.assert_allclose(np.asarray(got[0])[:, :n], np.asarray(want[0])[:, :n],
                                   rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(np.asarray(got[1])[:3], np.asarray(want[1])[:3],
                                   rtol=2e-5, atol=2e-5)
